"""The rewriter: walks a jaxpr, lets the handlers act at each site, and threads
what they emit (appended entries, accumulators, per-execution inputs) through
every higher-order primitive. One rule per primitive, shared by all handlers.

Rules for loops and branches work in two passes, like `jax.experimental.checkify`:
a discovery pass traces the body to learn what the handlers emit inside it (a
`Plan`), then the body is traced again with that state threaded in and out.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat, _jaxpr
from ._handlers import Handler
from ._primitives import bind_site, handling, probing, site_effect, site_p
from ._scope import Key, Scope, act, grow, types_of, zeros
from ._site import (
    CHECKPOINT_NAME,
    Axis,
    Lead,
    Site,
    after,
    describe,
    from_region,
    stacked_avals,
    to_region,
)
from ._sites import recomputes, site_of, sites_in, walk

Rule = Callable[[Any, list[Any], Scope], list[Any]]
rules: dict[Any, Rule] = {}

#
# Which sites does a jaxpr hold?
#


def _analyse(jaxpr) -> tuple[frozenset, tuple[frozenset, ...]]:
    """The sites of `jaxpr` (see `sites_in`) and, per equation, the sites it is
    or holds in its sub-jaxprs. An equation with none is plain: it is copied into
    the caller's trace as it is, never traced again."""
    found = walk(jaxpr)
    return found.keys, found.per_eqn


_runs_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plain_runs(jaxpr) -> dict[int, tuple[int, Any, list[Any]]]:
    """Each maximal run of equations holding no site, by its first equation:
    `(index after it, the run as a jaxpr, the variables it reads)`."""
    runs = _runs_cache.get(jaxpr)
    if runs is None:
        runs, per_eqn, i = {}, _analyse(jaxpr)[1], 0
        while i < len(per_eqn):
            if per_eqn[i]:
                i += 1
                continue
            stop = i
            while stop < len(per_eqn) and not per_eqn[stop]:
                stop += 1
            part, part_in = _jaxpr.equations_jaxpr(jaxpr, i, stop)
            runs[i] = (stop, part, part_in)
            i = stop
        _runs_cache[jaxpr] = runs
    return runs


def _matched(handlers, sites) -> list[tuple[str, str, str]]:
    return [s for s in sites if any(_handler_may_match(h, s) for h in handlers)]


def _handler_may_match(h: Handler, s) -> bool:
    return h.matches(Site.probe(*s))


#
# The interpreter
#


