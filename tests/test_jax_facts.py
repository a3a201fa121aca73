"""What JAX does, with JAX alone, that a workaround in `effects` answers. Each
test names the code that cites it; when one fails, JAX has changed and that
code may be simplified or removed."""

import functools
import gc
import signal
import sys
import weakref

import jax
import jax.core
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import devices, leak_checks, run_fresh
from jax.interpreters import batching


def test_custom_jvp_rule_is_traced_once_whatever_the_trace_context():
    # `effects/_rewrite.py`, "Custom rules, traced once per handling state": a
    # custom_jvp equation traces its rule the first time a jvp needs it, and
    # every later jvp of the same jaxpr is served that trace, even where the
    # trace context (here a user context the rule reads) has changed since.
    scale = jax.make_user_context(1.0)
    traced_with = []

    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def _(primals, tangents):
        traced_with.append(scale.value)
        return f(primals[0]), scale.value * tangents[0]

    def jvp_of(fun):
        return jax.make_jaxpr(lambda t: jax.jvp(fun, (0.0,), (t,))[1])(1.0)

    # (As JAX runs by default: the leak checker collects garbage at each trace.)
    with leak_checks(False):
        fun = jax.extend.core.jaxpr_as_fun(jax.make_jaxpr(f)(0.0))
        for value in (2.0, 3.0):
            with scale(value):
                jvp = jvp_of(fun)
        assert traced_with == [2.0]
        assert jax.core.eval_jaxpr(jvp.jaxpr, jvp.consts, 1.0) == [2.0]  # not 3.0

        # `jax.jit`'s own cache, by contrast, keys on the context: traced once
        # per context.
        traced_with.clear()
        g = jax.jit(f)
        for value in (2.0, 3.0, 2.0):
            with scale(value):
                jvp_of(g)
        assert traced_with == [2.0, 3.0]


def test_jit_params_hold_one_entry_per_input_and_per_output():
    # `effects/_jaxpr.py`, `_jit_template`: JAX has no function that builds a
    # `jit` equation's params for a given jaxpr (its own rules that bind `jit`
    # write them out, or edit those of an equation they were given), and the
    # values depend on the release (`ctx_mesh` is chosen by private code that
    # differs between 0.8 and 0.10; `inline` is a `jax.Inline` from 0.12). So
    # the params come from a traced `jax.jit`, each tuple stretched to the
    # number of inputs or outputs, which holds where the entries are alike.
    closed = jax.make_jaxpr(jax.jit(lambda x, y, z: (x + y, z)))(1.0, 2.0, 3.0)
    (eqn,) = closed.jaxpr.eqns
    tuples = {k: v for k, v in eqn.params.items() if type(v) is tuple}
    per_input = {k for k, v in tuples.items() if len(v) == 3}
    per_output = {k for k, v in tuples.items() if len(v) == 2}
    assert {"in_shardings", "in_layouts", "donated_invars"} <= per_input
    assert {"out_shardings", "out_layouts"} <= per_output
    # Every other tuple is empty (`compiler_options_kvs`): none has a length
    # of its own that stretching would break.
    assert all(
        len(v) == 0 for k, v in tuples.items() if k not in per_input | per_output
    )
    # An unannotated `jax.jit` gives every input (and every output) the same
    # entry: one entry, repeated, is what JAX would write.
    assert all(len(set(map(repr, tuples[k]))) == 1 for k in per_input | per_output)
    inline = eqn.params["inline"]
    inline_type = getattr(jax, "Inline", None)  # jax 0.12+
    if inline_type is not None:
        assert inline is inline_type.AUTO
    else:
        assert inline is False


def test_jit_cache_is_per_function_object():
    # `effects/_handle.py`, `_cache_for`: `jax.jit(fx.handle(f, ...))(x)`
    # written inline traces once only if `handle` returns the same wrapper, so
    # what is cached for `f` holds the wrapper, which holds `f`.
    traces = []

    def f(x):
        traces.append(None)
        return x * 2.0

    wrapper = lambda x: f(x)  # noqa: E731
    jax.jit(wrapper)(1.0)
    jax.jit(wrapper)(1.0)
    assert len(traces) == 1
    jax.jit(lambda x: f(x))(1.0)  # an equal wrapper, another object
    assert len(traces) == 2

    # (Python alone:) a `weakref.WeakKeyDictionary` entry whose value holds its
    # key keeps the key alive for good; a `__dict__` entry that does so is a
    # cycle the garbage collector frees with the function.
    class Cache:
        def __init__(self, fn):
            self.wrapper = functools.partial(fn)

    def make():
        return lambda x: x

    table = weakref.WeakKeyDictionary()
    in_table, in_dict = make(), make()
    table[in_table] = Cache(in_table)
    in_dict.__dict__["cache"] = Cache(in_dict)
    refs = [weakref.ref(in_table), weakref.ref(in_dict)]
    del in_table, in_dict
    gc.collect()
    assert [r() is None for r in refs] == [False, True]
    table.clear()


