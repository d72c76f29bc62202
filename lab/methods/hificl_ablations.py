"""HiFICL's component ablations (its paper's table on Idefics2, `python -m lab table hificl-ablation`), each HiFICL
(adapters.HiFICL) with one part changed: K_learn or V_learn one full [H, n, d_h] parameter instead of its low-rank
factors ("- LoRA on K / V"), or alpha(q) fixed to 1 ("w/o SA scaling", the linear shift). The fourth, + teacher
alignment, is HiFICL itself with MimIC's layer-wise loss (registry.py). Per head, n = r = 8: a full K or V holds
n d_h = 1,024 parameters, its factors r (n + d_h) = 1,088."""
import math

import torch
from torch import nn

from adapters import HiFICL, decompose_hificl, full_mask, per_query_head


class HiFICLFullK(HiFICL):
    """HiFICL's ablation "- LoRA on K": K_learn one full [H, n, d_h] parameter, N(0, 1) as K_A K_B's entries start."""

    def __init__(self, num_heads, head_dim, n=8, rank=8):
        super().__init__(num_heads, head_dim, n, rank)
        del self.K_A, self.K_B
        self.K_learn = nn.Parameter(torch.randn(num_heads, n, head_dim))

    def virtual(self, dtype):
        return self.K_learn.to(dtype), (self.V_A @ self.V_B).to(dtype)


class HiFICLFullV(HiFICL):
    """HiFICL's ablation "- LoRA on V": V_learn one full [H, n, d_h] parameter, zero as V_A V_B starts."""

    def __init__(self, num_heads, head_dim, n=8, rank=8):
        super().__init__(num_heads, head_dim, n, rank)
        del self.V_A, self.V_B
        self.V_learn = nn.Parameter(torch.zeros(num_heads, n, head_dim))

    def virtual(self, dtype):
        return (self.K_A @ self.K_B).to(dtype), self.V_learn.to(dtype)


class HiFICLLinear(HiFICL):
    """HiFICL's ablation alpha = 1, the linear shift: O = SA(q, K, V) + beta(q) V_learn, the real keys' attention not
    rescaled (at initialisation, V_learn = 0: the base model). Fused: beta V_learn = mu SA(q, K_learn, V_learn)."""

    def reference(self, q, k, v, mask, scaling):
        """O written out with beta = exp(q K_learn^T scaling) / (Z1 + Z2) (decompose_hificl), T x (n + T_k) logits."""
        k, v = (per_query_head(x, q.shape[1]) for x in (k, v))
        K_learn, V_learn = self.virtual(q.dtype)
        seen = full_mask(mask, q.shape[-2], k.shape[-2], q.device)
        logits_D, logits = q @ K_learn.transpose(-1, -2) * scaling, q @ k.transpose(-1, -2) * scaling
        weights = logits.masked_fill(~seen, -math.inf).softmax(-1).masked_fill(~seen.any(-1, keepdim=True), 0)
        return weights @ v + decompose_hificl(logits_D, logits, v, seen)[1] @ V_learn  # no key seen: SA = 0

    @staticmethod
    def mix(SA, SA_D, log_ratio):
        return SA + torch.sigmoid(log_ratio) * SA_D
