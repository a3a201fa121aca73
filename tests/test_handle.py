"""`handle`: the `found` structure, composition, every transformation on either
side, arguments, caching, bad input, the cost of the handled program, and Flax."""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    CountCompiles,
    assert_trees_close,
    mlp_params,
    no_leak_checks,
    optimized_hlo,
)

import effects as fx

X = jnp.array([0.3, -1.2, 2.0])
XB = jnp.stack([X, 0.5 * X + 1.0])  # a batch of two, for an outer vmap
T = jnp.array([1.0, 2.0, -0.5])  # a tangent


def _sin_sq(x):
    h = fx.tag(jnp.sin(x), "h")
    fx.tag(x * 3.0, "d")  # discarded
    return jnp.sum(h**2)


def _sin_sq_found(x):
    return {"intermediates": {"h": (jnp.sin(x),), "d": (x * 3.0,)}}


def _filled(shapes, seed=0):
    """Deterministic values in place of every `ShapeDtypeStruct` (random
    initialisers would compile their kernels, which is slow)."""
    count = [seed]

    def fill(s):
        if not isinstance(s, jax.ShapeDtypeStruct):
            return s
        count[0] += 1
        values = np.sin(np.arange(int(np.prod(s.shape))) * 0.37 + count[0])
        return jnp.asarray(values.reshape(s.shape).astype(s.dtype))

    return jax.tree.map(
        fill, shapes, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)
    )


_KEY = jax.ShapeDtypeStruct((2,), jnp.uint32)


def _merge_found(*founds):
    out: dict = {}
    for found in founds:
        for collection, values in found.items():
            out.setdefault(collection, {}).update(values)
    return out


#
# The structure of `found`
#


def _three_tags(x):
    a = fx.tag(x + 1.0, "layer1")
    b = fx.tag(jnp.sin(a), "layer2")
    c = fx.tag(b * 2.0, "aux", collection="aux")
    p = fx.perturb(c, "p")
    q = fx.perturb(p, "q", collection="intermediates")  # a perturb site, not a tag
    return jnp.sum(q**2)


def _three_tags_values(x):
    a = x + 1.0
    b = jnp.sin(a)
    c = b * 2.0
    return a, b, c


@pytest.mark.parametrize(
    "handlers, expected",
    [
        pytest.param((), lambda a, b, c: {}, id="no-handler"),
        pytest.param(
            (fx.Tag(),),
            lambda a, b, c: {"intermediates": {"layer1": (a,), "layer2": (b,)}},
            id="tag",
        ),
        pytest.param(
            (fx.Tag(names=lambda n: n.startswith("nothing")),),
            lambda a, b, c: {"intermediates": {}},
            id="matched-nothing",
        ),
        pytest.param(
            (fx.Tag("absent"),),
            lambda a, b, c: {"absent": {}},
            id="absent-collection",
        ),
        pytest.param(
            (fx.Tag("aux"),), lambda a, b, c: {"aux": {"aux": (c,)}}, id="collection"
        ),
        pytest.param(
            (fx.Tag(names="*2"),),
            lambda a, b, c: {"intermediates": {"layer2": (b,)}},
            id="glob",
        ),
        pytest.param(
            (fx.Tag(names=["x*", "layer1"]),),
            lambda a, b, c: {"intermediates": {"layer1": (a,)}},
            id="glob-list",
        ),
        pytest.param(
            (fx.Tag(names=lambda n: n.endswith("1")),),
            lambda a, b, c: {"intermediates": {"layer1": (a,)}},
            id="predicate",
        ),
        pytest.param(
            (fx.Tag(mode="strict"),),
            lambda a, b, c: {"intermediates": {"layer1": a, "layer2": b}},
            id="strict-is-bare",
        ),
        pytest.param(
            (fx.Tag(mode="last"),),
            lambda a, b, c: {"intermediates": {"layer1": a, "layer2": b}},
            id="last",
        ),
        pytest.param(
            (fx.Tag(mode="sum"),),
            lambda a, b, c: {"intermediates": {"layer1": a, "layer2": b}},
            id="sum",
        ),
        pytest.param(
            (fx.Tag(), fx.Tag("aux")),
            lambda a, b, c: {
                "intermediates": {"layer1": (a,), "layer2": (b,)},
                "aux": {"aux": (c,)},
            },
            id="two-collections",
        ),
        pytest.param(
            (fx.Substitute({"layer1": jnp.zeros(3)}),),
            lambda a, b, c: {},
            id="substitute",
        ),
        pytest.param(
            (fx.Perturb(),),
            lambda a, b, c: {"perturbations": {"p": (jnp.zeros(3),)}},
            id="perturb",
        ),
        pytest.param(
            (fx.Perturb(collection="intermediates"),),
            lambda a, b, c: {"intermediates": {"q": (jnp.zeros(3),)}},
            id="perturb-kind-is-separate",
        ),
        pytest.param(
            (fx.Perturb({"p": (jnp.zeros(3),)}),),
            lambda a, b, c: {},
            id="perturb-deltas",
        ),
    ],
)
def test_found_structure(handlers, expected):
    out, found = fx.handle(_three_tags, *handlers)(X)
    a, b, c = _three_tags_values(X)
    if any(isinstance(h, fx.Substitute) for h in handlers):
        c = jnp.sin(jnp.zeros(3)) * 2.0
    assert_trees_close(out, jnp.sum(c**2))
    assert_trees_close(found, expected(a, b, c))


def test_found_is_a_dict_of_dicts_of_tuples():
    _, found = fx.handle(_sin_sq, fx.Tag())(X)
    assert isinstance(found, dict) and type(found) is fx.Found
    assert type(found["intermediates"]) is fx.Found
    assert found == {"intermediates": dict(found["intermediates"])}
    assert repr(found).startswith("{'intermediates': {'h': (")
    assert type(found["intermediates"]["h"]) is tuple
    assert len(found["intermediates"]["h"]) == 1


def _two_collections(x):
    a = fx.tag(jnp.sin(x), "a")
    b = fx.tag(a * 2.0, "b", collection="aux")
    h = fx.tag(b + 1.0, "h")
    p = fx.perturb(h, "p")
    return jnp.sum(jnp.cos(p))


def _two_collections_ref(x, h=None, scale=1.0):
    a = jnp.sin(x)
    b = a * 2.0
    if h is None:
        h = b + 1.0
    h = scale * h
    return a, b, h, jnp.sum(jnp.cos(h))


V = jnp.array([5.0, 6.0, 7.0])


@pytest.mark.parametrize(
    "a_handler, b_handler, expected",
    [
        pytest.param(
            fx.Tag(names="a"),
            fx.Tag(names="h"),
            lambda a, b, h: (
                {"intermediates": {"a": (a,)}},
                {"intermediates": {"h": (h,)}},
            ),
            id="tag-tag-names",
        ),
        pytest.param(
            fx.Tag(),
            fx.Tag("aux"),
            lambda a, b, h: (
                {"intermediates": {"a": (a,), "h": (h,)}},
                {"aux": {"b": (b,)}},
            ),
            id="tag-other-collection",
        ),
        pytest.param(
            fx.Tag(),
            fx.Tag(),
            lambda a, b, h: (
                {"intermediates": {"a": (a,), "h": (h,)}},
                {"intermediates": {}},
            ),
            id="first-consumes",
        ),
        pytest.param(
            fx.Substitute({"h": V}),
            fx.Tag(),
            lambda a, b, h: ({}, {"intermediates": {"a": (a,), "h": (V,)}}),
            id="substitute-then-tag",
        ),
        pytest.param(
            fx.Intervene({"h": lambda v: 2.0 * v}),
            fx.Tag(names="h"),
            lambda a, b, h: ({}, {"intermediates": {"h": (h,)}}),
            id="intervene-then-tag",
        ),
        pytest.param(
            fx.Perturb(),
            fx.Tag("aux"),
            lambda a, b, h: (
                {"perturbations": {"p": (jnp.zeros(3),)}},
                {"aux": {"b": (b,)}},
            ),
            id="perturb-then-tag",
        ),
    ],
)
def test_two_handlers_equal_nested_handles(a_handler, b_handler, expected):
    substitute = isinstance(a_handler, fx.Substitute)
    scale = 2.0 if isinstance(a_handler, fx.Intervene) else 1.0
    a, b, h, out = _two_collections_ref(X, V if substitute else None, scale)
    found_a, found_b = expected(a, b, h)

    (inner_out, inner_found), outer_found = fx.handle(
        fx.handle(_two_collections, a_handler), b_handler
    )(X)
    assert_trees_close(inner_out, out)
    assert_trees_close(inner_found, found_a)
    assert_trees_close(outer_found, found_b)

    # (a later handler all of whose sites an earlier one consumed says so)
    with warnings.catch_warnings(record=True) as said:
        warnings.filterwarnings("always", "Tag matches no site left", UserWarning)
        merged_out, merged = fx.handle(_two_collections, a_handler, b_handler)(X)
    assert bool(said) == (found_b == {"intermediates": {}})
    assert_trees_close(merged_out, out)
    assert_trees_close(merged, _merge_found(found_a, found_b))


