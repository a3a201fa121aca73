"""The rewriter: walks a jaxpr, lets the handlers act at each site, and threads
what they emit (appended entries, accumulators, per-execution inputs) through
every higher-order primitive. One rule per primitive, shared by all handlers.

Calls are traced once, on the scope they are in; loops and branches as
`jax.experimental.checkify` traces them (see `_rules`).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from . import _compat, _jaxpr
from ._handlers import Handler, acts_on
from ._primitives import bind_site, handling, site_effect, site_p
from ._scope import Handlers, Scope, act
from ._site import (
    CHECKPOINT_NAME,
    Site,
)
from ._walk import NOT_YET, analysis, site_of, walk

Rule = Callable[[Any, list[Any], Scope], list[Any]]
# The rules for higher-order primitives, by primitive: `_rules` and `_custom`
# fill it (the package imports them, and they import this module).
rules: dict[Any, Rule] = {}

#
# Which sites does a jaxpr hold?
#


def _plain_runs(jaxpr) -> dict[int, tuple[int, Any, list[Any]]]:
    """Each maximal run of equations holding no site (itself or in its
    sub-jaxprs: see `walk`), by its first equation: `(index after it, the run
    as a jaxpr, the variables it reads)`. Such equations are copied into the
    caller's trace as they are, never traced again."""
    found = analysis(jaxpr)
    if found.runs is NOT_YET:
        runs, per_eqn, i = {}, walk(jaxpr).per_eqn, 0
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
        found.runs = runs
    return found.runs


class _Kept(NamedTuple):
    """A jaxpr whose sites are all `tag`/`perturb` equations at its top level
    (none in a sub-jaxpr, none recomputed) and whose other equations carry no
    effect, seen as if each site kept its value: `eqns`, the other equations,
    reading a site's inputs where they read its outputs; `sites`, the sites'
    equations, in order; `read(v)`, the variable they read in place of `v`."""

    eqns: list[Any]
    sites: list[Any]
    read: Callable[[Any], Any]


def _kept(jaxpr) -> _Kept | None:
    """`jaxpr` as a `_Kept`, or None where it is not one."""
    found = analysis(jaxpr)
    if found.kept is not NOT_YET:
        return found.kept
    hit, subst, eqns, sites = None, {}, [], []
    var = _compat.Var

    def read(v):
        return subst.get(v, v) if type(v) is var else v

    for eqn, inside in zip(jaxpr.eqns, walk(jaxpr).per_eqn):
        if not inside:
            if eqn.effects:
                break
            # (most equations read no site: left as they are)
            if subst and any(type(v) is var and v in subst for v in eqn.invars):
                eqn = eqn.replace(invars=list(map(read, eqn.invars)))
            eqns.append(eqn)
        elif (
            eqn.primitive is site_p
            and not eqn.params.get("recompute")
            and "part" not in eqn.params
        ):
            sites.append(eqn)
            subst.update(zip(eqn.outvars, map(read, eqn.invars)))
        else:
            break
    else:
        hit = _Kept(eqns, sites, read) if sites else None
    found.kept = hit
    return hit


def _all_kept(jaxpr, handlers: Handlers) -> bool:
    """Whether the first handler to match each site of `jaxpr` reports and
    consumes it, as a handler that only looks does (it may still change the
    value: `_spliced` checks), or no handler matches it and no `handle` encloses
    this one (it is gone: see `handle_site`)."""
    for key in walk(jaxpr).keys:
        if key[3] != "value":
            return False
        site = Site.probe(*key)
        first = next(
            (i for i, matches in enumerate(handlers.matches) if matches(site)),
            None,
        )
        if first is None:
            if handling.value:  # (an enclosing `handle` sees it: bound again)
                return False
            continue  # (gone: see `handle_site`)
        if not handlers.consumes[first]:
            return False
    return True


def _matched(handlers, sites) -> list[tuple[str, str, str]]:
    return [s for s in sites if any(_handler_may_match(h, s) for h in handlers)]


def _handler_may_match(h: Handler, s) -> bool:
    """Whether `h` may act at sites with the key `s`: a handler of the value
    acts at (is differentiated at) the value's tangent and cotangent sites."""
    return acts_on(h, Site.probe(*s)) is not None


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


