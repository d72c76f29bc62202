"""What is learned inside self-attention: Hyper-ICL's gated low-rank logit bias and HiFICL's virtual key-values.

Both act on one attention layer, all heads at once, with the tensors the attention kernel sees: q: [batch, H, T, d_h]
(after rotary embedding), k, v: [batch, H_kv, T_k, d_h] with H a multiple of H_kv (grouped-query attention: query
heads h of one group share key/value head h // (H / H_kv), never copied), mask: bool [batch, 1, T, T_k] (True = may
attend) or None for plain causal attention, scaling = 1/sqrt(d_h). Symbols as in the paper: S the logits, K and V
the keys and values, A = Q U_q, B = K U_k, g the gate (w, b); T queries attend T_k keys. A method's `reference`
writes its equations out (T x T_k logits): the tests hold its fused `forward`, the form that runs, to it.
First Eq 1-2 (the decomposition), then Hyper-ICL, HiFICL and the paper's ablations of Hyper-ICL; the kernel helpers
last. The baselines (MimIC, LIVE, LoRA) and every method by name: lab/methods/.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


# ------------------------------------------------------------------------------------ Eq 1-2: the decomposition

def decompose(logits_D, logits, V_D, V, mask=None):
    """Eq 2 written out: SA over [K_D; K] = (1 - mu) SA(q, K, V) + mu SA(q, K_D, V_D), per query row. The tests hold
    it to the left side (joint_attention); HiFICL and MimIC run it fused (attention_lse).

    logits_D: [..., T, T_D] = q K_D^T (already scaled); logits: [..., T, T_k] = q K^T; V_D: [..., T_D, d_v];
    V: [..., T_k, d_v]; mask: bool broadcastable to logits (True = attend), applied to K only.
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
    Not in the paper, which does not say: Q and K are the rotary-embedded ones the kernel sees (the gate's LN too),
    and under grouped-query attention each query head has its own U_k on the key head its group shares.
    """

    def __init__(self, num_heads, head_dim, rank=4):
        super().__init__()
        self.rank = rank
        self.U_q = nn.Parameter(torch.randn(num_heads, head_dim, rank) / math.sqrt(head_dim))
        self.U_k = nn.Parameter(torch.zeros(num_heads, head_dim, rank))
        self.w = nn.Parameter(torch.zeros(num_heads, head_dim))
        self.b = nn.Parameter(torch.zeros(num_heads))

    def gate(self, q):
        """Eq 9: g = sigmoid(LN(Q) w + b), one value per query token and head: [batch, H, T, 1]."""
        dtype = torch.promote_types(q.dtype, torch.float32)  # bf16 / fp16 in float32
        u = F.layer_norm(q.to(dtype), q.shape[-1:])
        return torch.sigmoid(torch.einsum("bhtd,hd->bht", u, self.w.to(dtype)) + self.b.to(dtype)[:, None])[..., None]

    def reference(self, q, k, v, mask, scaling):
        """Eq 3-8 written out, with the T x T_k logits S~: the reference the tests hold forward (what runs) to."""
        k, v = (per_query_head(x, q.shape[1]) for x in (k, v))
        A, B = q @ self.U_q.to(q.dtype), k @ self.U_k.to(k.dtype)              # Eq 6
        S = q @ k.transpose(-1, -2) * scaling                                   # Eq 3
        Delta = A @ B.transpose(-1, -2) / math.sqrt(self.rank)                  # Eq 7
        S_tilde = S + self.gate(q).to(S.dtype) * Delta                          # Eq 5
        seen = full_mask(mask, q.shape[-2], k.shape[-2], q.device)
        weights = S_tilde.masked_fill(~seen, -math.inf).softmax(-1)
        weights = weights.masked_fill(~seen.any(-1, keepdim=True), 0)  # a query that sees no key (padding): 0, as SDPA
        return weights @ v                                                      # Eq 8

    def forward(self, q, k, v, mask, scaling):
        """What runs: Eq 3-9 in fused attention. Delta = (Q U_q)(K U_k)^T / sqrt(r) = (Q U_q U_k^T) K^T / sqrt(r), so

            S~ = S + Diag(g) Delta = scaling Q~ K^T,   Q~ = Q + Diag(g) (Q U_q) U_k^T / (scaling sqrt(r)):

        the logit bias is a gated rank-r change of each query. The kernel gets Q~ and the model's own K and V (grouped
        heads shared, as in the base model's call): no T x T_k tensor, no copy of the keys or the cache, no wider head.
        Where Delta = 0 (U_k = 0 at initialisation) Q~ = Q exactly, so the kernel computes what the base model's
        does, in bf16 too; otherwise Q~ is rounded once to the model's dtype, as Q itself was.
        """
        g = self.gate(q)                                                        # Eq 9, float32 (or float64)
        A = q @ self.U_q.to(q.dtype)                                            # Eq 6
        offset = A @ (self.U_k.transpose(-1, -2) / (scaling * math.sqrt(self.rank))).to(q.dtype)
        q_tilde = torch.addcmul(q.to(g.dtype), g, offset.to(g.dtype))          # Q + Diag(g) Q U_q U_k^T / ...
        return sdpa(q_tilde.to(q.dtype), k, v, mask, scale=scaling)


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

    def reference(self, q, k, v, mask, scaling):
        """HiFICL as written: softmax([q K_learn^T, q K^T] scaling) [V_learn; V], the model's mask on K only, with
        the T x (n + T_k) logits: the reference the tests hold forward (what runs) to."""
        k, v = (per_query_head(x, q.shape[1]) for x in (k, v))
        K_learn, V_learn = self.virtual(q.dtype)
        seen = full_mask(mask, q.shape[-2], k.shape[-2], q.device)
        logits_D, logits = q @ K_learn.transpose(-1, -2) * scaling, q @ k.transpose(-1, -2) * scaling
        return joint_attention(logits_D, logits, V_learn.expand(len(q), -1, -1, -1), v, seen)

    def forward(self, q, k, v, mask, scaling):
        """What runs: the reference, computed by Eq 2 without a T x T_k tensor and without a copy of K or V (an
        optimisation, same function): (1 - mu) SA(q, K, V) + mu SA(q, K_learn, V_learn), mu = Z1 / (Z1 + Z2). The
        T x n virtual part is computed directly (float32 or float64); SA and log Z2 come from the model's K and V as
        it keeps them (attention_lse).
        """
        K_learn, V_learn = self.virtual(torch.promote_types(q.dtype, torch.float32))
        logits_D = q.to(K_learn.dtype) @ (K_learn.transpose(-1, -2) * scaling)  # [batch, H, T, n]
        log_Z1 = torch.logsumexp(logits_D, -1, keepdim=True)
        SA_D = torch.exp(logits_D - log_Z1) @ V_learn                          # SA(q, K_learn, V_learn)
        SA, log_Z2 = attention_lse(q, k, v, mask, scaling)
        log_ratio = log_Z1 - log_Z2                                             # mu = Z1 / (Z1 + Z2) = sigmoid
        return self.mix(SA.to(SA_D.dtype), SA_D, log_ratio).to(q.dtype)

    @staticmethod
    def mix(SA, SA_D, log_ratio):  # Eq 2: (1 - mu) SA + mu SA_D, 1 - mu as sigmoid(-log_ratio), not 1 - (near 1)
        return torch.sigmoid(-log_ratio) * SA + torch.sigmoid(log_ratio) * SA_D


# ----------------------------------------------- the paper's ablations: static gates (Fig 3a), output level (Table 11)

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
        """The constant g = sigmoid(c), broadcastable to [batch, H, T, 1]."""
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

    reference = None  # no logit bias, hence no T x T_k form: forward is plain fused attention plus an offset


# ------------------------------------ kernel helpers (optimisations): masks, SDPA, SDPA with its log-sum-exp

def causal_mask(T, T_k, device):
    """Bool [T, T_k]: query i (the last T of T_k positions) may attend key j <= T_k - T + i."""
    return torch.ones(T, T_k, dtype=torch.bool, device=device).tril(T_k - T)


def full_mask(mask, T, T_k, device):
    """The explicit bool mask that `mask` (None = plain causal) stands for, broadcastable to [batch, 1, T, T_k]."""
    return causal_mask(T, T_k, device) if mask is None else mask


def sdpa(q, k, v, mask, scale):
    """scaled_dot_product_attention with our mask convention (None = causal; decoding steps see everything) and
    grouped key/value heads shared by their query heads inside the kernel (enable_gqa). On CPU the fused kernel takes
    them with or without a mask; on a GPU only flash attention does (half precision, no mask), and the others would
    fall back to the math kernel, which forms T x T_k scores, so there the heads are repeated first, as transformers'
    own call does."""
    T, T_k = q.shape[-2], k.shape[-2]
    if mask is None and T > 1 and T != T_k:
        mask = causal_mask(T, T_k, q.device)
    if q.device.type != "cpu" and (mask is not None or q.dtype not in (torch.float16, torch.bfloat16)):
        k, v = per_query_head(k, q.shape[1]), per_query_head(v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def per_query_head(x, heads):
    """[batch, H_kv, T_k, d] -> [batch, heads, T_k, d]: each key/value head repeated for its group."""
    return x.repeat_interleave(heads // x.shape[1], 1)


def attention_lse(q, k, v, mask, scaling):
    """What Eq 2 needs of the real keys, from K and V as the model keeps them (grouped, never copied): SA(q, K, V) and
    log Z2 = log sum_j exp(q.k_j scaling) over the keys j the query may see: [batch, H, T, d_h], [batch, H, T, 1].
    A query that may see no key (a padding row) gets SA = 0, as in SDPA, and log Z2 = -inf, so that mu = 1.
    A decoding step reads them off its logits (one_query_attention_lse), longer inputs from one fused kernel
    (fused_attention_lse).
    """
    SA, log_Z2 = (one_query_attention_lse if q.shape[-2] == 1 else fused_attention_lse)(q, k, v, mask, scaling)
    if mask is not None:
        none = ~mask.any(-1, keepdim=True)
        SA, log_Z2 = SA.masked_fill(none, 0), log_Z2.masked_fill(none, -math.inf)
    return SA, log_Z2


def one_query_attention_lse(q, k, v, mask, scaling):
    """attention_lse for one query token against the cache (a decoding step). Why not the fused kernel: the logits
    are one row of T_k per head, small, so they are formed directly and log Z2 read off them; the step reads K and V
    once each, as SDPA's does (timed against SDPA's step: tools/bench_attention.py, docs/efficiency.md). The logits
    are rounded to the model's dtype, as in transformers' eager attention; the softmax runs in float32 (or float64).
    """
    (B, H, _, d_h), H_kv = q.shape, k.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    logits = (q.reshape(B, H_kv, H // H_kv, d_h) @ k.transpose(-1, -2)).to(dtype) * scaling  # a group's heads at once
    if mask is not None:                                                    # [B, 1, 1, T_k] on [B, H_kv, H / H_kv, T_k]
        logits = logits.masked_fill(~mask, -math.inf)
    log_Z2 = torch.logsumexp(logits, -1, keepdim=True)
    shift = log_Z2.masked_fill(log_Z2 == -math.inf, 0)  # a row that sees no key: weights exp(-inf) = 0, not NaN
    SA = torch.exp(logits - shift).to(v.dtype) @ v
    return SA.view(B, H, 1, d_h), log_Z2.view(B, H, 1, 1)


def fused_attention_lse(q, k, v, mask, scaling):
    """attention_lse from one fused kernel that returns the log-sum-exp of its logits beside its output (it keeps it
    for its backward; SDPA's public call drops it): on a CPU the flash kernel SDPA itself runs there (grouped heads
    shared), on CUDA the memory-efficient kernel (heads repeated, the mask aligned as SDPA aligns it). No T x T_k
    tensor beyond the additive mask SDPA forms too. These kernels are private to torch: on a torch that lacks the
    device's kernel, or has it with another signature (private_kernel), SDPA's public call gives SA and the
    log-sum-exp is computed here (public_attention_lse), with the same results. The log-sum-exp carries no gradient;
    where one is wanted it is added: d log Z2 = sum_j p_j d(q.k_j) scaling (p the attention weights) is the gradient
    of scaling q.SA(q, K, K) with the weights held, one more fused call, made only then.
    """
    (B, H, T, _), T_k = q.shape, k.shape[-2]
    if mask is None and T != T_k:
        mask = causal_mask(T, T_k, q.device)
    kernel = private_kernel(q.device.type)
    if kernel is None:
        SA, log_Z2 = public_attention_lse(q, k, v, mask, scaling)
    else:
        bias = None if mask is None else \
            torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)  # as SDPA makes it
        if q.device.type == "cpu":
            SA, log_Z2 = kernel(q, k, v, is_causal=mask is None, attn_mask=bias, scale=scaling)
        else:
            if bias is not None:                                              # rows 8-aligned, one per head
                bias = F.pad(bias, (0, -T_k % 8))[..., :T_k].expand(B, H, T, T_k)
            SA, log_Z2 = kernel(q, per_query_head(k, H), per_query_head(v, H), bias, True, is_causal=mask is None,
                                scale=scaling)[:2]
            log_Z2 = log_Z2[..., :T]                                          # the kernel pads T to a multiple of 32
    log_Z2 = log_Z2[..., None]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        mean_k = sdpa(q.detach(), k.detach(), k, mask, scale=scaling)     # sum_j p_j k_j, p held
        held = (q * mean_k).sum(-1, keepdim=True) * scaling
        log_Z2 = log_Z2 + (held - held.detach())                          # the same value, its gradient
    return SA, log_Z2


PRIVATE_KERNELS = {  # a device type: the private torch kernel fused_attention_lse calls there, and its signature
    "cpu": ("_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu(Tensor query, Tensor key, Tensor value, "
            "float dropout_p=0., bool is_causal=False, *, Tensor? attn_mask=None, float? scale=None) "
            "-> (Tensor output, Tensor logsumexp)"),
    "cuda": ("_scaled_dot_product_efficient_attention",
             "aten::_scaled_dot_product_efficient_attention(Tensor query, Tensor key, Tensor value, "
             "Tensor? attn_bias, bool compute_log_sumexp, float dropout_p=0., bool is_causal=False, *, "
             "float? scale=None) -> (Tensor output, Tensor log_sumexp, Tensor philox_seed, Tensor philox_offset)"),
}


def private_kernel(device_type):
    """The device's private kernel (PRIVATE_KERNELS) if this torch has it with the signature called here, else None
    (fused_attention_lse then takes the public path)."""
    name, schema = PRIVATE_KERNELS.get(device_type, (None, None))
    packet = getattr(torch.ops.aten, name, None) if name else None
    kernel = getattr(packet, "default", None)
    return kernel if kernel is not None and str(kernel._schema) == schema else None


def public_attention_lse(q, k, v, mask, scaling, chunk=1024):
    """fused_attention_lse's results from public calls: SA from SDPA (sdpa), log Z2 computed here a chunk of keys at
    a time (no T x T_k tensor kept; a group's query heads against their shared key head), in float32 or wider as the
    kernels keep it, without a gradient (fused_attention_lse adds it): [batch, H, T, d_h], [batch, H, T]."""
    (B, H, T, d_h), (H_kv, T_k) = q.shape, k.shape[1:3]
    dtype = torch.promote_types(q.dtype, torch.float32)
    seen = full_mask(mask, T, T_k, q.device)
    seen = seen[:, :, None] if seen.dim() == 4 else seen                  # [B, 1, T, T_k] on [B, H_kv, G, T, T_k]
    groups = q.detach().to(dtype).reshape(B, H_kv, H // H_kv, T, d_h)
    log_Z2 = torch.full((B, H_kv, H // H_kv, T), -math.inf, dtype=dtype, device=q.device)
    for start in range(0, T_k, chunk):
        keys = k.detach()[:, :, None, start:start + chunk].to(dtype)
        logits = (groups @ keys.transpose(-1, -2)) * scaling
        logits = logits.masked_fill(~seen[..., start:start + chunk], -math.inf)
        log_Z2 = torch.logaddexp(log_Z2, torch.logsumexp(logits, -1))
    return sdpa(q, k, v, mask, scale=scaling), log_Z2.view(B, H, T)
