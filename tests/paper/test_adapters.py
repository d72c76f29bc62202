"""The attention math of adapters.py against independent float64 references (Eq 2, Eq 3-9, HiFICL)."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import adapters

from adapters import (HiFICL, HyperICL, OutputLevel, StaticGate, StaticGateHead, decompose, decompose_hificl,
                      joint_attention)
from lab.methods.hificl_ablations import HiFICLFullK, HiFICLFullV, HiFICLLinear
from lab.methods.mimic import MimIC


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def padding_mask(batch, T, S, seed):
    """Causal + random left padding, as transformers builds it: bool [B, 1, T, S] with >= 1 key per row."""
    g = torch.Generator().manual_seed(seed)
    pads = torch.randint(0, max(1, S // 2), (batch,), generator=g)
    keys = torch.arange(S) >= pads[:, None]                                        # [B, S]
    causal = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    mask = causal[None] & keys[:, None, :]
    return (mask | ~mask.any(-1, keepdim=True))[:, None]  # a fully padded query row attends everything


def naive_softmax_attention(logits, v):
    """softmax written out: exp(x - max) / sum, then the weighted sum of values."""
    e = torch.exp(logits - logits.max(-1, keepdim=True).values)
    return (e / e.sum(-1, keepdim=True)) @ v


@settings(max_examples=60)
@given(T=st.integers(1, 6), T_D=st.integers(1, 6), extra=st.integers(0, 4), d=st.integers(1, 5),
       scale=st.floats(0.1, 20), seed=st.integers(0, 2**16), masked=st.booleans())
def test_decomposition_eq2(T, T_D, extra, d, scale, seed, masked):
    S = T + extra
    logits_D, logits = rand(2, T, T_D, seed=seed) * scale, rand(2, T, S, seed=seed + 1) * scale
    V_D, V = rand(2, T_D, d, seed=seed + 2), rand(2, S, d, seed=seed + 3)
    mask = padding_mask(2, T, S, seed)[:, 0] if masked else None
    full = joint_attention(logits_D, logits, V_D, V, mask)
    sa, sa_D, mu = decompose(logits_D, logits, V_D, V, mask)
    torch.testing.assert_close((1 - mu) * sa + mu * sa_D, full, rtol=1e-12, atol=1e-12)
    alpha, beta = decompose_hificl(logits_D, logits, V, mask)
    torch.testing.assert_close(alpha * sa + beta @ V_D, full, rtol=1e-12, atol=1e-12)
    # mu = Z1 / (Z1 + Z2) written out with exponentials (moderate logits only)
    if scale < 5:
        Z1 = torch.exp(logits_D).sum(-1, keepdim=True)
        Z2 = torch.exp(logits if mask is None else logits.masked_fill(~mask, -math.inf)).sum(-1, keepdim=True)
        torch.testing.assert_close(mu, Z1 / (Z1 + Z2), rtol=1e-12, atol=1e-12)


def random_hyper_icl(H, d_h, r, seed):
    torch.manual_seed(seed)
    adapter = HyperICL(H, d_h, r).double()
    for p in adapter.parameters():
        torch.nn.init.normal_(p, std=0.7)
    return adapter


def explicit_hyper_icl(adapter, q, k, v, mask):
    """Eq 3-9 per head with plain loops and a hand-written LN (no code shared with adapters.py)."""
    B, H, T, d_h = q.shape
    out = torch.empty_like(q)
    for b in range(B):
        for h in range(H):
            Q, K = q[b, h], k[b, h]
            ln = (Q - Q.mean(-1, keepdim=True)) / torch.sqrt(Q.var(-1, unbiased=False, keepdim=True) + 1e-5)
            g = 1 / (1 + torch.exp(-(ln @ adapter.w[h] + adapter.b[h])))             # Eq 9
            Delta = (Q @ adapter.U_q[h]) @ (K @ adapter.U_k[h]).T / math.sqrt(adapter.rank)  # Eq 6-7
            S_tilde = Q @ K.T / math.sqrt(d_h) + g[:, None] * Delta                 # Eq 3, 5
            S_tilde = S_tilde.masked_fill(~mask[b, 0], -math.inf)
            out[b, h] = naive_softmax_attention(S_tilde, v[b, h])                   # Eq 8
    return out


@settings(max_examples=25)
@given(T=st.integers(1, 7), extra=st.integers(0, 5), H=st.integers(1, 3), d_h=st.sampled_from([4, 8, 12]),
       r=st.integers(1, 5), seed=st.integers(0, 2**16), padded=st.booleans())
def test_hyper_icl_reference_and_fast_path_match_eq_3_to_9(T, extra, H, d_h, r, seed, padded):
    S = T + extra                              # S > T: decoding steps / a prefix in the KV cache
    adapter = random_hyper_icl(H, d_h, r, seed)
    q, k, v = rand(2, H, T, d_h, seed=seed), rand(2, H, S, d_h, seed=seed + 1), rand(2, H, S, d_h, seed=seed + 2)
    mask = padding_mask(2, T, S, seed) if padded else None
    explicit_mask = mask if padded else torch.ones(T, S, dtype=torch.bool).tril(S - T).expand(2, 1, T, S)
    want = explicit_hyper_icl(adapter, q, k, v, explicit_mask)
    scaling = d_h ** -0.5
    torch.testing.assert_close(adapter.reference(q, k, v, mask, scaling), want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(adapter(q, k, v, mask, scaling), want, rtol=1e-10, atol=1e-10)


def test_hyper_icl_fast_path_float32_relative_error():
    """Both float32 paths against the float64 per-head loops (explicit_hyper_icl), not against each other."""
    adapter = random_hyper_icl(4, 64, 4, seed=3)
    q, k, v = (rand(2, 4, 33, 64, seed=s) for s in (1, 2, 3))
    mask = padding_mask(2, 33, 33, seed=4)
    want = explicit_hyper_icl(adapter, q, k, v, mask)
    adapter, q, k, v = adapter.float(), q.float(), k.float(), v.float()
    for got in (adapter.reference(q, k, v, mask, 0.125), adapter(q, k, v, mask, 0.125)):
        assert ((got.double() - want).norm() / want.norm()).item() <= 1e-5


def test_hyper_icl_starts_as_identity_and_counts_parameters():
    adapter = HyperICL(32, 128, 4)
    assert sum(p.numel() for p in adapter.parameters()) == 32 * (2 * 128 * 4 + 128 + 1)
    q, k, v = rand(1, 32, 5, 128, seed=1), rand(1, 32, 5, 128, seed=2), rand(1, 32, 5, 128, seed=3)
    base = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(adapter.double()(q, k, v, None, 128 ** -0.5), base, rtol=1e-12, atol=1e-12)
    assert adapter.U_q.abs().sum() > 0  # U_k's gradient is A^T (...), zero if U_q were zero too


def explicit_hificl(adapter, q, k, v, mask):
    """softmax([q K_learn^T, q K^T] / sqrt(d_h)) [V_learn; V] with the mask on K only, the softmax written out with
    exponentials (not adapters.joint_attention, which HiFICL.reference uses)."""
    K_learn, V_learn = adapter.K_A @ adapter.K_B, adapter.V_A @ adapter.V_B
    scaling = q.shape[-1] ** -0.5
    logits_D = q @ K_learn.transpose(-1, -2) * scaling
    logits = q @ k.transpose(-1, -2) * scaling
    joint = torch.cat([logits_D, logits.masked_fill(~mask, -math.inf)], -1)
    weights = torch.exp(joint - joint.amax(-1, keepdim=True))
    values = torch.cat([V_learn.expand(len(q), -1, -1, -1), v], -2)
    return weights / weights.sum(-1, keepdim=True) @ values, (logits_D, logits)


@pytest.mark.usefixtures("attention_kernels")  # torch's private kernels, then the public path
@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(T=st.integers(1, 6), extra=st.integers(0, 4), n=st.integers(1, 5), r=st.integers(1, 4),
       seed=st.integers(0, 2**16), padded=st.booleans())
def test_hificl_is_the_joint_softmax_under_the_models_mask(T, extra, n, r, seed, padded):
    S, H, d_h = T + extra, 2, 8
    torch.manual_seed(seed)
    adapter = HiFICL(H, d_h, n, r).double()
    q, k, v = rand(2, H, T, d_h, seed=seed), rand(2, H, S, d_h, seed=seed + 1), rand(2, H, S, d_h, seed=seed + 2)
    mask = padding_mask(2, T, S, seed) if padded else torch.ones(T, S, dtype=torch.bool).tril(S - T)
    # at initialisation (V_B = 0): alpha(q) SA(q, K, V), not SA(q, K, V)
    want, (logits_D, logits) = explicit_hificl(adapter, q, k, v, mask)
    alpha, _ = decompose_hificl(logits_D, logits, v, mask)
    sa = logits.masked_fill(~mask, -math.inf).softmax(-1) @ v
    torch.testing.assert_close(adapter(q, k, v, mask if padded else None, d_h ** -0.5), alpha * sa)
    assert (alpha < 1).all()
    # trained (V_B != 0): the joint softmax
    torch.nn.init.normal_(adapter.V_B)
    want, _ = explicit_hificl(adapter, q, k, v, mask)
    for path in (adapter, adapter.reference):  # fused, readable
        torch.testing.assert_close(path(q, k, v, mask if padded else None, d_h ** -0.5), want, rtol=1e-10, atol=1e-10)


def test_hificl_parameter_count():
    assert sum(p.numel() for p in HiFICL(32, 128, 8, 8).parameters()) == 32 * 2 * 8 * (8 + 128)


@pytest.mark.usefixtures("attention_kernels")  # torch's private kernels, then the public path
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cls=st.sampled_from([HyperICL, StaticGate, StaticGateHead, OutputLevel, MimIC, HiFICL, HiFICLFullK,
                            HiFICLFullV, HiFICLLinear]),
       H_kv=st.integers(1, 3), groups=st.integers(1, 3), T=st.integers(1, 5), extra=st.integers(0, 4),
       seed=st.integers(0, 2**16), padded=st.booleans())
def test_grouped_key_value_heads_equal_the_same_heads_repeated(cls, H_kv, groups, T, extra, seed, padded):
    """Grouped-query attention: K and V of H_kv heads, shared inside the kernel, give what the same keys copied to
    every query head give (head h reads key/value head h // groups); the repeated form is the one checked above
    against the explicit formulas."""
    H, S, d_h = H_kv * groups, T + extra, 8
    torch.manual_seed(seed)
    adapter = cls(H, d_h).double()
    for p in adapter.parameters():
        torch.nn.init.normal_(p, std=0.5)
    q, k, v = rand(2, H, T, d_h, seed=seed), rand(2, H_kv, S, d_h, seed=seed + 1), rand(2, H_kv, S, d_h, seed=seed + 2)
    mask = padding_mask(2, T, S, seed) if padded else None
    head = torch.arange(H) // groups
    grouped, repeated = adapter(q, k, v, mask, d_h ** -0.5), adapter(q, k[:, head], v[:, head], mask, d_h ** -0.5)
    torch.testing.assert_close(grouped, repeated, rtol=1e-10, atol=1e-10)
    if cls.reference is not None:  # every method with a readable form beside its fused one
        torch.testing.assert_close(adapter.reference(q, k, v, mask, d_h ** -0.5), adapter(q, k, v, mask, d_h ** -0.5),
                                   rtol=1e-10, atol=1e-10)


def left_padded_step(pads, S):
    """One decoding step's mask, as transformers builds it: bool [B, 1, 1, S], row b's first pads[b] keys hidden."""
    return (torch.arange(S) >= torch.tensor(pads)[:, None])[:, None, None]


@pytest.mark.parametrize("cls", [HiFICL, MimIC, HiFICLLinear])
def test_decoding_steps_equal_the_reference_at_several_cache_lengths_with_left_padding(cls):
    """A decoding step (one query token: attention_lse reads its logits directly) against caches of 1 to 700 keys,
    rows left-padded differently, grouped key/value heads: equal to the reference (its T x T_k logits) in float64, and
    within 1e-5 of it, relatively, in float32."""
    H, H_kv, d_h = 4, 2, 16
    torch.manual_seed(0)
    adapter = cls(H, d_h).double()
    for p in adapter.parameters():
        torch.nn.init.normal_(p, std=0.5)
    for S, pads in [(1, [0, 0, 0]), (9, [0, 4, 8]), (130, [0, 61, 129]), (700, [3, 0, 699])]:
        q, k, v = rand(3, H, 1, d_h, seed=S), rand(3, H_kv, S, d_h, seed=S + 1), rand(3, H_kv, S, d_h, seed=S + 2)
        for mask in (left_padded_step(pads, S), None):
            want = adapter.reference(q, k, v, mask, d_h ** -0.5)
            torch.testing.assert_close(adapter(q, k, v, mask, d_h ** -0.5), want, rtol=1e-10, atol=1e-10)
            got = adapter.float()(q.float(), k.float(), v.float(), mask, d_h ** -0.5).double()
            assert ((got - want).norm() / want.norm()).item() <= 1e-5
            adapter.double()


@pytest.mark.usefixtures("attention_kernels")
@pytest.mark.parametrize("cls", [HiFICL, MimIC])
@pytest.mark.parametrize("T, S, padded", [(5, 5, True), (5, 5, False), (3, 7, True), (1, 7, True), (1, 7, False)])
def test_gradients_equal_the_references(cls, T, S, padded):
    """Training goes through the fused path: the gradients with respect to q, K, V (earlier layers' adapters reach
    them) and the adapter's parameters equal the reference's, float64. The fused kernel's log Z2 carries no gradient
    of its own; fused_attention_lse supplies it."""
    H, H_kv, d_h = 4, 2, 8
    torch.manual_seed(T + S)
    adapter = cls(H, d_h).double()
    for p in adapter.parameters():
        torch.nn.init.normal_(p, std=0.5)
    q, k, v = (rand(2, h, t, d_h, seed=i).requires_grad_() for i, (h, t) in enumerate([(H, T), (H_kv, S), (H_kv, S)]))
    mask = padding_mask(2, T, S, seed=T) if padded else None
    weights, inputs = rand(2, H, T, d_h, seed=9), (q, k, v, *adapter.parameters())
    got = torch.autograd.grad((adapter(q, k, v, mask, d_h ** -0.5) * weights).sum(), inputs)
    want = torch.autograd.grad((adapter.reference(q, k, v, mask, d_h ** -0.5) * weights).sum(), inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


CPU_KERNEL, CPU_SCHEMA = adapters.PRIVATE_KERNELS["cpu"]


@pytest.mark.skipif(adapters.private_kernel("cpu") is None,
                    reason=f"torch {torch.__version__} has no {CPU_KERNEL} of the signature called: public path only")
@settings(max_examples=40)
@given(H_kv=st.integers(1, 3), groups=st.integers(1, 3), T=st.integers(2, 6), extra=st.integers(0, 5),
       chunk=st.integers(1, 4), seed=st.integers(0, 2**16), padded=st.booleans(),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
def test_the_public_path_equals_the_private_kernel(H_kv, groups, T, extra, chunk, seed, padded, dtype):
    """fused_attention_lse's public path (SDPA, and log Z2 a chunk of keys at a time) gives what torch's private CPU
    kernel gives: SA and log Z2, grouped heads, padded or plain causal, with more keys than queries, several chunks."""
    H, S, d_h = H_kv * groups, T + extra, 8
    shapes = [(H, T), (H_kv, S), (H_kv, S)]
    q, k, v = (rand(2, h, t, d_h, seed=seed + i, dtype=dtype) for i, (h, t) in enumerate(shapes))
    mask = padding_mask(2, T, S, seed) if padded else None
    seen = mask if padded or T == S else adapters.causal_mask(T, S, "cpu")  # as fused_attention_lse passes it on
    private = adapters.fused_attention_lse(q, k, v, mask, d_h ** -0.5)
    SA, log_Z2 = adapters.public_attention_lse(q, k, v, seen, d_h ** -0.5, chunk=chunk)
    exact = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {}
    torch.testing.assert_close(SA, private[0], **exact)
    torch.testing.assert_close(log_Z2[..., None], private[1], **exact)
    assert log_Z2.dtype == private[1].dtype == torch.promote_types(dtype, torch.float32)


def test_a_private_kernel_missing_or_of_another_signature_is_not_called(monkeypatch):
    """private_kernel gives the kernel only where torch has it with the signature fused_attention_lse calls."""
    real = adapters.private_kernel("cpu")
    for kernels in ({}, {"cpu": ("_no_such_kernel", CPU_SCHEMA)},
                    {"cpu": (CPU_KERNEL, CPU_SCHEMA.replace("float? scale=None", "float? scale=None, bool x=False"))}):
        monkeypatch.setattr(adapters, "PRIVATE_KERNELS", kernels)
        assert adapters.private_kernel("cpu") is None
    monkeypatch.setattr(adapters, "PRIVATE_KERNELS", {"cpu": (CPU_KERNEL, CPU_SCHEMA)})
    assert adapters.private_kernel("cpu") is real
    assert real is None or real is getattr(torch.ops.aten, CPU_KERNEL).default


def test_hyper_icl_fast_path_bf16_relative_error():
    """bf16: Q~ = Q + Diag(g) Q U_q U_k^T / (scaling sqrt r) is rounded once; against the float64 reference."""
    adapter = random_hyper_icl(4, 64, 4, seed=5)
    q, k, v = (rand(2, 4, 33, 64, seed=s) for s in (1, 2, 3))
    mask = padding_mask(2, 33, 33, seed=6)
    want = adapter.reference(q, k, v, mask, 0.125)
    fast = adapter.to(torch.bfloat16)(*(x.to(torch.bfloat16) for x in (q, k, v)), mask, 0.125).double()
    assert ((fast - want).norm() / want.norm()).item() <= 2e-2


def test_hificl_at_initialisation_float32_relative_error():
    """At initialisation (V_learn = 0) HiFICL is (1 - mu) SA(q, K, V); where the virtual keys dominate, mu is close to
    1, and 1 - mu taken as a difference of float32 numbers near 1 loses its digits (torch.lerp's form did: 1.3e-4 in
    a row at mu = 1 - 8e-4). In float32 against the float64 reference: within 1e-6 over the output, 1e-5 in every
    row."""
    torch.manual_seed(0)
    adapter = HiFICL(4, 64).double()
    with torch.no_grad():
        adapter.K_A.mul_(torch.linspace(0.1, 2, 8)[:, None])  # a virtual key per scale: 1 - mu down to 8e-4
    q, k, v = rand(2, 4, 33, 64, seed=1), rand(2, 4, 33, 64, seed=2), rand(2, 4, 33, 64, seed=3)
    want = adapter.reference(q, k, v, None, 0.125)
    got = adapter.float()(q.float(), k.float(), v.float(), None, 0.125).double()
    assert ((got - want).norm() / want.norm()).item() <= 1e-6
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item() <= 1e-5


@pytest.mark.parametrize("cls", [HiFICL, MimIC, HiFICLLinear])
@pytest.mark.parametrize("T", [1, 3])
def test_a_row_that_sees_no_key_has_the_references_gradients(cls, T):
    """A query row that may see no real key (a fully padded row, a decoding step included): its SA is 0 and log Z2
    -inf, so mu = 1; the gradients with respect to q, K, V and the adapter are finite and the reference's (a decoding
    step's exp(-inf - (-inf)) once made V's gradient NaN)."""
    H, H_kv, d_h, S = 4, 2, 8, 5
    torch.manual_seed(T)
    adapter = cls(H, d_h).double()
    for p in adapter.parameters():
        torch.nn.init.normal_(p, std=0.5)
    q, k, v = (rand(2, h, t, d_h, seed=i).requires_grad_() for i, (h, t) in enumerate([(H, T), (H_kv, S), (H_kv, S)]))
    mask = torch.ones(2, 1, T, S, dtype=torch.bool)
    mask[1, :, -1] = False  # row 1's last query sees no key
    weights, inputs = rand(2, H, T, d_h, seed=9), (q, k, v, *adapter.parameters())
    got = torch.autograd.grad((adapter(q, k, v, mask, d_h ** -0.5) * weights).sum(), inputs)
    want = torch.autograd.grad((adapter.reference(q, k, v, mask, d_h ** -0.5) * weights).sum(), inputs)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
