"""Property tests for lorentz.py: the hyperboloid, the geodesic distance (against float64 and 60-digit mpmath),
its gradient, the anchor losses, and the relative delta-hyperbolicity."""
import math

import mpmath
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lorentz import (delta_hyperbolicity, distance, euclidean_anchor_loss, expmap0, hyperbolic_anchor_loss, inner,
                     layer_norm, origin, tangent_distance)

seeds = st.integers(0, 2 ** 31 - 1)
kappas = st.floats(0.01, 2.0)
dims = st.integers(1, 12)


def tangent(seed, n, d, kappa, radius, dtype=torch.float64):
    """n tangent vectors [n, d] with sqrt(kappa)|u| uniform in [0, radius] (moderate norms: float64 is exact)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(n, d, generator=g, dtype=dtype)
    r = radius * torch.rand(n, 1, generator=g, dtype=dtype) / kappa ** 0.5
    return u / u.norm(dim=-1, keepdim=True) * r


# ------------------------------------------------------------------------------------ Eq 10-13: the hyperboloid

@given(seeds, dims, kappas)
@settings(max_examples=50)
def test_expmap0_lies_on_the_hyperboloid(seed, d, kappa):
    p = expmap0(tangent(seed, 8, d, kappa, 5.0), kappa)
    assert p.shape == (8, d + 1)
    assert torch.allclose(inner(p, p), torch.full((8,), -1 / kappa, dtype=p.dtype), rtol=1e-9, atol=0)
    assert (p[:, 0] > 0).all()
    o = origin(d, kappa, dtype=torch.float64)  # Eq 11's origin o is a point of H^d_kappa
    assert torch.allclose(inner(o, o), torch.tensor(-1 / kappa, dtype=o.dtype), rtol=1e-12, atol=0) and o[0] > 0


@given(dims, kappas)
@settings(max_examples=20)
def test_expmap0_of_zero_is_the_origin_with_identity_jacobian(d, kappa):
    u = torch.zeros(d, dtype=torch.float64, requires_grad=True)
    p = expmap0(u, kappa)
    assert torch.equal(p, origin(d, kappa, dtype=torch.float64))
    J = torch.autograd.functional.jacobian(lambda x: expmap0(x, kappa), u)
    assert torch.equal(J, torch.cat([torch.zeros(1, d), torch.eye(d)]).double())


def test_layer_norm_has_no_affine_and_upcasts_low_precision():
    h = torch.randn(3, 7, dtype=torch.float64)
    want = (h - h.mean(-1, keepdim=True)) / torch.sqrt(h.var(-1, unbiased=False, keepdim=True) + 1e-5)
    assert torch.allclose(layer_norm(h), want, rtol=1e-12, atol=1e-12)
    assert layer_norm(h).dtype == torch.float64
    assert layer_norm(h.bfloat16()).dtype == torch.float32
    assert layer_norm(h.half()).dtype == torch.float32


# ------------------------------------------------------------------------------------ Eq 15: the geodesic distance

@given(seeds, dims, kappas)
@settings(max_examples=50)
def test_distance_is_a_metric(seed, d, kappa):
    U = tangent(seed, 3, d, kappa, 5.0)
    p, q, r = expmap0(U, kappa)
    assert distance(p, p, kappa) == 0
    assert tangent_distance(U[0], U[0], kappa) == 0
    for dist, (x, y, z) in ((distance, (p, q, r)), (tangent_distance, U)):
        assert torch.allclose(dist(x, y, kappa), dist(y, x, kappa), rtol=1e-12, atol=1e-12)
        assert dist(x, z, kappa) <= dist(x, y, kappa) + dist(y, z, kappa) + 1e-9


@given(seeds, dims, kappas)
@settings(max_examples=50)
def test_distance_from_the_origin_is_the_tangent_norm(seed, d, kappa):
    u = tangent(seed, 8, d, kappa, 5.0)
    zero = torch.zeros_like(u)
    o = origin(d, kappa, dtype=u.dtype)
    for got in (distance(o, expmap0(u, kappa), kappa), tangent_distance(u, zero, kappa),
                tangent_distance(zero, u, kappa)):
        assert torch.allclose(got, u.norm(dim=-1), rtol=1e-9, atol=1e-12)


@given(seeds, dims, kappas, st.sampled_from([None, 1e-2, 1e-5]))
@settings(max_examples=60)
def test_tangent_distance_equals_distance_between_the_points(seed, d, kappa, near):
    u, v = tangent(seed, 2, d, kappa, 4.0)
    if near is not None:
        v = u + near * v
    want = distance(expmap0(u, kappa), expmap0(v, kappa), kappa)
    assert torch.allclose(tangent_distance(u, v, kappa), want, rtol=1e-6, atol=0)


@given(seeds, dims, kappas)
@settings(max_examples=50)
def test_distance_is_eq_15_written_out(seed, d, kappa):
    """d_L = sqrt(1/kappa) arcosh(-kappa <P', P>_L) with the points, the Lorentz product and arcosh written out in
    float64 (math.cosh, math.sinh, math.acosh; no code shared with lorentz.py), for distance and tangent_distance."""
    U = tangent(seed, 2, d, kappa, 3.0)
    sk = math.sqrt(kappa)

    def point(u):
        a = sk * math.sqrt(sum(x * x for x in u))
        f = math.sinh(a) / a if a > 0 else 1.0
        return [math.cosh(a) / sk] + [f * x for x in u]

    P, Q = (point(u.tolist()) for u in U)
    lorentz_product = -P[0] * Q[0] + sum(x * y for x, y in zip(P[1:], Q[1:]))
    want = math.acosh(max(1.0, -kappa * lorentz_product)) / sk
    p, q = expmap0(U, kappa)
    for got in (distance(p, q, kappa), tangent_distance(U[0], U[1], kappa)):
        assert got.item() == pytest.approx(want, rel=1e-6, abs=1e-6)


def mpmath_distance(u, v, kappa):
    """Eq 15 on the explicit points exp_o(u), exp_o(v), in 60-digit arithmetic, for the exact values of u, v."""
    with mpmath.workdps(60):
        u, v = [[mpmath.mpf(x) for x in t.double().tolist()] for t in (u, v)]
        k = mpmath.mpf(kappa)
        sk = mpmath.sqrt(k)
        a, b = sk * mpmath.sqrt(mpmath.fdot(u, u)), sk * mpmath.sqrt(mpmath.fdot(v, v))
        # <P, P'>_L = -P0 P0' + sum_t P_t P'_t with P = (cosh(a) / sk, sinh(a) / a * u)
        ip = -mpmath.cosh(a) * mpmath.cosh(b) / k + mpmath.sinh(a) / a * mpmath.sinh(b) / b * mpmath.fdot(u, v)
        return float(mpmath.acosh(-k * ip) / sk)


@pytest.mark.parametrize("d", [4096, 8192])
@pytest.mark.parametrize("kappa", [0.01, 0.1, 1.0])
@pytest.mark.parametrize("near", [None, 1e-3, 1e-6])
@given(seed=seeds)
@settings(max_examples=2)
def test_float32_tangent_distance_matches_60_digit_reference(d, kappa, near, seed):
    """LN'd states (|u| ~ sqrt(d)) where the naive float32 formula cancels (kappa <= 0.1) or overflows (kappa = 1)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(d, generator=g)
    u = layer_norm(h)
    v = layer_norm(torch.randn(d, generator=g) if near is None else h + near * torch.randn(d, generator=g))
    got = tangent_distance(u, v, kappa)
    assert got.dtype == torch.float32
    want = mpmath_distance(u, v, kappa)
    assert abs(got.item() - want) <= 1e-4 * want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_computed_in_float32(dtype):
    u, v = layer_norm(torch.randn(2, 4096)).to(dtype)
    got = tangent_distance(u, v, 1.0)
    assert got.dtype == torch.float32 and torch.isfinite(got)
    assert got == tangent_distance(u.float(), v.float(), 1.0)


def test_zero_vectors():
    z = torch.zeros(2, 16)
    d = tangent_distance(z, z, 0.1)
    assert torch.equal(d, torch.zeros(2))


# ------------------------------------------------------------------------------------ gradients of d^2

@given(seeds, st.integers(1, 6), kappas, st.sampled_from([None, 1e-3]))
@settings(max_examples=25)
def test_squared_distance_gradient_matches_finite_differences(seed, d, kappa, near):
    u, v = tangent(seed, 2, d, kappa, 3.0)
    if near is not None:
        v = u + near * v
    u, v = u.requires_grad_(), v.requires_grad_()
    assert torch.autograd.gradcheck(lambda x, y: tangent_distance(x, y, kappa).square(), (u, v))


@pytest.mark.parametrize("d, kappa, dtype", [(5, 0.5, torch.float64), (4096, 1.0, torch.float32),
                                             (8192, 0.01, torch.float32)])
def test_squared_distance_gradient_is_zero_at_coincident_points(d, kappa, dtype):
    u = layer_norm(torch.randn(3, d, dtype=dtype)).requires_grad_()
    v = u.detach().clone().requires_grad_()
    tangent_distance(u, v, kappa).square().sum().backward()
    assert torch.equal(u.grad, torch.zeros_like(u)) and torch.equal(v.grad, torch.zeros_like(v))


def test_gradient_is_finite_for_large_and_zero_vectors():
    u = layer_norm(torch.randn(4, 8192)).requires_grad_()
    v = torch.cat([layer_norm(torch.randn(2, 8192)), torch.zeros(2, 8192)]).requires_grad_()
    tangent_distance(u, v, 1.0).square().sum().backward()
    assert torch.isfinite(u.grad).all() and torch.isfinite(v.grad).all()


# ------------------------------------------------------------------------------------ Eq 16: the anchor losses

def states(seed, L, B, T, d):
    g = torch.Generator().manual_seed(seed)
    student, teacher = 3 * torch.randn(2, L, B, T, d, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[0, 0] = True
    return student, teacher, mask


def loop_mean(student, teacher, mask, per_token):
    """Eq 16 one token at a time: per query b, (1/L) sum_l (1/T_b) sum_i per_token(LN h'_i^(l), LN h_i^(l)); then the
    mean over the queries that have masked tokens."""
    queries = []
    for b in range(mask.shape[0]):
        tokens = mask[b].nonzero().flatten().tolist()
        if tokens:
            layers = [sum(per_token(layer_norm(s[b, i]), layer_norm(t[b, i])) for i in tokens) / len(tokens)
                      for s, t in zip(student, teacher)]
            queries.append(sum(layers) / len(layers))
    return sum(queries) / len(queries)


@given(seeds, st.integers(1, 3), st.integers(1, 3), st.integers(1, 5), st.integers(1, 8), kappas)
@settings(max_examples=30)
def test_anchor_losses_are_the_mean_over_layers_and_masked_tokens(seed, L, B, T, d, kappa):
    student, teacher, mask = states(seed, L, B, T, d)
    hyp = loop_mean(student, teacher, mask, lambda s, t: distance(expmap0(s, kappa), expmap0(t, kappa), kappa) ** 2)
    euc = loop_mean(student, teacher, mask, lambda s, t: ((s - t) ** 2).sum())
    for s, t in ((student, teacher), (list(student), list(teacher))):
        assert torch.allclose(hyperbolic_anchor_loss(s, t, mask, kappa), hyp, rtol=1e-6, atol=1e-12)
        assert torch.allclose(euclidean_anchor_loss(s, t, mask), euc, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------ Eq 18: delta-hyperbolicity

def graph_distances(n, edges):
    """All-pairs shortest path lengths [n, n] of an unweighted graph (Floyd-Warshall)."""
    D = torch.full((n, n), math.inf, dtype=torch.float64)
    D.fill_diagonal_(0)
    for i, j in edges:
        D[i, j] = D[j, i] = 1
    for k in range(n):
        D = torch.minimum(D, D[:, k:k + 1] + D[k:k + 1, :])
    return D


@given(seeds, st.integers(4, 12))
@settings(max_examples=20)
def test_tree_metric_has_zero_delta(seed, n):
    g = torch.Generator().manual_seed(seed)
    edges = [(i, int(torch.randint(i, (1,), generator=g))) for i in range(1, n)]
    assert delta_hyperbolicity(graph_distances(n, edges), 2000, g) == 0


def test_four_cycle_has_relative_delta_one():
    # any four distinct nodes: pair sums 1+1, 1+1, 2+2 -> delta = (4 - 2) / 2 = 1; diam = 2 -> 2 * 1 / 2 = 1
    D = graph_distances(4, [(0, 1), (1, 2), (2, 3), (3, 0)])
    assert delta_hyperbolicity(D, 1000, torch.Generator().manual_seed(0)) == 1


@given(seeds, st.integers(4, 30), st.integers(1, 8))
@settings(max_examples=30)
def test_relative_delta_lies_in_unit_interval_and_depends_only_on_the_quadruples(seed, n, d):
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    D = torch.cdist(x, x)
    r = delta_hyperbolicity(D, 500, torch.Generator().manual_seed(seed))
    assert 0 <= r <= 1
    assert delta_hyperbolicity(3 * D, 500, torch.Generator().manual_seed(seed)) == pytest.approx(r.item())
