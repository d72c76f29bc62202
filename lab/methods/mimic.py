"""MimIC (Jiang et al. 2025), a baseline: a learned shift of each head's output, weighted as the demonstrations'
share of attention would be (Eq 2), on each decoder self-attention (the paper's plug), trained with a layer-wise
MSE to the teacher's states."""
import math

import torch
from torch import nn

from adapters import attention_lse, full_mask, per_query_head


class MimIC(nn.Module):
    """MimIC (Jiang et al. 2025): per head a shift s and log Z1 = w.q + b (MimIC's w, b), the head's output becomes

        SA(q, K, V) + mu s,   mu = Z1 / (Z1 + Z2),   Z2 = sum over the keys the token may see of exp(q.k scaling).

    Masked: Z2 covers exactly the keys of the model's causal and padding mask (MimIC's public code sums over all keys).
    Initialised as in MimIC's code: s ~ N(0, 1e-3^2), w ~ N(0, 0.02^2), b = 0. Parameters per head: 2 d_h + 1.
    """

    def __init__(self, num_heads, head_dim):
        super().__init__()
        self.s = nn.Parameter(torch.randn(num_heads, head_dim) * 1e-3)
        self.w = nn.Parameter(torch.randn(num_heads, head_dim) * 0.02)
        self.b = nn.Parameter(torch.zeros(num_heads))

    def log_Z1(self, q):
        """log Z1 = w.q + b per query token and head: [batch, H, T, 1] in float32 (or float64)."""
        dtype = torch.promote_types(q.dtype, torch.float32)
        return (torch.einsum("bhtd,hd->bht", q.to(dtype), self.w.to(dtype)) + self.b.to(dtype)[:, None])[..., None]

    def reference(self, q, k, v, mask, scaling):
        """MimIC as written: SA(q, K, V) + mu s with Z2 summed over the keys each token may see, with the T x T_k
        logits: the reference the tests hold forward (what runs) to. A token that sees no key (padding): SA = 0."""
        k, v = (per_query_head(x, q.shape[1]) for x in (k, v))
        seen = full_mask(mask, q.shape[-2], k.shape[-2], q.device)
        logits = (q @ k.transpose(-1, -2) * scaling).masked_fill(~seen, -math.inf)
        mu = torch.sigmoid(self.log_Z1(q) - torch.logsumexp(logits, -1, keepdim=True))       # Z1 / (Z1 + Z2)
        SA = logits.softmax(-1).nan_to_num(0) @ v                                   # no key seen: weights 0
        return SA + mu.to(q.dtype) * self.s.to(q.dtype)[:, None]

    def forward(self, q, k, v, mask, scaling):
        """What runs: the reference without a T x T_k tensor and without a copy of K or V (same function): SA and
        log Z2 from the model's K and V as it keeps them (attention_lse); a token that sees no key gets SA = 0 and
        mu = 1, as in the reference."""
        SA, log_Z2 = attention_lse(q, k, v, mask, scaling)
        mu = torch.sigmoid(self.log_Z1(q) - log_Z2)                             # Z1 / (Z1 + Z2)
        return torch.addcmul(SA, mu.to(q.dtype), self.s.to(q.dtype)[:, None])  # SA + mu s


def layerwise_mse(student, teacher, query_target):
    """MimIC's layer-wise loss: per query, the mean squared difference of the student's and teacher's states over
    layers, query tokens and features; then the mean over queries. student, teacher: [L, B, W, d]; query_target:
    [B, W]."""
    return torch.stack([(student[:, b, a] - teacher[:, b, a]).float().square().mean()
                        for b, a in enumerate(query_target)]).mean()