def _bind(eqn, invals, **new_params):
    params = dict(eqn.params, **new_params) if new_params else eqn.params
    with _compat.eqn_context(eqn), _compat.eqn_ctx_manager(eqn):
        outs = _compat.bind_eqn(eqn, invals, params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


_UNSUPPORTED = (
    "{where} is inside a `{prim}` primitive, which effects cannot rewrite yet. "
    "Move the tag out of it, or handle inside it (call `fx.handle` within the "
    "function passed to it)."
)


_UNDER_FLAG = (
    " It is `{0}` as JAX's `{1}` flag makes it; with the flag off, effects "
    "rewrites `{0}`."
)


def run(jaxpr, consts, args, scope: Scope) -> list[Any]:
    """Evaluates `jaxpr` on the current trace, with the scope's handlers acting."""
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, _compat.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    literal = _compat.Literal
    runs = _plain_runs(jaxpr)
    eqns, per_eqn = jaxpr.eqns, _analyse(jaxpr)[1]
    i = 0
    while i < len(eqns):
        run_of_plain = runs.get(i)
        if run_of_plain is not None:
            # Equations holding no site are copied as they are.
            stop, part, part_in = run_of_plain
            outs = _jaxpr.copy_into_trace(part, [read(v) for v in part_in])
            if outs is not None:
                env.update(zip(part.outvars, outs))
                i = stop
                continue
        eqn, sites = eqns[i], per_eqn[i]
        i += 1
        invals = [v.val if type(v) is literal else env[v] for v in eqn.invars]
        if not sites:
            outs = _bind(eqn, invals)
        elif eqn.primitive is site_p:
            outs = _site_rule(eqn, invals, scope)
        elif eqn.primitive is _compat.name_p:
            outs = _checkpoint_name_rule(eqn, invals, scope)
        elif _needs_rule(eqn, sites, scope):
            rule = rules.get(eqn.primitive)
            if rule is None:
                matched = _matched(scope.handlers, sites)
                if matched:
                    where = Site.probe(*matched[0]).where()
                    message = _UNSUPPORTED.format(
                        where=where, prim=_compat.primitive_name(eqn)
                    )
                    flag = _compat.hijax_flag(eqn)
                    if flag is not None:
                        message += _UNDER_FLAG.format(*flag)
                    raise ValueError(message)
                outs = _bind(eqn, invals)
            else:
                with _compat.eqn_context(eqn):
                    outs = rule(eqn, invals, scope)
        else:
            outs = _bind(eqn, invals)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _needs_rule(eqn, sites, scope: Scope) -> bool:
    """Whether an equation holding `sites` in its sub-jaxprs is rewritten."""
    return needs_rewrite(scope.handlers, sites, eqn.effects, bool(handling.value))


def needs_rewrite(handlers, sites, effects, handling_outside: bool) -> bool:
    """Whether an equation holding `sites` in its sub-jaxprs, with `effects`, is
    rewritten by `handlers` where `handling_outside` is the handling state."""
    if _matched(handlers, sites):
        return True
    # Only sites no handler matches: rebuild the equation just to drop the effect
    # its sites carried while `handle` traced, unless they still need it.
    return site_effect in effects and not handling_outside


def _site_rule(eqn, invals, scope: Scope) -> list[Any]:
    if eqn.params.get("recompute") and not scope.replaying:
        scope = scope.replay()  # a copy: its execution is reported by the original
    return handle_site(eqn.params, [v.aval for v in eqn.invars], invals, scope)


def handle_site(params, avals, invals, scope: Scope, effect=None) -> list[Any]:
    """Lets the scope's handlers act, in order, on one executed site (its
    params, the avals of its leaves, their values). A site no handler consumes
    is bound again, for handlers further out (carrying the site effect if
    `effect`; by default, if the current handling state says so)."""
    site = Site.from_eqn(params, avals, scope.shards)
    leaves, consumed = _act(site, list(invals), scope)
    if consumed:
        return leaves
    if effect is None:
        return site_p.bind(*leaves, **params)
    return bind_site(leaves, params, effect)


def _act(site: Site, leaves: list[Any], scope: Scope) -> tuple[list[Any], bool]:
    """The scope's handlers act, in order, on one executed site: the leaves
    they leave, and whether one of them consumed the site. A `checkpoint_name`
    is never consumed (see `_checkpoint_name_rule`): every handler sees it."""
    consumable = site.collection != CHECKPOINT_NAME
    handlers = scope.handlers
    for i, (handler, matches) in enumerate(zip(handlers, handlers.matches)):
        if matches(handler, site):
            leaves = act(scope, i, site, leaves)
            if handlers.consumes[i] and consumable:
                return leaves, True
    return leaves, False


def _checkpoint_name_rule(eqn, invals, scope: Scope) -> list[Any]:
    """Handlers act on a `checkpoint_name` as on a tag, and the name stays on
    the value they leave: remat policies that select by name keep working, and
    handlers further out see it again."""
    site = site_of(eqn, scope.shards)
    assert site is not None
    leaves, _ = _act(site, list(invals), scope)
    return _bind(eqn, leaves)


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
# any other state, once per state.


def _state() -> tuple[bool, Any]:
    return bool(handling.value), probing.value


_per_state_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def per_state(jaxpr):
    """`jaxpr`, traced in the current state, with the rule thunk of every
    custom_jvp/custom_vjp equation in it and its sub-jaxprs made one that gives
    each state its own trace of the rule."""
    birth = _state()
    hit = _per_state_cache.get(jaxpr)
    if hit is not None and hit[0] == birth:
        return jaxpr if hit[1] is None else hit[1]
    eqns = []
    for eqn in jaxpr.eqns:
        params = _jaxpr.map_jaxprs_in_params(eqn.params, per_state)
        name = _compat.rule_thunk_params.get(eqn.primitive)
        if name is not None:
            params = dict(params, **{name: _per_state_thunk(params[name], birth)})
        eqns.append(eqn if params is eqn.params else eqn.replace(params=params))
    changed = any(a is not b for a, b in zip(eqns, jaxpr.eqns))
    new = jaxpr.replace(eqns=eqns) if changed else None
    _per_state_cache[jaxpr] = (birth, new)  # (None: the jaxpr itself, kept weakly)
    return jaxpr if new is None else new


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


#
# Plans: what a region emits
#


@dataclasses.dataclass
class Plan:
    """What the handlers emit inside one region, learnt by discovery."""

    accs: dict[Key, Any]  # key -> init thunk
    acc_avals: dict[Key, Any]  # key -> avals tree
    acc_batch: dict[Key, tuple[Axis, ...]]  # key -> its per-example axes
    entries: dict[Key, list[tuple[Any, Lead]]]  # key -> [(avals tree, lead)]
    inputs: dict[Key, list[tuple[Any, Lead]]]
    sites: dict[Key, Site]

    def enter(self, scope: Scope) -> None:
        """Makes the region's sites known to the enclosing scope, in the order
        the region first executes them."""
        for key, site in self.sites.items():
            scope.sites.setdefault(key, site)

    def acc_in(self, scope: Scope) -> list[Any]:
        """The accumulators' values entering the region, flat (the region's
        sites made known first), broadcast to the types the region gives them."""
        self.enter(scope)
        return [
            x for key in self.acc_avals for x in jax.tree.leaves(self.acc(scope, key))
        ]

    def acc(self, scope: Scope, key: Key):
        """One accumulator's value entering the region."""
        if key not in scope.accs:
            scope.acc_inits.setdefault(key, self.accs[key])
            scope.accs[key] = self.accs[key]()
            scope.acc_batch[key] = self.acc_batch[key]
        scope.touched[key] = None
        acc, have = scope.accs[key], scope.acc_batch[key]
        if have != self.acc_batch[key]:  # grown inside, under a vmap
            acc = scope.accs[key] = grow(acc, have, self.acc_batch[key])
            scope.acc_batch[key] = self.acc_batch[key]
        return acc

    def forbid(
        self, what: str, *, appends: bool, inputs: bool, single: bool, scope: Scope
    ) -> None:
        for key in self.entries:
            mode = scope.modes[key[0]]
            where = self.sites[key].where()
            if single and mode.single:
                instead = _INSTEAD_IN_WHILE if appends else _INSTEAD_IN_SCAN
                raise ValueError(
                    _STRICT_IN_LOOP.format(
                        where=where, what=what, mode=mode.label, instead=instead
                    )
                )
            if appends:
                raise ValueError(_APPEND_IN_WHILE.format(where=where, mode=mode.label))
        if inputs:
            for key in self.inputs:
                raise ValueError(
                    _INPUT_IN_WHILE.format(
                        where=self.sites[key].where(),
                        handler=type(scope.handlers[key[0]]).__name__,
                    )
                )


_INSTEAD_IN_SCAN = "Use mode='append' (stacked over iterations), 'last' or 'sum'."
_INSTEAD_IN_WHILE = (
    "Use mode='last' or a reduction ('sum' or fx.Reduce); to keep every "
    "iteration, write the loop as a lax.scan."
)
_STRICT_IN_LOOP = (
    "{where} is inside a {what}, but {mode} collects a single value. {instead}"
)
_APPEND_IN_WHILE = (
    "{where} is inside a lax.while_loop, whose number of iterations is unknown, so "
    "{mode} cannot append its executions. Use Tag(mode='last'), a reduction "
    "('sum' or fx.Reduce), or a lax.scan."
)
_INPUT_IN_WHILE = (
    "{where} is inside a lax.while_loop, so {handler} cannot give it one value per "
    "execution. Give one value for every execution (Substitute without "
    "per_call), or use a lax.scan."
)


def _acc_avals_of(scope: Scope, key: Key):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), scope.accs[key]
    )


