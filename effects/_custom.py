"""custom_jvp and custom_vjp: the rule that rewrites their functions, and
their rule thunks, which JAX traces when a transformation first needs them,
made to trace once per handling state (`per_state`)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat, _jaxpr
from ._primitives import handling, probing
from ._rewrite import _bind, _matched, rules, run, trace_rewrite
from ._scope import Scope
from ._walk import NOT_YET, analysis, sites_in

#
# custom_jvp / custom_vjp
#


def _custom_rule(eqn, invals, scope: Scope) -> list[Any]:
    # Handlers may look at values inside, not change them (`_scope.act`
    # refuses): the custom rule would not know of the change.
    outer, scope.custom = scope.custom, eqn.primitive.name
    try:
        return _custom(eqn, invals, scope)
    finally:
        scope.custom = outer


def _custom(eqn, invals, scope: Scope) -> list[Any]:
    closed = eqn.params["call_jaxpr"]
    # The equation with its sites re-bound (dropping the effect they carried
    # while `handle` traced): its custom rule differentiates the function.
    stripped, consts = _compat.trace_closed(
        lambda *args: run(closed.jaxpr, closed.consts, args, Scope(())),
        closed.in_avals,
    )
    # (the original's debug info names the function in the equation)
    stripped = stripped.replace(debug_info=closed.jaxpr.debug_info)
    call_jaxpr = _compat.ClosedJaxpr(stripped, consts)
    if not _matched(scope.handlers, sites_in(closed.jaxpr)):
        return _bind(eqn, invals, call_jaxpr=call_jaxpr)
    # One region computes the outputs and what the handlers collect, so the
    # function runs once; differentiating it differentiates the equation, by its
    # own rule, and collects by running the region once more. What is collected
    # inside carries no gradient: the custom rule defines none for it.
    body, hoisted, leave = scope.traced(
        lambda finish: trace_rewrite(
            closed.jaxpr,
            closed.consts,
            scope.handlers,
            scope.rewrite,
            (),
            lambda _, run_in: finish(run_in(scope)),
        )
    )
    traced = _compat.jaxpr_as_fun(_compat.ClosedJaxpr(body, ()))

    def collecting(hoisted, args):
        return traced(*hoisted, *args)

    def original(*args):
        return _bind(eqn, args, call_jaxpr=call_jaxpr)

    n_out = len(eqn.outvars)
    if eqn.primitive is _compat.custom_vjp_call_p:
        collecting = _collecting_custom_vjp(original, collecting, n_out)
    else:
        src = closed.jaxpr.debug_info.func_src_info
        collecting = _collecting_custom_jvp(original, collecting, n_out, src)
    outs = collecting(hoisted, invals)
    leave(outs[n_out:])
    return outs[:n_out]


def _collecting_custom_vjp(original, region, n_out):
    collecting = jax.custom_vjp(region)

    def fwd(hoisted, args):
        # Only the inputs JAX perturbs are differentiated, as the equation's
        # own forward rule expects (Equinox's asserts it).
        hoisted, values = ([p.value for p in t] for t in (hoisted, args))
        perturbed = tuple(i for i, a in enumerate(args) if a.perturbed)

        def of_perturbed(*xs):
            full = list(values)
            for i, x in zip(perturbed, xs):
                full[i] = x
            return original(*full)

        outs, vjp = jax.vjp(of_perturbed, *(values[i] for i in perturbed))
        extra = region(hoisted, values)[n_out:]
        # (the perturbed positions travel as a residual with no leaves)
        where = jax.tree_util.Partial(
            functools.partial(_positions, perturbed, len(args))
        )
        return [*outs, *extra], (vjp, where)

    def bwd(residual, cts):
        vjp, where = residual
        cts = [_zero_tangent(c) if isinstance(c, _Zero) else c for c in cts[:n_out]]
        grads = iter(vjp(cts))
        return None, [next(grads) if p else None for p in where()]

    collecting.defvjp(fwd, bwd, symbolic_zeros=True)
    return collecting


def _positions(perturbed: tuple[int, ...], n: int) -> list[bool]:
    return [i in perturbed for i in range(n)]


_Zero = jax.custom_derivatives.SymbolicZero


_JVP_LAYOUT = (
    "The custom_jvp function {src}, under a jax.vmap, has a rule whose outputs "
    "JAX lays out unlike the function's (a tangent of shape {t} for an output "
    "of shape {o}): a JAX bug, which `jax.jvp(jax.jit(f))` meets alike where "
    "the function and its rule batch differently (tests/test_jax_facts.py::"
    "test_jvp_of_a_vmapped_custom_jvp_from_its_jaxpr_lays_out_its_outputs_"
    "wrong). The sites `handle` rewrites inside it (a tag in a loop) make the "
    "function batch unlike its rule. Map the function with in_axes=0 (move the "
    "axis first), or handle it inside the jax.vmap."
)


def _collecting_custom_jvp(original, region, n_out, src):
    collecting = jax.custom_jvp(region)

    @collecting.defjvp
    def jvp(primals, tangents):
        _, t_outs = jax.jvp(original, list(primals[1]), list(tangents[1]))
        outs = region(*primals)
        outs, extra = outs[:n_out], outs[n_out:]
        for o, t in zip(outs, t_outs):
            if np.shape(t) != np.shape(o):
                shapes = {"t": np.shape(t), "o": np.shape(o)}
                raise TypeError(_JVP_LAYOUT.format(src=src, **shapes))
        # (zeros of each tangent type: a float0 one, and one that varies over
        # the mesh axes the value does inside a shard_map)
        zeros = jax.custom_derivatives.zero_from_primal(extra)
        return [*outs, *extra], [*t_outs, *zeros]

    return collecting


def _zero_tangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


rules[_compat.custom_jvp_call_p] = _custom_rule
rules[_compat.custom_vjp_call_p] = _custom_rule


#
# Custom rules, traced once per handling state
#

# A custom_jvp/custom_vjp equation traces its rule when a transformation first
# needs it, through a thunk that JAX memoizes by which tangents are zero, not by
# the trace context (`pe._memoize`). `handle` traces with sites carrying their
# effect; the `jax.jit` functions it meets are traced in that state, and jit's
# cache serves those traces to every later `handle`. If a program rewritten from
# such a trace runs the thunk outside `handle` (`jax.grad(fx.handle(f))`), the
# rule is traced with effect-free sites, and a later `fx.handle(jax.grad(f))` is
# served that trace: the tags the rule discards are gone. (Run first inside
# `handle`, the thunk would put sites carrying the effect into unhandled
# programs.) So a jaxpr `handle` traced has its thunks replaced by ones that run
# the original only in the state it was made in, and bind its trace again in
# any other state, once per state. (JAX alone: tests/test_jax_facts.py::
# test_custom_jvp_rule_is_traced_once_whatever_the_trace_context.)


def _state() -> tuple[bool, Any]:
    return bool(handling.value), probing.value


def per_state(jaxpr):
    """`jaxpr`, traced in the current state, with the rule thunk of every
    custom_jvp/custom_vjp equation in it and its sub-jaxprs made one that gives
    each state its own trace of the rule."""
    birth = _state()
    found = analysis(jaxpr)
    hit = found.per_state
    if hit is not NOT_YET and hit[0] == birth:
        return jaxpr if hit[1] is None else hit[1]
    eqns = []
    for eqn in jaxpr.eqns:
        name = _compat.rule_thunk_params.get(eqn.primitive)
        # Only the jaxprs of the primitives the rewriter knows: another's are
        # its own (an Equinox filter primitive keeps among its params the
        # jaxpr of a closure-converted function, which that function holds
        # too and checks its arguments against: a copy would fail the check).
        # Most equations hold no jaxpr: finding none costs less than mapping.
        if eqn.primitive not in rules or not _jaxpr.sub_jaxprs(eqn):
            eqns.append(eqn)
            continue
        params = _jaxpr.map_jaxprs_in_params(eqn.params, per_state)
        if name is not None:
            params = dict(params, **{name: _per_state_thunk(params[name], birth)})
        eqns.append(eqn if params is eqn.params else eqn.replace(params=params))
    changed = any(a is not b for a, b in zip(eqns, jaxpr.eqns))
    new = jaxpr.replace(eqns=eqns) if changed else None
    found.per_state = (birth, new)  # (None: the jaxpr itself)
    return jaxpr if new is None else new


# States a rule meets: in and out of `handle`, and the probes of
# `_checks.branch_suspects`.
_TRACES_PER_THUNK = 16


def _per_state_thunk(thunk, birth):
    """`thunk`, made in the state `birth`, as a thunk memoized per state."""
    traces = {}

    def traced(*zeros):
        state = _state()
        out = traces.get((state, zeros))
        if out is None:
            with handling(birth[0]), probing(birth[1]):
                jaxpr, consts, *rest = thunk.call_wrapped(*zeros)
                jaxpr = per_state(jaxpr)
            if state != birth:
                jaxpr, consts = _bound_again(jaxpr, consts)
            if len(traces) >= _TRACES_PER_THUNK:  # (the oldest goes)
                del traces[next(iter(traces))]
            out = traces[(state, zeros)] = (jaxpr, consts, *rest)
        return out

    return _compat.like_thunk(traced, thunk)


def _bound_again(jaxpr, consts):
    """`(jaxpr, consts)` traced again in the current handling state: its sites
    bound again, carrying the effect or not as that state says."""
    opened = _compat.constvars_as_invars(jaxpr)
    n = len(consts)
    return _compat.trace_closed(
        lambda *args: run(opened, (), [*consts, *args], Scope(())),
        [v.aval for v in opened.invars[n:]],
    )