def trace_rewrite(
    jaxpr, consts, handlers: Handlers, rewrite, front_avals, fn
) -> tuple[Any, list[Any]]:
    """The jaxpr of `fn(front, run_in)`, traced on inputs of `front_avals`
    then `jaxpr`'s, where `run_in(scope)` evaluates `jaxpr` (closing over
    `consts`) on the latter with the scope's handlers acting and returns its
    outputs. The jaxpr takes the constants it closes over first (they are
    returned with it), and last any inputs `fn` enters in its trace (a
    region's state, `_scope.Lazy`). `handlers` and `rewrite`: those of the
    scope `fn` acts with.

    Where the handlers keep the value of every site (see `_all_kept`),
    `jaxpr` is not evaluated again: its other equations are taken as they
    are, and only what the handlers do at its sites is traced, to be spliced
    in after them. The rewrite then costs what the sites cost, not what the
    program does. Should a handler change a value there after all, the
    rewrite is marked (`Rewrite.changed`), and done again splicing nothing
    (`_handle._rewrite`)."""
    n = len(front_avals)
    spliced = _spliced(jaxpr, consts, handlers, rewrite, front_avals, fn)
    if spliced is not None:
        return spliced

    def rewritten(*flat):
        return fn(flat[:n], lambda scope: run(jaxpr, consts, flat[n:], scope))

    avals = [*front_avals, *(v.aval for v in jaxpr.invars)]
    return _jaxpr.trace(rewrite.ending(rewritten), avals)


def _spliced(jaxpr, consts, handlers: Handlers, rewrite, front_avals, fn):
    """`trace_rewrite` by splicing, or None where it does not apply: the
    sites handled in order, each value they read an input of the trace, and
    `jaxpr`'s other equations (`_kept`) put before what that trace made."""
    kept = _kept(jaxpr)
    if kept is None or not rewrite.splice:
        return None
    if not _all_kept(jaxpr, handlers):
        return None
    read, eqns = kept.read, kept.sites
    reads = [read(v) for eqn in eqns for v in eqn.invars]
    n = len(front_avals)

    def sites_only(*flat):
        def run_in(scope: Scope) -> list[Any]:
            values = iter(flat[n:])
            for eqn in eqns:
                invals = [next(values) for _ in eqn.invars]
                outs = _site_rule(eqn, invals, scope)
                # (the rewrite goes on, to be done again: a trace an exception
                # stopped would be kept alive by JAX, with the values of
                # enclosing traces a handler closed over, as
                # tests/test_jax_facts.py::test_a_trace_an_exception_stops_is_kept_alive
                # shows)
                if any(a is not b for a, b in zip(outs, invals)):
                    rewrite.changed = True
            return []

        return fn(flat[:n], run_in)

    sites, hoisted = _jaxpr.trace(
        rewrite.ending(sites_only), [*front_avals, *(_jaxpr.aval(v) for v in reads)]
    )
    n_hoisted = len(hoisted)
    n_front = n_hoisted + n  # (then the values read, then the inputs `fn` entered)
    n_read = n_front + len(reads)
    given = dict(zip(sites.invars[n_front:n_read], reads))

    def spliced(v):
        return given.get(v, v) if type(v) is _compat.Var else v

    new_eqns = [
        e.replace(invars=list(map(spliced, e.invars)))
        if any(v in given for v in e.invars if type(v) is _compat.Var)
        else e
        for e in sites.eqns
    ]
    new = _compat.Jaxpr(
        [],
        [
            *sites.invars[:n_hoisted],
            *jaxpr.constvars,
            *sites.invars[n_hoisted:n_front],
            *jaxpr.invars,
            *sites.invars[n_read:],
        ],
        [*map(read, jaxpr.outvars), *map(spliced, sites.outvars)],
        [*kept.eqns, *new_eqns],
        sites.effects,  # (the other equations carry none)
        sites.debug_info._replace(result_paths=None),
        # (lowering expands hijax equations where the jaxpr says it holds some)
        **({"is_high": True} if _compat.is_high(jaxpr) else {}),
    )
    return new, [*hoisted, *consts]


def run(jaxpr, consts, args, scope: Scope) -> list[Any]:
    """Evaluates `jaxpr` on the current trace, with the scope's handlers acting."""
    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, _compat.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    literal = _compat.Literal
    eqns, per_eqn = jaxpr.eqns, walk(jaxpr).per_eqn
    runs, i = _plain_runs(jaxpr), 0
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
        env.update(zip(eqn.outvars, _run_eqn(eqn, sites, invals, scope)))
    return [read(v) for v in jaxpr.outvars]