def discover(jaxpr, consts, in_avals, scope: Scope) -> Plan:
    """Traces `jaxpr` once, abstractly, to learn what the handlers emit in it."""
    plans = []

    # The region starts from the accumulators entering it (a reduction may
    # grow one there, by vmap batch axes).
    entering = {k: types_of(v) for k, v in scope.accs.items()}

    def fn(*args):
        sub = Scope(
            scope.handlers,
            discovering=True,
            accs=_zeros_of(entering),
            acc_batch=scope.acc_batch,
            custom=scope.custom,
            shards=scope.shards,
        )
        outs = run(jaxpr, consts, args, sub)
        # Only types leave the trace: nothing may keep its tracers alive.
        plans.append(
            Plan(
                accs=dict(sub.acc_inits),
                acc_avals={k: _acc_avals_of(sub, k) for k in sub.touched},
                acc_batch={k: sub.acc_batch[k] for k in sub.touched},
                entries={
                    k: [(jax.tree.map(_sds, v), nb) for v, nb in vs]
                    for k, vs in sub.entries.items()
                },
                inputs=dict(sub.input_avals),
                sites=dict(sub.sites),
            )
        )
        return outs

    _jaxpr.trace(fn, in_avals)
    return plans[0]


def _zeros_of(types: dict) -> dict:
    vary = _compat.vary_over_manual_axes
    return {k: jax.tree.map(vary, zeros(t)) for k, t in types.items()}


def _sds(x):
    return jax.ShapeDtypeStruct(jnp.shape(x), x.dtype)


def _avals(leaves) -> list[Any]:
    return [jax.typeof(x) for x in leaves]


def _flat(trees) -> list[Any]:
    return [leaf for t in trees for leaf in jax.tree.leaves(t)]


def _unflat(avals_trees, leaves) -> list[Any]:
    out, i = [], 0
    for t in avals_trees:
        tree = jax.tree.structure(t)
        out.append(jax.tree.unflatten(tree, leaves[i : i + tree.num_leaves]))
        i += tree.num_leaves
    return out


