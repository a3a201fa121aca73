"""Isolation: `effects` leaves JAX as it found it, and `handle` keeps no state
that leaks between calls, threads or functions.

- JAX stays untouched: a fresh interpreter snapshots JAX's rule tables, trace and
  tracer classes, module functions and effect-type sets, imports `effects`, runs
  handled functions under every transformation, and snapshots again. The only
  changes allowed are rules keyed by our own primitive, our own effect type in
  the effect-type sets, and new config options. The trace a handled function
  runs on under `jax.jit` is JAX's own `DynamicJaxprTrace`. Another fresh
  interpreter checks the check: plain JAX changes nothing in the snapshot, and
  each kind of patch is reported by name.
- Threads: concurrent `handle` calls, each thread on its own function and
  handlers, give what a hand-written version gives.
- Caches: a changed handler, dtype, shape or static argument never reuses a
  stale program; a failed call leaves the next one clean; caches keep neither
  dead functions' closures nor every handler configuration alive.
"""

from __future__ import annotations

import concurrent.futures
import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, no_leak_checks, run_fresh
from jax import lax

import effects as fx

#
# JAX stays untouched
#

# Shared by both scripts below: what a snapshot of JAX holds, how two compare,
# and a warm-up that uses every JAX feature the handled functions use, so that
# rules JAX registers lazily on first use are there before the first snapshot.
_SNAPSHOT = r'''
import sys
import warnings

warnings.filterwarnings("error")
# As in pyproject.toml: equinox reads deprecated `jax.core` names.
warnings.filterwarnings(
    "ignore", r"jax\.core\..* is deprecated", DeprecationWarning, "equinox"
)

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from jax._src import config as jax_config
from jax._src import core
from jax._src import effects as jax_effects
from jax._src import pjit
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe

# No `jax_check_tracer_leaks` here: what this checks is JAX's state, and the
# checker reports a false leak for effects kept through partial evaluation (see
# the `jax_leak_check_false_report` fixture in conftest.py).


def _tables():
    found = {
        "partial_eval.custom_staging_rules": pe.custom_staging_rules,
        "partial_eval.partial_eval_jaxpr_custom_rules": (
            pe.partial_eval_jaxpr_custom_rules
        ),
        "partial_eval.custom_partial_eval_rules": pe.custom_partial_eval_rules,
        "partial_eval.dce_rules": pe.dce_rules,
        "ad.primitive_jvps": ad.primitive_jvps,
        "ad.primitive_transposes": ad.primitive_transposes,
        "batching.fancy_primitive_batchers": batching.fancy_primitive_batchers,
        "mlir._lowerings": mlir._lowerings,
    }
    for module, name in [
        (pe, "forwarding_rules"),
        (pe, "const_fold_rules"),
        (ad, "primitive_linearizations"),
        (ad, "fancy_transposes"),
        (ad, "reducing_transposes"),
        # Before jax 0.5 plain batchers had a table of their own; since, they
        # are wrapped into `fancy_primitive_batchers`.
        (batching, "primitive_batchers"),
    ]:
        table = getattr(module, name, None)
        if isinstance(table, dict):
            found[f"{module.__name__.rsplit('.', 1)[-1]}.{name}"] = table
    for platform, table in mlir._platform_specific_lowerings.items():
        found[f"mlir._platform_specific_lowerings[{platform!r}]"] = table
    return found


def _ours(key):
    return str(getattr(key, "name", "")).startswith("effects")


def _classes(primitives):
    classes = [
        core.Trace, core.EvalTrace, core.Tracer, core.Primitive,
        pe.DynamicJaxprTrace, pe.DynamicJaxprTracer, pe.JaxprTrace,
        pe.JaxprTracer, ad.JVPTrace, ad.JVPTracer,
        batching.BatchTrace, batching.BatchTracer,
    ]
    for name in ["LinearizeTrace", "LinearizeTracer"]:
        if hasattr(ad, name):
            classes.append(getattr(ad, name))
    # The classes of JAX's primitives (`jit_p`'s, `scan_p`'s, ...): their
    # `bind` and `bind_with_trace` are what a patch would replace.
    classes += sorted({type(p) for p in primitives}, key=lambda c: c.__qualname__)
    return {f"{c.__module__}.{c.__qualname__}": c for c in dict.fromkeys(classes)}


_MODULES = {
    "jax": jax,
    "jax._src.core": core,
    "jax._src.pjit": pjit,
    "jax._src.interpreters.partial_eval": pe,
    "jax._src.interpreters.batching": batching,
    "jax._src.interpreters.ad": ad,
    "jax._src.interpreters.mlir": mlir,
}


def snapshot():
    """Everything a patch of JAX would change, by identity (the snapshot holds
    the objects themselves, so no id is reused while it lives)."""
    tables = {name: dict(table) for name, table in _tables().items()}
    primitives = {
        k for t in tables.values() for k in t if isinstance(k, core.Primitive)
    }
    primitives = {p for p in primitives if not _ours(p)}
    return {
        "tables": tables,
        "primitive attributes": {
            f"{p.name} ({type(p).__name__} at {id(p):#x})": dict(vars(p))
            for p in primitives
        },
        "class attributes": {
            name: dict(vars(cls)) for name, cls in _classes(primitives).items()
        },
        "module functions": {
            name: {k: v for k, v in vars(m).items() if callable(v)}
            for name, m in _MODULES.items()
        },
        "effect-type sets": {
            name: set(s._effect_types)
            for name, s in vars(jax_effects).items()
            if isinstance(s, jax_effects.EffectTypeSet)
        },
        "config options": dict(jax_config.config_states),
    }


def _label(key):
    if isinstance(key, str):
        return key
    return getattr(key, "name", None) or repr(key)


def diff(before, after):
    """What changed, one line each, leaving out what `effects` may add."""
    lines = []
    for group in ["tables", "primitive attributes", "class attributes",
                  "module functions"]:
        for where, old in before[group].items():
            new = after[group].get(where)
            if new is None:
                lines.append(f"{group}: {where} is gone")
                continue
            for key in old.keys() - new.keys():
                lines.append(f"{group}: {where}: {_label(key)} removed")
            for key in new.keys() - old.keys():
                if group == "tables" and _ours(key):
                    continue  # rules for our own primitive: the extension point
                lines.append(f"{group}: {where}: {_label(key)} added: {new[key]!r}")
            for key in old.keys() & new.keys():
                if old[key] is not new[key]:
                    lines.append(
                        f"{group}: {where}: {_label(key)} replaced: "
                        f"{old[key]!r} -> {new[key]!r}"
                    )
    for where, old in before["effect-type sets"].items():
        new = after["effect-type sets"].get(where, set())
        for t in old - new:
            lines.append(f"effect-type sets: {where}: {t!r} removed")
        for t in new - old:
            if not t.__module__.startswith("effects"):
                lines.append(f"effect-type sets: {where}: {t!r} added")
    old, new = before["config options"], after["config options"]
    # New options may be added (ours); existing ones stay the same objects.
    for key in old.keys() - new.keys():
        lines.append(f"config options: {key} removed")
    for key in old.keys() & new.keys():
        if old[key] is not new[key]:
            lines.append(f"config options: {key} replaced")
    return lines


problems = []


def plain(tree):
    # `found` is an `fx.Found`, a dict whose pytree structure keeps its order.
    if isinstance(tree, dict):
        return {k: plain(v) for k, v in tree.items()}
    if type(tree) in (tuple, list):
        return type(tree)(plain(v) for v in tree)
    return tree


def check(what, run, expected):
    """Records in `problems` (rather than raising, so that the snapshots are
    still compared) if `run()` raises or differs from `expected`."""
    try:
        actual = run()
        a_leaves, a_tree = jax.tree.flatten(plain(actual))
        e_leaves, e_tree = jax.tree.flatten(plain(expected))
        assert a_tree == e_tree, f"structure {a_tree} != {e_tree}"
        for a, e in zip(a_leaves, e_leaves):
            a, e = np.asarray(a), np.asarray(e)
            assert a.shape == e.shape, f"shape {a.shape} != {e.shape}"
            assert a.dtype == e.dtype, f"dtype {a.dtype} != {e.dtype}"
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
    except Exception as e:
        problems.append(f"{what}: {type(e).__name__}: {e}")


#
# Warm-up: plain JAX, every feature used below
#

import equinox  # noqa: F401,E402  a dependency of effects, not part of it: its
import jaxtyping  # noqa: F401,E402  own primitives are registered before the snapshot

W = jnp.arange(12.0, dtype=jnp.float32).reshape(3, 4) / 10
MESH = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("i",))


@jax.custom_jvp
def plain_cj(x):
    return jnp.sin(x)


plain_cj.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))


@jax.custom_vjp
def plain_cv(x):
    return x * 3.0


plain_cv.defvjp(lambda x: (x * 3.0, None), lambda _, g: (g * 3.0,))


def warm(x):
    y = jax.jit(lambda v: jnp.tanh(v @ W))(x)
    c, ys = lax.scan(lambda c, v: (c * 0.5 + v, c * 2), jnp.float32(0), y)
    z = lax.cond(c > 0, jnp.sin, jnp.cos, ys)
    z = jax.checkpoint(lambda v: v * 2.0)(z)
    z = plain_cj(z) + plain_cv(z)
    # (reverse-mode differentiation does not go through a while_loop)
    _, w = lax.while_loop(
        lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 0.5), (0, lax.stop_gradient(z))
    )
    s = jax.shard_map(
        lambda v: v + 1.0, mesh=MESH, in_specs=P("i"), out_specs=P("i")
    )(jnp.tile(z + w, 8))
    return jnp.sum(z**2) + jnp.sum(s)


X = jnp.array([0.3, -1.2, 2.0], jnp.float32)
XB = jnp.stack([X, -X, 0.5 * X + 1.0])
jax.jit(warm)(X)
jax.grad(warm)(X)  # eagerly: JVP and partial evaluation op by op
jax.jit(jax.grad(warm))(X)
jax.jit(jax.vmap(jax.grad(warm)))(XB)
jax.jvp(plain_cj, (X,), (X,))  # (forward mode does not go through a custom_vjp)
jax.linearize(lambda v: jax.jit(jnp.sin)(plain_cj(v)), X)
jax.eval_shape(warm, X)
jax.make_jaxpr(jax.grad(warm))(X)
jax.grad(lambda x: lax.scan(lambda c, v: (c + warm(v), None), 0.0, x)[0])(XB)
'''