def test_nested_handle_shape_under_jit_and_grad():
    inner = fx.handle(_two_collections, fx.Tag("aux"))
    nested = fx.handle(inner, fx.Tag())

    def loss(x):
        (out, inner_found), outer_found = nested(x)
        return out, (inner_found, outer_found)

    a, b, h, expected_out = _two_collections_ref(X)
    expected = (
        (expected_out, {"aux": {"b": (b,)}}),
        {"intermediates": {"a": (a,), "h": (h,)}},
    )
    assert_trees_close(nested(X), expected)
    assert_trees_close(jax.jit(nested)(X), expected)
    g, (inner_found, outer_found) = jax.grad(loss, has_aux=True)(X)
    assert_trees_close(g, jax.grad(lambda x: _two_collections_ref(x)[3])(X))
    assert_trees_close(inner_found, {"aux": {"b": (b,)}})
    assert_trees_close(outer_found, {"intermediates": {"a": (a,), "h": (h,)}})


#
# handle inside and outside every transformation
#

# Transformations applied to the function before `handle`, and what the handled
# result is, written by hand: (out, found) for an input of shape (3,).
INNER = {
    "none": (lambda f: f, lambda x: jnp.sum(jnp.sin(x) ** 2)),
    "jit": (jax.jit, lambda x: jnp.sum(jnp.sin(x) ** 2)),
    "checkpoint": (jax.checkpoint, lambda x: jnp.sum(jnp.sin(x) ** 2)),
    "vmap": (jax.vmap, lambda x: jnp.sin(x) ** 2),
    "grad": (jax.grad, lambda x: 2 * jnp.sin(x) * jnp.cos(x)),
    "value_and_grad": (
        jax.value_and_grad,
        lambda x: (jnp.sum(jnp.sin(x) ** 2), 2 * jnp.sin(x) * jnp.cos(x)),
    ),
    "jvp": (
        lambda f: lambda x: jax.jvp(f, (x,), (jnp.ones_like(x),)),
        lambda x: (jnp.sum(jnp.sin(x) ** 2), jnp.sum(2 * jnp.sin(x) * jnp.cos(x))),
    ),
    "vjp": (
        lambda f: lambda x: jax.vjp(f, x)[1](jnp.float32(1.5))[0],
        lambda x: 3.0 * jnp.sin(x) * jnp.cos(x),
    ),
    "grad-checkpoint": (
        lambda f: jax.grad(jax.checkpoint(f)),
        lambda x: 2 * jnp.sin(x) * jnp.cos(x),
    ),
}


def _scalar(result):
    out, found = result
    return sum(jnp.sum(leaf) for leaf in jax.tree.leaves(out)), found


def _ones_like(tree):
    return jax.tree.map(jnp.ones_like, tree)


# Transformations applied to a function returning (out, found), the same way
# to the handled function and to its hand-written reference.
OUTER = {
    "none": lambda g: g(X),
    "jit": lambda g: jax.jit(g)(X),
    "vmap": lambda g: jax.vmap(g)(XB),
    "grad": lambda g: jax.grad(lambda x: _scalar(g(x)), has_aux=True)(X),
    "value_and_grad": lambda g: jax.value_and_grad(
        lambda x: _scalar(g(x)), has_aux=True
    )(X),
    "jvp": lambda g: jax.jvp(g, (X,), (T,)),
    "vjp": lambda g: (lambda out, pb: (out, pb(_ones_like(out))))(*jax.vjp(g, X)),
    "checkpoint": lambda g: jax.checkpoint(g)(X),
}


@pytest.mark.parametrize("inner", list(INNER), ids=str)
@pytest.mark.parametrize("outer", list(OUTER), ids=str)
def test_handle_between_transformations(outer, inner):
    # outer(handle(inner(f))), all inside one jit to compile once.
    transform, reference = INNER[inner]
    handled = fx.handle(transform(_sin_sq), fx.Tag())

    def ref(x):
        return reference(x), _sin_sq_found(x)

    got, want = jax.jit(lambda: (OUTER[outer](handled), OUTER[outer](ref)))()
    assert_trees_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("outer", ["none", "vmap", "grad"])
def test_handle_under_eager_transformations(outer):
    handled = fx.handle(_sin_sq, fx.Tag())

    def ref(x):
        return jnp.sum(jnp.sin(x) ** 2), _sin_sq_found(x)

    assert_trees_close(OUTER[outer](handled), OUTER[outer](ref), rtol=1e-5, atol=1e-5)


S = jnp.float32(1.3)
SB = jnp.array([1.3, -0.7, 2.0])

# Transformations of a function of a scalar `s` returning (out, found).
OUTER_S = {
    "none": lambda g: g(S),
    "jit": lambda g: jax.jit(g)(S),
    "vmap": lambda g: jax.vmap(g)(SB),
    "grad": lambda g: jax.grad(lambda s: _scalar(g(s)), has_aux=True)(S),
    "value_and_grad": lambda g: jax.value_and_grad(
        lambda s: _scalar(g(s)), has_aux=True
    )(S),
    "jvp": lambda g: jax.jvp(g, (S,), (jnp.float32(0.7),)),
    "vjp": lambda g: (lambda out, pb: (out, pb(_ones_like(out))))(*jax.vjp(g, S)),
    "checkpoint": lambda g: jax.checkpoint(g)(S),
    "vmap-grad": lambda g: jax.vmap(jax.grad(lambda s: _scalar(g(s)), has_aux=True))(
        SB
    ),
}


@pytest.mark.parametrize("outer", list(OUTER_S), ids=str)
def test_handle_of_a_closure_over_outer_tracers(outer):
    def handled(s):
        def f(x):
            h = fx.tag(x * s, "h")
            fx.tag(jnp.sin(s), "only_s")  # discarded, depends on the closure only
            j = jax.jit(lambda y: fx.tag(y * s, "j"))(h)  # inner jit closing over s
            return jnp.sum(j**2)

        return fx.handle(f, fx.Tag())(X)

    def ref(s):
        h = X * s
        j = h * s
        found = {"h": (h,), "only_s": (jnp.sin(s),), "j": (j,)}
        return jnp.sum(j**2), {"intermediates": found}

    got, want = jax.jit(lambda: (OUTER_S[outer](handled), OUTER_S[outer](ref)))()
    assert_trees_close(got, want, rtol=1e-5, atol=1e-5)


def test_grad_of_handle_of_a_closure_example():
    def loss(s):
        return fx.handle(lambda x: fx.tag(x * s, "h") ** 2, fx.Tag())(X)[0].sum()

    np.testing.assert_allclose(jax.grad(loss)(S), 2 * S * jnp.sum(X**2), rtol=1e-5)
    np.testing.assert_allclose(
        jax.jit(jax.grad(loss))(S), 2 * S * jnp.sum(X**2), rtol=1e-5
    )


def test_handle_of_a_closure_over_a_tracer_with_vmapped_argument():
    # Both the argument and the closed-over value are tracers of different traces.
    def outer(s):
        f = lambda x: jnp.sum(fx.tag(jnp.sin(x) * s, "h"))  # noqa: E731
        return jax.vmap(fx.handle(f, fx.Tag()))(XB)

    out, found = jax.grad(lambda s: _scalar(outer(s)), has_aux=True)(S)
    np.testing.assert_allclose(out, jnp.sum(jnp.sin(XB)), rtol=1e-5)
    assert_trees_close(found, {"intermediates": {"h": (jnp.sin(XB) * S,)}})


#
# Arguments
#


def _dict_fn(params, x):
    h = fx.tag(jnp.tanh(x @ params["w"] + params["b"]), "h")
    return jnp.sum(h * params["scale"]["v"])


def _dict_params():
    return {
        "w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4),
        "b": jnp.arange(4.0) / 4,
        "scale": {"v": jnp.array([1.0, -2.0, 0.5, 3.0])},
    }


def test_dict_arguments():
    params = _dict_params()
    h = jnp.tanh(X @ params["w"] + params["b"])
    out, found = fx.handle(_dict_fn, fx.Tag())(params, X)
    assert_trees_close(out, jnp.sum(h * params["scale"]["v"]))
    assert_trees_close(found, {"intermediates": {"h": (h,)}})

    def plain(params, x):
        return jnp.sum(jnp.tanh(x @ params["w"] + params["b"]) * params["scale"]["v"])

    grads = jax.jit(jax.grad(lambda p: fx.handle(_dict_fn, fx.Tag())(p, X)[0]))(params)
    assert_trees_close(grads, jax.jit(jax.grad(plain))(params, X))


def test_keyword_arguments():
    def f(x, *, y, scale=1.0, name="h"):
        return jnp.sum(fx.tag(x * y, name) * scale)

    h = fx.handle(f, fx.Tag())
    out, found = h(X, y=T)
    assert_trees_close(
        (out, found), (jnp.sum(X * T), {"intermediates": {"h": (X * T,)}})
    )
    out, found = h(x=X, y=T, scale=3.0, name="other")
    assert_trees_close(
        (out, found), (3.0 * jnp.sum(X * T), {"intermediates": {"other": (X * T,)}})
    )
    out, found = jax.jit(h)(X, y=2.0 * T)
    assert_trees_close(
        (out, found), (jnp.sum(2.0 * X * T), {"intermediates": {"h": (2.0 * X * T,)}})
    )


