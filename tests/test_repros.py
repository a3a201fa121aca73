"""Behaviour found using `effects` with diffrax, optax and Equinox (the scripts in
`repros/`), reproduced with plain JAX and Equinox: each test names its script."""

from __future__ import annotations

import dataclasses
import re

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, no_leak_checks

import effects as fx

#
# One name tagged outside and inside a vmap
#


def _outside_and_inside_vmap(inner_jit: bool, batched: bool):
    """The same function tags "n" once outside a `vmap` (value `x[0] + 10` or
    `10`) and once per example inside it (`x + 1` or an unbatched `1`)."""

    def inner(v, c):
        fx.tag(v + c if batched else jnp.full((), c), "n")
        return 2 * v

    vmapped = jax.vmap(lambda v: inner(v, 1.0))
    if inner_jit:
        vmapped = jax.jit(vmapped)

    def f(x):
        y = inner(x[0], 10.0)
        return vmapped(x) + y

    return f


@pytest.mark.parametrize("mode", ["sum", "last", "append"])
@pytest.mark.parametrize("batched", [False, True], ids=["unbatched", "batched"])
@pytest.mark.parametrize("inner_jit", [True, False], ids=["inner_jit", "no_jit"])
@pytest.mark.parametrize("wrap", ["eager", "jit"])
def test_name_tagged_outside_and_inside_a_vmap(wrap, inner_jit, batched, mode):
    """bug_vmap_mixed_sum.py: one name tagged outside and inside a vmap."""
    # "sum" crashed in the MLIR verifier with the inner jit. Without it (which is
    # err_messages.py's second probe) "sum" and "last" raised an error about a
    # Reduce the user never wrote; an inner jit must not change what is computed.
    f = _outside_and_inside_vmap(inner_jit, batched)
    x = jnp.array([0.5, -1.0, 2.0])
    # Hand-written: the execution outside the vmap has no batch axis; the one
    # inside has one entry per example (broadcast when vmap left it unbatched).
    outside = x[0] + 10.0 if batched else jnp.float32(10.0)
    inside = x + 1.0 if batched else jnp.ones(3)
    expected = {"sum": outside + inside, "last": inside, "append": (outside, inside)}
    h = fx.handle(f, fx.Tag(mode=mode))
    if wrap == "jit":
        h = jax.jit(h)
    out, found = h(x)
    assert_trees_close(out, f(x))
    assert_trees_close(found, {"intermediates": {"n": expected[mode]}})


def _backsolve_loss():
    """diffrax's BacksolveAdjoint in miniature: a custom_vjp whose backward rule
    re-evaluates the tagged vector field per example under a vmap in a jit."""

    def vf(y, k):
        fx.tag(jnp.ones(()), "nfev")  # unbatched under the vmap
        fx.tag(jnp.sum(y), "ysum")  # batched under the vmap
        return -k * y

    @jax.custom_vjp
    def solve(y0, k):
        return vf(y0, k)

    def solve_fwd(y0, k):
        return vf(y0, k), (y0, k)

    def solve_bwd(res, g):
        y0, k = res

        @jax.jit
        def adjoint(y0, k, g):
            def one(yi, gi):
                return jax.vjp(vf, yi, k)[1](gi)

            dy, dk = jax.vmap(one)(y0, g)
            return dy, dk.sum()

        return adjoint(y0, k, g)

    solve.defvjp(solve_fwd, solve_bwd)

    @jax.jit
    def loss(k):
        return jnp.sum(solve(jnp.array([1.0, 2.0]), k) ** 2)

    return loss