# Imports `effects`, runs handled functions under every transformation, checks
# each against a hand-written version, and compares snapshots of JAX taken
# before the import and after.
_EFFECTS_SCRIPT = (
    _SNAPSHOT
    + r'''
before = snapshot()

import effects as fx  # noqa: E402

# The classes of the traces handled code ran on: since the last `clear()`, and
# all along.
trace_types = []
all_trace_types = set()


def record_trace_type():
    # Called in the body of handled functions: runs whenever the body does.
    trace_types.append(type(core.trace_ctx.trace))
    all_trace_types.add(type(core.trace_ctx.trace))


@jax.jit
def inner(x):
    return fx.tag(jnp.tanh(x @ W), "inner")


def f(x):
    record_trace_type()
    h = inner(x)

    def body(c, v):
        record_trace_type()
        c = fx.tag(c * 0.5 + v, "carry")
        return c, c * 2

    c, ys = lax.scan(body, jnp.float32(0), h)
    z = lax.cond(
        c > 0,
        lambda v: fx.tag(jnp.sin(v), "branch"),
        lambda v: fx.tag(jnp.cos(v), "branch"),
        ys,
    )
    z = fx.perturb(z, "p")
    return jnp.sum(z**2)


def f_ref(x, h=None, branch_fn=None, delta=None):
    """`f` by hand: its output and what `Tag()` finds."""
    if h is None:
        h = jnp.tanh(x @ W)

    def body(c, v):
        c = c * 0.5 + v
        return c, (c * 2, c)

    c, (ys, carries) = lax.scan(body, jnp.float32(0), h)
    z = lax.cond(c > 0, jnp.sin, jnp.cos, ys)
    if branch_fn is not None:
        z = branch_fn(z)
    found = {"intermediates": {"inner": (h,), "carry": (carries,), "branch": (z,)}}
    if delta is not None:
        z = z + delta
    return jnp.sum(z**2), found


def loss_ref(x):
    return f_ref(x)[0]


def tagged(x):
    return fx.handle(f, fx.Tag())(x)


# Both branches of the cond, eagerly and under jit. Under jit, through a
# function never handled before, so that `f`'s body runs while jit traces.
for x in [X, -X]:
    expected = f_ref(x)
    check("eager", lambda: fx.handle(f, fx.Tag())(x), expected)
    trace_types.clear()
    fresh = lambda v: f(v)  # noqa: E731
    check("jit", lambda: jax.jit(lambda v: fx.handle(fresh, fx.Tag())(v))(x), expected)
    if not trace_types:
        problems.append("trace class: under jax.jit, the handled function never ran")
    wrong = {t for t in trace_types if t is not pe.DynamicJaxprTrace}
    if wrong:
        problems.append(
            f"trace class: under jax.jit, handled code ran on a trace of class "
            f"{sorted(map(str, wrong))}, not exactly JAX's {pe.DynamicJaxprTrace}"
        )

check("grad", lambda: jax.grad(lambda v: tagged(v)[0])(X), jax.grad(loss_ref)(X))
check(
    "jit of grad",
    lambda: jax.jit(jax.grad(tagged, has_aux=True))(X),
    jax.grad(f_ref, has_aux=True)(X),
)
check(
    "handle of grad",
    lambda: fx.handle(jax.grad(f), fx.Tag())(X)[0],
    jax.grad(loss_ref)(X),
)
check("vmap", lambda: jax.vmap(tagged)(XB), jax.vmap(f_ref)(XB))
# (`f`'s cond has a predicate the vmap batches: handling its tags outside the
# vmap is refused, so the function handled outside a vmap has no cond.)
check(
    "handle of vmap",
    lambda: fx.handle(jax.vmap(lambda x: jnp.sum(inner(x) ** 2)), fx.Tag())(XB),
    (
        jax.vmap(lambda x: jnp.sum(jnp.tanh(x @ W) ** 2))(XB),
        {"intermediates": {"inner": (jnp.tanh(XB @ W),)}},
    ),
)
check(
    "inside lax.scan",
    lambda: lax.scan(lambda c, v: (c, tagged(v)), 0.0, XB),
    lax.scan(lambda c, v: (c, f_ref(v)), 0.0, XB),
)
z = f_ref(X)[1]["intermediates"]["branch"][0]
check(
    "intermediate_grads",
    lambda: fx.intermediate_grads(f)(X),
    (f_ref(X)[0], {"p": (2 * z,)}),
)

# The other handlers, eagerly and under jit.
H_NEW = jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32)
DELTA = jnp.full((4,), 0.25, jnp.float32)
for wrap in [lambda fn: fn, jax.jit]:
    check(
        "Substitute",
        lambda: wrap(fx.handle(f, fx.Substitute({"inner": H_NEW})))(X),
        (f_ref(X, h=H_NEW)[0], {}),
    )
    check(
        "Intervene",
        lambda: wrap(fx.handle(f, fx.Intervene({"branch": lambda v: v * 0.5})))(X),
        (f_ref(X, branch_fn=lambda v: v * 0.5)[0], {}),
    )
    check(
        "Perturb(deltas)",
        lambda: wrap(fx.handle(f, fx.Perturb({"p": (DELTA,)})))(X),
        (f_ref(X, delta=DELTA)[0], {}),
    )


# checkpoint, custom_jvp, custom_vjp, while_loop and shard_map.
@jax.custom_jvp
def cj(x):
    return fx.tag(jnp.sin(x), "cj")


cj.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))


@jax.custom_vjp
def cv(x):
    return fx.tag(x * 3.0, "cv")


cv.defvjp(lambda x: (x * 3.0, None), lambda _, g: (g * 3.0,))


def g(x):
    record_trace_type()
    a = jax.checkpoint(lambda v: fx.tag(v * 2.0, "ckpt"))(x)
    b = cj(a) + cv(a)

    def body(s):
        return s[0] + 1, fx.tag(s[1] * 0.5, "loop")

    # (reverse-mode differentiation does not go through a while_loop)
    _, w = lax.while_loop(lambda s: s[0] < 3, body, (0, lax.stop_gradient(b)))
    s = jax.shard_map(
        lambda v: fx.tag(v + 1.0, "shard"), mesh=MESH, in_specs=P("i"),
        out_specs=P("i"),
    )(b + w)
    return jnp.sum(s**2)


def g_ref(x):
    a = x * 2.0
    b = jnp.sin(a) + a * 3.0
    w = lax.stop_gradient(b) * 0.125
    s = b + w + 1.0
    found = {
        "ckpt": (a,), "cj": (jnp.sin(a),), "cv": (a * 3.0,),
        "shard": (s.reshape(8, -1),), "loop": w,
    }
    return jnp.sum(s**2), {"intermediates": found}


G_HANDLERS = (
    fx.Tag(names=["ckpt", "cj", "cv", "shard"]),
    fx.Tag(names="loop", mode="last"),
)
X8 = jnp.arange(8.0, dtype=jnp.float32) / 8
check("g eager", lambda: fx.handle(g, *G_HANDLERS)(X8), g_ref(X8))
check("g jit", lambda: jax.jit(fx.handle(g, *G_HANDLERS))(X8), g_ref(X8))
check(
    "g grad",
    lambda: jax.grad(lambda v: fx.handle(g, *G_HANDLERS)(v), has_aux=True)(X8),
    jax.grad(g_ref, has_aux=True)(X8),
)

foreign = [t for t in all_trace_types if not t.__module__.startswith("jax.")]
if foreign:
    problems.append(
        f"trace class: handled code ran on traces of classes not JAX's: {foreign}"
    )
problems += diff(before, snapshot())
if problems:
    print(
        "effects changed JAX (or ran on a trace that is not JAX's own):",
        *dict.fromkeys(problems), sep="\n  ", file=sys.stderr,
    )
    sys.exit(1)
'''
)


