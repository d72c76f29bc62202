"""LIVE (lab/methods/live.py) against its formulas: the shift and renormalisation, the tempered answer KL."""
import torch

from helpers import rand, randomised
from lab.methods import live
from lab.methods.live import LIVE


def test_live_shifts_and_renormalises():
    live = randomised(LIVE(16).double(), seed=3)
    h = rand(2, 5, 16, seed=4)
    shifted = h + live.alpha * live.v
    want = shifted / shifted.norm(dim=-1, keepdim=True) * h.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(live(h), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(live(h).norm(dim=-1), h.norm(dim=-1), rtol=1e-12, atol=1e-12)


def test_answer_kl_is_lives_tempered_kl():
    s, t = rand(4, 11, seed=1), rand(4, 11, seed=2)
    T = 2.0
    p, q = torch.softmax(t / T, -1), torch.softmax(s / T, -1)
    want = T ** 2 * (p * (p.log() - q.log())).sum(-1).mean()
    torch.testing.assert_close(live.answer_kl(s, t, T), want.float(), rtol=1e-6, atol=1e-6)
    assert live.answer_kl(t, t, T).abs() < 1e-6