def trace_region(
    jaxpr,
    consts,
    in_avals,
    scope: Scope,
    plan: Plan,
    *,
    input_avals: list[Any] | None = None,
    input_in=None,
    entry_out=None,
    acc_avals=None,
    acc_in=None,
    acc_out=None,
    shard=(),
):
    """Traces the region with the plan's state threaded through it:
    `(*args, *accs, *inputs) -> (*outs, *accs, *entries)`. Entries a run does not
    emit (a branch that did not tag a name) are filled with zeros. Returns the
    open jaxpr, with the constants it closes over as leading inputs, and those
    constants. `shard`: the region's shard_map, for a shard_map's body (see
    `Site.shards`)."""
    acc_trees = list(plan.acc_avals.values())
    input_trees = [avals for _, specs in plan.inputs.items() for avals, _ in specs]
    n_args = len(in_avals)
    n_acc = len(_flat(acc_trees))

    def fn(*flat):
        args = flat[:n_args]
        accs = _unflat(acc_trees, list(flat[n_args : n_args + n_acc]))
        if acc_in is not None:
            accs = [jax.tree.map(acc_in, a) for a in accs]
        entries_in = _unflat(input_trees, list(flat[n_args + n_acc :]))
        if input_in is not None:
            entries_in = [jax.tree.map(input_in, e) for e in entries_in]
        inputs, i = {}, 0
        for key, specs in plan.inputs.items():
            inputs[key], i = entries_in[i : i + len(specs)], i + len(specs)
        sub = Scope(
            scope.handlers,
            accs=dict(zip(plan.acc_avals, accs)),
            acc_batch=plan.acc_batch,
            inputs=inputs,
            custom=scope.custom,
            shards=scope.shards + shard,
        )
        outs = run(jaxpr, consts, args, sub)
        out_entries = []
        for key, specs in plan.entries.items():
            got = sub.entries.get(key, [])
            for j, (avals, _) in enumerate(specs):
                out_entries.append(got[j][0] if j < len(got) else zeros(avals))
        if entry_out is not None:
            out_entries = [jax.tree.map(entry_out, e) for e in out_entries]
        accs_out = [sub.accs[k] for k in plan.acc_avals]
        if acc_out is not None:
            accs_out = [jax.tree.map(acc_out, a) for a in accs_out]
        return [*outs, *_flat(accs_out), *_flat(out_entries)]

    if input_avals is None:
        input_avals = _avals_of_trees(input_trees)
    if acc_avals is None:
        acc_avals = _avals_of_trees(acc_trees)
    avals = [*in_avals, *acc_avals, *input_avals]
    return _jaxpr.trace(fn, avals)


def _avals_of_trees(trees) -> list[Any]:
    return [_compat.ShapedArray(a.shape, a.dtype) for a in _flat(trees)]


def _take_inputs(plan: Plan, scope: Scope, kind=None, size=0) -> list[Any]:
    """Takes the region's input entries from the enclosing scope, flat; for a
    region of `kind` ("scan" or "shard"), stacked over its `size` iterations or
    shards outside it, stacked axis first inside."""
    flat = []
    for key, specs in plan.inputs.items():
        outside = [
            (stacked_avals(a, lead, kind, size), after(lead, kind)) if kind else spec
            for spec in specs
            for a, lead in [spec]
        ]
        values = scope.take_inputs(key, outside, plan.sites[key])
        for value, (_, lead) in zip(values, specs):
            if kind:
                value = to_region(value, lead, kind)
            flat += jax.tree.leaves(value)
    return flat


def _emit_entries(plan: Plan, scope: Scope, leaves, kind=None) -> None:
    """Emits the entries a region returned (stacked along their first axis by
    a region of `kind`) into the enclosing scope."""
    i = 0
    for key, specs in plan.entries.items():
        for avals, lead in specs:
            tree = jax.tree.structure(avals)
            value = jax.tree.unflatten(tree, leaves[i : i + tree.num_leaves])
            i += tree.num_leaves
            if kind:
                value, lead = from_region(value, lead, kind), after(lead, kind)
            scope.add_entry(key, value, lead, plan.sites[key])


def _set_accs(plan: Plan, scope: Scope, leaves) -> None:
    for key, value in zip(
        plan.acc_avals, _unflat(list(plan.acc_avals.values()), list(leaves))
    ):
        scope.accs[key] = value


def _discovered(eqn, invals, scope: Scope, plan: Plan, kind=None, size=0) -> list[Any]:
    """A region met while discovering an enclosing one: what it emits is known
    from its plan, so it is not traced again (that would make discovery cost grow
    exponentially with nesting depth). The original equation gives the outputs'
    types; entries are zeros of their types outside the region."""
    for key, specs in plan.entries.items():
        for avals, lead in specs:
            if kind:
                avals, lead = stacked_avals(avals, lead, kind, size), after(lead, kind)
            scope.add_entry(key, zeros(avals), lead, plan.sites[key])
    return _bind(eqn, invals)


def _n(trees) -> int:
    return len(_flat(trees))


#
# Call-like primitives: jit, closed_call, checkpoint
#


def _call_rule(eqn, invals, scope: Scope, *, get_body, rebuild) -> list[Any]:
    jaxpr, consts = get_body(eqn.params)
    in_avals = [v.aval for v in eqn.invars]
    plan = discover(jaxpr, consts, in_avals, scope)
    acc_in = plan.acc_in(scope)
    inputs = _take_inputs(plan, scope)
    if scope.discovering:
        return _discovered(eqn, invals, scope, plan)
    body, hoisted = trace_region(
        jaxpr,
        consts,
        in_avals,
        scope,
        plan,
        input_avals=[jax.typeof(v) for v in inputs],
        acc_avals=[jax.typeof(v) for v in acc_in],
    )
    n_out = len(eqn.outvars)
    n_extra_in = len(acc_in) + len(inputs)
    n_extra_out = len(body.outvars) - n_out
    params = rebuild(eqn.params, body, len(hoisted), n_extra_in, n_extra_out)
    outs = _bind(eqn, [*hoisted, *invals, *acc_in, *inputs], **params)
    n_acc = _n(plan.acc_avals.values())
    _set_accs(plan, scope, outs[n_out : n_out + n_acc])
    _emit_entries(plan, scope, outs[n_out + n_acc :])
    return outs[:n_out]


