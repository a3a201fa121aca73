"""`tag` and `perturb` with no handler: the identity, under every transformation,
at no cost in the compiled program or in jit's dispatch."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, optimized_hlo
from jax import lax

import effects as fx
from effects import _compat
from effects._primitives import handling

PRIMITIVES = [
    pytest.param(fx.tag, "intermediates", id="tag"),
    pytest.param(fx.perturb, "perturbations", id="perturb"),
]

X = jnp.array([0.3, -1.2, 2.0])


def _subjaxprs(jaxpr):
    for eqn in jaxpr.eqns:
        for sub in _compat.jaxprs_in_params(eqn.params):
            yield sub
            yield from _subjaxprs(sub)


def _all_eqns(jaxpr):
    yield from jaxpr.eqns
    for sub in _subjaxprs(jaxpr):
        yield from sub.eqns


def _site_eqns(closed):
    return [e for e in _all_eqns(closed.jaxpr) if e.primitive.name == "effects_site"]


#
# Identity on values
#


@pytest.mark.parametrize("prim, _", PRIMITIVES)
@pytest.mark.parametrize(
    "value",
    [
        pytest.param(jnp.arange(6.0).reshape(2, 3), id="array"),
        pytest.param(jnp.arange(4, dtype=jnp.int32), id="int-array"),
        pytest.param(jnp.array([True, False]), id="bool-array"),
        pytest.param(
            {"a": jnp.ones(2), "b": (jnp.zeros((1, 3)), [jnp.float32(2.5)])},
            id="nested-pytree",
        ),
        pytest.param(np.arange(3.0), id="numpy"),
    ],
)
def test_returns_equal_value(prim, _, value):
    out = prim(value, "v")
    assert jax.tree.structure(out) == jax.tree.structure(value)
    for o, v in zip(jax.tree.leaves(out), jax.tree.leaves(value)):
        assert isinstance(o, jax.Array)
        assert o.shape == np.shape(v)
        assert o.dtype == jnp.asarray(v).dtype
        np.testing.assert_array_equal(o, v)


@pytest.mark.parametrize("prim, _", PRIMITIVES)
@pytest.mark.parametrize(
    "value, dtype",
    [(2.5, jnp.float32), (3, jnp.int32), (True, jnp.bool_), (1 + 2j, jnp.complex64)],
)
def test_python_scalars_become_arrays(prim, _, value, dtype):
    out = prim(value, "s")
    assert isinstance(out, jax.Array)
    assert out.shape == ()
    assert out.dtype == dtype
    assert np.asarray(out) == value
    # A pytree holding Python scalars gets arrays at the same places.
    tree = prim({"a": value, "b": (value, jnp.ones(2))}, "s")
    assert isinstance(tree["a"], jax.Array) and isinstance(tree["b"][0], jax.Array)
    assert np.asarray(tree["a"]) == value and np.asarray(tree["b"][0]) == value
    np.testing.assert_array_equal(tree["b"][1], np.ones(2))


@pytest.mark.parametrize("prim, _", PRIMITIVES)
@pytest.mark.parametrize("value", [{}, (), [], None, {"a": (), "b": {}}], ids=repr)
def test_empty_pytree_comes_back(prim, _, value):
    assert prim(value, "empty") == value
    assert jax.jit(lambda: prim(value, "empty"))() == value


@pytest.mark.parametrize("prim, _", PRIMITIVES)
def test_keyword_collection_is_accepted(prim, _):
    np.testing.assert_array_equal(prim(X, "v", collection="mine"), X)


#
# Transformations of an unhandled tagged function
#


def _make(prim):
    """A tagged function and the same function without tags."""

    def tagged(x):
        h = prim(jnp.sin(x) * x, "h")
        prim(h * 3.0, "discarded")
        pair = prim({"a": h, "b": (jnp.cos(x),)}, "pair")
        return jnp.sum(pair["a"] ** 2 + pair["b"][0])

    def plain(x):
        h = jnp.sin(x) * x
        return jnp.sum(h**2 + jnp.cos(x))

    return tagged, plain


def _scan_of(fn):
    def body(c, x):
        return c + fn(x * c), fn(x)

    return lambda x: lax.scan(body, 1.0, jnp.stack([x, 2 * x]))


TRANSFORMS = {
    "call": lambda f: f,
    "jit": jax.jit,
    "vmap": lambda f: jax.vmap(f),
    "vmap-axis1": lambda f: lambda x: jax.vmap(f, in_axes=1)(jnp.stack([x, x**2])),
    "grad": jax.grad,
    "value_and_grad": jax.value_and_grad,
    "hessian": jax.hessian,
    "jvp": lambda f: lambda x: jax.jvp(f, (x,), (jnp.cos(x),)),
    "vjp": lambda f: lambda x: (lambda o, pb: (o, pb(2.0)))(*jax.vjp(f, x)),
    "linearize": lambda f: (
        lambda x: (lambda o, lin: (o, lin(x + 1.0)))(*jax.linearize(f, x))
    ),
    "checkpoint": jax.checkpoint,
    "grad-checkpoint": lambda f: jax.grad(jax.checkpoint(f)),
    "jit-grad-checkpoint": lambda f: jax.jit(jax.grad(jax.checkpoint(f))),
    "scan": _scan_of,
    "grad-scan": lambda f: jax.grad(lambda x: jnp.sum(_scan_of(f)(x)[1])),
    "cond": lambda f: lambda x: lax.cond(x[0] > 0, f, lambda y: -f(y), x),
    "vmap-grad": lambda f: jax.vmap(jax.grad(f)),
    "jit-vmap-grad": lambda f: jax.jit(jax.vmap(jax.grad(f))),
}


@pytest.mark.parametrize("prim, _", PRIMITIVES)
@pytest.mark.parametrize("transform", list(TRANSFORMS), ids=str)
def test_unhandled_matches_untagged_under_transforms(prim, _, transform):
    # Both under one outer jit, to compile once (eager use is checked below).
    tagged, plain = _make(prim)
    t = TRANSFORMS[transform]
    got, want = jax.jit(lambda x: (t(tagged)(x), t(plain)(x)))(X)
    assert_trees_close(got, want)


@pytest.mark.parametrize("prim, _", PRIMITIVES)
def test_eager_transformations(prim, _):
    # d/dx of the identity is the identity, also for a pytree and in reverse mode.
    def f(x):
        t = prim({"u": x, "v": 2.0 * x}, "t")
        return jnp.sum(t["u"] * t["v"])

    np.testing.assert_allclose(jax.grad(f)(X), 4.0 * X, rtol=1e-6)
    _, tangent = jax.jvp(lambda x: prim(x, "t"), (X,), (jnp.ones(3),))
    np.testing.assert_array_equal(tangent, jnp.ones(3))
    _, pullback = jax.vjp(lambda x: prim(x, "t"), X)
    np.testing.assert_array_equal(pullback(jnp.full(3, 5.0))[0], jnp.full(3, 5.0))
    xs = jnp.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(jax.vmap(lambda x: prim(x, "t"), in_axes=1)(xs), xs.T)


#
# Zero cost: same compiled program, no JAX effects
#


def _tagged_mlp(x):
    w = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    h = fx.tag(jnp.tanh(x @ w), "h")
    fx.tag(h * 2.0, "discarded")
    h = fx.perturb(h, "p")
    return jnp.sum(fx.tag(h, "out") ** 2)


def _mlp_without_tags(x):
    # `_tagged_mlp` with each tag and perturb replaced by its value.
    w = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    h = jnp.tanh(x @ w)
    h * 2.0
    return jnp.sum(h**2)


def _plain_mlp(x):
    w = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    h = jnp.tanh(x @ w)
    return jnp.sum(h**2)


def _scan_cost(mlp):
    def f(x):
        def body(c, row):
            return c + mlp(row * c), mlp(row)

        return lax.scan(body, 0.5, x)

    return f


def _cond_cost(mlp):
    def f(x):
        return lax.cond(x.sum() > 0, mlp, lambda y: mlp(-y) * 2.0, x)

    return f


COST_CASES = {
    "plain": (lambda f: f, (3,)),
    "grad": (jax.grad, (3,)),
    "vmap-axis0": (lambda f: jax.vmap(f, in_axes=0), (5, 3)),
    "vmap-axis1": (lambda f: jax.vmap(lambda x: f(x.T), in_axes=1), (3, 5, 2)),
    "grad-checkpoint": (lambda f: jax.grad(jax.checkpoint(f)), (3,)),
    "scan": (_scan_cost, (4, 3)),
    "cond": (_cond_cost, (3,)),
    "vmap-grad": (lambda f: jax.vmap(jax.grad(f)), (5, 3)),
}


@pytest.mark.parametrize("case", list(COST_CASES), ids=str)
def test_optimized_hlo_is_the_same_as_untagged(case):
    transform, shape = COST_CASES[case]
    x = jnp.linspace(-1.0, 1.0, int(np.prod(shape))).reshape(shape)
    tagged_hlo = optimized_hlo(transform(_tagged_mlp), x)
    plain_hlo = optimized_hlo(transform(_plain_mlp), x)
    assert tagged_hlo == plain_hlo


def test_vmap_in_axes1_keeps_the_batch_axis_in_place():
    # A batch rule moving the axis to the front would add a transpose.
    def tagged(x):
        return jnp.sin(fx.tag(jnp.cos(x), "c"))

    def plain(x):
        return jnp.sin(jnp.cos(x))

    x = jnp.ones((3, 4))
    f_t = jax.vmap(tagged, in_axes=1, out_axes=1)
    f_p = jax.vmap(plain, in_axes=1, out_axes=1)
    assert optimized_hlo(f_t, x) == optimized_hlo(f_p, x)
    assert "transpose" not in str(jax.make_jaxpr(f_t)(x))


@pytest.mark.parametrize("case", list(COST_CASES), ids=str)
def test_unhandled_jaxpr_is_the_untagged_one(case):
    # With nothing handling them, tags leave no equation (so no effect, and no
    # cost to trace or lower): the jaxpr is the untagged function's.
    transform, shape = COST_CASES[case]
    x = jnp.ones(shape)
    closed = jax.make_jaxpr(jax.jit(transform(_tagged_mlp)))(x)
    assert closed.effects == set()
    assert _site_eqns(closed) == []
    plain = jax.make_jaxpr(jax.jit(transform(_mlp_without_tags)))(x)
    assert str(closed).replace("_tagged_mlp", "_mlp_without_tags") == str(plain)


def test_discarded_tag_is_not_kept_in_the_unhandled_program():
    # Unhandled, a tag whose result is unused is dead code: no effect keeps it.
    def f(x):
        fx.tag(x * 2.0, "discarded")
        return jnp.sin(x)

    closed = jax.make_jaxpr(jax.grad(lambda x: f(x).sum()))(X)
    assert closed.effects == set()
    assert all(not e.effects for e in _all_eqns(closed.jaxpr))


def test_jitted_tagged_function_uses_the_fast_path_cache():
    # An effect in a jitted program disables the C++ fast path; with none, repeated
    # calls hit the same executable without retracing.
    traces = []

    def f(x):
        traces.append(None)
        return jnp.sum(fx.tag(jnp.sin(x), "h") ** 2)

    jf = jax.jit(f)
    for _ in range(3):
        out = jf(X)
    assert len(traces) == 1
    np.testing.assert_allclose(out, jnp.sum(jnp.sin(X) ** 2), rtol=1e-6)
    assert jax.make_jaxpr(jf)(X).effects == set()


#
# Bad input
#


class _Opaque:
    def __repr__(self):
        return "<opaque>"


@pytest.mark.parametrize("prim, _", PRIMITIVES)
@pytest.mark.parametrize("name", [1, None, b"h", ("h",)], ids=repr)
def test_non_string_name_is_a_type_error(prim, _, name):
    with pytest.raises(TypeError, match=re.escape(repr(name))) as info:
        prim(X, name)
    assert prim.__name__ in str(info.value)


@pytest.mark.parametrize("prim, _", PRIMITIVES)
@pytest.mark.parametrize(
    "value",
    [
        pytest.param("text", id="string"),
        pytest.param(_Opaque(), id="object"),
        pytest.param({"ok": jnp.ones(2), "bad": "text"}, id="string-in-dict"),
        pytest.param((jnp.ones(2), jnp.sin), id="function-in-tuple"),
    ],
)
def test_non_array_leaf_is_a_type_error_naming_the_tag(prim, _, value):
    with pytest.raises(TypeError, match="'my_tag'"):
        prim(value, "my_tag")
    with pytest.raises(TypeError, match="'my_tag'"):
        jax.jit(lambda x: prim(value, "my_tag"))(X)


@pytest.mark.parametrize("prim, _", PRIMITIVES)
@pytest.mark.parametrize("collection", [1, None, ("c",)], ids=repr)
def test_non_string_collection_is_a_type_error_naming_the_tag(prim, _, collection):
    with pytest.raises(TypeError, match="'my_tag'"):
        prim(X, "my_tag", collection=collection)


@pytest.mark.parametrize("prim, _", PRIMITIVES)
def test_a_value_folded_at_trace_time_is_refused_naming_the_tag(prim, _):
    # Under `jax.ensure_compile_time_eval`, JAX evaluates a tag of constants on
    # the spot and stages no equation: `fx.Tag()` reported nothing, and a
    # `Substitute` named it unknown.
    def f(x):
        with jax.ensure_compile_time_eval():
            c = prim(jnp.arange(3.0) * 2, "folded")
        return x + c

    with pytest.raises(ValueError, match="'folded'.*ensure_compile_time_eval"):
        fx.handle(f, fx.Tag())(X[:3])
    # Outside `handle` it is the identity, as any tag is there.
    np.testing.assert_array_equal(jax.jit(f)(X[:3]), X[:3] + jnp.arange(3.0) * 2)


#
# The handling state is part of JAX's trace context
#


def test_inner_jit_cached_outside_handle_is_retraced_inside():
    traces = []

    @jax.jit
    def inner(x):
        traces.append(None)
        fx.tag(x * 2.0, "z")  # discarded
        return jnp.sin(x)

    def loss(x):
        return jnp.sum(inner(x) ** 2)

    # Traced and cached outside `handle`: no effect, so the discarded tag is
    # dead code there.
    outside = jax.make_jaxpr(inner)(X)
    assert outside.effects == set()
    np.testing.assert_allclose(loss(X), jnp.sum(jnp.sin(X) ** 2), rtol=1e-6)
    n_outside = len(traces)

    grads, found = fx.handle(jax.grad(loss), fx.Tag())(X)
    assert len(traces) > n_outside  # traced again, in the handling state
    assert_trees_close(grads, 2 * jnp.sin(X) * jnp.cos(X))
    assert_trees_close(found, {"intermediates": {"z": (X * 2.0,)}})

    # Checkpointed too, still exactly once.
    _, found = fx.handle(jax.grad(jax.checkpoint(loss)), fx.Tag())(X)
    assert_trees_close(found, {"intermediates": {"z": (X * 2.0,)}})

    # And the outside cache is still effect-free afterwards.
    assert jax.make_jaxpr(inner)(X).effects == set()
    assert jax.make_jaxpr(jax.grad(loss))(X).effects == set()
    np.testing.assert_allclose(inner(X), jnp.sin(X), rtol=1e-6)


#
# Traced outside `handle` first, traced again inside
#


@jax.custom_jvp
def _cj(x):
    return fx.tag(jnp.sin(x), "cj")


_cj.defjvp(lambda p, t: (_cj(p[0]), jnp.cos(p[0]) * t[0]))


@jax.custom_vjp
def _cv(x):
    return fx.tag(jnp.cos(x), "cv")


_cv.defvjp(lambda x: (_cv(x), x), lambda x, g: (-jnp.sin(x) * g,))


def _scan_body(c, x):
    return fx.tag(jnp.sin(c + x), "scan"), None


def _while_body(c):
    return c[0] + 1, fx.tag(c[1] * 0.5, "while")


_remat = jax.checkpoint(lambda x: fx.tag(jnp.cos(x), "remat"))
_inner_jit = jax.jit(lambda x: fx.tag(x * 2.0, "jit"))


def _everywhere(x):
    c = lax.scan(_scan_body, x, jnp.arange(3.0))[0]
    c = lax.cond(c.sum() > 0, lambda v: fx.tag(v * 2, "cond"), lambda v: v * 3, c)
    c = lax.while_loop(lambda s: s[0] < 2, _while_body, (0, c))[1]
    c = _inner_jit(_remat(_cv(_cj(c))))
    return jax.vmap(lambda v: fx.tag(v * 2.0, "vmap"))(c[None])[0]


EVERYWHERE = ["cj", "cond", "cv", "jit", "remat", "scan", "vmap", "while"]


def _custom(x):
    return jnp.sum(_remat(_cv(_cj(x))))


def test_a_function_traced_outside_handle_is_traced_again_inside():
    # Unhandled, the tags leave no equation; JAX's caches of traces (jit's,
    # the loops' and branches' bodies, custom rules, checkpoint) key on the
    # handling state, so inside `handle` every tag is there.
    x = jnp.linspace(0.2, 0.9, 2)
    _everywhere(x)
    jax.jit(_everywhere)(x)
    jax.vmap(_everywhere)(x[None])
    jax.grad(_custom)(x)  # (the custom rules traced outside)
    for handled in [
        fx.handle(_everywhere, fx.Tag(mode="last")),
        jax.jit(fx.handle(_everywhere, fx.Tag(mode="last"))),
    ]:
        out, found = handled(x)
        assert_trees_close(out, _everywhere(x))
        assert sorted(found["intermediates"]) == EVERYWHERE
    grad, found = fx.handle(jax.grad(_custom), fx.Tag())(x)
    assert_trees_close(grad, jax.grad(_custom)(x))
    assert sorted(found["intermediates"]) == ["cj", "cv", "remat"]


def test_a_derivative_site_differentiated_outside_handle_passes_its_tangent_on():
    # A jaxpr traced inside `handle` keeps the tangent sites of a jvp in it
    # (Equinox's filter primitives keep such jaxprs among their params, and
    # lineax differentiates them later: optimistix's solves under
    # `jax.grad(fx.handle(f))`). Outside `handle` a derivative site is the
    # identity on its derivative: its tangent is that of the derivative's
    # leaves (all of its inputs' tangents failed JAX's linearize on jax 0.7).
    def f(x, t):
        return jax.jvp(lambda x: jnp.sin(fx.tag(x * 2.0, "h")), (x,), (t,))[1]

    x, t = jnp.array([0.3, -1.0]), jnp.array([1.0, 0.5])
    with handling(True):
        traced = jax.make_jaxpr(f)(x, t)
    assert "part=tangent" in str(traced)
    run = jax.extend.core.jaxpr_as_fun(traced)

    def g(x, t):
        return run(x, t)[0]

    tangents = (t, x)
    assert_trees_close(jax.jvp(g, (x, t), tangents), jax.jvp(f, (x, t), tangents))
    out, linear = jax.linearize(g, x, t)
    want_out, want_linear = jax.linearize(f, x, t)
    assert_trees_close((out, linear(*tangents)), (want_out, want_linear(*tangents)))
