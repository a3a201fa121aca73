"""Behaviour found using `effects` with diffrax, optax and Equinox (the scripts in
`repros/`), reproduced with plain JAX and Equinox: each test names its script."""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, devices, no_leak_checks
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

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


@pytest.mark.parametrize("mode", ["sum", "last"])
@pytest.mark.parametrize("order", ["plain_first", "vmap_first"])
@pytest.mark.parametrize("loop", ["scan", "while", "unrolled"])
def test_a_name_reduced_unbatched_and_under_a_vmap_in_one_loop_body(loop, order, mode):
    """optimistix's NelderMead in miniature: its step evaluates the objective
    (tagged) on one point and, under a vmap, on the simplex, in a
    `lax.while_loop` body. With the unbatched execution first, a loop's
    accumulator started without the vmap's batch axis and the reduction
    failed ("vmap was requested to map its argument along axis 0")."""

    def g(y):
        return fx.tag(jnp.sum(y**2), "obj")

    def step(ys):
        if order == "plain_first":
            a, v = g(ys[0]), jax.vmap(g)(ys)
        else:
            v, a = jax.vmap(g)(ys), g(ys[0])
        return ys * 0.5 + 0 * v[:, None] + 0 * a

    def f(ys):
        if loop == "while":
            body = lambda c: (c[0] + 1, step(c[1]))  # noqa: E731
            return lax.while_loop(lambda c: c[0] < 2, body, (0, ys))[1].sum()
        if loop == "scan":
            return lax.scan(lambda ys, _: (step(ys), None), ys, None, length=2)[0].sum()
        return step(step(ys)).sum()

    ys = jnp.arange(6.0).reshape(3, 2)
    # Hand-written, per example: the unbatched execution counts for every
    # example, the vmapped one for its own.
    plain = [jnp.sum(ys[0] ** 2), jnp.sum((ys[0] / 2) ** 2)]  # per step
    vmapped = [jnp.sum(ys**2, axis=1), jnp.sum((ys / 2) ** 2, axis=1)]
    expected = {
        "sum": sum(p + v for p, v in zip(plain, vmapped)),
        "last": vmapped[1] if order == "plain_first" else jnp.full(3, plain[1]),
    }[mode]
    out, found = fx.handle(f, fx.Tag(mode=mode))(ys)
    assert_trees_close(out, f(ys))
    assert_trees_close(found, {"intermediates": {"obj": expected}})


@pytest.mark.parametrize("tagged", [False, True], ids=["untagged", "tagged"])
def test_grad_of_a_handled_optimistix_solve_equals_the_plain_grad(tagged):
    """optimistix (its solves are Equinox filter primitives, which keep the
    jaxpr of the closure-converted objective among their params): the
    handled function's gradient failed, with no tag at all, in Equinox's
    check that a closure-converted function gets the arguments it was
    converted with ("called with different static arguments"): `handle`
    gave the primitive a copy of that jaxpr, made to trace custom rules per
    handling state."""
    optx = pytest.importorskip("optimistix")
    tag = fx.tag if tagged else lambda v, _: v

    def objective(y, a):
        return tag(jnp.sum((y - a) ** 2) + jnp.sum(y**4), "obj")

    def solution(a):
        solver = optx.BFGS(rtol=1e-6, atol=1e-6)
        return optx.minimise(objective, solver, jnp.zeros(2), args=a, max_steps=200)

    def loss(a):
        return jnp.sum(solution(a).value)

    a = jnp.array([0.5, 2.0])
    handled = fx.handle(loss, fx.Tag(mode="last"))
    # (JAX's tracer-leak checker fails in its own code on an optimistix solve
    # without effects: jax 0.10.2, optimistix 0.1.0, an IndexError from
    # `checking_leaks`)
    with no_leak_checks():
        grad = jax.grad(lambda a: handled(a)[0])(a)
        assert_trees_close(grad, jax.grad(loss)(a), rtol=1e-5)
        _, found = handled(a)
    if tagged:  # (the objective's last evaluation: at the solution)
        y = solution(a).value
        want = jnp.sum((y - a) ** 2) + jnp.sum(y**4)
        assert_trees_close(found, {"intermediates": {"obj": want}}, rtol=1e-5)
    else:
        assert found == {"intermediates": {}}