def _run_eqn(eqn, sites, invals, scope: Scope) -> list[Any]:
    """One equation, holding `sites` (itself or in its sub-jaxprs), evaluated
    on the current trace: a site handled, a higher-order equation by its rule."""
    if not sites:
        return _bind(eqn, invals)
    if eqn.primitive is site_p:
        return _site_rule(eqn, invals, scope)
    if _compat.checkpoint_name_of(eqn) is not None:
        return _checkpoint_name_rule(eqn, invals, scope)
    if not needs_rewrite(scope.handlers, sites, eqn.effects, bool(handling.value)):
        return _bind(eqn, invals)
    rule = rules.get(eqn.primitive)
    if rule is None:
        matched = _matched(scope.handlers, sites)
        if matched and not _derivatives_kept(eqn, scope):
            where = Site.probe(*matched[0]).where()
            message = _UNSUPPORTED.format(where=where, prim=_compat.primitive_name(eqn))
            flag = _compat.hijax_flag(eqn)
            if flag is not None:
                message += _UNDER_FLAG.format(*flag)
            raise ValueError(message)
        return _bind(eqn, invals)
    with _compat.eqn_context(eqn):
        return rule(eqn, invals, scope)


def _derivatives_kept(eqn, scope: Scope) -> bool:
    """Whether the sites in `eqn`'s jaxprs are all derivative sites of values
    that the handlers that see them kept as they were (`Rewrite.kept`, as
    `_derivative` reads it): there, each is the identity, and `eqn` may be
    bound as it is, with no rule for its primitive (optimistix's Newton solves
    its linear systems with a Jacobian of the tagged function)."""
    handlers, kept = scope.handlers, scope.rewrite.kept
    for sub in _jaxpr.sub_jaxprs(eqn):
        for s in walk(sub).sites:
            site, pair = Site.probe(*s.key), s.eqn.params.get("pair")
            if site.part == "value":
                return False
            for i, matches in enumerate(handlers.matches):
                if matches(site.of("value")):
                    if not kept.get((i, pair)):
                        return False
                    if handlers.consumes[i]:
                        break
                elif matches(site):
                    return False
    return True


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
    # A constant's literal holds a Python scalar (a bool, say): handlers get
    # arrays, of its type.
    avals = [v.aval for v in eqn.invars]
    if any(type(v) is _compat.Literal for v in eqn.invars):
        invals = [
            _compat.literal_array(v) if type(v) is _compat.Literal else x
            for x, v in zip(invals, eqn.invars)
        ]
    return handle_site(eqn.params, avals, invals, scope)


def handle_site(params, avals, invals, scope: Scope) -> list[Any]:
    """Lets the scope's handlers act, in order, on one executed site (its
    params, the avals of its leaves, their values). A site no handler consumes
    is bound again for the handlers of an enclosing `handle`; with none, it is
    gone, as an unhandled tag is (see `_primitives.tag`)."""
    site = Site.from_eqn(params, avals, scope.shards)
    if site.part != "value":
        return _derivative(site, params, avals, list(invals), scope)
    if not scope.replaying:
        values, named = scope.rewrite.values, (site.kind, site.collection, site.name)
        values[named] = values.get(named, 0) + 1
    leaves, consumed = _act(site, list(invals), scope)
    if consumed or not handling.value:
        return leaves
    return site_p.bind(*leaves, **params)


_HIGHER = (
    "{handler} changes {where} in a program that differentiates it twice "
    "inside `fx.handle` (`jax.jacrev` of `jax.grad`, `jax.jvp` of `jax.grad`, "
    "...): only first derivatives are taken through a handler. Differentiate "
    "the handled function instead (`jax.hessian(lambda x: fx.handle(f, ...)(x)"
    "[0])`)."
)