def test_python_scalar_static_arguments_retrace_on_change():
    traces = []

    def f(x, n, scale):
        traces.append((n, scale))
        for i in range(n):
            x = fx.tag(x * scale, f"s{i}")
        return jnp.sum(x)

    h = fx.handle(f, fx.Tag())
    for n, scale in [(2, 2.0), (3, 2.0), (2, 0.5), (2, 2.0), (3, 2.0)]:
        out, found = h(X, n, scale)
        expected = {f"s{i}": (X * scale ** (i + 1),) for i in range(n)}
        assert_trees_close(out, jnp.sum(X * scale**n))
        assert_trees_close(found, {"intermediates": expected})
    assert traces == [(2, 2.0), (3, 2.0), (2, 0.5)]


@pytest.mark.parametrize("first, then", [(2, 2.0), (True, 1), (0.0, -0.0)])
def test_equal_static_arguments_of_other_types_or_signs_trace_apart(first, then):
    # 2 and 2.0 (True and 1, 0.0 and -0.0) are equal: the second call was
    # served the first call's program, with its dtype (an int32 product that
    # overflows where the float one does not) or its sign (1 / 0.0 for 1 / -0.0).
    def f(x, s):
        fx.tag(jnp.asarray(s), "s")
        fx.tag(1.0 / (s * jnp.ones(2)), "inverse")
        return fx.tag(x * s, "product")

    x = jnp.array([2**30, 3], jnp.int32)
    h = fx.handle(f, fx.Tag())
    h(x, first)
    out, found = h(x, then)
    want = {"s": jnp.asarray(then), "inverse": 1.0 / (then * jnp.ones(2))}
    assert out.dtype == f(x, then).dtype
    np.testing.assert_array_equal(out, f(x, then))
    for name, value in want.items():
        (got,) = found["intermediates"][name]
        assert got.dtype == value.dtype, name
        np.testing.assert_array_equal(got, value)


def test_handlers_with_equal_fields_of_other_types_or_signs_trace_apart():
    # A handler's field that is a leaf is keyed as a static argument is.
    class Divide(fx.Handler):
        by: float = 1.0

        def apply(self, site, value, ctx):
            return value / self.by

    f = lambda x: fx.tag(x, "h") * 1.0  # noqa: E731
    one = jnp.float32(1.0)
    assert fx.handle(f, Divide(0.0))(one)[0] == jnp.inf
    assert fx.handle(f, Divide(-0.0))(one)[0] == -jnp.inf


@functools.cache
def _mlp(seed=0):
    shapes = eqx.filter_eval_shape(
        lambda k: eqx.nn.MLP(3, 2, 4, 2, activation=jax.nn.tanh, key=k), _KEY
    )
    return _filled(shapes, seed)


def test_equinox_mlp_as_argument():
    mlp = _mlp()

    def f(model, x):
        first = fx.tag(model.activation(model.layers[0](x)), "first")
        return jnp.sum(fx.tag(model(x), "out") ** 2) + jnp.sum(first)

    @eqx.filter_jit
    def ref(model, x):
        first = jnp.tanh(model.layers[0].weight @ x + model.layers[0].bias)
        return jnp.sum(model(x) ** 2) + jnp.sum(first), {
            "intermediates": {"first": (first,), "out": (model(x),)}
        }

    handled = fx.handle(f, fx.Tag())
    assert_trees_close(handled(mlp, X), ref(mlp, X))
    other = _mlp(1)
    assert_trees_close(handled(other, X), ref(other, X))
    assert_trees_close(eqx.filter_jit(handled)(other, X), ref(other, X))

    grad = eqx.filter_jit(eqx.filter_grad(lambda m: handled(m, X)[0]))(mlp)
    want = eqx.filter_jit(eqx.filter_grad(lambda m: ref(m, X)[0]))(mlp)
    assert_trees_close(eqx.filter(grad, eqx.is_array), eqx.filter(want, eqx.is_array))


class _Labeled(eqx.Module):
    mlp: eqx.nn.MLP
    label: str

    def __call__(self, x, scale=1.0):
        h = fx.tag(self.mlp(x), self.label)
        return jnp.sum(h**2) * scale


@eqx.filter_jit
def _labeled_ref(model, x, scale=1.0):
    h = model.mlp(x)
    return jnp.sum(h**2) * scale, {"intermediates": {model.label: (h,)}}


def test_equinox_module_as_the_handled_function():
    model = _Labeled(_mlp(), "hidden")
    assert_trees_close(fx.handle(model, fx.Tag())(X), _labeled_ref(model, X))

    # Its arrays are inputs: another module of the same structure gives its own
    # values, another label its own name.
    other = _Labeled(_mlp(1), "hidden")
    assert_trees_close(fx.handle(other, fx.Tag())(X), _labeled_ref(other, X))
    renamed = _Labeled(other.mlp, "renamed")
    assert_trees_close(
        fx.handle(renamed, fx.Tag())(X, 2.0), _labeled_ref(renamed, X, 2.0)
    )

    # Differentiable with respect to the module's arrays, jittable with the module
    # as argument.
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: fx.handle(m, fx.Tag())(X)[0]))(
        model
    )
    want = eqx.filter_jit(eqx.filter_grad(lambda m: _labeled_ref(m, X)[0]))(model)
    assert_trees_close(eqx.filter(grads, eqx.is_array), eqx.filter(want, eqx.is_array))
    jitted = eqx.filter_jit(lambda m, x: fx.handle(m, fx.Tag())(x))
    assert_trees_close(jitted(other, X), _labeled_ref(other, X))
    assert_trees_close(jitted(model, X), _labeled_ref(model, X))


#
# Caching: no re-tracing on repeated calls
#


def _counted():
    calls = []

    def f(x):
        calls.append(None)
        h = fx.tag(jnp.sin(x), "h")
        return jnp.sum(h**2)

    return f, calls


def test_eager_calls_trace_once():
    f, calls = _counted()
    h = fx.handle(f, fx.Tag())
    xs = [X, X + 1.0, X * 2.0]
    results = [h(xs[0])]
    with CountCompiles() as counter:
        results += [h(x) for x in xs[1:]]
    assert len(calls) == 1
    assert counter.traces == 0 and counter.compiles == 0
    for x, result in zip(xs, results):
        assert_trees_close(
            result, (jnp.sum(jnp.sin(x) ** 2), {"intermediates": {"h": (jnp.sin(x),)}})
        )

    # A new shape traces again, and is right.
    x5 = jnp.linspace(0.0, 1.0, 5)
    out, found = h(x5)
    assert len(calls) == 2
    assert_trees_close(
        (out, found),
        (jnp.sum(jnp.sin(x5) ** 2), {"intermediates": {"h": (jnp.sin(x5),)}}),
    )
    h(X + 3.0)
    assert len(calls) == 2


def test_branch_check_traces_again_once_and_only_for_a_site_a_handler_matches():
    # Under `handle(vmap(f))`, in a program holding a select (`jnp.where`), a
    # tag the vmap batches may sit unmarked in a branch the vmap turned into a
    # select: `handle` checks by tracing `f` again, but only when a handler
    # matches such a tag, and once.
    calls = []

    def f(x, s):
        calls.append(None)
        y = fx.tag(jnp.where(x > 0, x, -x), "loose")
        return jax.lax.cond(s > 0, lambda y: fx.tag(y + 1.0, "kept"), jnp.negative, y)

    vf = jax.vmap(f, in_axes=(0, None))
    s = jnp.float32(1.0)
    out, found = fx.handle(vf, fx.Tag(names=lambda name: False))(X, s)
    assert len(calls) == 1
    assert_trees_close(out, jnp.abs(X) + 1.0)
    assert found == {"intermediates": {}}
    out, found = fx.handle(vf, fx.Tag(names="kept"))(X, s)
    assert len(calls) == 2
    assert_trees_close(out, jnp.abs(X) + 1.0)
    assert_trees_close(found, {"intermediates": {"kept": (jnp.abs(X) + 1.0,)}})
    out, found = fx.handle(vf, fx.Tag(names="loose"))(X, s)
    assert_trees_close(out, jnp.abs(X) + 1.0)
    assert_trees_close(found, {"intermediates": {"loose": (jnp.abs(X),)}})
    fx.handle(vf, fx.Tag(names="loose", mode="sum"))(X, s)
    assert len(calls) == 2


def test_a_tag_in_a_batched_cond_is_refused_from_the_one_trace():
    # Bound where the vmap evaluates the branches, the tag is marked there:
    # no trace again to find it.
    calls = []

    def f(x):
        calls.append(None)
        tagged = lambda y: fx.tag(y * 2.0, "b")  # noqa: E731
        return jax.lax.cond(jnp.sum(x) > 0, tagged, jnp.negative, x)

    with pytest.raises(ValueError, match="'b'.*inside the vmap"):
        fx.handle(jax.vmap(f), fx.Tag())(jnp.stack([X, -X]))
    assert len(calls) == 1