def test_gc_collect_while_another_thread_collects_collects_nothing():
    # tests/test_isolation.py, `_in_threads`: JAX's tracer-leak check
    # (`jax._src.core.maybe_find_leaked_tracers`) calls `gc.collect()` to free
    # what reference cycles alone keep alive, then reports every tracer still
    # referring to the trace it ended. (Python alone:) a `gc.collect()` made
    # while another thread collects returns at once and frees nothing, so
    # with several threads tracing, a trace a cycle keeps alive can be
    # reported as leaked.
    import threading

    class Node:
        pass

    seen = {}

    def during_a_collection(phase, info):
        if phase != "start" or seen:
            return
        node = Node()
        node.cycle = node
        ref = weakref.ref(node)
        del node

        def collect():
            seen["freed"] = gc.collect()
            seen["alive"] = ref() is not None

        thread = threading.Thread(target=collect)
        thread.start()
        thread.join()

    gc.callbacks.append(during_a_collection)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(during_a_collection)
    assert seen == {"freed": 0, "alive": True}


def test_a_primitive_is_bound_again_with_the_params_its_equation_stored():
    # `effects/_primitives.py`, `_SitePrimitive.bind`: evaluating a jaxpr (as
    # JAX's rules for `jit`, `scan`, `cond` and the rest do with a body, under
    # whatever trace is current) binds each primitive again with the params
    # stored in its equation. A param taken from a context at the first bind
    # is stale there; `bind` is the one place every bind passes through.
    flag = jax.make_user_context(False)
    binds = []

    class Recorded(jax.extend.core.Primitive):
        def bind(self, *args, **params):
            binds.append((params["flag"], flag.value))
            return super().bind(*args, **params)

    prim = Recorded("recorded_for_test")
    prim.def_impl(lambda x, **_: x)
    prim.def_abstract_eval(lambda x, **_: x)

    with flag(True):
        closed = jax.make_jaxpr(lambda x: prim.bind(x, flag=flag.value))(1.0)
    assert binds == [(True, True)]
    jax.make_jaxpr(jax.extend.core.jaxpr_as_fun(closed))(1.0)
    jax.core.eval_jaxpr(closed.jaxpr, closed.consts, 1.0)
    assert binds == [(True, True), (True, False), (True, False)]


def _frames_at_bind():
    """From a bind outwards: JAX's cond batching rule, with the batch axis of
    the predicate, and jaxpr traces, as ("cond", index_dim) and ("trace",)."""
    out, frame = [], sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_name
        if name == "_cond_batching_rule":
            out.append(("cond", frame.f_locals["index_dim"]))
        elif name == "trace_to_jaxpr_dynamic":
            out.append(("trace",))
        frame = frame.f_back
    return out


class _Recording(jax.extend.core.Primitive):
    def bind(self, *args, **params):
        self.seen.append(_frames_at_bind())
        return super().bind(*args, **params)


_recording = _Recording("recording")
_recording.seen = []
_recording.def_impl(lambda x: x)
_recording.def_abstract_eval(lambda x: x)
batching.primitive_batchers[_recording] = lambda args, dims: (
    _recording.bind(*args),
    dims[0],
)


def _recorded_branch(y):
    return _recording.bind(jnp.sin(y))


def _binds(fn, *args, in_axes):
    _recording.seen.clear()
    jax.make_jaxpr(jax.vmap(fn, in_axes=in_axes))(*args)
    return list(_recording.seen)