# Checks the snapshot itself: plain JAX after the warm-up changes nothing it
# sees, and each kind of patch `effects` must not make is seen and named.
_DETECTOR_SCRIPT = (
    _SNAPSHOT
    + r"""
before = snapshot()
# The warm-up again, and what JAX does for a new function: nothing new.
jax.jit(warm)(X + 1.0)
jax.grad(warm)(X + 1.0)
jax.jit(lambda x: jax.vmap(jax.grad(warm))(x))(XB)
lost = diff(before, snapshot())
assert not lost, "plain JAX changed the snapshot:\n" + "\n".join(lost)

# One patch of each kind.
original = pe.custom_staging_rules[pjit.jit_p]
pe.custom_staging_rules[pjit.jit_p] = lambda *a, **k: original(*a, **k)
init = pe.JaxprTrace.__init__
pe.JaxprTrace.__init__ = lambda self, *a, **k: init(self, *a, **k)
ad.primitive_jvps[lax.sin_p] = lambda *a, **k: None


class ForeignEffect(jax_effects.Effect):
    pass


ForeignEffect.__module__ = "someone_else"
jax_effects.control_flow_allowed_effects.add_type(ForeignEffect)
core.eval_jaxpr = lambda *a, **k: None
found = diff(before, snapshot())
print("\n".join(found))
expected = [
    "tables: partial_eval.custom_staging_rules: jit replaced",
    "tables: ad.primitive_jvps: sin replaced",
    "class attributes: jax._src.interpreters.partial_eval.JaxprTrace: "
    "__init__ replaced",
    "effect-type sets: control_flow_allowed_effects:",
    "module functions: jax._src.core: eval_jaxpr replaced",
]
missing = [e for e in expected if not any(line.startswith(e) for line in found)]
assert not missing, f"not reported: {missing}"
assert len(found) == len(expected), "reported more than was patched"
"""
)


