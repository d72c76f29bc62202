"""Eq 19 (Appendix D): Delta A = || A^ICD - A^noICD ||_1 per layer, head and query token, against a per-key loop."""
import torch
from hypothesis import given, settings, strategies as st

from lab.studies import analyses


def rows(shape, seed):
    """Random attention rows (softmax over the last axis)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).softmax(-1)


@settings(max_examples=60)
@given(L=st.integers(1, 3), H=st.integers(1, 3), T=st.integers(1, 4), start=st.integers(0, 4), icd=st.integers(0, 6),
       pad_icd=st.integers(0, 3), pad_plain=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_attention_shift_is_eq_19_summed_key_by_key(L, H, T, start, icd, pad_icd, pad_plain, seed):
    """Teacher row [pad; BOS + instruction; ICDs; query], student row [pad; BOS + instruction; query]: each teacher key
    is compared with the same key of the student row where it has one (the shared start, the query), with 0 where it
    has none (ICDs, padding); the sum of absolute differences over the teacher's keys is Delta A."""
    n_icd, n_plain = start + icd + T, start + T
    A_icd, A_plain = rows((L, H, T, pad_icd + n_icd), seed), rows((L, H, T, pad_plain + n_plain), seed + 1)
    counterpart = {pad_icd + j: pad_plain + j for j in range(start)}                  # BOS + instruction
    counterpart |= {pad_icd + start + icd + j: pad_plain + start + j for j in range(T)}  # the query
    want = torch.zeros(L, H, T, dtype=torch.float64)
    for key in range(A_icd.shape[-1]):
        other = A_plain[..., counterpart[key]] if key in counterpart else 0
        want += (A_icd[..., key] - other).abs()
    torch.testing.assert_close(analyses.aligned_shift(A_icd, A_plain, n_icd, n_plain, T), want, rtol=1e-12,
                               atol=1e-12)