@pytest.mark.parametrize("solver", ["Newton", "Chord"])
def test_tags_in_an_optimistix_root_find_are_collected(solver):
    """optimistix's Newton and Chord linearize the tagged function and solve
    with that Jacobian in lineax's `linear_solve` primitive, which has no rule
    here: collecting a tag was refused, as if a handler had to act on its
    tangent there (it need not: `Tag` keeps the value, so its derivative is
    the identity); Chord, which takes the Jacobian once and applies it in its
    loop, was refused as a value JAX took out of a loop."""
    optx = pytest.importorskip("optimistix")
    solve = getattr(optx, solver)(rtol=1e-6, atol=1e-6)
    seen = []

    def fn(y, a, tagged):
        s = jnp.sum(y)
        if tagged:
            s = fx.tag(s, "ysum")
        else:  # the reference: every evaluation, by callback
            jax.debug.callback(lambda v: seen.append(float(v)), s)
        return jnp.tanh(y) + a * y - 1.0 + 0 * s

    def root(a, tagged):
        f = functools.partial(fn, tagged=tagged)
        return optx.root_find(f, solve, jnp.array([0.0, 0.5]), args=a).value

    a = jnp.array([0.5, 2.0])
    with no_leak_checks():  # (see the test above)
        plain = jax.block_until_ready(root(a, False))
        jax.effects_barrier()
        tagged = functools.partial(root, tagged=True)
        out, summed = fx.handle(tagged, fx.Tag(mode="sum"))(a)
        _, last = jax.jit(fx.handle(tagged, fx.Tag(mode="last")))(a)
        assert_trees_close(out, plain)
        assert len(seen) > 2
        assert_trees_close(
            summed, {"intermediates": {"ysum": np.float32(sum(seen))}}, rtol=1e-5
        )
        assert_trees_close(
            last, {"intermediates": {"ysum": np.float32(seen[-1])}}, rtol=1e-5
        )
        # A handler that changes the value would have to be differentiated
        # there: refused, by name.
        with pytest.raises(ValueError, match="tag 'ysum'"):
            fx.handle(tagged, fx.Intervene({"ysum": lambda v: v + 1.0}))(a)


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
    other = fx.Tag(names=lambda n: n.startswith("other"))
    out, found = fx.handle(jax.vmap(fn), other)(xs)
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
@pytest.mark.parametrize("outer", ["none", "jit", "vmap", "grad", "eqx_filter_jit"])
def test_found_lists_names_in_execution_order(fn, outer):
    """The issue: found[collection] listed names sorted, not in execution order;
    and under an outer `jax.jit`, `jax.vmap` or `jax.grad` (which rebuild
    `found` from its flattened leaves) sorted too."""
    handled = fx.handle(fn, fx.Tag())
    x = jnp.float32(1.5)
    if outer == "jit":
        _, found = jax.jit(handled)(x)
    elif outer == "eqx_filter_jit":
        _, found = eqx.filter_jit(handled)(x)
    elif outer == "vmap":
        _, found = jax.vmap(handled)(jnp.stack([x, x]))
    elif outer == "grad":
        _, found = jax.grad(lambda v: handled(v), has_aux=True)(x)
    else:
        _, found = handled(x)
    assert list(found["intermediates"]) == ["z_first", "a_second"]
    assert list(found) == ["intermediates"]


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
def test_glob_matching_nothing_is_an_error(wrap):
    """The issue: a glob that matched nothing (`names="hidn*"`, a typo) gave an
    empty dict without a word; it is now the error a name gets. A predicate
    may match nothing."""
    h = fx.handle(_hidden, fx.Tag(names="hidn*"))
    if wrap == "jit":
        h = jax.jit(h)
    x = jnp.ones(2)
    with pytest.raises(ValueError, match="no tag matching 'hidn\\*'") as info:
        h(x)
    assert "'hidden'" in str(info.value)
    h = fx.handle(_hidden, fx.Tag(names=lambda n: n.startswith("zz")))
    out, found = (jax.jit(h) if wrap == "jit" else h)(x)
    assert_trees_close(out, _hidden(x))
    assert found == {"intermediates": {}}


#
# lax.custom_root (repros: bug_custom_root_jax012.py,
# err_custom_root_tag_inside_jax012.py): from jax 0.11 a hijax primitive,
# `call_hi_primitive`, that JAX lowers only from a jaxpr marked as holding one
#


def _sqrt_root(a, where: str = ""):
    """sqrt(a) by Newton's method in `lax.custom_root`, with the tag "root"
    outside it and one more inside `f` or the solve function if `where` says."""

    def f(x):
        if where == "f":
            x = fx.tag(x, "in_f")
        return x**2 - a

    def solve(f, x0):
        def body(i, x):
            if where == "solve":
                x = fx.tag(x, "in_solve")
            return x - f(x) / (2 * x)

        return jax.lax.fori_loop(0, 20, body, x0)

    x = jax.lax.custom_root(f, jnp.ones_like(a), solve, lambda g, y: y / g(1.0))
    return fx.tag(x, "root")


_ROOT_WRAPS = ["eager", "jit", "grad_of_handle", "handle_of_grad", "vmap"]


def _run_root(wrap: str, fn, handler):
    """`(what the handled program returns, what the plain one returns, found,
    the plain root)`."""
    a = jnp.float32(2.0)
    if wrap == "vmap":
        a = jnp.array([2.0, 3.0, 5.0], jnp.float32)
        out, found = jax.vmap(fx.handle(fn, handler))(a)
        return out, jax.vmap(fn)(a), found, jax.vmap(_sqrt_root)(a)
    if wrap == "eager":
        out, found = fx.handle(fn, handler)(a)
        plain = fn(a)
    elif wrap == "jit":
        out, found = jax.jit(fx.handle(fn, handler))(a)
        plain = jax.jit(fn)(a)
    elif wrap == "grad_of_handle":
        out, found = jax.grad(fx.handle(fn, handler), has_aux=True)(a)
        plain = jax.grad(fn)(a)
    else:
        out, found = fx.handle(jax.grad(fn), handler)(a)
        plain = jax.grad(fn)(a)
    return out, plain, found, _sqrt_root(a)


@pytest.mark.parametrize("wrap", _ROOT_WRAPS)
def test_custom_root_with_a_tag_outside(wrap):
    """The issue: on jax 0.12 any `lax.custom_root` in a handled function failed
    to lower ("MLIR translation rule for primitive 'call_hi_primitive' not
    found"), with its only tag outside it."""
    out, plain, found, root = _run_root(wrap, _sqrt_root, fx.Tag())
    assert_trees_close(out, plain)
    assert_trees_close(found, {"intermediates": {"root": (root,)}})


# jax 0.12 makes `lax.custom_root` a hijax primitive, `CustomRoot`, whose
# functions effects cannot rewrite yet; before, a `custom_jvp` it rewrites.
_ROOT_IS_HIJAX = "CustomRoot" in str(jax.make_jaxpr(_sqrt_root)(1.0))


@pytest.mark.parametrize("wrap", _ROOT_WRAPS)
@pytest.mark.parametrize("where", ["f", "solve"])
def test_custom_root_with_a_tag_inside(where, wrap):
    """A tag inside `custom_root`'s `f` or solve function: on jax 0.12 it was
    lost without a word (or, with the tag outside too, the crash above); now it
    is collected where effects can rewrite `custom_root`, an error naming it
    where it cannot."""
    fn = functools.partial(_sqrt_root, where=where)
    handler = fx.Tag(mode="last")
    if _ROOT_IS_HIJAX:
        with pytest.raises(ValueError, match=rf"'in_{where}'.*`CustomRoot`"):
            _run_root(wrap, fn, handler)
        return
    out, plain, found, root = _run_root(wrap, fn, handler)
    assert_trees_close(out, plain)
    # Newton's method has converged by its last iterations: the last value
    # tagged inside is the root.
    assert_trees_close(found, {"intermediates": {f"in_{where}": root, "root": root}})