@pytest.mark.slow
def test_the_snapshot_sees_patches_and_nothing_else():
    result = run_fresh(_DETECTOR_SCRIPT)
    if result.returncode != 0:
        pytest.fail(result.stdout + result.stderr, pytrace=False)


@pytest.mark.slow
def test_jax_stays_untouched():
    result = run_fresh(_EFFECTS_SCRIPT)
    if result.returncode != 0:
        pytest.fail(result.stderr, pytrace=False)


#
# Threads
#

_THREADS = 8
_ROUNDS = 12


def _f_append(x):
    a = fx.tag(jnp.sin(x), "t0_a")
    b = fx.tag(a * 2.0, "t0_b")
    return jnp.sum(b)


def _ref_append(x, k):
    a = jnp.sin(x)
    return jnp.sum(a * 2.0), {"intermediates": {"t0_a": (a,), "t0_b": (a * 2.0,)}}


def _f_sum_in_scan(xs):
    def body(c, x):
        return fx.tag(c + x, "t1_c"), None

    c, _ = lax.scan(body, jnp.zeros(xs.shape[1:], xs.dtype), xs)
    return c


def _ref_sum_in_scan(xs, k):
    carries = jnp.cumsum(xs, axis=0)
    return carries[-1], {"intermediates": {"t1_c": jnp.sum(carries, axis=0)}}