@pytest.mark.parametrize("mode", ["sum", "last", "append"])
def test_handle_of_grad_with_a_vmapped_adjoint(mode):
    """diffrax_backsolve_grad.py: handle(grad(f)), f's adjoint vmapped in a jit."""
    # "sum" crashed in the MLIR verifier.
    loss = _backsolve_loss()
    k = jnp.float32(0.7)
    # Hand-written: the forward rule runs the vector field once on y0 = [1, 2];
    # the backward rule once per example (the vmap's batch of two).
    y0 = jnp.array([1.0, 2.0])
    outside = {"nfev": jnp.float32(1.0), "ysum": jnp.sum(y0)}
    inside = {"nfev": jnp.ones(2), "ysum": y0}
    expected = {
        "sum": {n: outside[n] + inside[n] for n in outside},
        "last": inside,
        "append": {n: (outside[n], inside[n]) for n in outside},
    }
    g, found = fx.handle(jax.grad(loss), fx.Tag(mode=mode))(k)
    assert_trees_close(g, jax.grad(loss)(k))
    assert_trees_close(found, {"intermediates": expected[mode]})


#
# Loops under vmap
#


def _count_iterations(n):
    def body(carry):
        i, acc = carry
        fx.tag(jnp.ones(()), "iters")
        fx.tag(i, "i")
        return i + 1, acc + i

    return jax.lax.while_loop(lambda c: c[0] < n, body, (0, 0))[1]


NS = jnp.array([2, 5, 9])