# Substitute, Perturb and Intervene inside a shard_map take the layout Tag() reports
#

_SHARDS = Mesh(np.array(devices(8)), ("i",))


def _sharded(local, in_specs=P("i"), out_specs=P("i")):
    return jax.shard_map(local, mesh=_SHARDS, in_specs=in_specs, out_specs=out_specs)


def _times_h(x):
    # The tag's value is per shard (2,); Tag() reports it stacked, (8, 2).
    return x * fx.tag(jnp.sin(x), "h")


_X16 = jnp.arange(16.0) / 5
_V = (jnp.arange(16.0).reshape(8, 2) - 3) / 7  # shard s gets _V[s]


def _substituted(handler):
    return fx.handle(_sharded(_times_h), handler)


@pytest.mark.parametrize("wrap", ["eager", "jit"])
def test_shard_map_substitute_takes_the_tag_layout(wrap):
    # (repros: bug_shard_map_substitute.py)
    """The issue: Substitute({"h": v}) inside a shard_map refused v in the layout
    Tag() reports ((8, 2): one entry per shard), and the per-shard value (2,)
    crashed inside JAX on its varying-axes check. Per call, as before, the same
    layout in a tuple."""
    f = _sharded(_times_h)
    found = fx.handle(f, fx.Tag())(_X16)[1]["intermediates"]["h"][0]
    assert found.shape == (8, 2)

    for per_call in (False, True):

        def run(v):
            value = (v,) if per_call else v
            h = fx.handle(f, fx.Substitute({"h": value}, per_call=per_call))
            return (jax.jit(h) if wrap == "jit" else h)(_X16)[0]

        # What Tag() found leaves f unchanged; a made-up value reaches its shard.
        assert_trees_close(run(found), f(_X16))
        assert_trees_close(run(_V), _X16 * _V.reshape(16))


def test_shard_map_substitute_grads():
    """Gradients with respect to the input and to the substituted value, each
    shard's slice its own."""
    w = jnp.arange(16.0)
    for per_call in (False, True):

        def loss(x, v):
            values = {"h": (v,) if per_call else v}
            out = _substituted(fx.Substitute(values, per_call=per_call))(x)[0]
            return jnp.sum(w * out)

        gx, gv = jax.grad(loss, argnums=(0, 1))(_X16, _V)
        # loss = sum_s sum_j w[2s+j] x[2s+j] v[s, j]
        assert_trees_close(gx, w * _V.reshape(16))
        assert_trees_close(gv, (w * _X16).reshape(8, 2))


def test_shard_map_substitute_under_vmap():
    """A vmap outside handle (the value batched with the input), and one inside
    it (the batch axis first, then the shard axis, as Tag() reports)."""
    xs = jnp.stack([_X16, 2 * _X16, -_X16])
    vs = jnp.stack([_V, 2 * _V, _V + 1])
    expected = xs * vs.reshape(3, 16)
    batched = jax.vmap(_sharded(_times_h))
    found = fx.handle(batched, fx.Tag())(xs)[1]["intermediates"]["h"][0]
    assert found.shape == (3, 8, 2)
    for per_call in (False, True):

        def value(v):
            return {"h": (v,) if per_call else v}

        def one(x, v):
            return _substituted(fx.Substitute(value(v), per_call=per_call))(x)[0]

        assert_trees_close(jax.vmap(one)(xs, vs), expected)
        inside = fx.handle(batched, fx.Substitute(value(vs), per_call=per_call))
        assert_trees_close(inside(xs)[0], expected)
        again = fx.handle(batched, fx.Substitute(value(found), per_call=per_call))
        assert_trees_close(again(xs)[0], batched(xs))


def _scan_of_sin(x):
    def step(c, _):
        return c + fx.tag(jnp.sin(c), "h"), None

    return jax.lax.scan(step, x, None, length=3)[0]


def test_shard_map_substitute_in_and_around_scans():
    """A scan inside the shard_map, and one around it: a value for every
    execution has the shard axis and no scan axis; per call, Tag()'s layout
    (shards, then scan iterations) round-trips."""
    inside = _sharded(_scan_of_sin)

    def around(x):
        def step(c, _):
            return _sharded(lambda y: y + fx.tag(jnp.sin(y), "h"))(c), None

        return jax.lax.scan(step, x, None, length=3)[0]

    for f in (inside, around):
        out, found = fx.handle(f, fx.Tag())(_X16)
        h = found["intermediates"]["h"][0]
        assert h.shape == (8, 3, 2)
        again = fx.handle(f, fx.Substitute({"h": (h,)}, per_call=True))(_X16)[0]
        assert_trees_close(again, out)
        # Every iteration adds shard s's _V[s].
        patched = fx.handle(f, fx.Substitute({"h": _V}))(_X16)[0]
        assert_trees_close(patched, _X16 + 3 * _V.reshape(16))


def test_shard_map_substitute_vmap_inside_the_body():
    """A vmap inside the shard_map's body: its batch axis comes before the shard
    axis in Tag()'s layout, and so in the value substituted."""

    def local(x):  # per shard (2,), as a vmap over two rows of one
        return jax.vmap(lambda r: r * fx.tag(jnp.cos(r), "h"))(x.reshape(2, 1))

    f = _sharded(local, out_specs=P("i"))
    found = fx.handle(f, fx.Tag())(_X16)[1]["intermediates"]["h"][0]
    assert found.shape == (2, 8, 1)
    assert_trees_close(fx.handle(f, fx.Substitute({"h": found}))(_X16)[0], f(_X16))
    v = jnp.arange(16.0).reshape(2, 8, 1)  # v[j, s]: row j of shard s
    out = fx.handle(f, fx.Substitute({"h": v}))(_X16)[0]
    expected = _X16.reshape(8, 2, 1) * jnp.transpose(v, (1, 0, 2))
    assert_trees_close(out, expected.reshape(16, 1))