def _f_last(x):
    for i in range(3):
        x = fx.tag(x * 0.5 + i, "t2")
    return jnp.mean(x)


def _ref_last(x, k):
    for i in range(3):
        x = x * 0.5 + i
    return jnp.mean(x), {"intermediates": {"t2": x}}


def _f_substitute(x):
    h = fx.tag(jnp.cos(x), "t3_h")
    return h * x


def _ref_substitute(x, k):
    return jnp.full_like(x, k) * x, {}


def _f_perturb(x):
    p = fx.perturb(x**2, "t4_p")
    return jnp.sum(jnp.tanh(p))


def _ref_perturb(x, k):
    return jnp.sum(jnp.tanh(x**2 + k)), {}


def _f_zeros_and_aux(x):
    p = fx.perturb(x @ x, "t5_p")
    q = fx.tag(p.T, "t5_q", collection="aux5")
    return jnp.sum(q)


def _ref_zeros_and_aux(x, k):
    p = x @ x
    return jnp.sum(p), {
        "perturbations": {"t5_p": (jnp.zeros_like(p),)},
        "aux5": {"t5_q": (p.T,)},
    }


def _f_strict_ints(x):
    a = fx.tag(x + 1, "keep_a")
    b = fx.tag(x * 2, "drop_b")
    return a * b


def _ref_strict_ints(x, k):
    return (x + 1) * (x * 2), {"intermediates": {"keep_a": x + 1}}


def _f_intervene(x):
    return fx.tag(jnp.exp(-x), "t7") * 2.0


def _ref_intervene(x, k):
    h = jnp.exp(-x)[::-1]
    return h * 2.0, {"intermediates": {"t7": (h,)}}


def _reverse(v):
    return v[::-1]


def _floats(shape, i, dtype=np.float32):
    n = int(np.prod(shape))
    return jnp.asarray(np.sin(np.arange(n) * 0.37 + i).reshape(shape).astype(dtype))