def test_a_tag_in_a_cond_in_a_lax_map_with_a_batch_size_names_the_way_out():
    # `lax.map` runs its chunks under a vmap, which turns the cond into a
    # select: refused, with the handled function mapped as the way out.
    def g(x):
        tagged = lambda y: fx.tag(jnp.tanh(y), "pos")  # noqa: E731
        return jax.lax.cond(jnp.sum(x) > 0, tagged, jnp.negative, x).sum()

    xs = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    mapped = lambda xs: jax.lax.map(g, xs, batch_size=2)  # noqa: E731
    with pytest.raises(ValueError, match=r"'pos'.*lax\.map.*batch_size"):
        fx.handle(mapped, fx.Tag())(xs)
    out, found = jax.lax.map(
        fx.handle(g, fx.Tag(names="pos", mode="sum")), xs, batch_size=2
    )
    assert_trees_close(out, mapped(xs))
    taken = np.asarray(xs).sum(axis=1) > 0
    want = np.where(taken[:, None], np.tanh(np.asarray(xs)), 0.0).astype(np.float32)
    assert_trees_close(found, {"intermediates": {"pos": want}})


@pytest.mark.parametrize("part", ["tangent", "cotangent"])
def test_a_derivative_of_a_tag_in_a_batched_cond_is_refused(part):
    # A handler of the tangent or cotangent outside a vmap of a derivative:
    # the vmap runs every branch of the forward pass's cond (and of its
    # transpose) for every example. It was not refused, and reported the
    # derivative of an example that did not take the branch.
    def f(x):
        y = jax.lax.cond(jnp.sum(x) > 0, lambda v: fx.tag(v * 2.0, "t"), jnp.sin, x)
        return jnp.sum(jnp.sin(y))

    if part == "cotangent":
        g = jax.grad(f)
    else:
        g = lambda x: jax.jvp(f, (x,), (jnp.ones_like(x),))[1]  # noqa: E731
    xs = jnp.stack([X, -X])  # the first takes the branch, the second does not
    assert bool(jnp.sum(xs[0]) > 0) and not bool(jnp.sum(xs[1]) > 0)
    tag = fx.Tag(of=part)
    with pytest.raises(ValueError, match="'t'.*inside the vmap"):
        fx.handle(jax.vmap(g), tag)(xs)
    # Inside the vmap, each example's own: zeros where the branch did not run.
    _, found = jax.vmap(fx.handle(g, tag))(xs)
    # (d sum(sin(t)) / d t, and the tangent of t = 2 v along ones)
    want = jnp.cos(2.0 * X) if part == "cotangent" else 2.0 * jnp.ones_like(X)
    got = found[f"intermediates:{part}"]["t"][0]
    assert_trees_close(got, jnp.stack([want, jnp.zeros_like(X)]))


def test_a_tag_in_a_batched_cond_in_a_batched_while_loop_is_refused():
    # A cond in a while loop whose predicate a vmap batches (the loop masks its
    # carry per example): the tag is found by its mark (see `_checks.branch_marked`).
    def f(x):
        def body(c):
            tagged = lambda y: fx.tag(y + 1.0, "c")  # noqa: E731
            return jax.lax.cond(jnp.sum(c) > 5.0, tagged, lambda y: y + 2.0, c)

        return jax.lax.while_loop(lambda c: jnp.sum(c) < 10.0, body, x)

    xs = jnp.stack([X, -X])
    with pytest.raises(ValueError, match="'c'.*inside the vmap"):
        fx.handle(jax.vmap(f), fx.Tag(mode="last"))(xs)
    # Each example's own, the other way around: the last execution of each.
    out, found = jax.vmap(fx.handle(f, fx.Tag(mode="last")))(xs)
    assert_trees_close(out, jax.vmap(f)(xs))
    want = []
    for x in np.asarray(xs):
        c, last = x, np.zeros_like(x)
        while c.sum() < 10.0:
            if c.sum() > 5.0:
                c = last = c + 1.0
            else:
                c = c + 2.0
        want.append(last)
    assert_trees_close(found, {"intermediates": {"c": np.stack(want)}})


def _sin_branch(y):
    return fx.tag(jnp.sin(y), "t")


def _same_branch(y):
    return y


def test_a_kept_cond_given_the_branches_of_a_batched_one_is_not_refused():
    # JAX gives a cond it keeps the branches it batched for a select, traced
    # once (tests/test_jax_facts.py::
    # test_a_batched_cond_evaluates_its_branches_in_its_batching_rule): the
    # mark is made where they are evaluated, not where they are traced.
    def batched(x, k):
        return jax.lax.cond(jnp.sum(x) > 0, _sin_branch, _same_branch, x)

    def kept(x, k):
        return jax.lax.cond(k > 0, _sin_branch, _same_branch, x)

    xs, k = jnp.stack([X, -X]), jnp.int32(1)
    with pytest.raises(ValueError, match="'t'.*inside the vmap"):
        fx.handle(jax.vmap(batched, in_axes=(0, None)), fx.Tag())(xs, k)
    out, found = fx.handle(jax.vmap(kept, in_axes=(0, None)), fx.Tag())(xs, k)
    assert_trees_close(out, jnp.sin(xs))
    assert_trees_close(found, {"intermediates": {"t": (jnp.sin(xs),)}})


def test_handle_returns_the_same_wrapper():
    f, _ = _counted()
    assert fx.handle(f, fx.Tag()) is fx.handle(f, fx.Tag())
    assert fx.handle(f, fx.Tag(names="h")) is fx.handle(f, fx.Tag(names="h"))
    assert fx.handle(f, fx.Tag()) is not fx.handle(f, fx.Tag(mode="last"))


def test_handlers_with_arrays_share_compiled_evaluation():
    # `Perturb(deltas)` and `Substitute(values)` hold arrays, so each call builds
    # a new wrapper; eager calls in a loop must still compile once, each call
    # evaluating with its own arrays.
    calls = []

    def f(x):
        calls.append(None)
        return jnp.sum(fx.perturb(jnp.sin(x), "h") ** 2)

    deltas = [{"h": (jnp.full(X.shape, 0.1 * i),)} for i in range(4)]

    def expected(d):
        h = jnp.sin(X) + d
        return jnp.sum(h**2)

    results = [fx.handle(f, fx.Perturb(deltas[0]))(X)]
    with CountCompiles() as counter:
        for d in deltas[1:]:
            results.append(fx.handle(f, fx.Perturb(d))(X))
    assert counter.traces == 0 and counter.compiles == 0
    assert len(calls) == 1
    for d, (out, found) in zip(deltas, results):
        assert_trees_close(out, expected(d["h"][0]))
        assert found == {}


def test_handle_leaves_callable_objects_alone():
    # A callable object's `__dict__` may be its state (a Flax NNX module's is):
    # `handle` must not store anything there.
    class Scale:
        def __init__(self):
            self.w = jnp.float32(3.0)

        def __call__(self, x):
            return fx.tag(self.w * x, "h")

    model = Scale()
    before = dict(vars(model))
    out, found = fx.handle(model, fx.Tag())(X)
    assert_trees_close((out, found), (3.0 * X, {"intermediates": {"h": (3.0 * X,)}}))
    assert vars(model).keys() == before.keys()


@dataclasses.dataclass(frozen=True)
class _Scaled:
    """Hashed by value, like a Flax linen module."""

    factor: float

    def apply(self, x):
        _SCALED_CALLS.append(None)
        return fx.tag(self.factor * jnp.sin(x), "h")


_SCALED_CALLS: list = []


def test_methods_of_objects_hashed_by_value_trace_once():
    # `model.apply` is a new bound method at every access; eager and inline-jit
    # calls in a loop must still trace and compile once.
    _SCALED_CALLS.clear()
    model = _Scaled(2.0)
    xs = [X + i for i in range(4)]
    results = [fx.handle(model.apply, fx.Tag())(xs[0])]
    results.append(jax.jit(fx.handle(model.apply, fx.Tag()))(xs[0]))
    calls = len(_SCALED_CALLS)
    with CountCompiles() as counter:
        for x in xs[1:]:
            results.append(fx.handle(model.apply, fx.Tag())(x))
            results.append(jax.jit(fx.handle(model.apply, fx.Tag()))(x))
            # An equal object is the same model.
            results.append(fx.handle(_Scaled(2.0).apply, fx.Tag())(x))
    assert counter.traces == 0 and counter.compiles == 0
    assert len(_SCALED_CALLS) == calls
    expected = [2.0 * jnp.sin(x) for x in xs]
    for result, h in zip(
        results, [expected[0]] * 2 + [e for e in expected[1:] for _ in "abc"]
    ):
        assert_trees_close(result, (h, {"intermediates": {"h": (h,)}}))
    # Another value is another model.
    assert_trees_close(fx.handle(_Scaled(3.0).apply, fx.Tag())(X)[0], 3.0 * jnp.sin(X))


def test_methods_of_objects_hashed_by_identity_see_their_changes():
    # An object hashed by identity may change between calls: its method gets a
    # new wrapper, which reads its attributes afresh.
    class Model:
        def __init__(self):
            self.w = jnp.float32(2.0)

        def apply(self, x):
            return fx.tag(self.w * x, "h")

    model = Model()
    assert_trees_close(fx.handle(model.apply, fx.Tag())(X)[0], 2.0 * X)
    model.w = jnp.float32(5.0)
    assert_trees_close(fx.handle(model.apply, fx.Tag())(X)[0], 5.0 * X)
    assert_trees_close(jax.jit(fx.handle(model.apply, fx.Tag()))(X)[0], 5.0 * X)