def test_pmap_substitute_takes_the_tag_layout():
    """pmap lowers to a shard_map: its axis is the shard axis."""
    f = jax.pmap(_times_h, devices=devices(8))
    x = _X16.reshape(8, 2)
    found = fx.handle(f, fx.Tag())(x)[1]["intermediates"]["h"][0]
    assert found.shape == (8, 2)
    assert_trees_close(fx.handle(f, fx.Substitute({"h": found}))(x)[0], f(x))
    assert_trees_close(fx.handle(f, fx.Substitute({"h": _V}))(x)[0], x * _V)


def test_shard_map_perturb_deltas():
    """Perturb deltas inside a shard_map, in the layout Perturb() reports: the
    gradient with respect to them is the one to each shard's value."""

    def local(x):
        return x * fx.perturb(jnp.sin(x), "h")

    f = _sharded(local)
    zeros = fx.handle(f, fx.Perturb())(_X16)[1]["perturbations"]
    assert jax.tree.map(jnp.shape, zeros) == {"h": ((8, 2),)}

    def loss(deltas):
        return jnp.sum(fx.handle(f, fx.Perturb(deltas))(_X16)[0] ** 2)

    assert_trees_close(loss(zeros), jnp.sum(f(_X16) ** 2))
    out = fx.handle(f, fx.Perturb({"h": (_V,)}))(_X16)[0]
    assert_trees_close(out, _X16 * (jnp.sin(_X16) + _V.reshape(16)))
    grads = jax.jit(jax.grad(loss))(zeros)["h"][0]
    # d/dh of sum((x h)^2) = 2 x^2 h
    assert_trees_close(grads, (2 * _X16**2 * jnp.sin(_X16)).reshape(8, 2))

    # A site every shard holds alike (out_specs=P()) takes no delta per shard:
    # an error naming it, not JAX's internal one.
    def alike(x, w):
        return fx.perturb(2 * w, "w")

    g = _sharded(alike, in_specs=(P("i"), P()), out_specs=P())
    w = jnp.ones(3)
    zeros = fx.handle(g, fx.Perturb())(_X16, w)[1]["perturbations"]
    assert jax.tree.map(jnp.shape, zeros) == {"w": ((8, 3),)}
    with pytest.raises(ValueError, match="'w'.*Handle inside the shard_map"):
        fx.handle(g, fx.Perturb(zeros))(_X16, w)


def test_shard_map_intervene_sees_one_shard():
    """Intervene's function gets one shard's value (as it gets one example's
    under a vmap), and may return a value built without the shard's (zeros),
    which JAX's varying-axes check refused."""
    seen = []

    def double(h):
        seen.append(h.shape)
        return 2 * h

    f = _sharded(_times_h)
    out = fx.handle(f, fx.Intervene({"h": double}))(_X16)[0]
    assert_trees_close(out, 2 * f(_X16))
    assert set(seen) == {(2,)}
    zero = fx.handle(f, fx.Intervene({"h": jnp.zeros_like}))(_X16)[0]
    assert_trees_close(zero, jnp.zeros(16))
    with pytest.raises(ValueError, match=r"'h'.*float32\[2\]"):
        fx.handle(f, fx.Intervene({"h": lambda h: h[0]}))(_X16)


def test_shard_map_substitute_of_one_shards_value_and_a_wrong_layout():
    """One shard's value (2,) is every shard's (as one example's value is every
    example's under a vmap; it crashed inside JAX's varying-axes check); a
    value in neither layout is an error naming the tag and the layout."""
    v = jnp.array([0.5, -2.0])
    out, _ = _substituted(fx.Substitute({"h": v}))(_X16)
    assert_trees_close(out, _X16 * jnp.tile(v, 8))
    with pytest.raises(ValueError, match="'h'") as info:
        _substituted(fx.Substitute({"h": jnp.ones((4, 2))}))(_X16)
    message = str(info.value)
    assert "(8, 2)" in message and "broadcast_to" in message
    assert "jax-ml/jax/issues" not in message


@pytest.mark.parametrize("per_call", [False, True])
def test_shard_map_substitute_of_a_value_every_shard_holds_is_an_error(per_call):
    """A tagged value every shard holds alike (out_specs=P()) cannot be replaced
    by one value per shard: an error naming the tag, not JAX's internal one
    (as under a vmap that leaves a leaf unbatched)."""

    def local(x, w):
        return fx.tag(2 * w, "w")

    f = _sharded(local, in_specs=(P("i"), P()), out_specs=P())
    w = jnp.ones(3)
    found = fx.handle(f, fx.Tag())(_X16, w)[1]["intermediates"]["w"][0]
    assert found.shape == (8, 3)
    values = {"w": (found,) if per_call else found}
    with pytest.raises(ValueError, match="'w'.*Handle inside the shard_map"):
        fx.handle(f, fx.Substitute(values, per_call=per_call))(_X16, w)


# A jitted custom_vjp/custom_jvp function handled after another order of
# `handle` and a transformation (diffrax's BacksolveAdjoint)
#


def _custom_loop_loss(rule: str, loop: str):
    """`x -> solve(x) ** 2`, `solve` a `jax.jit` (whose trace JAX caches) of a
    `rule` ("custom_vjp" or "custom_jvp") function running `loop` ("while",
    "scan": 2 steps, "cond": 1) over a step that tags a discarded count "n" and
    the used value "h"; its rules run the loop once more. A new function at each
    call: new caches."""

    def step(x):
        fx.tag(jnp.float32(1.0), "n")  # discarded: counts executions
        return fx.tag(jnp.sin(x), "h")

    def inner(x):
        if loop == "while":
            body = lambda c: (c[0] + 1, step(c[1]))  # noqa: E731
            return jax.lax.while_loop(lambda c: c[0] < 2, body, (0, x))[1]
        if loop == "scan":
            return jax.lax.scan(lambda c, _: (step(c), None), x, None, length=2)[0]
        return jax.lax.cond(x > 0, step, lambda x: x, x)

    if rule == "custom_vjp":
        g = jax.custom_vjp(inner)
        g.defvjp(lambda x: (inner(x), x), lambda x, ct: (ct * inner(x),))
    else:
        g = jax.custom_jvp(inner)

        @g.defjvp
        def _(primals, tangents):
            y = inner(primals[0])
            return y, tangents[0] * jnp.cos(y)

    solve = jax.jit(g)
    return lambda x: solve(x) ** 2


