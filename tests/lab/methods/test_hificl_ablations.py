"""HiFICL's component ablations (lab/methods/hificl_ablations.py) against their formulas written out in float64:
alpha = 1 (the linear shift), a full-rank K or V; their parameters. Their grouped heads, decoding steps and rows that
see no key: tests/paper/test_adapters.py, beside HiFICL's; trained and evaluated on the toy world: test_registry.py."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters import HiFICL
from helpers import left_padded_mask, naive_attention, rand
from lab.methods.hificl_ablations import HiFICLFullK, HiFICLFullV, HiFICLLinear


def padding_mask(T, S, seed):
    """Causal with two rows left-padded at random (at least one key a row): bool [2, 1, T, S]."""
    pads = torch.randint(0, S - T + 1, (2,), generator=torch.Generator().manual_seed(seed)).tolist()
    return left_padded_mask(pads, T, S)


def explicit_linear_shift(K_learn, V_learn, q, k, v, mask):
    """HiFICL's ablation alpha = 1 written out with exponentials: SA(q, K, V) + beta(q) V_learn, beta = exp(q K_learn^T
    / sqrt(d_h)) / (Z1 + Z2), Z1 and Z2 the sums of the virtual and the seen real keys' exponentials."""
    scaling = q.shape[-1] ** -0.5
    logits_D, logits = q @ K_learn.transpose(-1, -2) * scaling, q @ k.transpose(-1, -2) * scaling
    shift = torch.cat([logits_D, logits.masked_fill(~mask, -math.inf)], -1).amax(-1, keepdim=True)
    e_D, e = torch.exp(logits_D - shift), torch.exp(logits - shift) * mask
    Z1, Z2 = e_D.sum(-1, keepdim=True), e.sum(-1, keepdim=True)
    return e / Z2 @ v + e_D / (Z1 + Z2) @ V_learn


@pytest.mark.usefixtures("attention_kernels")  # torch's private kernels, then the public path
@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(T=st.integers(1, 6), extra=st.integers(0, 4), n=st.integers(1, 5), r=st.integers(1, 4),
       seed=st.integers(0, 2**16), padded=st.booleans())
def test_hificl_ablations_are_their_formulas_under_the_models_mask(T, extra, n, r, seed, padded):
    """HiFICL's component ablations in float64: alpha = 1 (HiFICLLinear) is SA(q, K, V) at initialisation, the base
    model, and SA + beta V_learn trained, fused and reference; full-rank K or V is the joint softmax of HiFICL with
    its own K_learn or V_learn, V_learn zero at initialisation."""
    S, H, d_h = T + extra, 2, 8
    q, k, v = rand(2, H, T, d_h, seed=seed), rand(2, H, S, d_h, seed=seed + 1), rand(2, H, S, d_h, seed=seed + 2)
    mask = padding_mask(T, S, seed) if padded else torch.ones(T, S, dtype=torch.bool).tril(S - T)
    given_mask = mask if padded else None
    torch.manual_seed(seed)
    linear = HiFICLLinear(H, d_h, n, r).double()
    base, _ = naive_attention(q, k, v, mask)
    torch.testing.assert_close(linear(q, k, v, given_mask, d_h ** -0.5), base, rtol=1e-10, atol=1e-10)
    torch.nn.init.normal_(linear.V_B)
    want = explicit_linear_shift(linear.K_A @ linear.K_B, linear.V_A @ linear.V_B, q, k, v, mask)
    for path in (linear, linear.reference):
        torch.testing.assert_close(path(q, k, v, given_mask, d_h ** -0.5), want, rtol=1e-10, atol=1e-10)
    full_k, full_v = HiFICLFullK(H, d_h, n, r).double(), HiFICLFullV(H, d_h, n, r).double()
    assert not full_v.V_learn.any() and {n for n, _ in full_k.named_parameters()} == {"K_learn", "V_A", "V_B"}
    torch.nn.init.normal_(full_v.V_learn)
    torch.nn.init.normal_(full_k.V_B)
    for adapter, (K_learn, V_learn) in ((full_k, (full_k.K_learn, full_k.V_A @ full_k.V_B)),
                                        (full_v, (full_v.K_A @ full_v.K_B, full_v.V_learn))):
        logits_D = q @ K_learn.transpose(-1, -2) / math.sqrt(d_h)
        logits = (q @ k.transpose(-1, -2) / math.sqrt(d_h)).masked_fill(~mask, -math.inf)
        weights = torch.cat([logits_D, logits], -1).softmax(-1)
        want = weights @ torch.cat([V_learn.expand(2, -1, -1, -1), v], -2)
        for path in (adapter, adapter.reference):
            torch.testing.assert_close(path(q, k, v, given_mask, d_h ** -0.5), want, rtol=1e-10, atol=1e-10)


def test_hificl_ablations_count_their_parameters():
    """Per head: HiFICL 2 r (n + d_h); a full K or V, n d_h in place of its r (n + d_h); alpha = 1, HiFICL's."""
    count = lambda cls: sum(p.numel() for p in cls(32, 128, 8, 8).parameters())
    assert count(HiFICLFullK) == count(HiFICLFullV) == 32 * (8 * 128 + 8 * (8 + 128))
    assert count(HiFICLLinear) == count(HiFICL) == 32 * 2 * 8 * (8 + 128)