# One per thread: the handled function, its handlers given the round's scalar
# `k`, the round's input, and the hand-written reference `ref(x, k)`.
_THREAD_CASES = [
    (_f_append, lambda k: (fx.Tag(),), lambda i: _floats((3,), i), _ref_append),
    (
        _f_sum_in_scan,
        lambda k: (fx.Tag(mode="sum"),),
        lambda i: _floats((5, 2), i),
        _ref_sum_in_scan,
    ),
    (
        _f_last,
        lambda k: (fx.Tag(mode="last"),),
        lambda i: _floats((2, 3), i),
        _ref_last,
    ),
    (
        _f_substitute,
        lambda k: (fx.Substitute({"t3_h": jnp.full((4,), k)}),),
        lambda i: _floats((4,), i),
        _ref_substitute,
    ),
    (
        _f_perturb,
        lambda k: (fx.Perturb({"t4_p": (jnp.full((6,), k),)}),),
        lambda i: _floats((6,), i),
        _ref_perturb,
    ),
    (
        _f_zeros_and_aux,
        lambda k: (fx.Perturb(), fx.Tag("aux5")),
        lambda i: _floats((2, 2), i),
        _ref_zeros_and_aux,
    ),
    (
        _f_strict_ints,
        lambda k: (fx.Tag(names="keep*", mode="strict"),),
        lambda i: jnp.arange(16, dtype=jnp.int32).reshape(4, 4) - i,
        _ref_strict_ints,
    ),
    (
        _f_intervene,
        lambda k: (fx.Intervene({"t7": _reverse}), fx.Tag()),
        lambda i: _floats((7,), i),
        _ref_intervene,
    ),
]


def _run_case(case, start: threading.Barrier):
    fn, handlers, make_x, ref = case

    @jax.jit
    def jitted(x, k):  # handlers built under jit, from a traced `k`
        return fx.handle(fn, *handlers(k))(x)

    start.wait()
    for i in range(_ROUNDS):
        x, k = make_x(i), jnp.float32(0.1 * i)
        expected = ref(x, k)
        assert_trees_close(fx.handle(fn, *handlers(k))(x), expected)
        assert_trees_close(jitted(x, k), expected)
        # `jax.jit` of the handled function itself (one wrapper per handlers).
        assert_trees_close(jax.jit(fx.handle(fn, *handlers(k)))(x), expected)


def _in_threads(run, cases) -> None:
    """`run(case, start)` for each case, each in a thread of its own, started
    together, every thread's exception re-raised; then no tracer made while
    they ran is alive.

    JAX's own leak check is off while they run: it collects garbage
    (`gc.collect()`) and reports every tracer still referring to the trace it
    ends, but a `gc.collect()` while another thread collects returns at once,
    collecting nothing, so a trace kept alive by a reference cycle only (freed
    by the next collection) is reported as leaked, once in about 20 runs here
    (tests/test_jax_facts.py::test_gc_collect_while_another_thread_collects_
    collects_nothing). The same check, made once all threads are done, does
    not race."""
    before = {id(x) for x in gc.get_objects() if isinstance(x, jax.core.Tracer)}
    start = threading.Barrier(len(cases), timeout=120)
    with no_leak_checks(), concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        futures = [pool.submit(run, case, start) for case in cases]
        for future in futures:
            future.result()  # re-raises what failed in the thread
    gc.collect()
    alive = [
        x
        for x in gc.get_objects()
        if isinstance(x, jax.core.Tracer) and id(x) not in before
    ]
    assert not alive, alive[:4]


def test_threads_each_on_its_own_function():
    assert len(_THREAD_CASES) == _THREADS
    _in_threads(_run_case, _THREAD_CASES)


def _eight_tags(x):
    for j in range(_THREADS):
        x = fx.tag(jnp.sin(x) + j, f"s{j}")
    return jnp.sum(x)


def _eight_tags_values(x):
    values = []
    for j in range(_THREADS):
        x = jnp.sin(x) + j
        values.append(x)
    return jnp.sum(x), values


def _run_shared(j: int, start: threading.Barrier):
    # Thread `j` collects tag `s{j}`, and replaces tag `s{j + 1}` (mod 8).
    replaced = (j + 1) % _THREADS

    @jax.jit
    def substituted(x, new):
        return fx.handle(_eight_tags, fx.Substitute({f"s{replaced}": new}))(x)

    start.wait()
    for i in range(_ROUNDS):
        x = _floats((j + 1,), i)
        out, values = _eight_tags_values(x)
        collected = (out, {"intermediates": {f"s{j}": (values[j],)}})
        assert_trees_close(fx.handle(_eight_tags, fx.Tag(names=f"s{j}"))(x), collected)
        assert_trees_close(
            jax.jit(fx.handle(_eight_tags, fx.Tag(names=f"s{j}")))(x), collected
        )
        new = jnp.asarray(np.full(j + 1, 0.1 * i, np.float32))
        y = new  # by hand: from the replaced tag on, the values start from `new`
        for m in range(replaced + 1, _THREADS):
            y = jnp.sin(y) + m
        expected = (jnp.sum(y), {})
        handlers = fx.Substitute({f"s{replaced}": new})
        assert_trees_close(fx.handle(_eight_tags, handlers)(x), expected)
        assert_trees_close(substituted(x, new), expected)


def test_threads_on_one_function_with_different_handlers():
    _in_threads(_run_shared, list(range(_THREADS)))