_X = 0.5


def _custom_loop_reference(rule: str, loop: str, rules_run: bool):
    """Hand-written: the gradient, and what Tag(mode="sum") finds where the
    primal runs once (`rules_run` False) or the rules run instead (a
    custom_vjp's forward and backward rules run the loop twice)."""
    hs = [float(np.sin(np.float32(_X)))]
    if loop != "cond":
        hs.append(float(np.sin(np.float32(hs[-1]))))
    y = hs[-1]
    times = 2 if rules_run and rule == "custom_vjp" else 1
    grad = 2 * y * y if rule == "custom_vjp" else 2 * y * np.cos(y)
    found = {"intermediates": {"h": times * sum(hs), "n": times * len(hs)}}
    return jnp.float32(grad), jax.tree.map(jnp.float32, found)


# (rule, loop) pairs whose discarded tag a stale trace lost: the custom_jvp's
# rule keeps its scan and cond tag either way.
_CUSTOM_LOOPS = [
    ("custom_vjp", "while"),
    ("custom_vjp", "scan"),
    ("custom_vjp", "cond"),
    ("custom_jvp", "while"),
]


def _handled(loss):
    return lambda x: fx.handle(loss, fx.Tag(mode="sum"))(x)


# Transformations of `handle(loss)` that trace the custom rule outside `handle`.
_DIFFERENTIATED_HANDLE = {
    "grad": lambda loss, x: jax.grad(_handled(loss), has_aux=True)(x),
    "linearize": lambda loss, x: jax.linearize(lambda x: _handled(loss)(x)[0], x),
    "jit_grad": lambda loss, x: jax.jit(jax.grad(_handled(loss), has_aux=True))(x),
    "grad_jit": lambda loss, x: jax.grad(jax.jit(_handled(loss)), has_aux=True)(x),
    "vmap_grad": lambda loss, x: jax.vmap(jax.grad(_handled(loss), has_aux=True))(
        jnp.stack([x, x])
    ),
    "grad_vmap": lambda loss, x: jax.grad(
        lambda xs: jnp.sum(jax.vmap(_handled(loss))(xs)[0])
    )(jnp.stack([x, x])),
}


@pytest.mark.parametrize(
    "rule, loop, before",
    [(rule, loop, "grad") for rule, loop in _CUSTOM_LOOPS]
    + [("custom_vjp", "scan", b) for b in _DIFFERENTIATED_HANDLE if b != "grad"],
)
def test_handle_of_grad_after_a_transformed_handle(rule, loop, before):
    """bug_stale_trace_after_grad_of_handle.py: handle(grad(f)) lost a tag."""
    # After jax.grad(handle(loss)) (or any transformation that differentiates
    # it), handle(jax.grad(loss)) lost the discarded tag in the custom rule: JAX
    # had traced the rule for that call outside `handle` and served the trace
    # again.
    x = jnp.float32(_X)
    want = fx.handle(jax.grad(_custom_loop_loss(rule, loop)), fx.Tag(mode="sum"))(x)
    assert_trees_close(want, _custom_loop_reference(rule, loop, rules_run=True))
    loss = _custom_loop_loss(rule, loop)
    _DIFFERENTIATED_HANDLE[before](loss, x)
    got = fx.handle(jax.grad(loss), fx.Tag(mode="sum"))(x)
    assert_trees_close(got, want)
    got = fx.handle(jax.jit(jax.grad(loss)), fx.Tag(mode="sum"))(x)
    assert_trees_close(got, want)