def _pad(seq, before: int, after: int, fill) -> tuple:
    return (fill,) * before + tuple(seq) + (fill,) * after


def _rebuild_jit(params, body, n_hoisted, n_extra_in, n_extra_out):
    closed = _compat.ClosedJaxpr(body, ())
    unspec = _compat.UNSPECIFIED
    return dict(
        jaxpr=closed,
        in_shardings=_pad(params["in_shardings"], n_hoisted, n_extra_in, unspec),
        in_layouts=_pad(params["in_layouts"], n_hoisted, n_extra_in, None),
        donated_invars=_pad(params["donated_invars"], n_hoisted, n_extra_in, False),
        out_shardings=_pad(params["out_shardings"], 0, n_extra_out, unspec),
        out_layouts=_pad(params["out_layouts"], 0, n_extra_out, None),
    )


rules[_compat.pjit_p] = lambda eqn, invals, scope: _call_rule(
    eqn,
    invals,
    scope,
    get_body=lambda p: (p["jaxpr"].jaxpr, p["jaxpr"].consts),
    rebuild=_rebuild_jit,
)
rules[_compat.closed_call_p] = lambda eqn, invals, scope: _call_rule(
    eqn,
    invals,
    scope,
    get_body=lambda p: (p["call_jaxpr"].jaxpr, p["call_jaxpr"].consts),
    rebuild=lambda p, body, *_: dict(call_jaxpr=_compat.ClosedJaxpr(body, ())),
)


def _remat_rule(eqn, invals, scope: Scope) -> list[Any]:
    # In the backward pass's recomputation of a region, handlers act on its sites
    # so that it computes the values the forward pass did (a substituted value,
    # a perturbation), but what they report there is dropped: each execution is
    # reported once, by the forward pass.
    if recomputes(eqn):
        scope = scope.replay()
    return _call_rule(
        eqn,
        invals,
        scope,
        get_body=lambda p: (p["jaxpr"], ()),
        rebuild=lambda p, body, *_: dict(jaxpr=body),
    )


rules[_compat.remat_p] = _remat_rule

#
# scan
#


def _scan_rule(eqn, invals, scope: Scope) -> list[Any]:
    p = eqn.params
    closed, length = p["jaxpr"], p["length"]
    n_consts, n_carry = _compat.scan_counts(p)
    n_xs = len(invals) - n_consts - n_carry
    n_ys = len(eqn.outvars) - n_carry
    in_avals = closed.in_avals
    plan = discover(closed.jaxpr, closed.consts, in_avals, scope)
    plan.forbid("lax.scan", appends=False, inputs=False, single=True, scope=scope)

    acc_in = plan.acc_in(scope)
    inputs = _take_inputs(plan, scope, "scan", length)
    if scope.discovering:
        return _discovered(eqn, invals, scope, plan, "scan", length)
    body, hoisted = trace_region(
        closed.jaxpr,
        closed.consts,
        in_avals,
        scope,
        plan,
        input_avals=[_compat.mapped_aval(length, jax.typeof(v)) for v in inputs],
        acc_avals=[jax.typeof(v) for v in acc_in],
    )
    # The region is (hoisted, consts, carry, xs, accs, inputs) -> (carry, ys, accs,
    # entries); scan wants the accumulators in the carry: (hoisted, consts, carry,
    # accs, xs, inputs) -> (carry, accs, ys, entries).
    n_h, n_acc = len(hoisted), len(acc_in)
    iv = list(body.invars)
    c_end = n_h + n_consts + n_carry
    x_end = c_end + n_xs
    invars = (
        iv[:c_end] + iv[x_end : x_end + n_acc] + iv[c_end:x_end] + iv[x_end + n_acc :]
    )
    ov = list(body.outvars)
    outvars = (
        ov[:n_carry]
        + ov[n_carry + n_ys : n_carry + n_ys + n_acc]
        + ov[n_carry : n_carry + n_ys]
        + ov[n_carry + n_ys + n_acc :]
    )
    body = body.replace(invars=invars, outvars=outvars)
    consts, carry, xs = (
        invals[:n_consts],
        invals[n_consts : n_consts + n_carry],
        invals[n_consts + n_carry :],
    )
    params = _compat.scan_params(
        p,
        _compat.ClosedJaxpr(body, ()),
        n_consts=n_h + n_consts,
        n_carry=n_carry + n_acc,
        n_xs=n_xs + len(inputs),
        n_ys=len(body.outvars) - n_carry - n_acc,
    )
    outs = _bind(eqn, [*hoisted, *consts, *carry, *acc_in, *xs, *inputs], **params)
    _set_accs(plan, scope, outs[n_carry : n_carry + n_acc])
    _emit_entries(plan, scope, outs[n_carry + n_acc + n_ys :], "scan")
    return outs[:n_carry] + outs[n_carry + n_acc : n_carry + n_acc + n_ys]


rules[_compat.scan_p] = _scan_rule

#
# while_loop
#


