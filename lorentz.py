"""The Lorentz model of hyperbolic space and the layer-wise anchor losses of Hyper-ICL (Eq 10-18).

Hidden states are layer-normalised (Eq 12), read as tangent vectors at the origin o of the hyperboloid
H = {p in R^{d+1}: <p, p>_L = -1/kappa, p0 > 0} (Eq 10-11), mapped onto it by exp_o (Eq 13-14), and the
student is pulled towards the teacher by the mean squared geodesic distance (Eq 15-16, per query, then over
the batch); the Euclidean L2-anchor of Table 4 and the relative delta-hyperbolicity of Appendix C (Eq 18) sit
beside it. The functions below follow the equations as written; the loss evaluates Eq 15 by a rewrite that is
exact in float32 at real hidden sizes (`tangent_distance`, in the last section).
"""
import math

import torch
import torch.nn.functional as F

def inner(p, q):
    """Lorentz inner product <p, q>_L = -p0 q0 + sum_t p_t q_t (Eq 10). p, q: [..., d+1] -> [...]."""
    return -p[..., 0] * q[..., 0] + (p[..., 1:] * q[..., 1:]).sum(-1)


def origin(d, kappa, dtype=None, device=None):
    """The origin o = (1/sqrt(kappa), 0, ..., 0) of H^d_kappa (Eq 11): [d+1]."""
    o = torch.zeros(d + 1, dtype=dtype, device=device)
    o[0] = 1 / kappa ** 0.5
    return o


def layer_norm(h):
    """LN without affine over the last dim (Eq 12; also Eq 9). h: [..., d] -> [..., d], float32 for bf16/fp16 h."""
    h = _upcast(h)
    return F.layer_norm(h, h.shape[-1:])


def expmap0(u, kappa):
    """exp_o(u) = cosh(sqrt(kappa)|u|) o + sinh(sqrt(kappa)|u|) / (sqrt(kappa)|u|) (0, u) (Eq 13).

    u: [..., d] -> [..., d+1]. The fraction is 1 at |u| = 0 (Taylor series near 0, so its gradient is exact).
    Overflows when sqrt(kappa)|u| nears the dtype's log(max) (89 in float32): that is the explicit
    representation itself; tangent_distance does not go through it.
    """
    sk = kappa ** 0.5
    a = sk * torch.linalg.vector_norm(u, dim=-1, keepdim=True)
    small = a < 1e-2
    a_big = torch.where(small, 1, a)
    sinhc = torch.where(small, 1 + a * a / 6 + a ** 4 / 120, torch.sinh(a_big) / a_big)
    return torch.cat([torch.cosh(a) / sk, sinhc * u], -1)


def distance(p, q, kappa):
    """Geodesic distance between points p, q of H^d_kappa (Eq 15). p, q: [..., d+1] -> [...].

    Uses -kappa<p, q>_L - 1 = (kappa/2) <p - q, p - q>_L, exact on H (<p, p>_L = <q, q>_L = -1/kappa),
    so that d(p, p) = 0 exactly and nearby points keep their digits; arcosh(1 + y) = log1p(y + sqrt(y (y + 2))).
    No clamp: points off H by more than rounding give nan rather than a silently wrong number.
    """
    y = kappa / 2 * inner(p - q, p - q)
    return torch.log1p(y + torch.sqrt(y * (y + 2))) / kappa ** 0.5


def hyperbolic_anchor_loss(student, teacher, mask, kappa):
    """L_H-anchor (Eq 16): d_L^2 between LN'd student and teacher states, averaged over each query's layers and
    masked tokens, then over the queries (mean_per_query: a long query weighs no more than a short one).

    student, teacher: L x [B, T, d] or [L, B, T, d]; mask: bool [B, T], True for the tokens to align
    (the query tokens). Returns a scalar (float32 for bf16/fp16 states). No detach: the caller decides.
    """
    s = layer_norm(_per_layer_tokens(student, mask))
    t = layer_norm(_per_layer_tokens(teacher, mask))
    return mean_per_query(tangent_distance(s, t, kappa).square(), mask)


def mean_per_query(per_token, mask):
    """Eq 16's averaging: (1/L) sum_l (1/T_b) sum_i per_token for each query b, then the mean over the queries.

    per_token: [L, N], one value per layer and masked token (row-major order of mask); mask: bool [B, T].
    Every query weighs the same, however many tokens it has; queries without masked tokens are left out.
    """
    counts = mask.sum(1)
    query = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)[mask]  # the query of each token
    return (per_token.mean(0) / counts[query]).sum() / (counts > 0).sum()


def _per_layer_tokens(states, mask):
    """Hidden states of the masked tokens, layers stacked: L x [B, T, d] or [L, B, T, d] -> [L, N, d]."""
    return torch.stack([h[mask] for h in states])


def euclidean_anchor_loss(student, teacher, mask):
    """L2-anchor (Table 4): Eq 16 with the squared Euclidean distance of the LN'd states, averaged the same way
    (mean_per_query). Shapes as above."""
    s = layer_norm(_per_layer_tokens(student, mask))
    t = layer_norm(_per_layer_tokens(teacher, mask))
    return mean_per_query((s - t).square().sum(-1), mask)