@pytest.mark.parametrize(
    "rule, loop, before",
    [(rule, loop, "jit") for rule, loop in _CUSTOM_LOOPS]
    + [("custom_vjp", "scan", "vmap")],
)
def test_grad_of_handle_after_a_handle_of_grad(rule, loop, before):
    """bug_stale_trace_after_grad_of_handle.py, the other order."""
    # The custom rule traced for handle(jax.grad(loss)) was served to a later
    # jax.grad(handle(loss)), whose program then held sites carrying the effect
    # `handle` gives them while it traces: a program with no handler left in it
    # stayed effectful, off jit's fast path.
    x = jnp.float32(_X)
    fresh = _custom_loop_loss(rule, loop)
    want = jax.grad(_handled(fresh), has_aux=True)(x)
    assert_trees_close(want, _custom_loop_reference(rule, loop, rules_run=False))
    want_effects = jax.make_jaxpr(jax.grad(_handled(fresh), has_aux=True))(x).effects
    loss = _custom_loop_loss(rule, loop)
    inner = jax.grad(loss) if before == "vmap" else jax.jit(jax.grad(loss))
    if before == "vmap":
        jax.vmap(fx.handle(inner, fx.Tag(mode="sum")))(jnp.stack([x, x]))
    else:
        jax.jit(fx.handle(inner, fx.Tag(mode="sum")))(x)
    for transformed in [
        jax.grad(_handled(loss), has_aux=True),
        jax.grad(jax.jit(_handled(loss)), has_aux=True),
    ]:
        assert_trees_close(transformed(x), want)
        assert jax.make_jaxpr(transformed)(x).effects == want_effects


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
    substitution reaches every execution, and a Tag after the Substitute
    collects it, once per execution."""
    x, v = jnp.array([0.5, -1.0], jnp.float32), jnp.full(2, 0.1, jnp.float32)
    handled = fx.handle(
        jax.grad(_nested_checkpoints), fx.Substitute({"x": v}), fx.Tag(names="x")
    )
    grad, found = handled(x)
    # The substituted value carries no derivative (as under grad(handle(f))).
    want = jax.grad(
        lambda x: fx.handle(_nested_checkpoints, fx.Substitute({"x": v}))(x)[0]
    )
    assert_trees_close(grad, want(x))
    assert_trees_close(grad, np.zeros(2, np.float32))
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
        info, cotangent = under_grad[name]
        assert cotangent.part == "cotangent"
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


#
# One layer of a scanned stack of Equinox blocks
#


class _Block(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x):
        return x + jnp.tanh(self.lin(x))


class _Stacked(eqx.Module):
    blocks: _Block  # stacked: every leaf has a leading axis of layers

    def __call__(self, x):
        dyn, static = eqx.partition(self.blocks, eqx.is_array)
        step = lambda x, d: (eqx.combine(d, static)(x), None)  # noqa: E731
        return jax.lax.scan(step, x, dyn)[0]


def test_intervene_patches_one_layer_of_a_scanned_equinox_stack():
    """scale_scan_intervene_one_layer.py: in a scan over stacked Equinox blocks
    (`eqx.filter_vmap` + `lax.scan`), Intervene's function saw no layer index,
    so one layer could not be patched alone."""
    keys = jax.random.split(jax.random.key(0), 4)
    make = lambda k: _Block(eqx.nn.Linear(3, 3, key=k))  # noqa: E731
    model = _Stacked(eqx.filter_vmap(make)(keys))
    tagged = fx.tag_modules(model)
    x_clean, x_corrupt = jnp.ones(3), -jnp.ones(3)
    clean = fx.handle(tagged, fx.Tag())(x_clean)[1]["intermediates"]["blocks"][0]

    def by_hand(x, k):
        dyn, static = eqx.partition(model.blocks, eqx.is_array)
        for i in range(4):
            x = eqx.combine(jax.tree.map(lambda a: a[i], dyn), static)(x)
            x = clean[k] if i == k else x
        return x

    def patched(k):
        def patch(v, at):
            return jnp.where(at[1] == k, clean[k], v)

        return fx.handle(tagged, fx.Intervene({"blocks": patch}))(x_corrupt)[0]

    grid = jax.jit(jax.vmap(patched))(jnp.arange(4))
    for k in range(4):
        assert_trees_close(grid[k], by_hand(x_corrupt, k), rtol=1e-5)
        assert_trees_close(patched(k), by_hand(x_corrupt, k), rtol=1e-5)


#
# The gradient at a value the batch does not change
#


class _Embedder(eqx.Module):
    wte: eqx.nn.Embedding
    wpe: eqx.nn.Embedding
    out: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.wte = eqx.nn.Embedding(7, 4, key=k[0])
        self.wpe = eqx.nn.Embedding(5, 4, key=k[1])
        self.out = eqx.nn.Linear(4, 1, key=k[2])

    def __call__(self, tokens, pos_delta=0.0):  # one example: (T,)
        h = jax.vmap(self.wte)(tokens)
        h = h + jax.vmap(self.wpe)(jnp.arange(tokens.shape[0])) + pos_delta
        return jnp.sum(jax.vmap(self.out)(jnp.tanh(h)))


def test_intermediate_grads_at_a_position_embedding():
    """scale_intermediate_grads_unbatched_tag.py: intermediate_grads(kind="tag")
    refused a loss vmapping over the batch whose tagged position embedding
    (`jax.vmap(self.wpe)(jnp.arange(T))`) does not depend on the example."""
    model = _Embedder(jax.random.key(0))
    tokens = jnp.array([[1, 2, 3], [4, 5, 6]])

    def loss(m, tokens):
        return jnp.mean(jax.vmap(m)(tokens))

    value, grads = fx.intermediate_grads(loss, kind="tag")(
        fx.tag_modules(model), tokens
    )

    def by_hand(deltas):  # one delta per example at the position embedding
        return jnp.mean(jax.vmap(model)(tokens, deltas))

    zeros = jnp.zeros((2, 3, 4))
    assert_trees_close(value, loss(model, tokens))
    assert_trees_close(grads["wpe"], (jax.grad(by_hand)(zeros),), rtol=1e-5)
    assert grads["wte"][0].shape == (2, 3, 4)


# find_nonfinite(backward=True) when the forward pass is already non-finite
#


class _Net(eqx.Module):
    """The model of scale_find_nonfinite_backward_forward_nan.py."""

    l0: eqx.nn.Linear
    l1: eqx.nn.Linear
    l2: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.l0, self.l1, self.l2 = (eqx.nn.Linear(4, 4, key=ki) for ki in k[:3])
        self.out = eqx.nn.Linear(4, 1, key=k[3])

    def __call__(self, x):
        for layer in (self.l0, self.l1, self.l2):
            x = jnp.tanh(layer(x))
        return self.out(x)[0]


def test_find_nonfinite_backward_reports_the_nan_weight_of_the_forward_pass():
    """scale_find_nonfinite_backward_forward_nan.py: with a NaN weight in l1,
    find_nonfinite(..., backward=True) named 'out', the tag nearest the loss
    where the backward pass first meets a NaN cotangent, not l1, whose value
    the forward pass already holds non-finite."""
    net = _Net(jax.random.key(0))
    bad = eqx.tree_at(lambda m: m.l1.weight, net, net.l1.weight.at[0, 0].set(jnp.nan))
    tagged = fx.tag_modules(bad)

    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    x = jnp.ones((2, 4))
    # The reference: l0's value is finite, l1's is not.
    h0 = jax.vmap(lambda v: jnp.tanh(bad.l0(v)))(x)
    assert bool(jnp.all(jnp.isfinite(h0)))
    assert not bool(jnp.all(jnp.isfinite(jax.vmap(bad.l1)(h0))))

    forward = fx.find_nonfinite(loss, tagged, x)
    backward = fx.find_nonfinite(loss, tagged, x, backward=True)
    assert forward == backward == fx.BadSite("l1", "intermediates", 0, None)
    assert not backward.backward
    assert "forward pass is already non-finite" in str(backward)


#
# What real code found at 545a672 (repros: bug_scan_invariant_tag_under_grad,
# bug_two_reporting_handlers_one_name, bug_sum_mode_low_precision,
# perf_eager_grad_scan_recompiles_jax010, err_stats_key_tag,
# err_jacfwd_vmap_out_axes)
#


def _invariant_in_scan(x, w):
    def body(c, _):
        u = fx.tag(w * 2.0, "u")  # computed from what the body closes over only
        return jnp.sin(c) * u, None

    return lax.scan(body, x, None, length=3)[0]


@pytest.mark.parametrize(
    "handler",
    [
        fx.Intervene({"u": lambda v, at: v * (1.0 + at[-1])}),
        fx.Tag(mode="sum"),
        fx.Tag(),
    ],
    ids=["intervene_at", "sum", "append"],
)
def test_a_hoisted_loop_invariant_tag_is_refused_not_seen_once(handler):
    x, w = jnp.float32(0.5), jnp.float32(0.7)
    with pytest.raises(ValueError, match="'u'.*computes from what the loop closes"):
        fx.handle(jax.grad(_invariant_in_scan, argnums=1), handler)(x, w)
    # The way the message gives is the law's other side: per iteration.
    g, found = (
        jax.grad(
            lambda w: fx.handle(_invariant_in_scan, fx.Tag(mode="sum"))(x, w)[0],
            has_aux=False,
        )(w),
        fx.handle(_invariant_in_scan, fx.Tag(mode="sum"))(x, w)[1],
    )
    np.testing.assert_allclose(found["intermediates"]["u"], 3 * 1.4, rtol=1e-6)
    np.testing.assert_allclose(g, jax.grad(_invariant_in_scan, argnums=1)(x, w))


def test_a_loop_invariant_tag_keeps_its_cotangent_per_iteration():
    # The derivative site stays in the loop: a handler of the cotangent is exact.
    x, w = jnp.float32(0.5), jnp.float32(0.7)
    _, found = fx.handle(
        jax.grad(_invariant_in_scan, argnums=1), fx.Tag(of="cotangent")
    )(x, w)
    _, want = fx.intermediate_grads(_invariant_in_scan, kind="tag")(x, w)
    assert_trees_close(found["intermediates:cotangent"]["u"], want["u"])


class _Clip(fx.Handler):
    # The guide's handler: clips, and counts what it clipped.
    mode = fx.Reduce(lambda acc, x: acc + x, lambda value: jnp.zeros((), jnp.int32))

    def apply(self, site, value, ctx):
        clipped = jnp.clip(value, -0.5, 0.5)
        ctx.emit(jnp.sum(clipped != value, dtype=jnp.int32))
        return clipped


def _doubling(x):
    return lax.scan(lambda h, _: (fx.tag(2.0 * h, "h"), None), x, None, length=3)[0]


def _doubling_clipped(x):
    """`_doubling` under `_Clip`, by hand: the output and the count."""
    h, count = np.asarray(x), 0
    for _ in range(3):
        h, before = np.clip(2.0 * h, -0.5, 0.5), 2.0 * h
        count += int(np.sum(h != before))
    return h, count


@pytest.mark.parametrize("wrap", ["eager", "jit"])
def test_two_handlers_reporting_one_name_keep_one_report_not_a_loss(wrap):
    # One site, one report: the first handler that reports a site consumes it,
    # so no report overwrites another (Tag's used to replace Clip's, silently).
    x = jnp.array([0.05, 0.3, -0.2])
    want, count = _doubling_clipped(x)
    handled = fx.handle(_doubling, _Clip(), fx.Tag())
    handled = jax.jit(handled) if wrap == "jit" else handled
    with warnings.catch_warnings():
        # (said once per rewrite, which `handle` caches: the test in
        # tests/test_handle.py::test_a_handler_naming_none_whose_every_site_...)
        warnings.filterwarnings("ignore", "Tag matches no site left", UserWarning)
        out, found = handled(x)
    assert_trees_close((out, found), (want, {"intermediates": {"h": np.int32(count)}}))
    assert count == 5
    # Nested, the same: the inner Clip consumed the site.
    (out, inner), outer = fx.handle(fx.handle(_doubling, _Clip()), fx.Tag())(x)
    assert_trees_close(
        (out, inner, outer),
        (want, {"intermediates": {"h": np.int32(5)}}, {"intermediates": {}}),
    )
    # Tag first: it consumes, and leaves nothing for a second that matches
    # every name (a predicate may match nothing: a warning, once per rewrite).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Tag matches no site left", UserWarning)
        _, found = fx.handle(_doubling, fx.Tag(), fx.Tag(mode="sum", names=bool))(x)
    assert found["intermediates"]["h"][0].shape == (3, 3)


def test_sum_counts_as_jnp_sum_does_for_narrow_dtypes():
    def f(x):
        def body(c, _):
            fx.tag(c > 0, "pos")
            fx.tag(jnp.int8(1), "count_i8")
            fx.tag(jnp.ones((), jnp.bfloat16), "one_bf16")
            fx.tag(jnp.float32(0.5), "half")
            return c + 1, None

        return lax.scan(body, x, None, length=300)[0]

    x = jnp.float32(-10.0)
    _, summed = fx.handle(f, fx.Tag(mode="sum"))(x)
    _, stacked = fx.handle(f, fx.Tag())(x)
    got = summed["intermediates"]
    for name in ("pos", "count_i8", "one_bf16", "half"):
        want = np.sum(np.asarray(stacked["intermediates"][name][0], np.float64))
        assert float(got[name]) == want, name
    assert got["pos"].dtype == got["count_i8"].dtype == jnp.sum(jnp.int8(1)).dtype
    assert got["one_bf16"].dtype == jnp.float32
    assert got["half"].dtype == jnp.float32


def _keyed(k, x):
    k = fx.tag(k, "key")
    return fx.tag(jnp.tanh(x) + jax.random.normal(k, x.shape), "h")


def test_a_tagged_prng_key_under_stats_and_sum():
    k, x = jax.random.key(42), jnp.ones(3)
    _, found = fx.handle(_keyed, fx.Stats())(k, x)
    stats = found["intermediates"]["key"][0]
    data = np.asarray(jax.random.key_data(k), np.float64)
    assert stats.dtype == str(k.dtype) and data.max() > 0
    np.testing.assert_allclose(float(stats["mean"]), data.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(stats["max"]), data.max())
    assert "key" in str(fx.summary(found))
    assert "key" in str(fx.summary(fx.handle(_keyed, fx.Tag())(k, x)[1]))
    with pytest.raises(ValueError, match="Tag sums tag 'key'.*PRNG key.*no sum"):
        fx.handle(_keyed, fx.Tag(mode="sum"))(k, x)
    # "last" and "append" keep the key.
    _, last = fx.handle(_keyed, fx.Tag(mode="last"))(k, x)
    assert jnp.array_equal(
        jax.random.key_data(last["intermediates"]["key"]), jax.random.key_data(k)
    )


_W = jnp.array([[0.5, -0.3], [0.2, 0.8]])


def _cubed(v):
    return jnp.sum(fx.tag(jnp.tanh(v @ _W), "h") ** 3)


@pytest.mark.parametrize("transform", [jax.jacfwd, jax.hessian])
def test_jacfwd_inside_handle_names_the_handler_and_the_tag(transform):
    H = fx.Intervene({"h": lambda a: a * 1.5})
    x = jnp.array([0.3, -0.7])
    with pytest.raises(ValueError, match="Intervene changes tag 'h'.*jax.jacfwd"):
        fx.handle(transform(_cubed), H)(x)
    # The way it gives: the handled function differentiated.
    got = transform(lambda v: fx.handle(_cubed, H)(v)[0])(x)
    want = transform(lambda v: jnp.sum((1.5 * jnp.tanh(v @ _W)) ** 3))(x)
    assert_trees_close(got, want)


def test_eager_grad_of_a_handled_scan_compiles_once():
    def f(x, w):
        h = fx.tag(jnp.tanh(x * w), "h")
        scan = lax.scan(lambda c, _: (fx.tag(jnp.sin(c), "s"), None), h, None, length=3)
        return jnp.sum(scan[0] ** 2)

    w = jnp.float32(1.5)
    handled = fx.handle(f, fx.Tag())
    step = jax.grad(lambda x: handled(x, w)[0])
    plain = jax.grad(lambda x: f(x, w))
    x = jnp.full((4,), 0.1)
    _compiled_functions(step, x)
    # (as above: under leak checks eager operations compile at every call, the
    # plain function's too; jax 0.10 compiled the scan's transpose every call)
    for i in range(2, 4):
        again = _compiled_functions(step, x * i)
        assert not any("scan" in n for n in again), again
        assert_trees_close(step(x * i), plain(x * i))


def test_at_in_a_while_loop_a_vmap_batches_is_refused_by_name():
    # (jax's batched loop keeps one iteration count for every example: the
    # count `at` reads was a scalar, and lowering failed with a bare
    # AssertionError naming nothing)
    class LastIteration(fx.Handler):
        mode = fx.Reduce(lambda acc, x: x, lambda z: jnp.int32(-1))

        def apply(self, site, value, ctx):
            ctx.emit(ctx.at[1])
            return value

    def count(n):
        return jax.lax.while_loop(lambda c: c < n, lambda c: fx.tag(c + 1, "c"), 0)

    with pytest.raises(
        ValueError, match="reads `at` in the lax.while_loop holding tag 'c'"
    ):
        fx.handle(jax.vmap(count), LastIteration())(NS)
    _, found = jax.vmap(fx.handle(count, LastIteration()))(NS)
    np.testing.assert_array_equal(found["intermediates"]["c"], np.maximum(NS, 1) - 1)


@pytest.mark.parametrize(
    ("handler", "reference"),
    [
        (fx.Tag(), lambda x: x**2),
        (fx.Intervene({"f": lambda v: 2 * v}), lambda x: 2 * x**2),
    ],
    ids=["tag", "intervene"],
)
def test_a_handled_function_returns_the_weak_type_jax_returns(handler, reference):
    # (bug_weak_type_lost_handle_grad: a tag of a constant, from a Python float
    # argument, gave handlers a strongly typed array, so the result of
    # `handle(jax.grad(f), H)(3.0)` promoted the bfloat16 arrays it met)
    f = lambda x: fx.tag(x**2, "f")  # noqa: E731
    for fn, ref in ((f, reference), (jax.grad(f), jax.grad(reference))):
        want = jax.jit(ref)(3.0)  # (weakly typed, as `fn(3.0)` is)
        for got in (
            fx.handle(fn, handler)(3.0)[0],
            jax.jit(fx.handle(fn, handler))(3.0)[0],
        ):
            assert (got.dtype, got.weak_type) == (want.dtype, want.weak_type)
            assert float(got) == float(want)
            assert (jnp.ones(2, jnp.bfloat16) * got).dtype == jnp.bfloat16


def test_a_strict_handler_of_a_name_reported_twice_in_a_while_body_is_refused():
    # (fuzz_strict_name_twice_in_while: the property's oracle expected the
    # while loop's refusal; the refusal that applies first is that the body
    # reports the name twice, which a strict handler cannot collect either)
    from jax.ad_checkpoint import checkpoint_name

    class Strict(fx.Handler):
        mode = "strict"

        @property
        def matches(self):
            return fx.Select(frozenset({"n3"}), collection="checkpoint_name")

        def apply(self, site, value, ctx):
            ctx.emit(value)
            return value

    def f(x):
        def inner(v, i):
            v = checkpoint_name(v, "n3")
            v = checkpoint_name(v, "n3")  # the same name twice in one execution
            return checkpoint_name(v, "n4")

        def body(s):
            i, v = s
            return i + 1, jnp.sin(jax.jit(inner)(v, i))

        return lax.while_loop(lambda s: s[0] < 2, body, (jnp.int32(0), x))[1]

    with pytest.raises(ValueError, match="'n3'.*executed more than once.*'append'"):
        fx.handle(f, Strict())(jnp.ones(3))
    out, found = fx.handle(f, fx.Tag("checkpoint_name", names="n3", mode="last"))(
        jnp.ones(3)
    )
    np.testing.assert_allclose(out, f(jnp.ones(3)))
    np.testing.assert_allclose(found["checkpoint_name"]["n3"], jnp.sin(jnp.ones(3)))