def _iterations_found(ns):
    # Hand-written: n iterations, and the sum of i over them.
    ns = np.asarray(ns)
    return {
        "intermediates": {
            "iters": jnp.asarray(ns, jnp.float32),
            "i": jnp.asarray(ns * (ns - 1) // 2, jnp.int32),
        }
    }


@pytest.mark.parametrize("order", ["vmap_of_handle", "handle_of_vmap"])
def test_sum_in_while_loop_under_vmap_is_per_example(order):
    """vmap_while_sum.py: a lax.while_loop under vmap is masked per example."""
    if order == "vmap_of_handle":
        h = jax.vmap(fx.handle(_count_iterations, fx.Tag(mode="sum")))
    else:
        h = fx.handle(jax.vmap(_count_iterations), fx.Tag(mode="sum"))
    out, found = jax.jit(h)(NS)
    assert_trees_close(found, _iterations_found(NS))
    alone = [fx.handle(_count_iterations, fx.Tag(mode="sum"))(n)[1] for n in NS]
    assert_trees_close(found, jax.tree.map(lambda *a: jnp.stack(a), *alone))
    assert_trees_close(out, jax.vmap(_count_iterations)(NS))


@pytest.fixture
def equinox_checkpointed_leak_report():
    """Tracer-leak checking off: on jax 0.12 (Equinox 0.13.8), Equinox's
    checkpointed loop inside `lax.map` under `jax.jit` is reported as leaking,
    with no effects involved:

        jax.config.update("jax_check_tracer_leaks", True)
        def g(n):
            def body(c):
                return c[0] + 1, c[1] + c[0]
            return eqxi.while_loop(
                lambda c: c[0] < n, body, (0, 0), max_steps=16, kind="checkpointed"
            )[1]
        jax.jit(lambda ns: jax.lax.map(g, ns))(jnp.array([1, 3, 5]))
        # Exception: Leaked trace DynamicJaxprTrace
    """
    with no_leak_checks():
        yield


@pytest.mark.parametrize("kind", ["checkpointed", "bounded"])
def test_select_masked_loop_under_lax_map_is_per_example(kind, request):
    """vmap_while_sum.py: Equinox's loops under lax.map count each example's own."""
    if kind == "checkpointed":
        request.getfixturevalue("equinox_checkpointed_leak_report")
    # Under vmap, Equinox's loops (so diffrax's) mask finished examples by select
    # and run the body for them too: documented, not fixable. `lax.map` (a scan)
    # runs each example alone.

    def g(n):
        def cond(carry):
            return carry[0] < n

        def body(carry):
            i, acc = carry
            fx.tag(jnp.ones(()), "iters")
            fx.tag(i, "i")
            return i + 1, acc + i

        return eqxi.while_loop(cond, body, (0, 0), max_steps=16, kind=kind)[1]

    h = fx.handle(g, fx.Tag(mode="sum"))
    out, found = jax.jit(lambda ns: jax.lax.map(h, ns))(NS)
    assert_trees_close(found, _iterations_found(NS))
    assert [int(o) for o in out] == [int(g(n)) for n in NS]


#
# cond with a batched predicate, handled outside the vmap
#


def _branchy(x):
    return jax.lax.cond(
        x > 0,
        lambda x: fx.tag(x * 2.0, "b") + 1.0,
        lambda x: fx.tag(x * 3.0, "b") - 1.0,
        x,
    )


def _scan_of_branches(x):
    def body(c, xi):
        c = jax.lax.cond(
            xi > 0,
            lambda c: fx.tag(c + xi, "b"),
            lambda c: fx.tag(c - 10.0 * xi, "b"),
            c,
        )
        return c, None

    return jax.lax.scan(body, x, jnp.array([1.0, -1.0, 2.0]) * x)[0]


_MOVE_INSIDE = re.compile(r"(?i)inside the vmap|vmap\((fx\.)?handle|handler inside")


@pytest.mark.parametrize("mode", ["append", "last", "sum"])
@pytest.mark.parametrize("fn", [_branchy, _scan_of_branches], ids=["cond", "scan"])
def test_handle_of_vmap_of_batched_cond_reports_each_examples_branch(fn, mode):
    """The issue: handle(vmap(f)) with a batched cond predicate mixed branches."""
    # JAX's vmap turns the cond into a select of every branch before any handler
    # sees the program, so handle(vmap(f)) refuses, saying to move the handler
    # inside the vmap; vmap(handle(f)) gets each example's own branch.
    xs = jnp.array([1.0, -2.0, 3.0])
    handled = fx.handle(fn, fx.Tag(mode=mode))
    alone = [handled(x) for x in xs]  # each example's own branch
    expected = jax.tree.map(lambda *a: jnp.stack(a), *alone)
    assert_trees_close(jax.vmap(handled)(xs), expected)
    with pytest.raises(ValueError, match=_MOVE_INSIDE) as e:
        fx.handle(jax.vmap(fn), fx.Tag(mode=mode))(xs)
    assert "'b'" in str(e.value)
    # A handler that matches none of the branches' tags sees no mixed value.
    out, found = fx.handle(jax.vmap(fn), fx.Tag(names=["other*"]))(xs)
    assert_trees_close(out, jax.vmap(fn)(xs))
    assert found == {"intermediates": {}}


def _tags_beside_branches(x, s):
    # `top` and `kept` are exact under the vmap: `top` is outside any cond, and
    # `kept`'s cond has an unbatched predicate, so JAX keeps it a cond.
    y = fx.tag(x * 2.0, "top")
    y = jax.lax.cond(s > 0, lambda y: fx.tag(y + 1.0, "kept"), lambda y: y - 1.0, y)
    return jax.lax.cond(
        y > 0, lambda y: fx.tag(jnp.sin(y), "b"), lambda y: jnp.where(y < -3, y, 0.0), y
    )


@pytest.mark.parametrize("mode", ["append", "last", "sum"])
def test_handle_of_vmap_refuses_only_the_tags_of_batched_branches(mode):
    xs, s = jnp.array([1.0, -2.0, 3.0]), jnp.array(1.0)
    vf = jax.vmap(_tags_beside_branches, in_axes=(0, None))
    with pytest.raises(ValueError, match=_MOVE_INSIDE) as e:
        fx.handle(vf, fx.Tag(mode=mode))(xs, s)
    assert "'b'" in str(e.value) and "'top'" not in str(e.value)
    assert "'kept'" not in str(e.value)
    handlers = (fx.Tag(names=["top", "kept"], mode=mode),)
    got = fx.handle(vf, *handlers)(xs, s)
    handled = fx.handle(_tags_beside_branches, *handlers)
    want = jax.vmap(handled, in_axes=(0, None))(xs, s)
    assert_trees_close(got, want)
    assert set(got[1]["intermediates"]) == {"top", "kept"}


def test_handle_of_vmap_of_a_cond_with_an_unbatched_predicate_is_exact():
    # A cond whose predicate the vmap does not batch stays a cond: every example
    # takes the same branch, and handle(vmap(f)) reports it.
    def f(x, s):
        return jax.lax.cond(
            s > 0, lambda x: fx.tag(x * 2.0, "b"), lambda x: fx.tag(x - 1.0, "b"), x
        )

    xs = jnp.array([1.0, -2.0, 3.0])
    for s in (1.0, -1.0):
        got = fx.handle(jax.vmap(f, in_axes=(0, None)), fx.Tag(mode="sum"))(xs, s)
        want = jax.vmap(fx.handle(f, fx.Tag(mode="sum")), in_axes=(0, None))(xs, s)
        assert_trees_close(got, want)


#
# custom_vjp around a while loop (diffrax's RecursiveCheckpointAdjoint, and
# Equinox's checkpointed while_loop)
#


def _loop_in_custom_vjp(callback, kind):
    """`y -> 0.5 y + 1` five times from `x`, tagging `y` before each step and
    calling `callback(i)` there, inside a custom_vjp."""

    def loop(x):
        def body(carry):
            i, y = carry
            if callback is not None:
                jax.debug.callback(callback, i)
            fx.tag(y, "y")
            return i + 1, 0.5 * y + 1.0

        if kind == "checkpointed":  # Equinox's own custom_vjp around a loop
            return eqxi.while_loop(
                lambda c: c[0] < 5, body, (0, x), max_steps=8, kind="checkpointed"
            )[1]
        return jax.lax.while_loop(lambda c: c[0] < 5, body, (0, x))[1]

    if kind == "checkpointed":
        return loop

    @jax.custom_vjp
    def f(x):
        return loop(x)

    def fwd(x):
        return loop(x), None

    def bwd(_, g):
        return (g * 0.5**5,)

    f.defvjp(fwd, bwd)
    return f


def _loop_found(x, mode):
    # Hand-written: the values tagged, one per iteration.
    ys = [x]
    for _ in range(4):
        ys.append(0.5 * ys[-1] + 1.0)
    return {"intermediates": {"y": ys[-1] if mode == "last" else sum(ys)}}


@pytest.mark.parametrize("mode", ["last", "sum"])
@pytest.mark.parametrize("kind", ["custom_vjp", "checkpointed"])
def test_handled_custom_vjp_runs_its_primal_once(kind, mode):
    """perf_diffrax_custom_vjp.py, diffrax_callback_count.py: primal ran twice."""
    # The handled program ran a tagged copy of the custom_vjp's primal beside the
    # original call.
    count = [0]

    def callback(_):
        count[0] += 1

    f = _loop_in_custom_vjp(callback, kind)
    x = jnp.float32(3.0)

    def calls(fn):
        count[0] = 0
        result = fn(x)
        jax.effects_barrier()
        return count[0], result

    plain_calls, plain_out = calls(jax.jit(f))
    assert plain_calls == 5
    handled_calls, (out, found) = calls(jax.jit(fx.handle(f, fx.Tag(mode=mode))))
    assert handled_calls == plain_calls
    assert_trees_close(out, plain_out)
    assert_trees_close(found, _loop_found(x, mode))


@pytest.mark.parametrize("with_callback", [False, True], ids=["no_cb", "cb"])
@pytest.mark.parametrize("kind", ["custom_vjp", "checkpointed"])
def test_grad_of_handle_with_callback_in_custom_vjp_loop(kind, with_callback):
    """bug_grad_custom_vjp_callback.py: grad(handle(f)), callback in a loop."""
    # With the callback, grad(handle(f)) failed: "Reverse-mode differentiation
    # does not work for lax.while_loop".
    f = _loop_in_custom_vjp((lambda i: None) if with_callback else None, kind)
    x = jnp.float32(3.0)

    def loss(x):
        return fx.handle(f, fx.Tag(mode="last"))(x)

    g, found = jax.grad(loss, has_aux=True)(x)
    assert_trees_close(g, jax.grad(f)(x))
    assert_trees_close(found, _loop_found(x, "last"))


#
# Compilation outside jit
#

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


# One listener for the whole session (jax 0.7 has no public way to remove one):
# it records into the list `_compiled_functions` sets while it runs.
_recording: list[list[str]] = []


def _listener(event, duration, **kwargs):
    del duration
    if event == _BACKEND_COMPILE and _recording:
        _recording[-1].append(kwargs.get("fun_name", "?"))


jax.monitoring.register_event_duration_secs_listener(_listener)


def _compiled_functions(fn, *args) -> list[str]:
    """Names of the functions XLA compiles while `fn(*args)` runs."""
    names: list[str] = []
    _recording.append(names)
    try:
        jax.block_until_ready(fn(*args))
    finally:
        _recording.pop()
    return names


@pytest.mark.parametrize("outer", ["grad", "vmap", "eager"])
def test_repeated_calls_outside_jit_compile_nothing(outer):
    """perf_grad_handle_recompiles.py: no recompiles of inner jits outside jit."""
    # grad(handle(f)) and vmap(handle(f)) recompiled the inner jit at every call.
    w = jnp.eye(4) * 0.5

    @jax.jit
    def inner(x):
        return jnp.tanh(w @ fx.tag(x, "x"))

    def f(x):
        return jnp.sum(inner(x) ** 2)

    h = fx.handle(f, fx.Tag())
    fn = {
        "grad": jax.grad(lambda x: h(x)[0]),
        "vmap": lambda x: jax.vmap(h)(x[None]),
        "eager": h,
    }[outer]
    plain = {
        "grad": jax.grad(f),
        "vmap": lambda x: jax.vmap(f)(x[None]),
        "eager": f,
    }[outer]
    x = jnp.ones(4)
    assert _compiled_functions(fn, x), "the first call compiles"
    _compiled_functions(plain, x)
    # With tracer-leak checking on (as in this suite) JAX compiles the eager
    # operations outside any jit again at every call, for the plain function
    # too: a repeated call compiles nothing more than the plain one does, and
    # never the handled program or the inner jit.
    allowed = set(_compiled_functions(plain, x))
    for _ in range(2):
        again = _compiled_functions(fn, x)
        assert set(again) <= allowed, again
        assert not any("handled" in n or "inner" in n for n in again), again


#
# Equinox wrappers that read the signature
#


class _Scale(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return fx.tag(self.w * x, "y")


# equinox warns about any `jax.vmap` of a callable holding arrays handed to
# `filter_jit` (its `__wrapped__` is the module): the warning is about the
# user's code, as it is for `eqx.filter_jit(jax.vmap(module))`.
@pytest.mark.filterwarnings("ignore:\\s*Possibly assigning a JAX-transformed")
@pytest.mark.parametrize("wrapper", ["filter_jit_vmap", "filter_jit"])
def test_filter_jit_of_handled_module(wrapper):
    """bug_filter_jit_signature.py: eqx.filter_jit of a handled module."""
    # filter_jit read the handled module's signature as (self, x) and failed with
    # "missing a required argument: 'x'".
    m = _Scale(jnp.array([1.0, -2.0, 0.5]))
    xs = jnp.array([[0.3, 1.0, -1.5], [2.0, 0.0, 4.0]])
    h = fx.handle(m, fx.Tag())
    if wrapper == "filter_jit_vmap":
        out, found = eqx.filter_jit(jax.vmap(h))(xs)
        assert_trees_close(out, m.w * xs)
        assert_trees_close(found, {"intermediates": {"y": (m.w * xs,)}})
    else:
        for x in xs:
            out, found = eqx.filter_jit(h)(x)
            assert_trees_close(out, m(x))
            assert_trees_close(found, {"intermediates": {"y": (m.w * x,)}})


#
# Error messages
#


def _fori(x, n):
    return jax.lax.fori_loop(0, n, lambda i, c: fx.tag(c + 1.0, "counter"), x)


@pytest.mark.parametrize("wrap", ["eager", "jit"])
def test_strict_in_while_loop_does_not_suggest_append(wrap):
    """err_messages.py: strict in a while loop suggested append (an error too)."""
    h = fx.handle(_fori, fx.Tag(mode="strict"))
    if wrap == "jit":
        h = jax.jit(h)
    with pytest.raises(ValueError, match="'counter'") as info:
        h(1.0, jnp.int32(3))
    message = str(info.value)
    assert "while_loop" in message
    assert "'last'" in message
    assert not re.search(r"(?i)\buse\b[^.]*append", message), message


@pytest.mark.parametrize("wrap", ["eager", "jit"])
def test_sum_failure_names_the_tag_not_a_reduce(wrap):
    """err_messages.py: a failing "sum" names the tag and speaks of no Reduce."""
    # It spoke of a Reduce and `fn(acc, x)` the user never wrote; with these
    # shapes, of neither the tag nor the sum ("add got incompatible shapes").

    def f(x):
        fx.tag(jnp.ones(2), "loss_terms")
        fx.tag(jnp.ones(3), "loss_terms")  # cannot be added to the first
        return x

    h = fx.handle(f, fx.Tag(mode="sum"))
    if wrap == "jit":
        h = jax.jit(h)
    with pytest.raises((ValueError, TypeError), match="'loss_terms'") as info:
        h(1.0)
    message = str(info.value)
    assert "Reduce" not in message, message
    assert "fn(acc" not in message, message


@pytest.mark.parametrize("handled", [True, False], ids=["handled", "unhandled"])
def test_non_array_leaf_at_top_level_has_no_empty_path(handled):
    """err_messages.py: tagging a string said "at ." with an empty path."""

    def f(x):
        fx.tag("hello", "greeting")
        return x

    with pytest.raises(TypeError, match="'greeting'") as info:
        (fx.handle(f, fx.Tag()) if handled else f)(1.0)
    message = str(info.value)
    assert "'hello'" in message
    assert not re.search(r"\bat \.", message), message


#
# jax_debug_nans
#


@pytest.fixture
def debug_nans():
    previous = jax.config.jax_debug_nans
    jax.config.update("jax_debug_nans", True)
    try:
        yield
    finally:
        jax.config.update("jax_debug_nans", previous)


def _log_doubled(x):
    return fx.tag(jnp.log(x), "log") * 2.0


@pytest.mark.parametrize("wrap", ["eager", "jit"])
def test_debug_nans_handled_values(debug_nans, wrap):
    """The issue: with jax_debug_nans on, a handled call gives the right values."""
    h = fx.handle(_log_doubled, fx.Tag())
    if wrap == "jit":
        h = jax.jit(h)
    x = jnp.array([1.0, 2.0, 4.0])
    out, found = h(x)
    assert_trees_close(out, 2.0 * jnp.log(x))
    assert_trees_close(found, {"intermediates": {"log": (jnp.log(x),)}})


@pytest.mark.parametrize("wrap", ["eager", "jit"])
def test_debug_nans_reports_the_nan_as_jax_does(debug_nans, wrap):
    """The issue: with jax_debug_nans on, a handled NaN raises as JAX does."""
    # It crashed with AttributeError: 'NoneType' object has no attribute 'frame'.
    x = jnp.array([1.0, -1.0])
    with pytest.raises(FloatingPointError):
        jax.jit(_log_doubled)(x)  # what JAX does without a handler
    h = fx.handle(_log_doubled, fx.Tag())
    if wrap == "jit":
        h = jax.jit(h)
    with pytest.raises(FloatingPointError, match="nan"):
        h(x)


#
# found lists names in the order the program first executed them
#


def _order_plain(x):
    fx.tag(x, "z_first")
    return fx.tag(x + 1.0, "a_second")


def _order_inner_jit(x):
    y = jax.jit(lambda x: fx.tag(x, "z_first") + 1.0)(x)
    return fx.tag(y, "a_second")


def _order_scan(x):
    def body(c, _):
        fx.tag(c, "z_first")
        return fx.tag(c * 2.0, "a_second"), None

    return jax.lax.scan(body, x, None, length=3)[0]


def _order_cond(x):
    y = jax.lax.cond(x > 0, lambda x: fx.tag(x, "z_first"), lambda x: x - 1.0, x)
    return fx.tag(y, "a_second")


def _order_scan_then_outside(x):
    def body(c, _):
        return fx.tag(c + 1.0, "z_first"), None

    c = jax.lax.scan(body, x, None, length=2)[0]
    return fx.tag(c, "a_second")


@pytest.mark.parametrize(
    "fn",
    [
        _order_plain,
        _order_inner_jit,
        _order_scan,
        _order_cond,
        _order_scan_then_outside,
    ],
    ids=lambda fn: fn.__name__.removeprefix("_order_"),
)
def test_found_lists_names_in_execution_order(fn):
    """The issue: found[collection] listed names sorted, not in execution order."""
    # (Not under an outer `jax.jit`: JAX returns every dict with sorted keys.)
    _, found = fx.handle(fn, fx.Tag())(jnp.float32(1.5))
    assert list(found["intermediates"]) == ["z_first", "a_second"]


#
# Tag names that match nothing
#


def _hidden(x):
    h = fx.tag(jnp.tanh(x), "hidden")
    return fx.tag(h * 2.0, "out")


@pytest.mark.parametrize("wrap", ["eager", "jit"])
def test_exact_name_matching_nothing_is_an_error(wrap):
    """The issue: Tag(names="hiden"), a typo, silently found nothing."""
    h = fx.handle(_hidden, fx.Tag(names="hiden"))
    if wrap == "jit":
        h = jax.jit(h)
    with pytest.raises(ValueError, match="'hiden'") as info:
        h(jnp.ones(2))
    assert "'hidden'" in str(info.value)
    assert "'out'" in str(info.value)


@pytest.mark.parametrize("wrap", ["eager", "jit"])
def test_glob_matching_nothing_is_empty(wrap):
    """The issue: a glob that matches nothing stays an empty dict."""
    h = fx.handle(_hidden, fx.Tag(names="zz*"))
    if wrap == "jit":
        h = jax.jit(h)
    x = jnp.ones(2)
    out, found = h(x)
    assert_trees_close(out, _hidden(x))
    assert found == {"intermediates": {}}


#
# Tags in a checkpoint inside a scan inside a checkpoint, under handle(grad(f))
#


def _nested_checkpoints(x):
    """`checkpoint(scan(checkpoint(body)))`, the nesting Equinox's bounded while
    loops build; "n" counts the body's executions."""

    @jax.checkpoint
    def body(c):
        fx.tag(c * 0.0 + 1.0, "n")
        return fx.tag(jnp.sin(c), "x")

    @jax.checkpoint
    def region(c):
        return jax.lax.scan(lambda c, _: (body(c), None), c, None, length=3)[0]

    return jnp.sum(region(x))


@pytest.mark.parametrize("mode", ["append", "sum", "last"])
@pytest.mark.parametrize("wrap", ["eager", "jit"])
def test_grad_collects_tags_in_nested_checkpoints_as_the_forward_pass(mode, wrap):
    """bug_grad_nested_checkpoint_scan.py: handle(jax.grad(f), Tag()) lost the
    tags in checkpoint(scan(checkpoint(body))), or reported them from the
    backward pass."""
    x = jnp.array([0.5, -1.0], jnp.float32)
    h = fx.handle(jax.grad(_nested_checkpoints), fx.Tag(mode=mode))
    grad, found = (jax.jit(h) if wrap == "jit" else h)(x)
    _, want = fx.handle(_nested_checkpoints, fx.Tag(mode=mode))(x)
    assert_trees_close(grad, jax.grad(_nested_checkpoints)(x))
    assert_trees_close(found, want)
    # The forward pass by hand: three executions, stacked over the iterations.
    xs = [np.sin(np.asarray(x))]
    for _ in range(2):
        xs.append(np.sin(xs[-1]))
    by_mode = {
        "append": ((np.ones((3, 2), np.float32),), (np.stack(xs),)),
        "sum": (np.full(2, 3.0, np.float32), sum(xs)),
        "last": (np.ones(2, np.float32), xs[-1]),
    }
    n, xs_want = by_mode[mode]
    assert_trees_close(found, {"intermediates": {"n": n, "x": xs_want}})


def test_grad_substitutes_in_nested_checkpoints():
    """bug_grad_nested_checkpoint_scan.py: under handle(jax.grad(f)) the
    substituted value is the one the backward pass differentiates at, and a
    Tag after the Substitute collects it, once per execution."""
    x, v = jnp.array([0.5, -1.0], jnp.float32), jnp.full(2, 0.1, jnp.float32)
    handled = fx.handle(
        jax.grad(_nested_checkpoints), fx.Substitute({"x": v}), fx.Tag(names="x")
    )
    grad, found = handled(x)

    # By hand: each `sin` is differentiated at its input, which after the
    # first iteration is the substituted value; the tangent passes through.
    def straight_through(x):
        c = x
        for _ in range(3):
            h = jnp.sin(c)
            c = h + jax.lax.stop_gradient(v - h)
        return jnp.sum(c)

    assert_trees_close(grad, jax.grad(straight_through)(x))
    assert_trees_close(grad, np.float32(np.cos(0.1) ** 2) * np.cos(np.asarray(x)))
    substituted = np.full((3, 2), 0.1, np.float32)
    assert_trees_close(found, {"intermediates": {"x": (substituted,)}})


def test_sites_of_grad_lists_the_sites_in_nested_checkpoints():
    """bug_grad_nested_checkpoint_scan.py: fx.sites(jax.grad(f)) listed none of
    the sites in checkpoint(scan(checkpoint(body)))."""
    x = jnp.array([0.5, -1.0], jnp.float32)
    forward = fx.sites(_nested_checkpoints)(x)["intermediates"]
    under_grad = fx.sites(jax.grad(_nested_checkpoints))(x)["intermediates"]
    assert list(under_grad) == list(forward) == ["n", "x"]
    for name in ("n", "x"):
        (info,) = under_grad[name]
        assert info == dataclasses.replace(forward[name][0], where=info.where)
        assert forward[name][0].where == "checkpoint > scan(length=3) > checkpoint"
        # JAX computes the outer region's forward part outside any checkpoint.
        assert info.where == "scan(length=3) > checkpoint"
        assert info.loops == (3, "other")


def _bounded_while(x):
    """Equinox's bounded while loop: over 256 steps, checkpointed scans of
    checkpointed scans."""

    def body(state):
        i, c = state
        return i + 1, fx.tag(jnp.sin(c) + 0.5, "c")

    state = (0, x)
    return jnp.sum(
        eqxi.while_loop(lambda s: s[0] < 5, body, state, max_steps=300, kind="bounded")[
            1
        ]
    )


def _checkpointed_blocks(x):
    """An Equinox model's blocks: a scan over `eqx.filter_checkpoint` blocks in
    an outer `eqx.filter_checkpoint`."""
    weights = np.array([0.5, -1.5, 2.0], np.float32)

    @eqx.filter_checkpoint
    def block(c, w):
        return fx.tag(jnp.tanh(c * w), "block")

    @eqx.filter_checkpoint
    def blocks(c):
        return jax.lax.scan(lambda c, w: (block(c, w), None), c, weights)[0]

    return jnp.sum(blocks(x) ** 2)


@pytest.mark.parametrize(
    "fn, modes",
    [(_bounded_while, ["sum", "last"]), (_checkpointed_blocks, ["append", "sum"])],
    ids=["eqxi_bounded_while", "eqx_checkpointed_blocks"],
)
def test_grad_collects_tags_in_equinox_nested_checkpoints(fn, modes, request):
    """bug_grad_nested_checkpoint_scan.py: handle(eqx.filter_grad(f), Tag())
    returned {} for an Equinox bounded while loop of over 256 steps, and for a
    scan over eqx.filter_checkpoint blocks in an outer one."""
    if fn is _bounded_while:  # a tag kept in a scan under grad (see the fixture)
        request.getfixturevalue("jax_leak_check_false_report")
    x = jnp.array([0.5, -1.0], jnp.float32)
    for mode in modes:
        grad, found = fx.handle(eqx.filter_grad(fn), fx.Tag(mode=mode))(x)
        _, want = fx.handle(fn, fx.Tag(mode=mode))(x)
        assert_trees_close(grad, jax.grad(fn)(x))
        assert_trees_close(found, want)
        assert found["intermediates"]