def test_methods_of_objects_whose_hash_fails_are_not_cached():
    # A frozen dataclass (as a Flax linen module) holding a list defines a
    # hash that fails: its method is handled with no cache, from the first
    # call on (a fresh per-method table once failed to hash it only on `put`).
    @dataclasses.dataclass(frozen=True)
    class Listed:
        scales: list

        def apply(self, x):
            return fx.tag(self.scales[0] * x, "h")

    fx._handle._shared.items.clear()
    with pytest.raises(TypeError):
        hash(Listed([2.0]))
    for scale in (2.0, 3.0):
        got = fx.handle(Listed([scale]).apply, fx.Tag())(X)
        assert_trees_close(got, (scale * X, {"intermediates": {"h": (scale * X,)}}))


def test_a_function_that_is_one_jit_call_is_handled_as_its_body():
    # `handle(jax.jit(f))` (a tapped function is one such call too) rewrites
    # the call's body as `handle(f)` rewrites `f`: the same program, with no
    # call left in it, and its sites listed at its top level.
    def f(x):
        return jnp.sum(fx.tag(jnp.sin(x), "h") ** 2)

    jitted = jax.jit(f)
    for handler in (fx.Tag(), fx.Tag(mode="sum")):
        got, want = fx.handle(jitted, handler), fx.handle(f, handler)
        assert_trees_close(got(X), want(X))
        assert optimized_hlo(got, X) == optimized_hlo(want, X)
        names = [e.primitive.name for e in jax.make_jaxpr(got)(X).jaxpr.eqns]
        assert names == [e.primitive.name for e in jax.make_jaxpr(want)(X).jaxpr.eqns]
        assert "pjit" not in names and "jit" not in names, names
    (info,) = fx.sites(jitted)(X)["intermediates"]["h"]
    assert info.where == ""
    # Called with more than its arguments, or inside more, it is a call.
    (info,) = fx.sites(lambda x: jitted(x) + 1.0)(X)["intermediates"]["h"]
    assert info.where.startswith("jit")


def test_inline_jit_of_handle_traces_once():
    f, calls = _counted()
    xs = [X + i for i in range(5)]
    results = [jax.jit(fx.handle(f, fx.Tag()))(xs[0])]
    with CountCompiles() as counter:
        for x in xs[1:]:
            results.append(jax.jit(fx.handle(f, fx.Tag()))(x))
    assert len(calls) == 1
    assert counter.traces == 0 and counter.compiles == 0
    for x, result in zip(xs, results):
        assert_trees_close(
            result, (jnp.sum(jnp.sin(x) ** 2), {"intermediates": {"h": (jnp.sin(x),)}})
        )

    x5 = jnp.linspace(0.0, 1.0, 5)
    result = jax.jit(fx.handle(f, fx.Tag()))(x5)
    assert len(calls) == 2
    assert_trees_close(
        result, (jnp.sum(jnp.sin(x5) ** 2), {"intermediates": {"h": (jnp.sin(x5),)}})
    )


def _sin_sq_h(x):
    return jnp.sum(jnp.sin(x) ** 2), {"intermediates": {"h": (jnp.sin(x),)}}


def test_many_handler_configurations_keep_the_trace():
    # Traces and rewritten programs are cached apart, at most 64 of each: more
    # than 64 handler configurations for one argument signature drop programs,
    # never the trace of another signature.
    f, calls = _counted()
    x5 = jnp.linspace(0.0, 1.0, 5)
    assert_trees_close(jax.jit(fx.handle(f, fx.Tag()))(X), _sin_sq_h(X))
    for i in range(70):
        handlers = (fx.Tag(collection=f"c{i}"), fx.Tag())
        jaxpr = jax.make_jaxpr(fx.handle(f, *handlers))(x5)
        assert len(jaxpr.out_avals) == 2
    assert len(calls) == 2
    out, found = jax.jit(fx.handle(f, fx.Tag(collection="c3")))(X)
    assert len(calls) == 2
    assert_trees_close((out, found), (_sin_sq_h(X)[0], {"c3": {}}))


def test_first_and_later_uses_give_the_same_results():
    # The first use of a handled function under a transformation builds its
    # program, later ones take it from the cache: the same results either way.
    f, calls = _counted()
    handled = fx.handle(f, fx.Tag())
    for use in range(3):
        assert_trees_close(jax.jit(lambda x: handled(x))(X + use), _sin_sq_h(X + use))
        assert_trees_close(
            jax.grad(lambda x: handled(x)[0])(X), 2 * jnp.sin(X) * jnp.cos(X)
        )
        assert_trees_close(jax.vmap(handled)(XB), jax.vmap(_sin_sq_h)(XB))
    assert_trees_close(handled(X), _sin_sq_h(X))


def test_handled_call_under_disable_jit():
    f, _ = _counted()
    with jax.disable_jit():
        assert_trees_close(fx.handle(f, fx.Tag())(X), _sin_sq_h(X))
        assert_trees_close(jax.jit(fx.handle(f, fx.Tag()))(X), _sin_sq_h(X))
        assert_trees_close(
            jax.grad(lambda x: fx.handle(f, fx.Tag())(x)[0])(X),
            2 * jnp.sin(X) * jnp.cos(X),
        )


def test_grad_outside_jit_reuses_jax_cached_derivative(monkeypatch):
    # The handled program is one `jit` call, so `jax.grad` differentiates it
    # with JAX's derivative of the whole jaxpr, cached: a second call runs no
    # JVP rule at all (`dot_general`'s is counted), like `grad(jit(hand))`.
    from jax import lax
    from jax.interpreters import ad

    calls = []
    rule = ad.primitive_jvps[lax.dot_general_p]

    def counting_rule(*args, **kwargs):
        calls.append(None)
        return rule(*args, **kwargs)

    monkeypatch.setitem(ad.primitive_jvps, lax.dot_general_p, counting_rule)
    # Shapes no other test uses, so JAX's caches start empty for them.
    ws = [jnp.full((5, 5), 0.1 * (i + 1), jnp.float32) for i in range(6)]

    def loss(x):
        h = x
        for i, w in enumerate(ws):
            h = fx.perturb(jnp.tanh(h @ w), f"l{i}")
        return jnp.sum(h**2)

    def hand(x):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.sum(h**2)

    x = jnp.linspace(-1.0, 1.0, 35).reshape(7, 5)
    grad = jax.grad(lambda x: fx.handle(loss, fx.Perturb())(x)[0])
    first = grad(x)
    assert 1 <= len(calls) <= len(ws)
    del calls[:]
    second = grad(x)
    assert calls == []
    assert_trees_close(first, jax.grad(hand)(x))
    assert_trees_close(second, jax.grad(hand)(x))


def test_handlers_holding_arrays_do_not_bake_them_in():
    # Same wrapper shape, new substituted values: each call uses its own.
    def f(x):
        return jnp.sum(fx.tag(jnp.sin(x), "h") * x)

    for v in [jnp.zeros(3), jnp.ones(3), T]:
        out, found = fx.handle(f, fx.Substitute({"h": v}))(X)
        assert_trees_close((out, found), (jnp.sum(v * X), {}))
        out, found = jax.jit(lambda v: fx.handle(f, fx.Substitute({"h": v}))(X))(v)
        assert_trees_close((out, found), (jnp.sum(v * X), {}))


#
# Bad input
#


@pytest.mark.parametrize("fn", [3, "f", jnp.ones(3), None], ids=repr)
def test_handle_of_a_non_callable_is_a_type_error(fn):
    with pytest.raises(TypeError, match="callable"):
        fx.handle(fn, fx.Tag())


@pytest.mark.parametrize(
    "handler",
    [fx.Tag, "Tag", None, lambda x: x, {"intermediates": None}],
    ids=["class", "str", "None", "function", "dict"],
)
def test_handle_with_a_non_handler_is_a_type_error(handler):
    with pytest.raises(TypeError, match="handler"):
        fx.handle(_sin_sq, fx.Tag(), handler)


@pytest.mark.parametrize(
    "make",
    [
        lambda: fx.Tag(names=3),
        lambda: fx.Tag(names=["h", 3]),
        lambda: fx.Tag(names={"h", 3}),
        lambda: fx.Tag(names=b"h"),
        lambda: fx.Perturb(names=3),
    ],
)
def test_bad_names_filter_is_a_type_error(make):
    with pytest.raises(TypeError, match="names"):
        make()


@pytest.mark.parametrize("mode", ["bogus", "APPEND", "max", 3, None], ids=repr)
def test_unknown_mode_is_a_value_error(mode):
    with pytest.raises(ValueError, match=re.escape(repr(mode))):
        fx.Tag(mode=mode)


def _tagged_twice(x):
    a = fx.tag(jnp.sin(x), "h")
    b = fx.tag(jnp.cos(a), "h")
    return jnp.sum(b)


@jax.jit
def _clean_reference(x):
    a = jnp.sin(x)
    return (
        (jnp.sum(jnp.cos(a)), {"intermediates": {"h": (a, jnp.cos(a))}}),
        (jnp.sum(a**2), {"intermediates": {"h": a, "d": x * 3.0}}),
        (jnp.sum(T**2), {}),
    )