def _while_rule(eqn, invals, scope: Scope) -> list[Any]:
    p = eqn.params
    cond_closed, body_closed = p["cond_jaxpr"], p["body_jaxpr"]
    n_cc, n_bc = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, carry = (
        invals[:n_cc],
        invals[n_cc : n_cc + n_bc],
        invals[n_cc + n_bc :],
    )
    matched = _matched(scope.handlers, sites_in(cond_closed.jaxpr))
    if matched:
        raise ValueError(
            f"{Site.probe(*matched[0]).where()} is inside the "
            "cond_fun of a lax.while_loop, which handlers cannot collect from. "
            "Tag the value in body_fun instead."
        )
    plan = discover(body_closed.jaxpr, body_closed.consts, body_closed.in_avals, scope)
    plan.forbid("lax.while_loop", appends=True, inputs=True, single=True, scope=scope)
    acc_in = plan.acc_in(scope)
    if scope.discovering:
        return _discovered(eqn, invals, scope, plan)
    body, hoisted = trace_region(
        body_closed.jaxpr,
        body_closed.consts,
        body_closed.in_avals,
        scope,
        plan,
        acc_avals=[jax.typeof(v) for v in acc_in],
    )
    # Region: (hoisted, body_consts, carry, accs) -> (carry, accs): the accumulators
    # extend the carry; cond_fun ignores them.
    cond = _jaxpr.insert_invars(
        cond_closed.jaxpr, len(cond_closed.jaxpr.invars), _avals(acc_in)
    )
    params = dict(
        cond_jaxpr=_compat.ClosedJaxpr(cond, cond_closed.consts),
        body_jaxpr=_compat.ClosedJaxpr(body, ()),
        body_nconsts=len(hoisted) + n_bc,
    )
    outs = _bind(eqn, [*cond_consts, *hoisted, *body_consts, *carry, *acc_in], **params)
    _set_accs(plan, scope, outs[len(carry) :])
    return outs[: len(carry)]


rules[_compat.while_p] = _while_rule

#
# cond / switch
#


def _merge_plans(plans: list[Plan], scope: Scope) -> Plan:
    merged = Plan({}, {}, {}, {}, {}, {})
    for plan in plans:
        merged.sites.update(plan.sites)
        merged.accs.update(plan.accs)
        for key, avals in plan.acc_avals.items():
            # Where branches differ, the accumulator of the branch under more
            # vmaps (the other's grows to it).
            batch = plan.acc_batch[key]
            if len(batch) >= len(merged.acc_batch.get(key, ())):
                merged.acc_avals[key], merged.acc_batch[key] = avals, batch
        for field in ("entries", "inputs"):
            ours = getattr(merged, field)
            for key, specs in getattr(plan, field).items():
                have = ours.setdefault(key, [])
                for j, spec in enumerate(specs):
                    if j == len(have):
                        have.append(spec)
                    elif _spec_key(have[j]) != _spec_key(spec):
                        raise ValueError(
                            f"{plan.sites[key].where()} has {describe(spec[0])} in "
                            f"one branch of a lax.cond and {describe(have[j][0])} in "
                            "another; a tag's shape and dtype must agree across "
                            "branches."
                        )
    return merged


def _spec_key(spec):
    avals, nbatch = spec
    return (
        jax.tree.structure(avals),
        tuple((a.shape, a.dtype) for a in jax.tree.leaves(avals)),
        nbatch,
    )


def _cond_rule(eqn, invals, scope: Scope) -> list[Any]:
    branches = eqn.params["branches"]
    index, ops = invals[0], invals[1:]
    in_avals = branches[0].in_avals
    plans = [discover(b.jaxpr, b.consts, in_avals, scope) for b in branches]
    plan = _merge_plans(plans, scope)
    acc_in = plan.acc_in(scope)
    inputs = _take_inputs(plan, scope)
    if scope.discovering:
        return _discovered(eqn, invals, scope, plan)
    # Inside a shard_map, one branch's entry may vary over the mesh where another
    # branch's (or a zeros fill) does not; cond needs them alike.
    traced = [
        trace_region(
            b.jaxpr,
            b.consts,
            in_avals,
            scope,
            plan,
            input_avals=[jax.typeof(v) for v in inputs],
            acc_avals=[jax.typeof(v) for v in acc_in],
            entry_out=_compat.vary_over_manual_axes,
        )
        for b in branches
    ]
    all_hoisted = [c for _, hoisted in traced for c in hoisted]
    hoisted_avals = [[jax.typeof(c) for c in h] for _, h in traced]
    new_branches = []
    for i, (body, hoisted) in enumerate(traced):
        before = [a for h in hoisted_avals[:i] for a in h]
        after = [a for h in hoisted_avals[i + 1 :] for a in h]
        # Every branch takes every branch's constants: its own, with the others'
        # as unused inputs around them.
        body = _jaxpr.insert_invars(body, len(hoisted), after)
        body = _jaxpr.insert_invars(body, 0, before)
        new_branches.append(_compat.ClosedJaxpr(body, ()))
    n_out = len(eqn.outvars)
    outs = _bind(
        eqn, [index, *all_hoisted, *ops, *acc_in, *inputs], branches=tuple(new_branches)
    )
    n_acc = len(acc_in)
    _set_accs(plan, scope, outs[n_out : n_out + n_acc])
    _emit_entries(plan, scope, outs[n_out + n_acc :])
    return outs[:n_out]