#
# Caches
#


def _powered(x, power, name):
    # `power` (an int) and `name` (a string) are static arguments.
    h = fx.tag(x**power, name)
    fx.tag(h + 1, "other")
    return jnp.sum(h)


def _powered_values(x, power, name):
    h = x**power
    return jnp.sum(h), {name: h, "other": h + 1}


def _powered_expected(handler, x, power, name):
    """What `handle(_powered, handler)` returns, by hand."""
    out, values = _powered_values(x, power, name)
    if isinstance(handler, fx.Substitute):
        (value,) = handler.values.values()
        return jnp.sum(value), {}
    if handler.collection != "intermediates":
        return out, {handler.collection: {}}
    if handler.names is not None:
        values = {handler.names: values[handler.names]}
    if handler.mode == "append":
        values = {n: (v,) for n, v in values.items()}
    return out, {"intermediates": values}


_X0 = jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float32)


def _variants():
    """`(handler, x, power, name)`: a base call, and calls that each differ from
    it in one thing only."""
    base = (fx.Tag(), _X0, 2, "a")
    handlers = [
        fx.Tag(names="other"),
        fx.Tag(mode="sum"),
        fx.Tag(mode="last", names="a"),
        fx.Tag("elsewhere"),
        fx.Substitute({"a": jnp.full((3,), 2.0, jnp.float32)}),
        fx.Substitute({"a": jnp.full((3,), 3.0, jnp.float32)}),  # new values only
    ]
    inputs = [
        jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32).reshape(2, 2),  # shape
        jnp.arange(3, dtype=jnp.int32),  # dtype
        jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float16),  # dtype
        jnp.linspace(0.5, 1.5, 3, dtype=jnp.float32),  # values only
    ]
    return [
        base,
        *[(h, *base[1:]) for h in handlers],
        *[(base[0], x, *base[2:]) for x in inputs],
        (*base[:2], 3, "a"),  # a static argument
        (*base[:3], "b"),  # another static argument
    ]


@pytest.mark.slow
def test_no_stale_program_for_changed_handlers_dtype_shape_or_static_arguments():
    variants = _variants()
    base = variants[0]
    # Each variant right after the base, and the base right after each variant,
    # in both orders.
    calls = [c for v in variants[1:] for c in (base, v)]
    for handler, x, power, name in calls + calls[::-1]:
        expected = _powered_expected(handler, x, power, name)
        handled = fx.handle(_powered, handler)
        assert_trees_close(handled(x, power, name), expected)
        jitted = jax.jit(handled, static_argnums=(1, 2))
        assert_trees_close(jitted(x, power, name), expected)
        _assert_vmapped(handled, handler, x, power, name)


def _assert_vmapped(handled, handler, x, power, name):
    # Under vmap (outside jit), `handle` traces `fn` and caches the trace.
    xs = jnp.stack([x, x * 2])
    assert_trees_close(
        jax.vmap(lambda v: handled(v, power, name))(xs),
        jax.vmap(lambda v: _powered_expected(handler, v, power, name))(xs),
    )


def test_one_handled_function_with_changing_arguments():
    handled = fx.handle(_powered, fx.Tag())
    jitted = jax.jit(handled, static_argnums=(1, 2))
    variants = _variants()
    base = variants[0]
    calls = [v for v in variants if v[0] is base[0]]  # all but the handler varied
    calls = [c for v in calls[1:] for c in (base, v)]
    for handler, x, power, name in calls + calls[::-1]:
        expected = _powered_expected(handler, x, power, name)
        assert_trees_close(handled(x, power, name), expected)
        assert_trees_close(jitted(x, power, name), expected)
        # Keyword arguments are arguments too.
        assert_trees_close(handled(x, power=power, name=name), expected)
        _assert_vmapped(handled, handler, x, power, name)


#
# After an error
#


def _flaky(where: str):
    """A function whose first call raises a ValueError, `where` in its body."""
    calls = []

    def maybe_fail():
        calls.append(None)
        if len(calls) == 1:
            raise ValueError("the first call fails")

    def fn(x):
        if where == "body":
            maybe_fail()
        h = fx.tag(jnp.sin(x), "h")

        def step(c, v):
            if where == "scan":
                maybe_fail()
            return fx.tag(c + v, "c"), None

        c, _ = lax.scan(step, jnp.float32(0), h)

        @jax.jit
        def inner(v):
            if where == "inner jit":
                maybe_fail()
            return fx.tag(v * 2.0, "inner")

        return inner(c)

    return fn


def _flaky_expected(x):
    h = jnp.sin(x)
    return 2.0 * jnp.sum(h), {
        "intermediates": {
            "h": (h,),
            "c": (jnp.cumsum(h),),
            "inner": (2.0 * jnp.sum(h),),
        }
    }


def _tagged(x):
    return jnp.sum(fx.tag(jnp.cos(x), "t"))


