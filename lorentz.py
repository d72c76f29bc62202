"""The Lorentz model of hyperbolic space and the layer-wise anchor losses of Hyper-ICL (Eq 10-18).

Hidden states h are layer-normalised (Eq 12), read as tangent vectors u at the origin o of the hyperboloid
H = {p in R^{d+1}: <p, p>_L = -1/kappa, p0 > 0} (Eq 10-11), mapped onto it by exp_o (Eq 13-14), and the student is
pulled towards the teacher by the mean squared geodesic distance (Eq 15-16, per query, then over the batch); the
L2-anchor of Table 4 and the relative delta-hyperbolicity of Appendix C (Eq 18) sit beside it. `inner`, `origin`,
`expmap0` and `distance` write Eq 10-15 out: the reference the tests hold the stable form to. The loss runs the
stable form, `tangent_distance` (last section): Eq 13-15 from the tangent vectors, exact in float32 at d = 4096.
Symbols: P = exp_o(u) a point, kappa the curvature, L layers, d the hidden size; batch, T, N (aligned tokens) sizes.
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
    """exp_o(u) = cosh(rho) o + sinh(rho) / rho (0, u), rho = sqrt(kappa)|u| (Eq 13) written out: the reference for
    tangent_distance, which the loss runs instead. u: [..., d] -> [..., d+1]. sinh(rho) / rho is 1 at |u| = 0 (Taylor
    series near 0, so its gradient is exact). Overflows when rho nears the dtype's log(max) (89 in float32): that is
    the explicit representation itself.
    """
    sqrt_kappa = kappa ** 0.5
    rho = sqrt_kappa * torch.linalg.vector_norm(u, dim=-1, keepdim=True)
    small = rho < 1e-2
    rho_big = torch.where(small, 1, rho)
    sinhc = torch.where(small, 1 + rho * rho / 6 + rho ** 4 / 120, torch.sinh(rho_big) / rho_big)
    return torch.cat([torch.cosh(rho) / sqrt_kappa, sinhc * u], -1)


def distance(p, q, kappa):
    """Geodesic distance between points p, q of H^d_kappa (Eq 15) written out: the reference for tangent_distance.
    p, q: [..., d+1] -> [...].

    Uses -kappa<p, q>_L - 1 = (kappa/2) <p - q, p - q>_L, exact on H (<p, p>_L = <q, q>_L = -1/kappa),
    so that d(p, p) = 0 exactly and nearby points keep their digits; arcosh(1 + y) = log1p(y + sqrt(y (y + 2))).
    No clamp: points off H by more than rounding give nan rather than a silently wrong number.
    """
    y = kappa / 2 * inner(p - q, p - q)
    return torch.log1p(y + torch.sqrt(y * (y + 2))) / kappa ** 0.5


def hyperbolic_anchor_loss(student, teacher, query_target, kappa):
    """L_H-anchor (Eq 16): d_L^2 between the student's and the teacher's points exp_o(LN(h)) (Eq 12-15, computed by
    tangent_distance), averaged over each query's layers and aligned tokens, then over the queries (mean_per_query).

    student, teacher: L x [batch, T, d] or [L, batch, T, d]; query_target: bool [batch, T], True at the query's and
    its target's tokens (data.collate's). Returns a scalar (float32 for bf16/fp16 states). No detach here.
    """
    s = layer_norm(_per_layer_tokens(student, query_target))
    t = layer_norm(_per_layer_tokens(teacher, query_target))
    return mean_per_query(tangent_distance(s, t, kappa).square(), query_target)


def mean_per_query(per_token, query_target):
    """Eq 16's averaging: per query, the mean over layers of the mean over its aligned tokens; then over the queries.

    per_token: [L, N], one value per layer and aligned token (row-major order of query_target: bool [batch, T]).
    Every query weighs the same, however many tokens it has; queries without aligned tokens are left out.
    """
    counts, rows = query_target.sum(1), torch.arange(query_target.shape[0], device=query_target.device)
    query = rows[:, None].expand_as(query_target)[query_target]  # the query of each token
    return (per_token.mean(0) / counts[query]).sum() / (counts > 0).sum()


def _per_layer_tokens(states, query_target):
    """Hidden states of the aligned tokens, layers stacked: L x [batch, T, d] or [L, batch, T, d] -> [L, N, d]."""
    return torch.stack([h[query_target] for h in states])


def euclidean_anchor_loss(student, teacher, query_target):
    """L2-anchor (Table 4): Eq 16 with the squared Euclidean distance of the LN'd states, averaged the same way
    (mean_per_query). Shapes as above."""
    s = layer_norm(_per_layer_tokens(student, query_target))
    t = layer_norm(_per_layer_tokens(teacher, query_target))
    return mean_per_query((s - t).square().sum(-1), query_target)


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
# After LN, |u| ~ sqrt(d), so rho_u = sqrt(kappa)|u| is ~20 at kappa = 0.1 and ~64 at kappa = 1 (d = 4096). The
# explicit points then have p0 ~ e^rho_u, and Eq 15's argument -kappa<P', P>_L is the difference of two numbers near
# e^(rho_u + rho_v): float32 cancels most digits and overflows at large rho. The loss therefore never forms the
# points: with rho_v = sqrt(kappa)|v| and theta the angle between u and v,
#     -kappa <exp_o(u), exp_o(v)>_L - 1 = (cosh(rho_u - rho_v) - 1) + sinh(rho_u) sinh(rho_v) (1 - cos theta)
# is a sum of non-negative terms, evaluated in log space (no overflow) with rho_u - rho_v and 1 - cos theta formed
# without cancellation, and arcosh(1 + y) is evaluated from log y. log 0 is represented by the finite _LOG0, so that at
# coincident points (y = 0) autograd gives the squared distance its true gradient, 0.

_LOG0 = -1e30  # log 0 as a finite number: exp(_LOG0) == 0 in every dtype, yet autograd through it never makes nan


def tangent_distance(u, v, kappa):
    """d_L(exp_o(u), exp_o(v)) (Eq 13-15) from the tangent vectors, without forming the points: what the loss runs,
    held by the tests to Eq 15 written out (distance of expmap0's points) and to 60-digit arithmetic.

    u, v: [..., d] (broadcastable) -> [...]; bf16/fp16 inputs are computed in float32. y as above, in log space;
    |u| - |v| = (u - v).(u + v) / (|u| + |v|) and u_hat - v_hat = (2 (u - v) - (u_hat + v_hat)(|u| - |v|)) / (|u| + |v|)
    are free of cancellation, so nearby points keep their digits. Finite gradient everywhere; at u = v the gradient
    of d^2 is exactly 0; at exactly u = 0 (or v = 0) a subgradient (|u| has a kink there).
    """
    u, v = _upcast(u), _upcast(v)
    sqrt_kappa = kappa ** 0.5
    tiny = torch.finfo(u.dtype).tiny  # the clamps below only replace an exact 0 norm (0/0 -> 0)
    norm_u = torch.linalg.vector_norm(u, dim=-1, keepdim=True)
    norm_v = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
    norm_sum = (norm_u + norm_v).clamp_min(tiny)
    u_minus_v = u - v
    norm_diff = (u_minus_v * (u + v)).sum(-1, keepdim=True) / norm_sum  # |u| - |v|
    hat_diff = (2 * u_minus_v - (u / norm_u.clamp_min(tiny) + v / norm_v.clamp_min(tiny)) * norm_diff) / norm_sum
    one_m_cos = (hat_diff * hat_diff).sum(-1) / 2  # 1 - cos theta = |u_hat - v_hat|^2 / 2
    rho_u, rho_v, rho_diff = (sqrt_kappa * x.squeeze(-1) for x in (norm_u, norm_v, norm_diff))
    log_y = torch.logaddexp(_log_cosh_m1(rho_diff), _log_sinh(rho_u) + _log_sinh(rho_v) + _log(one_m_cos))
    return _arcosh1p_exp(log_y) / sqrt_kappa


def _log(x):
    """log x for x >= 0, with log 0 = _LOG0 and zero gradient there."""
    pos = x > 0
    return torch.where(pos, torch.log(torch.where(pos, x, 1)), _LOG0)


def _log_sinh(x):
    """log sinh(x) for x >= 0, without overflow: x - log 2 + log(1 - e^(-2x))."""
    return x - math.log(2) + _log(-torch.expm1(-2 * x))


def _log_cosh_m1(x):
    """log(cosh(x) - 1) = log(2 sinh^2(x / 2)) = |x| - log 2 + 2 log(1 - e^(-|x|)), without overflow."""
    x = x.abs()
    return x - math.log(2) + 2 * _log(-torch.expm1(-x))


def _arcosh1p_exp(log_y):
    """arcosh(1 + y) from log y, never forming y: softplus(log(y + sqrt(y (y + 2))))."""
    half = log_y / 2
    g = half + torch.logaddexp(half, torch.logaddexp(log_y, torch.full_like(log_y, math.log(2))) / 2)
    return torch.logaddexp(g, torch.zeros_like(g))


def _upcast(x):
    """bf16/fp16 -> float32; float32 and float64 unchanged."""
    return x.float() if torch.finfo(x.dtype).bits < 32 else x