def _assert_clean_afterwards():
    # The next valid calls work and unhandled functions are effect-free.
    twice, strict, substituted = _clean_reference(X)
    assert_trees_close(fx.handle(_tagged_twice, fx.Tag())(X), twice)
    assert_trees_close(fx.handle(_sin_sq, fx.Tag(mode="strict"))(X), strict)
    assert_trees_close(fx.handle(_sin_sq, fx.Substitute({"h": T}))(X), substituted)
    for fn in [_tagged_twice, jax.jit(_tagged_twice), jax.grad(_sin_sq)]:
        assert jax.make_jaxpr(fn)(X).effects == set()
    np.testing.assert_allclose(jax.jit(_tagged_twice)(X), twice[0], rtol=1e-6)


def _raise_in_trace(x):
    fx.tag(x, "before")
    raise RuntimeError("user error while tracing")


@pytest.mark.parametrize(
    "fail, error, match",
    [
        pytest.param(
            lambda: fx.handle(_tagged_twice, fx.Tag(mode="strict"))(X),
            ValueError,
            "'h'",
            id="strict-repeat",
        ),
        pytest.param(
            lambda: jax.jit(fx.handle(jax.jit(_tagged_twice), fx.Tag(mode="strict")))(
                X
            ),
            ValueError,
            "'h'",
            id="strict-repeat-in-jit",
        ),
        pytest.param(
            lambda: fx.handle(_sin_sq, fx.Substitute({"nope": T}))(X),
            ValueError,
            "'nope'.*'d'.*'h'",
            id="unknown-substitute-name",
        ),
        pytest.param(
            lambda: fx.handle(_sin_sq, fx.Substitute({"h": jnp.ones(4)}))(X),
            ValueError,
            "'h'",
            id="substitute-wrong-shape",
        ),
        pytest.param(
            lambda: fx.handle(_raise_in_trace, fx.Tag())(X),
            RuntimeError,
            "user error",
            id="user-error-while-tracing",
        ),
        pytest.param(
            lambda: fx.handle(lambda x: fx.tag("text", "bad"), fx.Tag())(X),
            TypeError,
            "'bad'",
            id="bad-tag-while-tracing",
        ),
    ],
)
def test_a_failed_call_leaves_nothing_behind(fail, error, match):
    with pytest.raises(error, match=match):
        fail()
    _assert_clean_afterwards()
    # Failing again fails the same way (nothing half-cached).
    with pytest.raises(error, match=match):
        fail()


#
# The handled program costs what the hand-written one does
#


def _params(seed, widths):
    return _filled(jax.eval_shape(lambda k: mlp_params(k, list(widths)), _KEY), seed)


def _tagged_mlp(params, x):
    for i, w in enumerate(params):
        x = fx.tag(jnp.tanh(x @ w), f"layer{i}")
    return jnp.sum(x**2)


def _hand_mlp(params, x):
    found = {}
    for i, w in enumerate(params):
        x = jnp.tanh(x @ w)
        found[f"layer{i}"] = (x,)
    return jnp.sum(x**2), {"intermediates": found}


def _layer(w, x, name):
    return fx.tag(jnp.tanh(x @ w), name)


def _tagged_mlp_jit_inside(params, x):
    for i, w in enumerate(params):
        x = jax.jit(_layer, static_argnums=2)(w, x, f"layer{i}")
    return jnp.sum(x**2)


def _hand_layer(w, x):
    return jnp.tanh(x @ w)


def _hand_mlp_jit_inside(params, x):
    found = {}
    for i, w in enumerate(params):
        x = jax.jit(_hand_layer)(w, x)
        found[f"layer{i}"] = (x,)
    return jnp.sum(x**2), {"intermediates": found}


@pytest.mark.parametrize(
    "tagged, hand",
    [
        pytest.param(_tagged_mlp, _hand_mlp, id="mlp"),
        pytest.param(_tagged_mlp_jit_inside, _hand_mlp_jit_inside, id="jit-inside"),
    ],
)
def test_handled_program_compiles_like_the_hand_written_one(tagged, hand):
    params = _params(0, (3, 8, 8, 2))
    x = jnp.ones((5, 3))
    handled = fx.handle(tagged, fx.Tag())
    assert_trees_close(handled(params, x), hand(params, x))
    assert optimized_hlo(handled, params, x) == optimized_hlo(hand, params, x)


_shared_layer = jax.jit(lambda w, x: fx.tag(jnp.tanh(x @ w), "layer"))
_hand_shared_layer = jax.jit(_hand_layer)


def _tagged_shared(params, x):
    for w in params:
        x = _shared_layer(w, x)
    return jnp.sum(x**2)


def _hand_shared(params, x, how=tuple):
    found = []
    for w in params:
        x = _hand_shared_layer(w, x)
        found.append(x)
    return jnp.sum(x**2), {"intermediates": {"layer": how(found)}}


def _calls(fn, *args) -> int:
    return jax.jit(fn).lower(*args).as_text().count("func.func")


@pytest.mark.parametrize("mode", ["append", "sum"])
def test_a_jitted_function_called_many_times_lowers_once_as_unhandled(mode):
    # The calls rewritten to the same program bind one jaxpr, which JAX lowers
    # once for all of them, as it lowers the unhandled function's: one
    # `func.func` for the layer, one for the program, and under "sum" one more
    # for the first call, which starts the accumulator. However many calls.
    x = jnp.ones((5, 8))
    handled = fx.handle(_tagged_shared, fx.Tag(mode=mode))

    def hand(params, x):
        return _hand_shared(params, x, tuple if mode == "append" else sum)

    for layers in (3, 6):
        params = _params(1, (8,) * (layers + 1))
        assert_trees_close(handled(params, x), hand(params, x))
        if mode == "append":  # (a sum adds in another order than `sum` does)
            assert optimized_hlo(handled, params, x) == optimized_hlo(hand, params, x)
        first = 0 if mode == "append" else 1
        assert (
            _calls(handled, params, x) == _calls(hand, params, x) + first == 2 + first
        )


def test_calls_rewritten_to_different_programs_stay_apart():
    # A handler reading `at` gets each call's number; constants that compare
    # equal as numbers but are other values (0.0 and -0.0) are others.
    params = _params(1, (8, 8, 8, 8))
    x = jnp.ones((5, 8))
    handled = fx.handle(
        _tagged_shared, fx.Intervene({"layer": lambda v, at: v + at[0]})
    )
    h = x
    for i, w in enumerate(params):
        h = np.tanh(np.asarray(h) @ np.asarray(w)) + np.float32(i)
    assert_trees_close(handled(params, x)[0], jnp.sum(jnp.asarray(h) ** 2))
    plus = jax.jit(lambda x: fx.tag(x + 0.0, "a"))
    minus = jax.jit(lambda x: fx.tag(x + -0.0, "a"))
    program = jax.make_jaxpr(
        fx.handle(lambda x: (plus(x), minus(x), plus(x)), fx.Tag())
    )
    first, second, third = [e.params["jaxpr"] for e in program(0.0).jaxpr.eqns]
    assert first is third and first is not second


@pytest.mark.parametrize(
    "tagged", [_tagged_mlp, _tagged_mlp_jit_inside], ids=["mlp", "jit-inside"]
)
def test_a_handler_matching_nothing_leaves_the_untagged_program(tagged):
    # Sites no handler matches are gone, as unhandled tags are (no enclosing
    # `handle` to see them): the jaxpr is the plain function's, with an empty
    # `found`.
    params = _params(0, (3, 8, 8, 2))
    x = jnp.ones((5, 3))
    handled = fx.handle(tagged, fx.Tag(names=lambda name: False))
    out, found = handled(params, x)
    assert_trees_close(out, tagged(params, x))
    assert found == {"intermediates": {}}
    program = str(jax.make_jaxpr(lambda p, x: handled(p, x)[0])(params, x))
    plain = str(jax.make_jaxpr(tagged)(params, x))
    assert "effects_site" not in program
    assert program.count(" = ") == plain.count(" = ")  # equation for equation


@pytest.mark.parametrize("handler", [fx.Tag(), fx.Stats()], ids=["Tag", "Stats"])
def test_an_exported_handled_function_serializes_and_runs(handler):
    # `found` is an `fx.Found` (its `Stats` entries `fx.Statistics`): pytree
    # types `jax.export` did not know how to serialize.
    from jax import export

    def f(x):
        return jnp.sum(fx.tag(jnp.tanh(x), "h") ** 2)

    x = jnp.linspace(-1.0, 1.0, 6)
    handled = fx.handle(f, handler)
    exported = export.export(jax.jit(handled))(jax.ShapeDtypeStruct(x.shape, x.dtype))
    back = export.deserialize(exported.serialize())
    got, want = back.call(x), handled(x)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert_trees_close(got, want)
    assert list(got[1]["intermediates"]) == ["h"]


