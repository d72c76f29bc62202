"""MimIC (lab/methods/mimic.py) against a naive float64 attention: SA plus the mu shift with a masked Z2."""
import pytest
import torch

from helpers import left_padded_mask, naive_attention, rand, randomised
from lab.methods.mimic import MimIC

pytestmark = pytest.mark.usefixtures("attention_kernels")  # torch's private kernels, then the public path


@pytest.mark.parametrize("T,S,pads", [(5, 5, [0, 2]), (1, 7, [3, 0]), (3, 6, [0, 0]), (4, 4, [0, 0]), (1, 5, [0, 0])])
def test_mimic_is_sa_plus_mu_shift_with_a_masked_z2(T, S, pads):
    H, d_h = 3, 8
    mimic = randomised(MimIC(H, d_h).double(), seed=T + S)
    q, k, v = rand(2, H, T, d_h, seed=1), rand(2, H, S, d_h, seed=2), rand(2, H, S, d_h, seed=3)
    mask = left_padded_mask(pads, T, S)
    sa, log_Z2 = naive_attention(q, k, v, mask)
    log_Z1 = (q * mimic.w[:, None]).sum(-1, keepdim=True) + mimic.b[:, None, None]
    mu = torch.exp(log_Z1) / (torch.exp(log_Z1) + torch.exp(log_Z2))
    want = sa + mu * mimic.s[:, None]
    seen = mask.any(-1).expand(-1, H, -1)  # [B, H, T]
    for ours in (mimic(q, k, v, mask, d_h ** -0.5), mimic.reference(q, k, v, mask, d_h ** -0.5)):  # fused, readable
        torch.testing.assert_close(ours[seen], want[seen], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(ours[~seen], mimic.s[:, None].expand_as(ours)[~seen])  # no key seen: SA 0, mu 1
    if not any(pads):  # mask None = plain causal (the last T of S positions)
        torch.testing.assert_close(mimic(q, k, v, None, d_h ** -0.5), want, rtol=1e-10, atol=1e-10)


def test_mimic_ignores_padding_and_future_tokens():
    H, d_h, T, pad = 2, 8, 6, 3
    mimic = randomised(MimIC(H, d_h).double(), seed=0)
    q, k, v = rand(1, H, T, d_h, seed=1), rand(1, H, T, d_h, seed=2), rand(1, H, T, d_h, seed=3)
    alone = mimic(q, k, v, None, d_h ** -0.5)
    junk = lambda x, s: torch.cat([rand(1, H, pad, d_h, seed=s) * 50, x], -2)
    padded = mimic(junk(q, 4), junk(k, 5), junk(v, 6), left_padded_mask([pad], T + pad, T + pad), d_h ** -0.5)
    torch.testing.assert_close(padded[..., pad:, :], alone, rtol=1e-10, atol=1e-10)
    k2, v2 = k.clone(), v.clone()
    k2[..., 4:, :] += 10
    v2[..., 4:, :] -= 10
    changed = mimic(q, k2, v2, None, d_h ** -0.5)
    torch.testing.assert_close(changed[..., :4, :], alone[..., :4, :], rtol=1e-10, atol=1e-10)
    assert (changed[..., 4:, :] - alone[..., 4:, :]).abs().max() > 1e-3