rules[_compat.cond_p] = _cond_rule

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
    sites = sites_in(closed.jaxpr)
    if scope.discovering:
        outs = _bind(eqn, invals)
        run(closed.jaxpr, closed.consts, invals, scope)  # types only: nothing runs
        return outs
    # The equation with its sites re-bound (dropping the effect they carried
    # while `handle` traced): its custom rule differentiates the function.
    stripped, consts = _compat.trace_closed(
        lambda *args: run(closed.jaxpr, closed.consts, args, Scope(())),
        closed.in_avals,
    )
    # (the original's debug info names the function in the equation)
    stripped = stripped.replace(debug_info=closed.jaxpr.debug_info)
    call_jaxpr = _compat.ClosedJaxpr(stripped, consts)
    if not _matched(scope.handlers, sites):
        return _bind(eqn, invals, call_jaxpr=call_jaxpr)
    # One region computes the outputs and what the handlers collect, so the
    # function runs once; differentiating it differentiates the equation, by its
    # own rule, and collects by running the region once more. What is collected
    # inside carries no gradient: the custom rule defines none for it.
    in_avals = [v.aval for v in eqn.invars]
    plan = discover(closed.jaxpr, closed.consts, in_avals, scope)
    acc_in = plan.acc_in(scope)
    body, hoisted = trace_region(
        closed.jaxpr,
        closed.consts,
        in_avals,
        scope,
        plan,
        acc_avals=[jax.typeof(v) for v in acc_in],
    )
    region = _compat.jaxpr_as_fun(_compat.ClosedJaxpr(body, ()))
    n_out = len(eqn.outvars)

    def original(*args):
        return _bind(eqn, args, call_jaxpr=call_jaxpr)

    if eqn.primitive is _compat.custom_vjp_call_p:
        outs = _collecting_custom_vjp(original, region, n_out)(hoisted, invals, acc_in)
    else:
        outs = _collecting_custom_jvp(original, region, n_out)(hoisted, invals, acc_in)
    n_acc = _n(plan.acc_avals.values())
    _set_accs(plan, scope, outs[n_out : n_out + n_acc])
    _emit_entries(plan, scope, outs[n_out + n_acc :])
    return outs[:n_out]


def _collecting_custom_vjp(original, region, n_out):
    @jax.custom_vjp
    def collecting(hoisted, args, accs):
        return region(*hoisted, *args, *accs)

    def fwd(hoisted, args, accs):
        # Only the inputs JAX perturbs are differentiated, as the equation's
        # own forward rule expects (Equinox's asserts it).
        hoisted, accs = _values(hoisted), _values(accs)
        values = _values(args)
        perturbed = tuple(i for i, a in enumerate(args) if a.perturbed)

        def of_perturbed(*xs):
            full = list(values)
            for i, x in zip(perturbed, xs):
                full[i] = x
            return original(*full)

        outs, vjp = jax.vjp(of_perturbed, *(values[i] for i in perturbed))
        extra = region(*hoisted, *values, *accs)[n_out:]
        # (the perturbed positions travel as a residual with no leaves)
        where = jax.tree_util.Partial(
            functools.partial(_positions, perturbed, len(args))
        )
        return [*outs, *extra], (vjp, where)

    def bwd(residual, cts):
        vjp, where = residual
        grads = iter(vjp([_materialized(c) for c in cts[:n_out]]))
        return None, [next(grads) if p else None for p in where()], None

    collecting.defvjp(fwd, bwd, symbolic_zeros=True)
    return collecting


def _values(primals) -> list[Any]:
    return [p.value for p in primals]


def _positions(perturbed: tuple[int, ...], n: int) -> list[bool]:
    return [i in perturbed for i in range(n)]


def _materialized(ct):
    return _zero_tangent(ct) if isinstance(ct, _SymbolicZero) else ct


_SymbolicZero = jax.custom_derivatives.SymbolicZero


def _collecting_custom_jvp(original, region, n_out):
    @jax.custom_jvp
    def collecting(hoisted, args, accs):
        return region(*hoisted, *args, *accs)

    @collecting.defjvp
    def jvp(primals, tangents):
        hoisted, args, accs = primals
        outs, t_outs = jax.jvp(lambda *a: original(*a), list(args), list(tangents[1]))
        extra = region(*hoisted, *args, *accs)[n_out:]
        return [*outs, *extra], [*t_outs, *map(_zero_tangent, extra)]

    return collecting


def _zero_tangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


rules[_compat.custom_jvp_call_p] = _custom_rule
rules[_compat.custom_vjp_call_p] = _custom_rule

#
# shard_map (and pmap, which lowers to it)
#

_ACC_GROWS_IN_SHARD_MAP = (
    "{where} is reduced in a shard_map (or pmap) that gives its per-shard "
    "accumulator vmap batch axes it did not have: reduce it under one vmap "
    "throughout, give the tags different names, or use Tag(mode='append')."
)


def _stacked_init(init, lead: Lead, n_shards: int):
    value = jax.tree.map(lambda x: jnp.broadcast_to(x, (n_shards, *x.shape)), init())
    return from_region(value, lead, "shard")