def test_handled_gradient_compiles_like_the_hand_written_one():
    params = _params(1, (3, 8, 2))
    x = jnp.ones((5, 3))

    def handled(params, x):
        return jax.grad(lambda p: fx.handle(_tagged_mlp, fx.Tag())(p, x), has_aux=True)(
            params
        )

    def hand(params, x):
        return jax.grad(lambda p: _hand_mlp(p, x), has_aux=True)(params)

    assert_trees_close(jax.jit(handled)(params, x), jax.jit(hand)(params, x))
    assert optimized_hlo(handled, params, x) == optimized_hlo(hand, params, x)


#
# Flax
#


def test_flax_linen_tag_collects_what_sow_does():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        use_sow: bool

        @nn.compact
        def __call__(self, x):
            h = jnp.tanh(nn.Dense(x.shape[-1])(x))
            if self.use_sow:
                self.sow("intermediates", "h", h)
            else:
                fx.tag(h, "block/h")  # discarded
            return h

    class Net(nn.Module):
        use_sow: bool

        @nn.compact
        def __call__(self, x):
            block = Block(self.use_sow)
            h = block(block(x))  # the same block twice: two entries
            out = nn.Dense(2)(h)
            if self.use_sow:
                self.sow("intermediates", "out", out)
            else:
                out = fx.tag(out, "out")
            return jnp.sum(out**2)

    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    tagged, sown = Net(False), Net(True)
    variables = _filled(jax.eval_shape(tagged.init, _KEY, x))

    want_out, state = jax.jit(lambda v, x: sown.apply(v, x, mutable="intermediates"))(
        variables, x
    )
    sown_values = state["intermediates"]
    assert len(sown_values["Block_0"]["h"]) == 2
    expected = {
        "intermediates": {
            "block/h": sown_values["Block_0"]["h"],
            "out": sown_values["out"],
        }
    }

    out, found = fx.handle(tagged.apply, fx.Tag())(variables, x)
    assert_trees_close((out, found), (want_out, expected))
    assert_trees_close(
        jax.jit(fx.handle(tagged.apply, fx.Tag()))(variables, x), (want_out, expected)
    )
    # `tagged.apply` is a new bound method each time; the module is hashed by
    # value, so repeated calls reuse one wrapper and its compiled evaluation.
    assert fx.handle(tagged.apply, fx.Tag()) is fx.handle(Net(False).apply, fx.Tag())
    with CountCompiles() as counter:
        again = fx.handle(tagged.apply, fx.Tag())(variables, x)
    assert counter.traces == 0 and counter.compiles == 0
    assert_trees_close(again, (want_out, expected))

    grads, found = jax.jit(
        jax.grad(lambda v: fx.handle(tagged.apply, fx.Tag())(v, x), has_aux=True)
    )(variables)
    assert_trees_close(found, expected)
    assert_trees_close(
        grads, jax.jit(jax.grad(lambda v: tagged.apply(v, x)))(variables)
    )


def test_flax_nnx_module_with_tags():
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(3, 4, rngs=rngs)
            self.l2 = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            h = fx.tag(jnp.tanh(self.l1(x)), "h")
            return jnp.sum(fx.tag(self.l2(h), "out") ** 2)

    graphdef, shapes = nnx.split(nnx.eval_shape(lambda: Net(nnx.Rngs(0))))
    model = nnx.merge(graphdef, _filled(shapes))
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)

    @jax.jit
    def by_hand(weights, x):
        w1, b1, w2, b2 = weights
        h = jnp.tanh(x @ w1 + b1)
        out = h @ w2 + b2
        return jnp.sum(out**2), {"intermediates": {"h": (h,), "out": (out,)}}

    weights = (
        model.l1.kernel[...],
        model.l1.bias[...],
        model.l2.kernel[...],
        model.l2.bias[...],
    )
    expected = by_hand(weights, x)

    assert_trees_close(fx.handle(lambda x: model(x), fx.Tag())(x), expected)
    # The module itself, called: handling it leaves its graph as it was.
    graphdef_before = nnx.split(model)[0]
    assert_trees_close(fx.handle(model, fx.Tag())(x), expected)
    assert nnx.split(model)[0] == graphdef_before

    graphdef, state = nnx.split(model)

    def pure(state, x):
        return nnx.merge(graphdef, state)(x)

    assert_trees_close(fx.handle(pure, fx.Tag())(state, x), expected)
    assert_trees_close(jax.jit(fx.handle(pure, fx.Tag()))(state, x), expected)

    grads, found = jax.jit(
        jax.grad(lambda s: fx.handle(pure, fx.Tag())(s, x), has_aux=True)
    )(state)
    assert_trees_close(found, expected[1])
    want = jax.jit(jax.grad(lambda w: by_hand(w, x)[0]))(weights)
    got = (
        grads["l1"]["kernel"][...],
        grads["l1"]["bias"][...],
        grads["l2"]["kernel"][...],
        grads["l2"]["bias"][...],
    )
    assert_trees_close(got, want)


def test_a_name_consumed_by_an_earlier_handler_is_unknown_to_later_ones():
    # Found by the property tests: handle(f, A, B) as handle(handle(f, A), B),
    # where A (a Tag) consumes the tag B (an Intervene) names.
    def f(x):
        return fx.tag(jnp.sin(x), "t1") * 2.0

    intervene = fx.Intervene({"t1": lambda v: v * 2.0})
    with pytest.raises(ValueError, match="no tag named 't1'.*Known names: none"):
        fx.handle(fx.handle(f, fx.Tag()), intervene)(X)
    # In one `handle`, the message can say which handler consumed it.
    with pytest.raises(ValueError, match="'t1'.*is consumed by Tag \\(handler 0\\)"):
        fx.handle(f, fx.Tag(), intervene)(X)
    # The other order: the Intervene sees the tag, the Tag collects its result.
    out, found = fx.handle(f, intervene, fx.Tag())(X)
    expected = {"intermediates": {"t1": (2.0 * jnp.sin(X),)}}
    assert_trees_close((out, found), (4.0 * jnp.sin(X), expected))


def test_the_advice_for_a_consumed_name_works():
    # The error says how to have both handlers act: a handler that reports
    # nothing first, or the two nested with the inner mode passing it on.
    def f(x):
        return fx.tag(jnp.sin(x), "t1") * 2.0

    new = {"t1": jnp.cos(X)}
    with pytest.raises(ValueError, match="put a handler that reports nothing"):
        fx.handle(f, fx.Tag(), fx.Substitute(new))(X)
    out, found = fx.handle(f, fx.Substitute(new), fx.Tag())(X)
    assert_trees_close(
        (out, found["intermediates"]["t1"]), (2 * new["t1"], (new["t1"],))
    )
    passing = fx.Tag(mode=fx.Append(consumes=False))
    (out, found), outer = fx.handle(fx.handle(f, passing), fx.Substitute(new))(X)
    assert outer == {}
    assert_trees_close(
        (out, found["intermediates"]["t1"]), (2 * new["t1"], (jnp.sin(X),))
    )


class _Count(fx.Handler):
    """A user's handler that counts the executions of every tag."""

    mode = fx.Reduce(lambda n, x: n + x, lambda zero: jnp.int32(0))

    def apply(self, site, value, ctx):
        ctx.emit(jnp.int32(1))
        return value


def test_a_handler_naming_none_whose_every_site_an_earlier_one_consumed_warns():
    def f(x):
        return fx.tag(jnp.sin(x), "t1") * fx.tag(x, "t2")

    with pytest.warns(UserWarning, match="Stats matches no site left") as record:
        flat = fx.handle(f, _Count(), fx.Stats())(X)
    # (the warning names the user's call; its message what to do)
    assert [w.filename for w in record] == [__file__]
    assert "consumes=False" in str(record[0].message)
    # The values are the nested form's, where Stats sees no site at all.
    (out, inner), outer = fx.handle(fx.handle(f, _Count()), fx.Stats())(X)
    assert outer == {"intermediates": {}}
    assert_trees_close(flat, (out, inner))
    assert_trees_close(out, jnp.sin(X) * X)
    assert_trees_close(inner["intermediates"], {"t1": np.int32(1), "t2": np.int32(1)})
    # Where one site is left, or none was ever there, nothing is said
    # (warnings are errors in this suite).
    _, found = fx.handle(f, fx.Tag(names="t1"), fx.Stats())(X)
    assert list(found["intermediates"]) == ["t1", "t2"]
    assert fx.handle(jnp.sin, _Count(), fx.Stats())(X)[1] == {"intermediates": {}}


def test_a_handler_naming_none_whose_derivatives_an_inner_handle_consumed_warns():
    # The cotangents an inner `handle` reported are consumed there: a handler
    # of them that names none, after one that consumes in the outer handle,
    # finds none left, and says so (as the flat form does), with the values
    # of the form nested once more.
    def f(x):
        return jnp.sum(jnp.sin(fx.tag(x * 2.0, "h")))

    inner = fx.handle(jax.grad(f), fx.Tag(of="cotangent"))
    with pytest.warns(UserWarning, match="cotangent of tag 'h'.*inside this one"):
        flat = fx.handle(inner, fx.Tag(), fx.Tag(of="cotangent"))(X)
    nested, outer = fx.handle(fx.handle(inner, fx.Tag()), fx.Tag(of="cotangent"))(X)
    assert outer == {"intermediates:cotangent": {}}
    assert_trees_close(flat, (nested[0], {**nested[1], **outer}))
    assert_trees_close(nested[1]["intermediates"]["h"], (2.0 * X,))


