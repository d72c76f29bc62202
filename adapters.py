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


# ------------------------------------------------------------- baselines: static gates, output level, MimIC, LIVE

class StaticGate(HyperICL):
    """Hyper-ICL with the query-adaptive gate of Eq 9 replaced by a learned constant g = sigmoid(c) (Fig 3a, static
    intervention), one c per layer (this class) or per layer and head (StaticGateHead). Same fused path.
    c starts at 0, so g = 1/2 as Hyper-ICL's gate at initialisation. Parameters per layer: 2 H d_h r + (1 or H).
    """
    per_head = False

    def __init__(self, num_heads, head_dim, rank=4):
        super().__init__(num_heads, head_dim, rank)
        del self.w, self.b
        self.c = nn.Parameter(torch.zeros(num_heads if self.per_head else 1))

    def gate(self, q):
        """The constant g = sigmoid(c), broadcastable to [B, H, T, 1]."""
        return torch.sigmoid(self.c.to(torch.promote_types(q.dtype, torch.float32)))[None, :, None, None]


class StaticGateHead(StaticGate):
    """StaticGate with one constant per layer and head."""
    per_head = True


class OutputLevel(HyperICL):
    """Appendix E (Table 11): Hyper-ICL's module applied to the attention output O instead of the logits S.

    O~ = SA(Q, K, V) + Diag(g) (Q U_q) U_k^T / sqrt(r), with A = Q U_q and the gate g of Eq 9 exactly as in Hyper-ICL
    and the key side K U_k (one row per key) replaced by U_k itself (one row per output coordinate): the paper gives
    no formula, this is the form that keeps the module, its parameters (2 d_h r + d_h + 1 per head) and its
    initialisation (U_k = 0: the base model) unchanged. The softmax is untouched, so it runs in plain fused SDPA.
    """

    def forward(self, q, k, v, mask, scaling):
        """SA(Q, K, V) in fused attention, plus the gated low-rank offset of each query's output."""
        A = q @ self.U_q.to(q.dtype)
        offset = self.gate(q).to(q.dtype) * (A @ self.U_k.to(q.dtype).transpose(-1, -2)) / math.sqrt(self.rank)
        return sdpa(q, k, v, mask, scale=scaling) + offset

    reference = None  # no logit bias, hence no T x S form: forward is plain fused attention plus an offset


class MimIC(nn.Module):
    """MimIC (Jiang et al. 2025): per head a shift s (size d_h) and log Z1 = w.q + b, the head's output becomes

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
        """log Z1 = w.q + b per query token and head: [B, H, T, 1] in float32 (or float64)."""
        dtype = torch.promote_types(q.dtype, torch.float32)
        return (torch.einsum("bhtd,hd->bht", q.to(dtype), self.w.to(dtype)) + self.b.to(dtype)[:, None])[..., None]

    def forward(self, q, k, v, mask, scaling):
        """One fused SDPA over [virtual key; K]: the virtual key's logit is log Z1 (q gains a column log Z1 / scaling,
        the virtual key is the unit vector on it, real keys have 0 there). Two extra value columns mark the virtual
        key and the real keys, so the kernel returns (1 - mu) SA, mu and 1 - mu; SA = first / (1 - mu), each read
        with the kernel's own relative precision. Under plain causal attention (mask None) a leading dummy query row
        lines the kernel's own causal mask up with [virtual key; K], so no mask tensor is formed at all; otherwise
        the model's bool mask gains one always-true column.
        A query that may see no real key (a padding row) gets SA = 0, as in SDPA; elsewhere nothing is clamped: if
        Z2 / Z1 underflows (log Z1 - log Z2 > ~100 in float32), the result is NaN and training stops on it.
        """
        batch, H, T, d_h = q.shape
        S = k.shape[-2]
        width = -(-(d_h + 2) // 8) * 8
        q_aug, k_aug, v_aug = (x.new_zeros(batch, H, n, width) for x, n in ((q, T + 1), (k, S + 1), (v, S + 1)))
        q_aug[..., 1:, :d_h], q_aug[..., 1:, d_h] = q, (self.log_Z1(q)[..., 0] / scaling).to(q.dtype)
        k_aug[..., 0, d_h] = 1
        k_aug[..., 1:, :d_h] = k
        v_aug[..., 0, d_h] = 1                     # virtual key: its weight mu
        v_aug[..., 1:, :d_h], v_aug[..., 1:, d_h + 1] = v, 1  # real keys: (1 - mu) SA and their weight 1 - mu
        if mask is None:   # row 0 is the dummy query: row i + 1 sees [virtual; K_0..K_i] under the causal mask
            out = sdpa(q_aug, k_aug, v_aug, None, scale=scaling)[..., 1:, :]
        else:
            mask = mask.expand(batch, 1, T, S)
            out = sdpa(q_aug[..., 1:, :], k_aug, v_aug, torch.cat([mask.new_ones(batch, 1, T, 1), mask], -1),
                       scale=scaling)
        mu, rest = out[..., d_h:d_h + 1], out[..., d_h + 1:d_h + 2]
        if mask is not None:  # a row that sees no real key: (1 - mu) SA = 0, so SA = 0
            rest = rest.masked_fill(~mask.any(-1, keepdim=True), 1)
        return out[..., :d_h] / rest + mu * self.s.to(q.dtype)[:, None]


class LIVE(nn.Module):
    """LIVE (Peng et al. 2024): one vector v (size d) and scale alpha per decoder layer, added to the output h of the
    layer's MLP and renormalised to its norm: h' = (h + alpha v) |h| / |h + alpha v|.

    Initialised as in LIVE's public runs: alpha = 0.1 (their alpha_init_value), v ~ N(0, 0.01^2). Parameters per
    layer: d + 1. Runs as a forward hook on the MLP (model.attach), not inside attention.
    """

    def __init__(self, hidden_size):
        super().__init__()
        self.v = nn.Parameter(torch.randn(hidden_size) * 0.01)
        self.alpha = nn.Parameter(torch.tensor(0.1))

    def forward(self, h):
        """h' = (h + alpha v) |h| / |h + alpha v| over the last axis, computed in float32 (or float64)."""
        x = h.to(torch.promote_types(h.dtype, torch.float32))
        shifted = x + self.alpha.to(x.dtype) * self.v.to(x.dtype)
        return (shifted * (x.norm(dim=-1, keepdim=True) / shifted.norm(dim=-1, keepdim=True))).to(h.dtype)