def test_a_batched_cond_evaluates_its_branches_in_its_batching_rule():
    # `effects/_compat.py`, `in_every_branch`: under `vmap`, JAX's batching rule
    # of `cond` holds the predicate's batch axis as `index_dim`. Batched, the
    # rule traces the branches batched, then evaluates them on the current
    # trace: a bind there has the rule's frame nearer than any trace.
    ps, xs = jnp.array([True, False]), jnp.ones((2, 3))
    cond = lambda p, x: jax.lax.cond(p, _recorded_branch, lambda y: y, x)  # noqa: E731
    nearest = [seen[0] for seen in _binds(cond, ps, xs, in_axes=(0, 0)) if seen]
    assert ("cond", 0) in nearest
    # Unbatched, the cond is kept: its rule only traces its branches, with
    # `index_dim` None.
    for seen in _binds(cond, True, xs, in_axes=(None, 0)):
        assert seen[0] == ("trace",) and ("cond", None) in seen

    # What the rule traces is cached, and a kept cond with the same branches
    # is given the branch batched for a select: a mark made while tracing it
    # there would be found in a cond that ran one branch per example.
    def fresh(y):
        return _recording.bind(jnp.sin(y))

    cond = lambda p, x: jax.lax.cond(p, fresh, lambda y: y, x)  # noqa: E731
    alone = len(_binds(cond, True, xs, in_axes=(None, 0)))

    def shared(y):
        return _recording.bind(jnp.sin(y))

    cond = lambda p, x: jax.lax.cond(p, shared, lambda y: y, x)  # noqa: E731
    _binds(cond, ps, xs, in_axes=(0, 0))
    assert len(_binds(cond, True, xs, in_axes=(None, 0))) < alone


@pytest.mark.parametrize("custom", ["custom_jvp", "custom_vjp"])
def test_an_effect_in_a_custom_rule_in_a_while_loop_in_a_checkpoint_fails_under_grad(
    custom,
):
    # `tests/test_properties.py`, `_allowed`: JAX's partial evaluation of a
    # `while_loop` in a `jax.checkpoint` asserts that its body saves no
    # residual, which a custom_jvp/custom_vjp function holding an effect does
    # (here `jax.debug.print`; in `fx.handle(jax.grad(f))`, a tag's). The same
    # effect directly in the loop body, or the checkpoint inside the loop, is
    # differentiated. `jax.grad(fx.handle(f, ...))` works: no effect is left.
    def printed(v):
        jax.debug.print("{}", v)
        return jnp.sin(v)

    if custom == "custom_jvp":
        fn = jax.custom_jvp(printed)
        fn.defjvp(lambda p, t: (fn(p[0]), jnp.cos(p[0]) * t[0]))
    else:
        fn = jax.custom_vjp(printed)
        fn.defvjp(lambda u: (jnp.sin(u), u), lambda u, ct: (jnp.cos(u) * ct,))

    def looped(body):
        def f(v):
            step = lambda s: (s[0] + 1, body(s[1]))  # noqa: E731
            init = (0, jax.lax.stop_gradient(v))
            return v + jax.lax.while_loop(lambda s: s[0] < 0, step, init)[1]

        return f

    def grad_of(f):
        return jax.grad(lambda x: jnp.sum(f(x)))(jnp.ones(3))

    with pytest.raises(AssertionError):
        grad_of(jax.checkpoint(looped(fn)))
    assert grad_of(looped(jax.checkpoint(fn))).shape == (3,)
    assert grad_of(jax.checkpoint(looped(printed))).shape == (3,)


def test_vmap_of_a_cond_with_a_batched_predicate_leaves_no_cond():
    # `effects/_checks.py`, `branch_suspects`: under `vmap` with a batched predicate
    # a `cond` becomes a `select_n` of every branch's outputs, so no `cond` is
    # left to say that a site was in one.
    ps, xs = jnp.array([True, False]), jnp.ones(2)
    branchy = lambda p, x: jax.lax.cond(p, jnp.sin, jnp.cos, x)  # noqa: E731
    names = {e.primitive.name for e in jax.make_jaxpr(jax.vmap(branchy))(ps, xs).eqns}
    assert "select_n" in names and "cond" not in names


def test_what_a_batched_branch_calls_is_traced_under_the_rule_anew_per_context():
    # `effects/_checks.py`, `branch_suspects`: a bind in what a batched branch
    # calls (here a cond the vmap keeps, on a loop's iteration, in a loop) is
    # made where the batching rule of the batched cond traces its branches:
    # under that rule's frame, through traces and the kept cond's rule. JAX
    # caches those traces; a new value of a user context (part of every cache
    # key of traces) traces them all again, so a mark made in a trace of its
    # own stays in it.
    token = jax.make_user_context(None)

    def f(p, x):
        def step(i, y):
            return jax.lax.cond(i > 0, _recorded_branch, lambda z: z, y)

        looped = lambda y: jax.lax.fori_loop(0, 2, step, y)  # noqa: E731
        return jax.lax.cond(p, looped, lambda y: y, x)

    ps, xs = jnp.array([True, False]), jnp.ones((2, 3))
    binds = _binds(f, ps, xs, in_axes=(0, 0))
    kept = [s for s in binds if ("cond", None) in s and ("cond", 0) in s]
    assert kept and all(s[0] == ("trace",) for s in kept)
    assert all(s.index(("cond", None)) < s.index(("cond", 0)) for s in kept)
    again = len(_binds(f, ps, xs, in_axes=(0, 0)))
    assert again < len(binds)  # (cached)
    with token(object()):
        assert len(_binds(f, ps, xs, in_axes=(0, 0))) == len(binds)