def test_jax_errors_while_tracing_name_the_users_function():
    def branchy_model(x):
        h = fx.tag(jnp.sin(x), "h")
        return h if h > 0 else -h  # Python control flow on a traced value

    class Branchy(eqx.Module):
        def __call__(self, x):
            return branchy_model(x)

    for fn, name in ((branchy_model, "branchy_model"), (Branchy(), "__call__")):
        with pytest.raises(
            jax.errors.TracerBoolConversionError,
            match=f"tracing the function {name} at .*test_handle.py:\\d+ for fx.handle",
        ):
            fx.handle(fn, fx.Tag())(1.0)


#
# Equinox modules and `intermediate_grads`, called eagerly: compiled once
#


class _Counted(eqx.Module):
    """A tagged two-layer network counting how often its body runs (traces)."""

    w1: jax.Array
    w2: jax.Array
    scale: float = 2.0  # a leaf that is not an array: static

    def __call__(self, x):
        _MODULE_CALLS.append(None)
        h = fx.tag(jnp.tanh(self.w1 @ x), "h")
        return jnp.sum(self.scale * (self.w2 @ h))


_MODULE_CALLS = []


def _counted_model(seed: int) -> _Counted:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return _Counted(jax.random.normal(k1, (4, 3)), jax.random.normal(k2, (2, 4)))


def _counted_ref(model, x):
    h = np.tanh(np.asarray(model.w1) @ np.asarray(x))
    return model.scale * np.sum(np.asarray(model.w2) @ h), h


def test_inline_handle_of_an_equinox_module_compiles_once():
    # (repros: perf_inline_equinox_module_retraces.py)
    # `fx.handle(model, ...)(x)` written inline makes a new wrapper each call;
    # models of one structure share its jitted call, each with its own arrays.
    models = [_counted_model(i) for i in range(3)]
    models.append(eqx.tree_at(lambda m: m.w1, models[0], models[0].w1 + 1.0))
    xs = [X, X + 1.0, 2.0 * X, -X]
    del _MODULE_CALLS[:]
    results = [fx.handle(models[0], fx.Tag())(xs[0])]
    assert len(_MODULE_CALLS) == 1
    with CountCompiles() as counter:
        for model, x in zip(models[1:], xs[1:]):
            results.append(fx.handle(model, fx.Tag())(x))
    assert counter.traces == 0 and counter.compiles == 0
    # Another `Tag` is another configuration: a new program, not a new trace.
    results.append(fx.handle(models[1], fx.Tag(names="h"))(xs[1]))
    assert len(_MODULE_CALLS) == 1
    for model, x, (out, found) in zip([*models, models[1]], [*xs, xs[1]], results):
        want, h = _counted_ref(model, x)
        assert_trees_close(out, jnp.float32(want), rtol=1e-5)
        assert_trees_close(found, {"intermediates": {"h": (jnp.asarray(h),)}})
        assert_trees_close(out, model(x))
    # Another static field is another structure: traced again, and right.
    other = dataclasses.replace(models[1], scale=3.0)
    n = len(_MODULE_CALLS)
    out, _ = fx.handle(other, fx.Tag())(X)
    assert len(_MODULE_CALLS) == n + 1
    assert_trees_close(out, jnp.float32(_counted_ref(other, X)[0]))


def test_inline_handle_of_tag_modules_compiles_once():
    # As the capture-every-layer guide writes it, with the model updated
    # between calls.
    model = eqx.nn.MLP(3, 2, width_size=8, depth=2, key=jax.random.key(0))
    x = X

    def layers_ref(m):
        h, outs = x, []
        for i, layer in enumerate(m.layers):
            h = layer.weight @ h + layer.bias
            outs.append(h)
            if i < len(m.layers) - 1:
                h = jax.nn.relu(h)
        return h, outs

    def update(m, i):
        return eqx.tree_at(lambda m: m.layers[0].bias, m, m.layers[0].bias + i)

    fx.handle(fx.tag_modules(model), fx.Tag())(x)
    updated = [update(model, float(i)) for i in range(1, 4)]
    with CountCompiles() as counter:
        results = [(m, fx.handle(fx.tag_modules(m), fx.Tag())(x)) for m in updated]
    assert counter.traces == 0 and counter.compiles == 0
    for m, (out, found) in results:
        want, outs = layers_ref(m)
        assert_trees_close(out, m(x))
        assert_trees_close(out, want)
        got = found["intermediates"]
        assert_trees_close([got[f"layers.{i}"][0] for i in range(3)], outs)


def test_the_module_cache_keeps_no_model_arrays():
    import gc
    import weakref

    model = _counted_model(7)
    ref = weakref.ref(model.w1)
    want = _counted_ref(model, X)[0]
    out, _ = fx.handle(model, fx.Tag())(X)
    assert_trees_close(out, jnp.float32(want))
    del model, out
    gc.collect()
    assert ref() is None


def test_eager_intermediate_grads_compile_once():
    # (repros: perf_eager_intermediate_grads_recompiles.py)
    calls = []
    w = jnp.array([[0.5, -1.0, 2.0], [1.5, 0.2, -0.3]])

    def loss(x):
        calls.append(None)
        h = fx.tag(jnp.tanh(w @ x), "h")
        return jnp.sum(h**2)

    def ref(x):  # d loss / d h = 2 h
        h = jnp.tanh(w @ x)
        return jnp.sum(h**2), {"h": (2.0 * h,)}

    g = fx.intermediate_grads(loss, kind="tag")
    xs = [X, X + 1.0, 2.0 * X, -X]
    results = [g(xs[0])]
    n = len(calls)
    with CountCompiles() as counter:
        results += [g(x) for x in xs[1:3]]
        # Written inline, a new `intermediate_grads` each call: the same.
        results.append(fx.intermediate_grads(loss, kind="tag")(xs[3]))
    assert counter.traces == 0 and counter.compiles == 0
    assert len(calls) == n
    for x, result in zip(xs, results):
        assert_trees_close(result, ref(x))


def test_eager_grad_of_handlers_with_arrays_compiles_once():
    # `Perturb(deltas)` under an eager `jax.grad`: the handlers hold tracers,
    # and the rewritten program is still cached (by the arrays' types).
    calls = []

    def f(x):
        calls.append(None)
        return jnp.sum(fx.perturb(jnp.sin(x), "h") ** 2)

    def loss(d, x):
        return fx.handle(f, fx.Perturb({"h": (d,)}))(x)[0]

    grad = jax.grad(loss)
    inputs = [(jnp.full_like(X, d), s * X) for d, s in ((0, 1), (0.1, 1), (0, 2))]
    # JAX's caches of derivatives are off while it checks for leaked tracers.
    with no_leak_checks():
        results = [grad(*inputs[0])]
        n = len(calls)
        with CountCompiles() as counter:
            results += [grad(*args) for args in inputs[1:]]
    assert counter.compiles == 0
    assert len(calls) == n
    for (d, x), got in zip(inputs, results):
        assert_trees_close(got, 2.0 * (jnp.sin(x) + d))


def test_a_handler_matching_no_site_traces_the_function_once():
    # A vmapped tag and a select: a tag could sit in a cond branch the vmap ran
    # for every example, which only a second trace can tell. That check is for
    # handlers that see the tag; others cost one trace, as the plain function.
    calls = []

    def f(x):
        calls.append(None)
        h = jax.vmap(lambda r: fx.tag(jnp.sin(r), "h"))(x)
        return jnp.sum(jnp.where(h > 0, h, 0.0))

    def ref(x):
        h = np.sin(np.asarray(x))
        return np.float32(np.sum(np.where(h > 0, h, 0.0)))

    out, found = fx.handle(f, fx.Tag(collection="other"))(XB)
    assert len(calls) == 1
    assert found == {"other": {}}
    assert_trees_close(out, ref(XB))
    assert_trees_close(out, jax.jit(f)(XB))
    # A handler that sees the tag: checked (by tracing again), and right.
    out, found = fx.handle(f, fx.Tag())(XB)
    assert_trees_close(
        (out, found), (ref(XB), {"intermediates": {"h": (jnp.sin(XB),)}})
    )


def _x64():
    # `jax.enable_x64` (jax 0.8+), `jax.experimental.enable_x64` before.
    import jax.experimental

    if hasattr(jax, "enable_x64"):
        return jax.enable_x64
    return jax.experimental.enable_x64  # pyright: ignore


def test_a_trace_is_not_reused_across_the_x64_setting():
    # The trace made with 32-bit floats must not serve a call under
    # `jax.enable_x64`, where `jax.jit` traces again and computes in float64.
    def f(x):
        return fx.tag(x * 2.0, "h") + 1.0

    handled = fx.handle(f, fx.Tag())
    out, found = handled(1.0)
    assert out.dtype == jnp.float32
    with _x64()(True):
        out, found = handled(1.0)
        want = jax.jit(f)(1.0)
        assert out.dtype == want.dtype == jnp.float64
        assert found["intermediates"]["h"][0].dtype == jnp.float64
        out, _ = jax.jit(handled)(1.0)
        assert out.dtype == jnp.float64
    assert handled(1.0)[0].dtype == jnp.float32
