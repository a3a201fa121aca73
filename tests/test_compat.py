"""The JAX internals the rewriter relies on, checked in one place.

The rewriter reads and rebuilds the params of higher-order primitives (the
bodies, their constant and carry counts, the shardings of a jit). A JAX
release that renames, adds or drops one of those params fails here first,
with the primitive's name, rather than somewhere deep in a rewrite.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, devices
from jax.sharding import PartitionSpec as P

import effects as fx
from effects import _compat, _jaxpr

JAX = tuple(int(p) for p in jax.__version__.split(".")[:2])

_JIT = {
    "jaxpr",
    "in_shardings",
    "out_shardings",
    "in_layouts",
    "out_layouts",
    "donated_invars",
    "ctx_mesh",
    "name",
    "keep_unused",
    "inline",
    "compiler_options_kvs",
}
_CUSTOM_JVP = {"call_jaxpr", "jvp_jaxpr_fun", "num_consts", "symbolic_zeros"}
_CUSTOM_VJP = {
    "call_jaxpr",
    "fwd_jaxpr_thunk",
    "bwd",
    "num_consts",
    "out_trees",
    "symbolic_zeros",
}
_SHARD_MAP = {"jaxpr", "mesh", "in_specs", "out_specs", "check_vma"}

if JAX >= (0, 11):  # scan's counts became flat-tree params
    _SCAN = {"jaxpr", "length", "reverse", "unroll", "ft_in", "ft_out"}
elif JAX >= (0, 10):
    _SCAN = {"jaxpr", "length", "reverse", "unroll", "num_consts", "num_carry"}
else:  # jax 0.7-0.9
    _SCAN = {
        "jaxpr",
        "length",
        "reverse",
        "unroll",
        "num_consts",
        "num_carry",
        "linear",
        "_split_transpose",
    }
if JAX >= (0, 10):
    _SHARD_MAP = _SHARD_MAP | {"newly_manual_axes"}
else:  # jax 0.7-0.9
    _SHARD_MAP = _SHARD_MAP | {"manual_axes"}

EXPECTED = {
    _compat.pjit_p: _JIT,
    _compat.scan_p: _SCAN,
    _compat.while_p: {"cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts"},
    _compat.cond_p: {"branches"},
    _compat.remat_p: {"jaxpr", "prevent_cse", "differentiated", "policy"},
    _compat.custom_jvp_call_p: _CUSTOM_JVP,
    _compat.custom_vjp_call_p: _CUSTOM_VJP,
    _compat.shard_map_p: _SHARD_MAP,
}


@jax.custom_jvp
def _custom_jvp(x):
    return x


_custom_jvp.defjvp(lambda primals, tangents: (primals[0], tangents[0]))


@jax.custom_vjp
def _custom_vjp(x):
    return x


_custom_vjp.defvjp(lambda x: (x, None), lambda _, g: (g,))


def _shard_map(f, **kwargs):
    shard_map = getattr(jax, "shard_map", None)  # jax 0.7+: public
    assert shard_map is not None
    return shard_map(f, **kwargs)


def _every_higher_order_primitive(x):
    x = jax.jit(lambda y: y + 1)(x)
    x = jax.lax.scan(lambda c, y: (c + y, c), x, jnp.ones((2,) + x.shape))[0]
    x = jax.lax.while_loop(lambda c: c.sum() < 0, lambda c: c + 1, x)
    x = jax.lax.cond(x.sum() > 0, lambda y: y, lambda y: -y, x)
    x = jax.checkpoint(lambda y: y * 2)(x)
    x = _custom_jvp(x)
    x = _custom_vjp(x)
    mesh = jax.sharding.Mesh(np.array(devices(1)), ("i",))
    return _shard_map(lambda y: y, mesh=mesh, in_specs=P(), out_specs=P())(x)


def _equations():
    jaxpr = jax.make_jaxpr(_every_higher_order_primitive)(jnp.ones(3))
    return {e.primitive: e for e in jaxpr.eqns if e.primitive in EXPECTED}


def test_every_primitive_is_found():
    missing = [p.name for p in EXPECTED if p not in _equations()]
    assert not missing, f"no equation of {missing} in the probe function"


@pytest.mark.parametrize("prim", list(EXPECTED), ids=lambda p: p.name)
def test_param_names(prim):
    eqn = _equations()[prim]
    got = set(eqn.params)
    assert got == EXPECTED[prim], (
        f"jax {jax.__version__} changed the params of `{prim.name}`: "
        f"new {sorted(got - EXPECTED[prim])}, gone {sorted(EXPECTED[prim] - got)}. "
        "Update effects/_compat.py and the rule for it in effects/_rewrite.py."
    )


def test_scan_counts_roundtrip():
    eqn = _equations()[_compat.scan_p]
    assert _compat.scan_counts(eqn.params) == (0, 1)
    rebuilt = _compat.scan_params(
        eqn.params, eqn.params["jaxpr"], n_consts=0, n_carry=1, n_xs=1, n_ys=1
    )
    assert _compat.scan_counts(dict(eqn.params, **rebuilt)) == (0, 1)


def test_shard_map_manual_axes():
    eqn = _equations()[_compat.shard_map_p]
    assert _compat.shard_map_manual_axes(eqn.params) == frozenset({"i"})


def test_jaxprs_in_params_finds_every_body():
    eqns = _equations()
    counts = {p.name: len(_compat.jaxprs_in_params(e.params)) for p, e in eqns.items()}
    assert counts[_compat.cond_p.name] == 2
    assert counts[_compat.while_p.name] == 2
    for prim in (_compat.pjit_p, _compat.scan_p, _compat.remat_p, _compat.shard_map_p):
        assert counts[prim.name] == 1, prim.name


def test_sub_jaxprs_agrees_with_jax():
    # The fast scan finds what JAX's own helper finds, on every primitive, and
    # in a named tuple of jaxprs (custom_linear_solve's).
    solve = jax.make_jaxpr(
        lambda b: jax.lax.custom_linear_solve(lambda x: 2 * x, b, lambda m, c: c / 2)
    )(jnp.ones(3)).eqns[-1]
    assert solve.primitive.name == "custom_linear_solve"
    for eqn in [*_equations().values(), solve]:
        fast = _jaxpr.sub_jaxprs(eqn)
        jax_own = _compat.jaxprs_in_params(eqn.params)
        assert [id(j) for j in fast] == [id(getattr(j, "jaxpr", j)) for j in jax_own]
        assert fast, eqn.primitive.name


def test_call_jaxpr_binds_one_inline_jit_call():
    # `call_jaxpr` stretches the params of a template jit equation. Where a
    # jaxpr is being built the call is inlined, as `jax.jit(..., inline=True)`
    # is: its equations appear in place. Under `grad` it is one call that JAX
    # differentiates (and then inlines in turn).
    def fn(a, b):
        return (a * b, a + b, a)

    closed = jax.make_jaxpr(fn)(1.0, 2.0)
    inlined = jax.make_jaxpr(lambda a, b: _jaxpr.call_jaxpr(closed, [a, b], "f"))
    assert str(inlined(1.0, 2.0)) == str(jax.make_jaxpr(fn)(1.0, 2.0))
    seen = []

    def grad_of(a, b):
        out = _jaxpr.call_jaxpr(closed, [a, b], "f")
        seen.extend(type(x).__name__ for x in out)
        return out[0]

    assert jax.grad(grad_of)(3.0, 2.0) == jax.grad(lambda a, b: fn(a, b)[0])(3.0, 2.0)
    assert seen and all("JVP" in name or "Linearize" in name for name in seen)


def test_closed_call_is_rewritten():
    # `closed_call` has no public constructor; it is bound the way JAX's own
    # interpreters re-bind a closed_call equation. (Its jaxpr is traced where
    # `f` is: one traced outside `handle` holds no tag.)
    def f(x):
        inner = jax.make_jaxpr(lambda y: fx.tag(jnp.sin(y) * 3, "a"))(x)
        params = _compat.closed_call_p.get_bind_params(dict(call_jaxpr=inner))
        if isinstance(params, tuple):  # jax 0.7: (subfuns, params)
            subfuns, params = params
            return _compat.closed_call_p.bind(*subfuns, x, **params)[0] + 1
        return _compat.closed_call_p.bind(x, **params)[0] + 1

    x = jnp.linspace(0.0, 1.0, 3)
    eqns = jax.make_jaxpr(f)(x).eqns
    assert any(e.primitive is _compat.closed_call_p for e in eqns)
    out, found = fx.handle(f, fx.Tag())(x)
    assert_trees_close(out, jnp.sin(x) * 3 + 1)
    assert_trees_close(found, {"intermediates": {"a": (jnp.sin(x) * 3,)}})
    grad = jax.grad(
        lambda x: fx.handle(f, fx.Tag())(x)[1]["intermediates"]["a"][0].sum()
    )
    assert_trees_close(grad(x), 3 * jnp.cos(x))