def delta_hyperbolicity(dist, n_samples=1000, generator=None):
    """Relative delta-hyperbolicity 2 delta / diam in [0, 1] (Eq 18; Khrulkov et al. 2020, Fournier et al. 2015).

    dist: [N, N] distance matrix of a finite metric space. delta is the largest four-point delta,
    (largest - second largest of d(x,y)+d(z,w), d(x,z)+d(y,w), d(x,w)+d(y,z)) / 2, over n_samples random
    quadruples (x, y, z, w) drawn with `generator` (pass equally seeded ones to compare spaces on the same
    quadruples). Returns a 0-dim tensor; 0 for a tree metric.
    """
    x, y, z, w = torch.randint(dist.shape[0], (4, n_samples), generator=generator, device=dist.device)
    sums = torch.stack([dist[x, y] + dist[z, w], dist[x, z] + dist[y, w], dist[x, w] + dist[y, z]], -1)
    top2 = sums.topk(2, dim=-1).values
    delta = (top2[:, 0] - top2[:, 1]).max() / 2
    return 2 * delta / dist.max()


# ------------------------------------------------------------- the stable rewrite of Eq 13-15 (what the loss uses)
#
# After LN, |u| ~ sqrt(d), so a = sqrt(kappa)|u| is ~20 at kappa = 0.1 and ~64 at kappa = 1 (d = 4096). The explicit
# points then have p0 ~ e^a, and Eq 15's argument -kappa<P', P>_L is the difference of two numbers near e^(a+b):
# float32 cancels most digits and overflows at large a. The loss therefore never forms the points: with
# b = sqrt(kappa)|v| and theta the angle between u and v,
#     -kappa <exp_o(u), exp_o(v)>_L - 1 = (cosh(a - b) - 1) + sinh(a) sinh(b) (1 - cos theta)
# is a sum of non-negative terms, evaluated in log space (no overflow) with a - b and 1 - cos theta formed without
# cancellation, and arcosh(1 + y) is evaluated from log y. log 0 is represented by the finite _LOG0, so that at
# coincident points (y = 0) autograd gives the squared distance its true gradient, 0.

_LOG0 = -1e30  # log 0 as a finite number: exp(_LOG0) == 0 in every dtype, yet autograd through it never makes nan


def tangent_distance(u, v, kappa):
    """d_L(exp_o(u), exp_o(v)) (Eq 13-15) from the tangent vectors, without forming the points.

    u, v: [..., d] (broadcastable) -> [...]; bf16/fp16 inputs are computed in float32. With a = sqrt(kappa)|u|,
    b = sqrt(kappa)|v|: y = -kappa<exp_o(u), exp_o(v)>_L - 1 = (cosh(a - b) - 1) + sinh(a) sinh(b) (1 - cos theta),
    all in log space; |u| - |v| = (u - v).(u + v) / (|u| + |v|) and
    u_hat - v_hat = (2 (u - v) - (u_hat + v_hat)(|u| - |v|)) / (|u| + |v|) are free of cancellation, so
    nearby points keep their digits. Finite gradient everywhere; at u = v the gradient of d^2 is exactly 0.
    At exactly u = 0 (or v = 0) the gradient w.r.t. that vector is a subgradient (|u| has a kink there).
    """
    u, v = _upcast(u), _upcast(v)
    sk = kappa ** 0.5
    tiny = torch.finfo(u.dtype).tiny  # the clamps below only replace an exact 0 norm (0/0 -> 0)
    nu = torch.linalg.vector_norm(u, dim=-1, keepdim=True)
    nv = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
    n = (nu + nv).clamp_min(tiny)
    w = u - v
    dn = (w * (u + v)).sum(-1, keepdim=True) / n  # |u| - |v|
    dhat = (2 * w - (u / nu.clamp_min(tiny) + v / nv.clamp_min(tiny)) * dn) / n  # u_hat - v_hat
    one_m_cos = (dhat * dhat).sum(-1) / 2
    a, b, c = sk * nu.squeeze(-1), sk * nv.squeeze(-1), sk * dn.squeeze(-1)
    log_y = torch.logaddexp(_log_cosh_m1(c), _log_sinh(a) + _log_sinh(b) + _log(one_m_cos))
    return _arcosh1p_exp(log_y) / sk


def _log(x):
    """log x for x >= 0, with log 0 = _LOG0 and zero gradient there."""
    pos = x > 0
    return torch.where(pos, torch.log(torch.where(pos, x, 1)), _LOG0)


def _log_sinh(a):
    """log sinh(a) for a >= 0, without overflow: a - log 2 + log(1 - e^(-2a))."""
    return a - math.log(2) + _log(-torch.expm1(-2 * a))


def _log_cosh_m1(c):
    """log(cosh(c) - 1) = log(2 sinh^2(c / 2)) = |c| - log 2 + 2 log(1 - e^(-|c|)), without overflow."""
    c = c.abs()
    return c - math.log(2) + 2 * _log(-torch.expm1(-c))


def _arcosh1p_exp(log_y):
    """arcosh(1 + y) from log y, never forming y: softplus(log(y + sqrt(y (y + 2))))."""
    half = log_y / 2
    g = half + torch.logaddexp(half, torch.logaddexp(log_y, torch.full_like(log_y, math.log(2))) / 2)
    return torch.logaddexp(g, torch.zeros_like(g))


def _upcast(x):
    """bf16/fp16 -> float32; float32 and float64 unchanged."""
    return x.float() if torch.finfo(x.dtype).bits < 32 else x