def test_a_trace_an_exception_stops_is_kept_alive():
    # `effects/_rewrite.py`, `_spliced`: a trace that an exception stops, in
    # which a value of an enclosing trace was used, stays alive with that
    # value (its frame's tracers hold the trace through the finalizers JAX
    # registers), which JAX's leak checker reports. A trace that is only
    # abandoned is let run to its end.
    class Stop(Exception):
        pass

    def stopped(x, s):
        x * s
        raise Stop

    def finished(x, s):
        return x * s

    def outer(inner):
        @jax.jit
        def f(s):
            try:
                jax.make_jaxpr(lambda x: inner(x, s))(1.0)
            except Stop:
                pass
            return s

        return f

    with leak_checks():
        with pytest.raises(Exception, match="Leaked trace"):
            outer(stopped)(1.0)
        assert outer(finished)(1.0) == 1.0


_EMPTY_CONSTANT_IN_A_SHARD_MAP = """
import jax
import jax.numpy as jnp
import numpy as np
import numpy as np
from jax import lax

mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("s",))
spec = jax.sharding.PartitionSpec("s")


def f(x):
    def step(c, xk):
        v = jnp.sin(c * 0.5 + xk[0])

        def body(w):
            def empty():
                return jnp.asarray([], jnp.float32).reshape((0, 1, 1))

            xs = w[None] * empty() + (empty() if add else 0.0)

            def inner(c, xk):
                u = c * 0.5 + xk[0]
                return u, u * 0.5

            return lax.scan(inner, w, (xs, jnp.arange(0)))[0]

        out = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(v)
        return out, out * 0.5

    c, ys = lax.scan(step, x, (x[None] * jnp.ones((2, 1, 1)), jnp.arange(2)))
    return c + ys.sum(0)


jax.jit(jax.grad(lambda x: jnp.sum(f(x) ** 2)))(jnp.ones((2, 3)))
print("compiled")
"""


def test_an_empty_constant_added_in_a_shard_map_in_a_scan_fails_under_grad():
    # `tests/test_properties.py`, `jax_alone`: JAX (0.7 to 0.12) fails to
    # compile the gradient of a scan whose body calls a shard_map whose body
    # multiplies a value by an empty constant, adds another, and scans over
    # the result (Shardy: "'func.call' op expected at least one operand of
    # @xla.sdy.manual_computation_body to be produced by a
    # xla.sdy.GlobalToLocalShape CustomCallOp"). Without the addition it
    # compiles, but on jax 0.11, whose compiler crashes the process on it
    # (a segmentation fault): each program runs in a process of its own.
    # (Generated programs meet the same error in other shapes: a shard_map of
    # two scans of length 0 under a loss linear in its output.)
    def run(add: bool):
        return run_fresh(f"add = {add}\n" + _EMPTY_CONSTANT_IN_A_SHARD_MAP)

    failed = run(add=True)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "GlobalToLocalShape" in failed.stderr
    compiled = run(add=False)
    if jax.__version_info__[:2] == (0, 11):
        assert compiled.returncode == -signal.SIGSEGV, compiled.stderr
    else:
        assert compiled.stdout == "compiled\n", compiled.stderr


def test_xla_refuses_a_reduction_of_floats_of_two_precisions():
    # `effects._nonfinite._checked`: `lax.reduce` builds a variadic reduction
    # of a bfloat16 and a float32 operand, which XLA's CPU compiler refuses
    # ("Seen floating point types of different precisions"), jax 0.8 to 0.12;
    # integers, and a complex64 beside a float32, it takes.
    import numpy as np
    from jax import lax

    def first(a, b):
        take = lax.le(a[0], b[0])
        return tuple(lax.select(take, u, v) for u, v in zip(a, b))

    def reduced(*values):
        key = lax.iota(np.int32, 4)
        init = (np.int32(9), *(np.zeros((), v.dtype) for v in values))
        return lax.reduce((key, *values), init, first, (0,))

    def run(*dtypes):
        return jax.jit(reduced)(*(jnp.ones(4, d) for d in dtypes))

    assert run(jnp.float32, jnp.int32)[0] == 0
    assert run(jnp.complex64, jnp.float32)[0] == 0
    if jax.devices()[0].platform == "cpu":
        with pytest.raises(Exception, match="different precisions"):
            run(jnp.bfloat16, jnp.float32)