def _assert_clean():
    """What a failed call must not disturb: other handled calls, and unhandled
    tagged functions (effect-free, hence no site effect left switched on)."""
    x = jnp.array([0.5, 1.5], jnp.float32)
    expected = (jnp.sum(jnp.cos(x)), {"intermediates": {"t": (jnp.cos(x),)}})
    assert_trees_close(fx.handle(_tagged, fx.Tag())(x), expected)
    assert_trees_close(jax.jit(fx.handle(_tagged, fx.Tag()))(x), expected)
    assert jax.make_jaxpr(_tagged)(x).effects == set()
    np.testing.assert_allclose(jax.jit(_tagged)(x), expected[0], rtol=1e-6)


class _Marker:
    pass


@pytest.mark.parametrize("where", ["body", "scan", "inner jit"])
@pytest.mark.parametrize("transform", ["eager", "jit"])
def test_the_call_after_a_raising_function_is_clean(where, transform):
    fn = _flaky(where)
    wrap = jax.jit if transform == "jit" else (lambda g: g)
    x = jnp.array([0.3, -1.2, 2.0], jnp.float32)
    marker = _Marker()
    every_name = lambda name, marker=marker: True  # noqa: E731
    with pytest.raises(ValueError, match="the first call fails"):
        wrap(fx.handle(fn, fx.Tag(names=every_name)))(x)
    _assert_clean()
    assert_trees_close(wrap(fx.handle(fn, fx.Tag()))(x), _flaky_expected(x))
    _assert_clean()
    # Nothing holds on to the failed call's handlers. (Not its trace's arrays:
    # JAX 0.10 itself keeps an array a failed trace closed over alive.)
    collected = weakref.ref(marker)
    del fn, marker, every_name
    gc.collect()
    assert collected() is None, "the failed call's handlers are kept alive"


@pytest.mark.parametrize("transform", ["eager", "jit"])
def test_the_call_after_a_handler_error_is_clean(transform):
    wrap = jax.jit if transform == "jit" else (lambda g: g)
    fn = _flaky("nowhere")  # never fails
    x = jnp.array([0.3, -1.2, 2.0], jnp.float32)
    with pytest.raises(ValueError, match="'h'"):
        wrap(fx.handle(fn, fx.Substitute({"h": jnp.ones(4)})))(x)  # wrong shape
    _assert_clean()
    new = jnp.array([1.0, 2.0, 3.0], jnp.float32)
    assert_trees_close(
        wrap(fx.handle(fn, fx.Substitute({"h": new})))(x),
        (2.0 * jnp.sum(new), {}),
    )
    assert_trees_close(wrap(fx.handle(fn, fx.Tag()))(x), _flaky_expected(x))
    _assert_clean()


#
# What caches keep alive
#

_SHAPES = 500


def _handle_many_shapes() -> weakref.ref:
    """Handles a function closing over a large array at `_SHAPES` input shapes,
    under every path `handle` caches on; returns a weak reference to the array."""
    big = jnp.arange(1_000_000, dtype=jnp.float32)

    def fn(x):
        return jnp.sum(fx.tag(x * 2.0, "h")) + big[0]

    def loss(x):
        return fx.handle(fn, fx.Tag())(x)[0]

    for n in range(1, _SHAPES + 1):
        x = np.ones(n, np.float32)
        if n <= 5:  # each compiles: a few
            out, found = fx.handle(fn, fx.Tag())(x)
            np.testing.assert_allclose(found["intermediates"]["h"][0], 2.0 * x)
            jax.jit(fx.handle(fn, fx.Tag()))(x)
            jax.grad(loss)(x)
        elif n % 2:  # traced only
            jax.eval_shape(fx.handle(fn, fx.Tag()), x)
        else:
            jax.make_jaxpr(jax.grad(loss))(x)
    return weakref.ref(big)


@pytest.mark.slow
def test_caches_keep_no_dead_function_alive():
    ref = _handle_many_shapes()
    gc.collect()
    assert ref() is None, "a cache keeps a deleted function's closure alive"


def test_handler_configurations_are_not_all_kept_alive():
    # Each handler holds a predicate closing over an array of its own; handling
    # one function with many of them keeps a bounded number alive.
    def fn(x):
        return fx.tag(jnp.sin(x), "h")

    x = np.ones(3, np.float32)
    refs = []
    for i in range(400):
        data = jnp.asarray(np.full(3, i, np.float32))  # (`jnp.full` compiles)
        refs.append(weakref.ref(data))
        only_h = lambda name, data=data: name == "h"  # noqa: E731
        _, found = jax.eval_shape(fx.handle(fn, fx.Tag(names=only_h)), x)
        assert found["intermediates"]["h"][0].shape == (3,)
        del data, only_h
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive < len(refs) // 2, f"{alive} of {len(refs)} handlers kept alive"
