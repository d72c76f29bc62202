"""What is learned inside self-attention: Hyper-ICL's gated low-rank logit bias and HiFICL's virtual key-values.

Both act on one attention layer, all heads at once, with the tensors the attention kernel sees:
q: [B, H, T, d_h] (after rotary embedding), k, v: [B, H, S, d_h] (grouped key/value heads already repeated to H),
mask: bool [B, 1, T, S] (True = may attend) or None for plain causal attention, scaling = 1/sqrt(d_h).

Also here: the attention decomposition of Eq 1-2, the identity both methods start from.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


def causal_mask(T, S, device):
    """Bool [T, S]: query i (the last T of S positions) may attend key j <= S - T + i."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)


def full_mask(mask, T, S, device):
    """The explicit bool mask that `mask` (None = plain causal) stands for, broadcastable to [B, 1, T, S]."""
    return causal_mask(T, S, device) if mask is None else mask


def sdpa(q, k, v, mask, scale):
    """scaled_dot_product_attention with our mask convention (None = causal; decoding steps see everything)."""
    T, S = q.shape[-2], k.shape[-2]
    if mask is None and T > 1 and T != S:
        mask = causal_mask(T, S, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1, scale=scale)


# ------------------------------------------------------------------------------------ Eq 1-2: the decomposition

def decompose(logits_D, logits, V_D, V, mask=None):
    """Eq 2: SA over [K_D; K] = (1 - mu) SA(q, K, V) + mu SA(q, K_D, V_D), per query row.

    logits_D: [..., T, T_D] = q K_D^T (already scaled); logits: [..., T, S] = q K^T; V_D: [..., T_D, d_v];
    V: [..., S, d_v]; mask: bool broadcastable to logits (True = attend), applied to K only.
    Returns (SA(q, K, V), SA(q, K_D, V_D), mu) with mu = Z1 / (Z1 + Z2) of shape [..., T, 1].
    """
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf)
    log_Z1 = torch.logsumexp(logits_D, -1, keepdim=True)
    log_Z2 = torch.logsumexp(logits, -1, keepdim=True)
    mu = torch.sigmoid(log_Z1 - log_Z2)  # Z1 / (Z1 + Z2)
    return logits.softmax(-1) @ V, logits_D.softmax(-1) @ V_D, mu


def decompose_hificl(logits_D, logits, V, mask=None):
    """HiFICL's form of Eq 2: SA over [K_D; K] = alpha(q) SA(q, K, V) + beta(q) V_D.

    alpha = Z2 / (Z1 + Z2): [..., T, 1];  beta = exp(q K_D^T) / (Z1 + Z2): [..., T, T_D]. Returns (alpha, beta).
    """
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf)
    log_Z = torch.logsumexp(torch.cat([logits_D, logits], -1), -1, keepdim=True)  # log(Z1 + Z2)
    alpha = torch.exp(torch.logsumexp(logits, -1, keepdim=True) - log_Z)
    beta = torch.exp(logits_D - log_Z)
    return alpha, beta


def joint_attention(logits_D, logits, V_D, V, mask=None):
    """The left side of Eq 2: softmax([q K_D^T, q K^T]) [V_D; V], the mask applied to K only."""
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf)
    return torch.cat([logits_D, logits], -1).softmax(-1) @ torch.cat([V_D, V], -2)


# ------------------------------------------------------------------------- Hyper-ICL: gated low-rank logit bias