def test_the_max_of_a_sharded_array_drops_a_nan():
    # `effects._nonfinite._finite_by_sums`: XLA's maximum (and minimum)
    # propagates a NaN within a device, but on a sharded array the all-reduce
    # that combines the shards' results drops a shard's NaN (CPU, jax 0.8 to
    # 0.12): `jnp.max` answers 7.0, `jnp.min` 2.0 (the first shard, [nan, 1],
    # left out whole). A sum keeps it, as a boolean reduction of `x != x` does:
    # the finite check sums `x - x`.
    import numpy as np

    mesh = jax.sharding.Mesh(np.array(devices(4)), ("d",))
    x = jnp.array([np.nan, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    sharded = jax.device_put(
        x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    )
    assert np.isnan(jax.jit(jnp.max)(x)) and np.isnan(jax.jit(jnp.min)(x))
    if jax.devices()[0].platform == "cpu":
        assert jax.jit(jnp.max)(sharded) == 7.0
        assert jax.jit(jnp.min)(sharded) == 2.0
    assert jax.jit(lambda v: jnp.any(v != v))(sharded)
    assert np.isnan(jax.jit(jnp.sum)(sharded)) and np.isnan(
        jax.jit(jnp.sum)(sharded - sharded)
    )
    assert np.isnan(jax.jit(lambda v: jnp.sum(jnp.minimum(jnp.abs(v), 1)))(sharded))


def test_xla_folds_a_product_by_zero_into_the_product_before_it():
    # `effects._nonfinite._finite_by_sums`: XLA's algebraic simplifier takes
    # `(x * 2) * 0` for `x * (2 * 0)` (jax 0.8 to 0.12, CPU), so a sum of
    # `y * 0` misses the Inf that `y = x * 2` made by overflowing: 0.0, where
    # the same sum of `y` given as an input, or of `y - y`, is a NaN. (jax
    # 0.10 folds it through an optimization barrier too.) The finite check
    # sums `y - y`.
    import numpy as np

    x = jnp.array([1e38, -2.0e38, -3.0e38])
    assert np.isinf(x * 2).any()
    assert jax.jit(lambda v: jnp.sum((v * 2.0) * 0.0))(x) == 0.0
    assert np.isnan(jax.jit(lambda y: jnp.sum(y * 0.0))(x * 2))
    assert np.isnan(jax.jit(lambda v: jnp.sum((v * 2.0) - (v * 2.0)))(x))


def test_xla_folds_a_product_by_two_constants_into_one():
    # tests/test_properties.py::
    # test_find_nonfinite_answers_exactly_where_the_output_is_non_finite, and
    # the NaN guide's note on it: XLA's algebraic simplifier (jax 0.8 to
    # 0.10, CPU) makes `(x * -1.5) * 0.5` `x * -0.75`, so the Inf the
    # operations one at a time make is not in the compiled output; jax 0.12
    # keeps both products.
    import numpy as np

    x = np.float32([3e38])

    def f(v):
        return (v * -1.5) * 0.5

    apart = jax.jit(f, compiler_options={"xla_disable_hlo_passes": "algsimp"})
    assert np.isneginf(apart(x)).all()
    folded = bool(np.isfinite(jax.jit(f)(x)).all())
    assert folded == (jax.__version_info__ < (0, 12))


def test_jvp_of_a_vmapped_custom_jvp_from_its_jaxpr_lays_out_its_outputs_wrong():
    # A JAX bug that `handle` meets (effects evaluates jaxprs; found by
    # tests/test_properties.py::test_taps_are_the_plain_program_unhandled_and_
    # keep_the_laws, with a tagged loop in such a function under `jax.grad`),
    # as `jax.jit` does: jax 0.8 to 0.12 give the jvp of a jaxpr holding a vmap
    # (over axis 1) of a custom_jvp function whose rule batches its outputs
    # unlike the function (here: the function holds a scan, which moves the
    # batch axis to the front; the rule does not) outputs of the wrong layout:
    # the batch axis where the rule had it, not where the equation says it is.
    # `effects._custom._collecting_custom_jvp` raises a clear error for it.
    @jax.custom_jvp
    def g(v):
        scanned = jax.lax.scan(lambda c, _: (c * 2, None), v, length=2)[0]
        return v * 0.5 + jax.lax.stop_gradient(scanned)

    g.defjvp(lambda p, t: (p[0] * 0.5 + p[0], 1.5 * t[0]))

    def f(x):
        return jax.vmap(g, in_axes=1, out_axes=0)(x)

    x = jnp.arange(6.0).reshape(2, 3)
    closed = jax.make_jaxpr(f)(x)

    def evaluated(x):
        return jax.core.eval_jaxpr(closed.jaxpr, closed.consts, x)[0]

    assert jax.jvp(f, (x,), (x,))[0].shape == evaluated(x).shape == (3, 2)
    for staged in (evaluated, jax.jit(f)):
        assert [o.shape for o in jax.jvp(staged, (x,), (x,))] == [(2, 3)] * 2
    # Of a square argument, the values are transposed, silently.
    square = jnp.arange(9.0).reshape(3, 3)
    right, wrong = (jax.jvp(h, (square,), (square,))[1] for h in (f, jax.jit(f)))
    np.testing.assert_allclose(wrong, right.T)

    # A while loop whose body is not the identity in the function and is in
    # the rule (JAX forwards such a carry out of the loop) is such a difference.
    def loop(body):
        def of(v):
            start = (0, jax.lax.stop_gradient(v))
            return v * 0.5 + jax.lax.while_loop(lambda s: s[0] < 2, body, start)[1]

        return of

    h = jax.custom_jvp(loop(lambda s: (s[0] + 1, jnp.sin(s[1]))))
    h.defjvp(lambda p, t: jax.jvp(loop(lambda s: (s[0] + 1, s[1])), p, t))

    def k(x):
        return jax.vmap(h, in_axes=1)(x)

    assert jax.jvp(k, (x,), (x,))[0].shape == (3, 2)
    assert jax.jvp(jax.jit(k), (x,), (x,))[0].shape == (2, 3)


def test_an_error_in_a_custom_jvp_rule_of_a_jit_under_grad_is_reported_as_a_leak():
    # With tracer-leak checks on, an error raised in the rule of a custom_jvp
    # function evaluated from a jaxpr (here `jax.jit`'s) under `jax.grad` is
    # replaced by a leak report (jax 0.8 to 0.12); raised eagerly, it is not.
    # `tests/test_rewrite.py::test_a_tagged_loop_in_a_vmapped_custom_jvp_
    # whose_rule_batches_unlike_it` meets it with effects' error.
    @jax.custom_jvp
    def g(v):
        return v * 2

    @g.defjvp
    def _(primals, tangents):
        raise ValueError("the rule's error")

    def loss(of):
        return jax.grad(lambda x: jnp.sum(of(x)))(jnp.ones(3))

    with leak_checks():
        with pytest.raises(ValueError, match="the rule's error"):
            loss(g)
        with pytest.raises(Exception, match="Leaked trace"):
            loss(jax.jit(g))


def test_a_discarded_checkpoint_in_a_scan_in_a_checkpoint_runs_only_backward():
    # `docs/sharp-bits.md`'s known gap: a `jax.checkpoint` whose output
    # nothing uses, in a scan in another checkpoint in a scan, under
    # `jax.grad`: jax 0.8 to 0.10 drop its forward execution, effects and all,
    # and run it in the backward pass alone: an ordered callback there runs
    # after one that ends the forward pass. Used, it runs in both, as it does
    # discarded from jax 0.11. So on 0.8 to 0.10 `handle(jax.grad(f))` finds only
    # recomputed copies of its tags, and refuses a handler that reports them
    # (`_checks._check_recomputed_only`).
    def order(use: bool) -> list[str]:
        calls = []

        def f(x):
            def step(c, _):
                def inner(v):
                    def body(c2, k):
                        def leaf(v2):
                            jax.debug.callback(
                                lambda _: calls.append("in"), v2, ordered=True
                            )
                            return v2 * 2.0

                        return jax.checkpoint(leaf)(c2 * 0.5 + k), None

                    return jax.lax.scan(body, v, jnp.arange(3.0))[0]

                kept = jax.checkpoint(inner)(c)
                return jnp.tanh(c) + (kept if use else 0.0), None

            out = jax.lax.scan(step, x, jnp.arange(2.0))[0]
            jax.debug.callback(lambda _: calls.append("end"), out, ordered=True)
            return jnp.sum(out)

        jax.grad(f)(jnp.ones(3))
        jax.effects_barrier()
        return calls

    used = order(use=True)
    assert used.index("end") == 6 and used.count("in") == 18
    discarded = order(use=False)
    if jax.__version_info__ < (0, 11):
        assert discarded == ["end"] + ["in"] * 6
    else:
        assert discarded == ["in"] * 6 + ["end"] + ["in"] * 6


def test_checkify_fails_on_checks_in_shard_maps():
    # `effects._nonfinite._sites_and_mesh`: checkify (jax 0.7 to 0.12) fails on a
    # program with a `checkify.check` in each of two shard_maps: the first
    # leaves its error stacked per shard, which the second cannot combine with
    # its own ("select cases must have the same shapes"). One shard_map of
    # checks, or checks in one shard_map and before it, pass; after it fail.
    # So do a loop around a shard_map of checks, a loop of checks inside one,
    # and a loop or a branch holding a shard_map without checks (below).
    from jax.experimental import checkify

    mesh = jax.sharding.Mesh(devices(4), ("d",))
    spec = jax.sharding.PartitionSpec("d")

    def body(x):
        checkify.check(jnp.all(jnp.isfinite(x)), "not finite")
        return jnp.sin(x)

    sm = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
    x = jnp.arange(8.0)

    def checked(fn):
        return jax.jit(checkify.checkify(fn, errors=checkify.user_checks))(x)

    assert checked(sm)[0].get() is None
    with pytest.raises(TypeError, match="select cases must have the same shapes"):
        checked(lambda x: sm(sm(x)))

    # `effects._taps._Inserter.sealed`: a check after one fails alike; one
    # before it passes.
    def after(x):
        y = sm(x).sum()
        checkify.check(jnp.isfinite(y), "after")
        return y

    def before(x):
        checkify.check(jnp.all(jnp.isfinite(x)), "before")
        return sm(x).sum()

    assert checked(before)[0].get() is None
    with pytest.raises(TypeError, match="select cases must have the same shapes"):
        checked(after)

    # A loop around the shard_map: its error stacked per shard is the loop's
    # carry, whose type then changes.
    def around(x):
        return jax.lax.scan(lambda c, _: (sm(c), None), x, length=2)[0]

    with pytest.raises(TypeError, match="carry input and carry output must have equal"):
        checked(around)

    # A loop inside it: the error, varying over the shards, is the loop's
    # carry, which entered it unvarying.
    def step(c, _):
        checkify.check(jnp.all(jnp.isfinite(c)), "in a loop")
        return jnp.sin(c), None

    inside = jax.shard_map(
        lambda x: jax.lax.scan(step, x, length=2)[0],
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
    )
    with pytest.raises(ValueError, match="mismatched varying manual axes"):
        checked(inside)

    # A shard_map with no check at all, in a loop or a branch beside one:
    # the error after it is stacked per shard all the same.
    plain = jax.shard_map(jnp.sin, mesh=mesh, in_specs=spec, out_specs=spec)

    def checked_sin(x):
        checkify.check(jnp.all(jnp.isfinite(x)), "beside")
        return jnp.sin(x)

    def loop(x):
        return jax.lax.fori_loop(0, 2, lambda i, c: checked_sin(plain(c)), x)

    with pytest.raises(TypeError, match="select cases must have the same shapes"):
        checked(loop)
    with pytest.raises(Exception, match="mismatched return types"):
        checked(lambda x: jax.lax.cond(x.sum() > 0, plain, checked_sin, x))


@pytest.mark.parametrize("region", ["checkpoint", "cond"])
@pytest.mark.parametrize("outer", [False, True])
def test_an_unused_region_in_a_checkpoint_loses_its_effects_in_the_backward_pass(
    region, outer
):
    # docs/sharp-bits.md ("The cotangent of a tag nothing uses") and
    # `NameInfo.no_cotangent` in tests/test_properties.py: transposing a
    # `jax.checkpoint` partially evaluates its body again
    # (`ad_checkpoint._transpose_jaxpr`), and there a `jax.checkpoint` or a
    # `cond` none of whose outputs are used is left out, effects and all: an
    # effectful, linear primitive in it (a tag's derivative site) is never
    # transposed. Outside a checkpoint it is.
    from jax._src import effects
    from jax.interpreters import ad

    class Probe(effects.Effect):
        pass

    probe = Probe()
    for allowed in [
        effects.remat_allowed_effects,
        effects.control_flow_allowed_effects,
        effects.partial_eval_kept_effects,
    ]:
        allowed.add_type(Probe)
    probe_p = jax.extend.core.Primitive("fact_probe")
    probe_p.def_impl(lambda x: x)
    probe_p.def_effectful_abstract_eval(lambda x: (x, {probe}))
    transposed = []

    def transpose(ct, x):
        # (as a tag's: a zero cotangent is transposed too, to report zeros)
        transposed.append(ct)
        return [probe_p.bind(ad.instantiate_zeros(ct))]

    ad.primitive_jvps[probe_p] = lambda x, t: (probe_p.bind(*x), probe_p.bind(*t))
    ad.primitive_transposes[probe_p] = transpose

    def unused(v):
        if region == "checkpoint":
            jax.checkpoint(probe_p.bind)(v)
        else:
            jax.lax.cond(v[0] > 0, probe_p.bind, jnp.sin, v)
        return v * 3.0

    f = jax.checkpoint(unused) if outer else unused
    jax.make_jaxpr(jax.grad(lambda x: jnp.sum(f(x))))(jnp.ones(3))
    assert bool(transposed) != outer, len(transposed)


def test_indexing_by_a_vmap_index_over_an_explicitly_sharded_batch_fails():
    # docs/sharp-bits.md, "Known gaps" (a vmap whose batch axis is sharded over
    # an Explicit-axis mesh): a handler's value per example is the example's
    # entry of the whole batch's, `value[index]` at the example's index
    # (`Context.example`), which JAX refuses there, in `jnp`'s indexing and in
    # `lax.dynamic_index_in_dim` alike. Unsharded, it works.
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    mesh = jax.make_mesh(
        (4,), ("d",), axis_types=(AxisType.Explicit,), devices=devices(4)
    )
    table = jnp.arange(8.0)

    def per_example(take):
        return jax.jit(
            jax.vmap(lambda r: r.sum() + take(jax.lax.axis_index("b")), axis_name="b")
        )

    takes = [
        lambda i: table[i],
        lambda i: jax.lax.dynamic_index_in_dim(table, i, keepdims=False),
    ]
    x = jnp.ones((8, 3))
    for take in takes:
        assert jnp.allclose(per_example(take)(x), 3.0 + table)
        with jax.set_mesh(mesh):
            sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec("d")))
            with pytest.raises(Exception, match="shard|PartitionSpec"):
                per_example(take)(sharded)