def _derivative(site: Site, params, avals, invals, scope: Scope):
    """The handlers act at a tangent or cotangent site: a handler of that part
    gets the derivative (and the value, `ctx.primal`); a handler of the value
    is differentiated there, so that handling commutes with differentiation:
    its JVP acts on the tangent, its VJP (at the value) on the cotangent, in
    the order the derivative flows (the handlers' order for a tangent, the
    reverse for a cotangent). Handlers further out (an enclosing `handle`) see
    the derivative after these for a tangent, before them for a cotangent, as
    they see the value after these."""
    n = len(invals) // 2
    primal, leaves = invals[:n], invals[n:]
    value = site.of("value", avals[:n])
    handlers, part = scope.handlers, site.part
    higher = bool(params.get("higher"))
    # The handlers acting, in order, and whether each is one of the value.
    steps: list[tuple[int, bool]] = []
    # (what a `handle` inside this one consumed: the value, or the derivative,
    # whose handlers of the value are still differentiated here)
    sees_value = not params.get("value_consumed")
    consumed = bool(params.get("derivative_consumed"))
    consumable = site.collection != CHECKPOINT_NAME
    for i, matches in enumerate(handlers.matches):
        if matches(value):  # a handler of the value: differentiated here
            if sees_value and not scope.rewrite.kept.get((i, site.pair)):
                steps.append((i, True))
            sees_value = sees_value and not (handlers.consumes[i] and consumable)
        elif not (higher or consumed) and matches(site):
            steps.append((i, False))
            consumed = handlers.consumes[i] and consumable
    # An enclosing `handle` sees the site while the derivative, or the value
    # (whose handlers are differentiated here), is its to change; with none,
    # it is dropped, and so is the value the backward pass kept for it.
    outer = (sees_value or not consumed) and bool(handling.value)
    if not (outer or consumed):
        scope.rewrite.dropped = True
    again = dict(params)
    if not sees_value:
        again["value_consumed"] = True
    if consumed:
        again["derivative_consumed"] = True

    def rebind(p, d):
        return bind_site([*p, *d], again, bool(handling.value))

    if higher:
        for i, _ in steps:
            if act(scope, i, value, primal, within="higher") is not primal:
                raise ValueError(
                    _HIGHER.format(
                        handler=type(handlers[i]).__name__, where=value.where()
                    )
                )
        return rebind(primal, leaves) if outer else leaves
    if part == "tangent":
        p, d = primal, leaves
        for i, of_value in steps:
            if of_value:
                p, d = _jvp(functools.partial(_acted, scope, i, value, site.pair), p, d)
            else:
                d = act(scope, i, site, d, primal=p)
        return rebind(p, d) if outer else d
    # A cotangent: the values each handler saw, then the derivatives back.
    seen, p = [], primal
    for i, of_value in steps:
        back = None
        if of_value:
            p_in = p
            p, back = jax.vjp(lambda q, i=i: act(scope, i, value, q, within=part), p)
            seen.append((i, p_in, back))
        else:
            seen.append((i, p, None))
    d = rebind(p, leaves) if outer else leaves
    for i, p_i, back in reversed(seen):
        d = list(back(d)[0]) if back is not None else act(scope, i, site, d, primal=p_i)
    return d


def _acted(scope: Scope, i: int, value: Site, pair, q):
    """Handler `i` acts on the primal value `q` at a tangent site, which is
    also what tells whether it keeps a value whose own site the program does
    not hold (a linearization JAX computed apart: `_derivatives_kept`)."""
    new = act(scope, i, value, q, within="tangent")
    kept = scope.rewrite.kept
    kept[i, pair] = kept.get((i, pair), True) and new is q
    return new


def _jvp(fn, primal, tangent):
    out, tangent_out = jax.jvp(fn, (primal,), (tangent,))
    return list(out), list(tangent_out)


def _act(site: Site, leaves: list[Any], scope: Scope) -> tuple[list[Any], bool]:
    """The scope's handlers act, in order, on one executed site: the leaves
    they leave, and whether one of them consumed the site. A `checkpoint_name`
    is never consumed (see `_checkpoint_name_rule`): every handler sees it."""
    consumable = site.collection != CHECKPOINT_NAME
    handlers = scope.handlers
    for i, matches in enumerate(handlers.matches):
        if matches(site):
            new = act(scope, i, site, leaves)
            if site.pair is not None:
                kept = scope.rewrite.kept
                kept[i, site.pair] = kept.get((i, site.pair), True) and new is leaves
            leaves = new
            if handlers.consumes[i] and consumable:
                return leaves, True
    return leaves, False


def _checkpoint_name_rule(eqn, invals, scope: Scope) -> list[Any]:
    """Handlers act on a `checkpoint_name` as on a tag, and the name stays on
    the value they leave: remat policies that select by name keep working, and
    handlers further out see it again."""
    site = site_of(eqn, scope.shards)
    leaves, _ = _act(site, list(invals), scope)
    key = site.kind, site.collection, site.name, site.part
    changed = any(map(operator.is_not, leaves, invals))
    if changed and key in scope.rewrite.differentiated:
        raise ValueError(_CHANGED_DIFFERENTIATED.format(name=site.name))
    return _bind(eqn, leaves)


_CHANGED_DIFFERENTIATED = (
    "A handler changes the checkpoint_name {name!r}, which a `jax.grad` (or "
    "`jax.jvp`) inside the handled function differentiates: JAX differentiated "
    "the program before the handler changed the value, so its derivative would "
    "be the old value's. Differentiate the handled function instead "
    "(`jax.grad(lambda x: fx.handle(f, ...)(x)[0])`), or mark the value with "
    "`fx.tag`, whose derivative follows what a handler does to it."
)