class HyperICL(nn.Module):
    """The gated low-rank logit bias of Eq 5-9 for one layer, with U_q, U_k, w, b per query head.

    S~ = S + Diag(g) Delta,  Delta = (Q U_q)(K U_k)^T / sqrt(r),  g = sigmoid(LN(Q) w + b).
    U_k starts at zero, so Delta = 0 and the layer is exactly the base attention at initialisation;
    U_q starts random so that U_k receives a gradient. Parameters per head: 2 d_h r + d_h + 1.
    """

    def __init__(self, num_heads, head_dim, rank=4):
        super().__init__()
        self.rank = rank
        self.U_q = nn.Parameter(torch.randn(num_heads, head_dim, rank) / math.sqrt(head_dim))
        self.U_k = nn.Parameter(torch.zeros(num_heads, head_dim, rank))
        self.w = nn.Parameter(torch.zeros(num_heads, head_dim))
        self.b = nn.Parameter(torch.zeros(num_heads))

    def gate(self, q):
        """Eq 9: g = sigmoid(LN(Q) w + b), one value per query token and head: [B, H, T, 1]."""
        dtype = torch.promote_types(q.dtype, torch.float32)  # bf16 / fp16 in float32
        u = F.layer_norm(q.to(dtype), q.shape[-1:])
        return torch.sigmoid(torch.einsum("bhtd,hd->bht", u, self.w.to(dtype)) + self.b.to(dtype)[:, None])[..., None]

    def low_rank(self, q, k):
        """Eq 6: A = Q U_q and B = K U_k, each [B, H, *, r]."""
        return q @ self.U_q.to(q.dtype), k @ self.U_k.to(k.dtype)

    def reference(self, q, k, v, mask, scaling):
        """Eq 3-8 written out: forms the T x S logits S~ (readable; the fast path must match it)."""
        A, B = self.low_rank(q, k)
        S = q @ k.transpose(-1, -2) * scaling                                   # Eq 3
        Delta = A @ B.transpose(-1, -2) / math.sqrt(self.rank)                  # Eq 7
        S_tilde = S + self.gate(q).to(S.dtype) * Delta                          # Eq 5
        seen = full_mask(mask, q.shape[-2], k.shape[-2], q.device)
        P = S_tilde.masked_fill(~seen, -math.inf).softmax(-1)
        P = P.masked_fill(~seen.any(-1, keepdim=True), 0)   # a padding query sees no key: output 0, as SDPA does
        return P @ v                                                            # Eq 8

    def forward(self, q, k, v, mask, scaling):
        """Eq 3-8 inside fused attention: S~ = scaling [Q, g A / (scaling sqrt(r))] [K, B]^T, one dot product over
        d_h + r, so no T x S tensor is formed. Q and K enter the kernel untouched and with the model's own scale, so
        where Delta = 0 (at initialisation) the kernel computes exactly what the base model's does, in bf16 too.

        Zero columns add nothing to a dot product, so q/k and v are zero-padded to one head size, a multiple of 8,
        which the fused (flash / memory-efficient) kernels accept; the output is sliced back to d_h.
        """
        A, B = self.low_rank(q, k)
        d_h, r = q.shape[-1], self.rank
        width = -(-(d_h + r) // 8) * 8
        q_aug, k_aug, v_pad = (x.new_zeros(*x.shape[:-1], width) for x in (q, k, v))
        q_aug[..., :d_h], q_aug[..., d_h:d_h + r] = q, self.gate(q).to(q.dtype) * A / (scaling * math.sqrt(r))
        k_aug[..., :d_h], k_aug[..., d_h:d_h + r] = k, B
        v_pad[..., :d_h] = v
        return sdpa(q_aug, k_aug, v_pad, mask, scale=scaling)[..., :d_h]


# --------------------------------------------------------------------------- HiFICL: low-rank virtual key-values

class HiFICL(nn.Module):
    """n learnable virtual key-value pairs per head, K_learn = K_A K_B and V_learn = V_A V_B (HiFICL).

    O = softmax([q K_learn^T, q K^T] / sqrt(d_h)) [V_learn; V]: the virtual pairs sit before the sequence, carry no
    rotary position, and every query token sees them; the real keys keep the model's own causal and padding mask,
    so the softmax is the true joint softmax over the keys the token may see. Parameters per head: 2 r (n + d_h).

    At initialisation V_B = 0, so V_learn = 0 and the layer computes alpha(q) SA(q, K, V) with
    alpha = Z2 / (Z1 + Z2) (Eq 2 with the virtual keys as K_D): not the base model, as in HiFICL.
    """

    def __init__(self, num_heads, head_dim, n=8, rank=8):
        super().__init__()
        self.K_A = nn.Parameter(torch.randn(num_heads, n, rank))
        self.K_B = nn.Parameter(torch.randn(num_heads, rank, head_dim) / math.sqrt(rank))
        self.V_A = nn.Parameter(torch.randn(num_heads, n, rank))
        self.V_B = nn.Parameter(torch.zeros(num_heads, rank, head_dim))

    def virtual(self, dtype):
        """K_learn, V_learn: [H, n, d_h] each."""
        return (self.K_A @ self.K_B).to(dtype), (self.V_A @ self.V_B).to(dtype)

    def forward(self, q, k, v, mask, scaling):
        """Joint attention over [K_learn; K] and [V_learn; V] in one fused call.

        Without padding (mask None) no mask is formed. The virtual keys stand before the sequence, so every query sees
        the keys of [K_learn; K] up to its own position counted from the end: causal attention aligned at the lower
        right. In a prefill (T = S) n zero query rows are put before the queries, which makes the query and key
        lengths equal, so SDPA's own causal path is exactly that; their outputs are dropped. A decoding step (T = 1)
        sees every key. Otherwise (padding, or a chunk of T < S queries) the explicit mask is built.
        """
        batch, T, S = q.shape[0], q.shape[-2], k.shape[-2]
        K_learn, V_learn = (x.expand(batch, -1, -1, -1) for x in self.virtual(q.dtype))
        n = K_learn.shape[-2]
        keys, values = torch.cat([K_learn, k], -2), torch.cat([V_learn, v], -2)
        if mask is None and T == S:
            q = torch.cat([q.new_zeros(*q.shape[:-2], n, q.shape[-1]), q], -2)
            return sdpa(q, keys, values, None, scale=scaling)[..., n:, :]
        if mask is None and T == 1:
            return sdpa(q, keys, values, None, scale=scaling)
        seen = full_mask(mask, T, S, q.device).expand(batch, 1, T, S)
        mask = torch.cat([seen.new_ones(batch, 1, T, n), seen], -1)
        return sdpa(q, keys, values, mask, scale=scaling)