def test_xla_fusion_copies_a_chain_into_each_of_its_values_a_program_returns():
    # docs/performance.md, "Many values of one chain" (`Tag()` of every step
    # returns them all), and `effects._nonfinite._RUN_ONCE`: with
    # `backward=True`, `find_nonfinite` checks the cotangent of every tag, and
    # so reads every value of the backward pass's chain. On CPU, XLA's fusion
    # pass copies the chain of operations it deems cheap (`sin`, `add`,
    # `multiply`; not `tanh`) that each value is computed by into the fusion
    # that computes it: the compiled program grows with the square of the
    # chain's length, without the pass linearly.
    if jax.default_backend() != "cpu":
        pytest.skip("XLA's CPU fusion pass")
    unfused = {"compiler_options": {"xla_disable_hlo_passes": "fusion"}}

    def every_value(n, **jit):
        def f(x):
            values = []
            for _ in range(n):
                x = jnp.sin(x) + 0.1
                values.append(x)
            return values

        compiled = jax.jit(f, **jit).lower(jnp.ones(4)).compile()
        return compiled.as_text().count(" sine(")

    assert [every_value(n) for n in (20, 40)] == [210, 820]  # n (n + 1) / 2
    assert [every_value(n, **unfused) for n in (20, 40)] == [20, 40]

    def cotangents(n, **jit):
        def loss(zs, x):
            for z in zs:
                x = jnp.tanh(1.01 * x + 0.1) + z
            return jnp.sum(x)

        every = jax.jit(lambda x: jax.grad(loss)([jnp.zeros(8)] * n, x), **jit)
        return every.lower(jnp.ones(8)).compile().as_text().count(" multiply(")

    # The backward pass's chain, every value of it returned.
    fused = [cotangents(n) for n in (20, 40)]
    plain = [cotangents(n, **unfused) for n in (20, 40)]
    assert fused[1] > 3.5 * fused[0]  # doubling the chain: about 4x
    assert plain[1] < 2.5 * plain[0]  # about 2x
    assert fused[1] > 10 * plain[1]
    x = jnp.linspace(-1.0, 1.0, 8)

    def grads(**jit):
        def loss(zs):
            y = x
            for z in zs:
                y = jnp.tanh(1.01 * y + 0.1) + z
            return jnp.sum(y)

        return jax.jit(jax.grad(loss), **jit)([jnp.zeros(8)] * 20)

    # The same values up to rounding (fused, a multiply and an add may round
    # once, as one operation).
    for a, b in zip(grads(), grads(**unfused)):
        assert jnp.allclose(a, b, rtol=1e-5, atol=0)