def _without_axis(types, axis: int):
    return jax.tree.map(
        lambda t: jax.ShapeDtypeStruct(t.shape[:axis] + t.shape[axis + 1 :], t.dtype),
        types,
    )


def _shard_map_rule(eqn, invals, scope: Scope) -> list[Any]:
    # Shards run in parallel, like the examples of a vmap: entries come out
    # stacked over the shards and an accumulator is one per shard, each axis
    # after the vmap batch axes (`_site.Lead`). Inside, each shard holds a
    # slice of size 1 of what is stacked.
    p = eqn.params
    body = p["jaxpr"]
    mesh = p["mesh"]
    axes = tuple(a for a in mesh.axis_names if a in _compat.shard_map_manual_axes(p))
    n_shards = 1
    for a in axes:
        n_shards *= mesh.shape[a]
    spec = jax.sharding.PartitionSpec(axes)
    shard = ((axes, n_shards),)
    in_avals = [v.aval for v in body.invars]
    # An accumulator with a shard axis already (from this shard_map's previous
    # run in a loop, or another over the same axes) enters split along it; any
    # other enters whole in every shard. Inside, each shard sees its own.
    marker = ("shard", n_shards)
    split = {
        k
        for k, b in scope.acc_batch.items()
        if b and b[-1] == marker and k in scope.accs
    }
    local = Scope(
        scope.handlers,
        accs={
            k: _without_axis(types_of(v), len(scope.acc_batch[k]) - 1)
            if k in split
            else types_of(v)
            for k, v in scope.accs.items()
        },
        acc_batch={k: b[:-1] if k in split else b for k, b in scope.acc_batch.items()},
        custom=scope.custom,
        shards=scope.shards + shard,
    )
    with _compat.shard_map_body(p):
        plan = discover(body, (), in_avals, local)
    plan.enter(scope)
    acc_in = []
    for key, avals in plan.acc_avals.items():
        inside = plan.acc_batch[key]
        if key in split:
            if scope.acc_batch[key][:-1] != inside:
                raise ValueError(
                    _ACC_GROWS_IN_SHARD_MAP.format(where=plan.sites[key].where())
                )
            scope.touched[key] = None
            value = to_region(scope.accs[key], Lead(len(inside)), "shard")
        else:
            value = jax.tree.map(
                lambda x: jnp.broadcast_to(x, (n_shards, *x.shape)),
                plan.acc(scope, key),
            )
        acc_in += jax.tree.leaves(value)
    inputs = _take_inputs(plan, scope, "shard", n_shards)

    def per_shard(key):
        return plan.acc_batch[key] + (marker,)

    if scope.discovering:
        for key, avals in plan.acc_avals.items():
            lead = Lead(len(plan.acc_batch[key]))
            scope.accs[key] = zeros(stacked_avals(avals, lead, "shard", n_shards))
            scope.acc_batch[key] = per_shard(key)
            if key in plan.accs:  # first made here: what it starts as, stacked
                scope.acc_inits[key] = functools.partial(
                    _stacked_init, plan.accs[key], lead, n_shards
                )
        return _discovered(eqn, invals, scope, plan, "shard", n_shards)
    in_input_avals = [
        _compat.shard_aval(p, spec, _compat.ShapedArray((n_shards,) + a.shape, a.dtype))
        for _, specs in plan.inputs.items()
        for avals, _ in specs
        for a in jax.tree.leaves(avals)
    ]

    def stacked_out(x):
        return _compat.vary_over_manual_axes(x)[None]

    def sliced_in(x):
        return _compat.vary_over_manual_axes(x[0])

    acc_avals = [
        _compat.shard_aval(p, spec, _compat.ShapedArray((n_shards,) + a.shape, a.dtype))
        for a in _flat(plan.acc_avals.values())
    ]
    with _compat.shard_map_body(p):
        new_body, hoisted = trace_region(
            body,
            (),
            in_avals,
            scope,
            plan,
            input_avals=in_input_avals,
            input_in=lambda x: x[0],
            entry_out=stacked_out,
            acc_avals=acc_avals,
            acc_in=sliced_in,
            acc_out=stacked_out,
            shard=shard,
        )
    n_out, n_acc = len(eqn.outvars), len(acc_in)
    n_entry = len(new_body.outvars) - n_out - n_acc
    replicated = jax.sharding.PartitionSpec()
    params = dict(
        jaxpr=new_body,
        in_specs=(replicated,) * len(hoisted)
        + tuple(p["in_specs"])
        + (spec,) * n_acc
        + (spec,) * len(inputs),
        out_specs=tuple(p["out_specs"]) + (spec,) * (n_acc + n_entry),
    )
    outs = _bind(eqn, [*hoisted, *invals, *acc_in, *inputs], **params)
    accs = _unflat(list(plan.acc_avals.values()), outs[n_out : n_out + n_acc])
    for key, value in zip(plan.acc_avals, accs):
        lead = Lead(len(plan.acc_batch[key]))
        scope.accs[key] = from_region(value, lead, "shard")
        scope.acc_batch[key] = per_shard(key)
    _emit_entries(plan, scope, outs[n_out + n_acc :], "shard")
    return outs[:n_out]


rules[_compat.shard_map_p] = _shard_map_rule
