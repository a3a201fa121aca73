"""The rules for higher-order primitives (jit, checkpoint, scan, while_loop,
cond, custom_jvp/custom_vjp, shard_map): each threads what the handlers emit in
its sub-jaxprs, and keeps only its binder order and params.

A call (jit, checkpoint, custom_jvp/custom_vjp) is traced once, on the scope
it is in (`Scope.traced`). A loop, a cond's branches and a shard_map's body
(a `Region`) are traced once, each accumulator, per-execution input and
loop iteration entering the trace as a new input where a handler first
touches it (`_scope.Lazy`), an accumulator leaving it as an output; what
the trace found the region threads (`Emitted`). Where an accumulator left
with other types than it entered (a value under more vmaps inside grew it),
the region makes it so outside, and traces the region again.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from . import _compat, _jaxpr
from ._handlers import mode_label
from ._layout import WHOLE, Axes, Boundary
from ._rewrite import _bind, _matched, rules, trace_rewrite
from ._scope import Acc, Key, Lazy, Scope, last_first, types_key, types_of
from ._site import Site, describe, strong
from ._walk import recomputes, sites_in

#
# Plans: what a region emits
#


@dataclasses.dataclass
class Emitted:
    """What the handlers emit inside one region, as a trace of it found: the
    types of the state the region threads, with the sites, their executions
    and whether a handler read the iterations."""

    # key -> init thunk, for those first made inside
    accs: dict[Key, Any] = dataclasses.field(default_factory=dict)
    # key -> the types and batch axes of the accumulators it threads
    acc_avals: dict[Key, Acc] = dataclasses.field(default_factory=dict)
    # key -> [(avals tree, lead)]
    entries: dict[Key, list[tuple[Any, Axes]]] = dataclasses.field(default_factory=dict)
    # key -> [(avals tree, lead)], of the per-execution inputs it took
    inputs: dict[Key, list[tuple[Any, Axes]]] = dataclasses.field(default_factory=dict)
    # key -> per entry, of a cotangent, the value's executions before it
    # (see `Scope.add_entry`)
    counts: dict[Key, list[int]] = dataclasses.field(default_factory=dict)
    sites: dict[Key, Site] = dataclasses.field(default_factory=dict)
    calls: dict[Key, int] = dataclasses.field(default_factory=dict)  # per run
    index: bool = False  # whether a handler reads the loops' iterations

    @classmethod
    def of(cls, sub: Scope) -> Emitted:
        """What the trace of a region in the scope `sub` found: types only
        (nothing may keep the trace's tracers alive)."""
        outside = sub.outside
        return cls(
            accs=dict(sub.acc_inits),
            acc_avals={k: sub.accs[k].types() for k in sub.touched},
            entries={
                k: [(types_of(v), lead) for v, lead in vs]
                for k, vs in sub.entries.items()
            },
            inputs=dict(sub.input_avals),
            counts={k: list(c) for k, c in sub.counts.items()},
            sites=dict(sub.sites),
            calls={
                k: n - (0 if outside is None else outside.count(k))
                for k, n in sub.calls.items()
            },
            index=sub.wants_index,
        )

    def acc(self, scope: Scope, key: Key):
        """One accumulator's value entering the region (made, or grown by the
        vmap batch axes it has inside)."""
        return scope.acc(key, self.accs.get(key), self.acc_avals[key].batch)

    def forbid(self, loop: str, scope: Scope) -> None:
        """Refuses what a loop cannot do: a single value, and in a while_loop
        (whose number of iterations is unknown) appends and per-execution
        inputs."""
        unbounded = loop == "lax.while_loop"
        for key in self.entries:
            mode, where = scope.handlers.modes[key[0]], self.sites[key].where()
            label = mode_label(scope.handlers[key[0]])
            if mode.single:
                instead = _INSTEAD_IN_WHILE if unbounded else _INSTEAD_IN_SCAN
                raise ValueError(
                    _STRICT_IN_LOOP.format(
                        where=where, what=loop, mode=label, instead=instead
                    )
                )
            if unbounded:
                raise ValueError(_APPEND_IN_WHILE.format(where=where, mode=label))
        for key in self.inputs if unbounded else ():
            raise ValueError(
                _INPUT_IN_WHILE.format(
                    where=self.sites[key].where(),
                    handler=type(scope.handlers[key[0]]).__name__,
                )
            )

    @classmethod
    def merged(cls, each: list[Emitted], handlers=None) -> Emitted:
        """One for several: the branches of a cond (every branch threads what
        any of them emits), or what a region threads and what a trace found.
        (`handlers` name the one whose reports differ across branches.)"""
        if len(each) == 1:  # (a region of one body, as most are)
            return each[0]
        merged = cls()
        for emitted in each:
            merged.sites.update(emitted.sites)
            merged.accs.update(emitted.accs)
            merged.index |= emitted.index
            for key, n in emitted.calls.items():  # (entries of a name, likewise)
                merged.calls[key] = max(n, merged.calls.get(key, 0))
            for key, counts in emitted.counts.items():
                if len(counts) > len(merged.counts.get(key, ())):
                    merged.counts[key] = counts
            for key, acc in emitted.acc_avals.items():
                # Where branches differ, the accumulator of the branch under
                # more vmaps (the other's grows to it).
                have = merged.acc_avals.get(key)
                if have is None or len(acc.batch) >= len(have.batch):
                    merged.acc_avals[key] = acc
            for ours, theirs in [
                (merged.entries, emitted.entries),
                (merged.inputs, emitted.inputs),
            ]:
                for key, specs in theirs.items():
                    have = ours.setdefault(key, [])
                    for (one, lead), (other, at) in zip(specs, have):
                        if (types_key(one), lead) != (types_key(other), at):
                            h = handlers and type(handlers[key[0]]).__name__
                            raise ValueError(
                                _BRANCHES_DIFFER.format(
                                    handler=h or "A handler",
                                    what="reports"
                                    if ours is merged.entries
                                    else "takes",
                                    where=emitted.sites[key].where(),
                                    one=describe(other),  # (the first's)
                                    other=describe(one),
                                )
                            )
                    have += specs[len(have) :]
        return merged


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
_BRANCHES_DIFFER = (
    "{handler} {what} {one} at {where} in one branch of a lax.cond and {other} "
    "in another; what a handler reports or takes for one name must have one "
    "shape and dtype in every branch (for Tag(), the tag's value)."
)


#
# Regions
#


class Region:
    """Sub-jaxprs (a loop body, a cond's branches, a shard_map's body) with
    what the handlers emit in them threaded through (`emitted`). Made, it
    has taken from the enclosing scope the state the region threads, as two
    pytrees flattened at its boundary: `carried` (the accumulators, and a
    while_loop's iteration where a handler reads it), which the region
    returns updated, and `sliced` (the per-execution inputs, and a scan's
    iterations), which a scan slices per iteration. A body is traced
    (`trace`) and laid out (`aligned`) with the carried leaves among its
    inputs and outputs at `at` (`(i, o)`: before its `i`-th input and `o`-th
    output; at the end by default), the sliced ones after its inputs, and the
    entries it appends after its outputs; `leave` gives what came out back
    to the scope. A rule reads:

        region, [(body, hoisted)] = Region.traced(scope, [(jaxpr, consts)], in_avals)
        # body: (*hoisted, *args, *carried, *sliced) -> (*outs, *carried, *entries)
        outs = _bind(eqn, [*hoisted, *region.args(invals)], ...)
        return region.leave(outs)
    """

    def __init__(
        self,
        scope: Scope,
        emitted: Emitted,
        boundary: Boundary = WHOLE,
        accs=None,
        loop: str | None = None,
        at: tuple[int, int] | None = None,
    ):
        self.scope, self.emitted, self.boundary = scope, emitted, boundary
        self.loop, self.at = loop, at
        if accs is None:
            accs = [emitted.acc(scope, key) for key in emitted.acc_avals]
        inputs = []
        for key, specs in emitted.inputs.items():
            outside_specs = [
                (boundary.stacked(a, lead), boundary.after(lead)) for a, lead in specs
            ]
            values = scope.take_inputs(key, outside_specs, emitted.sites[key])
            for value, (_, lead) in zip(values, specs):
                # (typed as a trace enters them: see `_scope.Lazy.take`)
                value = jax.tree.map(_typed_input, value)
                inputs.append(boundary.to_inside(value, lead))
        carried: dict[str, Any] = {"accs": accs}
        sliced: dict[str, Any] = {"inputs": inputs}
        # A loop's iteration, where a handler reads it (`Context.at`): a scan's
        # sliced per iteration, a while_loop's carried and counted.
        if emitted.index and loop == "lax.while_loop":
            carried["index"] = jnp.int32(0)
        if emitted.index and loop == "lax.scan":
            sliced["index"] = jnp.arange(boundary.size, dtype=jnp.int32)
        self.carried, self._carried = jax.tree.flatten(carried)
        self.sliced, self._sliced = jax.tree.flatten(sliced)
        # Per trace: what it found, what it entered, and whether each
        # accumulator left it with the types it entered with; the types of
        # the inputs a region traced again gives (see `traced`).
        self.found: list[Emitted] = []
        self.entered: list[tuple[Lazy, bool]] = []
        self.known: dict = {}

    def args(self, invals) -> list[Any]:
        """The equation's own inputs with the state the region threads."""
        i = len(invals) if self.at is None else self.at[0]
        return [*invals[:i], *self.carried, *invals[i:], *self.sliced]

    @classmethod
    def traced(
        cls,
        scope: Scope,
        bodies: list[tuple[Any, Any]],
        in_avals,
        boundary: Boundary = WHOLE,
        loop: str | None = None,
        enter=None,
        at: tuple[int, int] | None = None,
    ):
        """The region of `bodies` (`(jaxpr, consts)`: a body, or a cond's
        branches), and each body traced, `(open jaxpr, its constants)`.
        `enter(emitted)`: the accumulators entering, one tree each (by default
        as `Emitted.acc` makes them).

        A trace enters the accumulators, the per-execution inputs and the
        loop's iteration as the handlers first touch them (`_scope.Lazy`),
        and is laid out as the region threads them (`aligned`). Where an
        accumulator left with other types than it entered (a value under more
        vmaps inside grew it, a shard_map split one it had whole), the region
        has made it outside as it leaves, and the bodies are traced again,
        entering it so."""
        tracer = cls(scope, Emitted(), boundary, [], loop, at)
        traced = [tracer.trace(j, c, in_avals) for j, c in bodies]
        emitted = Emitted.merged(tracer.found, scope.handlers)
        if loop is not None:
            emitted.forbid(loop, scope)
        accs = None if enter is None else enter(emitted)
        region = cls(scope, emitted, boundary, accs, loop, at)
        aligned = tracer.aligned(region, traced, len(in_avals))
        if aligned is None:
            tracer = cls(scope, Emitted(), boundary, [], loop, at)
            # (an input enters as the region gives one of its shape and dtype)
            tracer.known = {(a.shape, a.dtype): a for a in region.input_types()}
            traced = [tracer.trace(j, c, in_avals) for j, c in bodies]
            aligned = tracer.aligned(region, traced, len(in_avals))
            assert aligned is not None, "a second trace entered other types"
        region.found = tracer.found
        return region, aligned

    def _index_aval(self):
        """The type of the loop's iteration inside (see `__init__`)."""
        if self.loop == "lax.scan":
            index = jnp.arange(self.boundary.size, dtype=jnp.int32)
            return self.boundary.input_aval(jax.typeof(index))
        return jax.typeof(jnp.int32(0))

    def aligned(self, region: Region, traced, n_args: int):
        """This region's traces (`traced`: `(body, hoisted)` each) as `region`
        threads them, or None where they cannot be: each accumulator must
        leave with the types it entered with, and enter, as each input, with
        the types the region gives (see `_laid_out`)."""
        accs: dict[Key, list[Any]] = {}  # (the types each entered with)
        for found, (lazy, ok) in zip(self.found, self.entered):
            if not ok:
                return None
            for key, (_, avals) in lazy.accs.items():
                if not _compat.same_types(accs.setdefault(key, avals), avals):
                    return None
        b, emitted = region.boundary, region.emitted
        given = region._carried.unflatten(region.carried)["accs"]
        have = [b.acc_aval(jax.typeof(x)) for x in jax.tree.leaves(given)]
        if not _compat.same_types(
            have, [a for k in emitted.acc_avals for a in accs[k]]
        ):
            return None
        leaves = iter(region.input_types())
        inputs = {
            key: [[next(leaves) for _ in jax.tree.leaves(a)] for a, _ in specs]
            for key, specs in emitted.inputs.items()
        }
        bodies = []
        for (body, hoisted), found, (lazy, _) in zip(traced, self.found, self.entered):
            args = emitted, found, body, hoisted, n_args, lazy, accs, inputs
            laid_out = self._laid_out(*args)
            if laid_out is None:
                return None
            bodies.append(laid_out)
        return bodies

    def input_types(self) -> list[Any]:
        """The types inside of the per-execution inputs' leaves this region
        gives."""
        given = self._sliced.unflatten(self.sliced)["inputs"]
        b = self.boundary
        return [b.input_aval(jax.typeof(x)) for x in jax.tree.leaves(given)]

    def _laid_out(
        self, emitted: Emitted, found, body, hoisted, n_args, lazy, accs, inputs
    ):
        """A trace's `(body, hoisted)` as the region threads `emitted`: the state it
        entered, after its own inputs, moved where the carried and the sliced
        state go, and its outputs in the region's order; for a branch, the
        accumulators it did not touch passed through, unused inputs for the
        entries of `inputs` it did not take, and zeros for the entries it
        lacks (after its own, or before them in a backward pass, which runs
        the executions last first), made by a jaxpr of their own whose
        equations join the body's (its constants, a float0 zero's, among the
        hoisted). None where an input entered with other types than the
        region gives."""
        sizes = {k: len(avals) for k, avals in accs.items()}
        lacking = [k for k in emitted.acc_avals if k not in found.acc_avals]
        fills = [s[len(found.entries.get(k, ())) :] for k, s in emitted.entries.items()]
        if not (lazy.n or accs or inputs or any(fills)) and list(found.entries) == list(
            emitted.entries
        ):
            return body, hoisted  # (it entered nothing, and lacks nothing)
        index = lazy.index_at
        carries = index is not None and self.loop == "lax.while_loop"
        n_hoisted = len(hoisted)
        outs, start = body.outvars, n_hoisted + n_args
        n_state = sum(sizes[k] for k in found.acc_avals) + carries
        n_own = len(outs) - n_state - sum(map(_n_leaves, found.entries.values()))
        i, o = (n_args, n_own) if self.at is None else self.at
        state, got = iter(outs[n_own : n_own + n_state]), iter(outs[n_own + n_state :])
        passed = [a for k in lacking for a in accs[k]]
        consts, const_ins, ins, outs_extra, eqns, effects = self._filler(passed, fills)
        through = iter(zip(ins, outs_extra[: len(passed)]))
        made = iter(outs_extra[len(passed) :])
        mine = {k: [next(state) for _ in range(sizes[k])] for k in found.acc_avals}
        carried_in, carried_out = [], []
        for key in emitted.acc_avals:
            if key in mine:
                first = start + lazy.accs[key][0]
                carried_in += body.invars[first : first + sizes[key]]
                carried_out += mine[key]
            else:
                pairs = [next(through) for _ in range(sizes[key])]
                carried_in += [v for v, _ in pairs]
                carried_out += [v for _, v in pairs]
        sliced_in = [] if index is None else [body.invars[start + index]]
        if carries:
            carried_in, sliced_in = carried_in + sliced_in, []
            carried_out.append(next(state))
        taken = _taken(emitted, found, body.invars[start:], lazy, inputs)
        if taken is None:
            return None
        sliced_in += taken
        entries = _filled(emitted, found, got, made, fills)
        own = outs[:n_own]  # (the equation's)
        cut = n_hoisted + i
        body = body.replace(
            invars=[
                *body.invars[:n_hoisted],
                *const_ins,
                *body.invars[n_hoisted:cut],
                *carried_in,
                *body.invars[cut:start],
                *sliced_in,
            ],
            eqns=[*body.eqns, *eqns],
            outvars=[*own[:o], *carried_out, *own[o:], *entries],
            effects=body.effects | effects,
        )
        return body, [*hoisted, *consts]

    def _filler(self, passed, fills):
        """What a branch lacks (see `_laid_out`): the accumulators of types
        `passed` passed through and zeros for the entries `fills` (specs,
        per name), as a jaxpr's constants (a float0 zero's), their inputs, its
        other inputs, outputs, equations and effects."""
        if not passed and not any(fills):
            return [], [], [], [], [], frozenset()
        b, zeros = self.boundary, self.scope.rewrite.zeros

        def fill(*passed):
            made = [zeros(avals) for specs in fills for avals, _ in specs]
            return [*map(b.leave, passed), *map(b.leave, jax.tree.leaves(made))]

        filler, consts = _jaxpr.trace(self.scope.rewrite.ending(fill), passed)
        n = len(consts)
        ins, outs = filler.invars, filler.outvars
        return consts, ins[:n], ins[n:], outs, filler.eqns, filler.effects

    def trace(self, jaxpr, consts, in_avals):
        """Traces a body `(*args) -> (*outs, *accs, *entries)` (as
        `trace_rewrite` does: where every site's value is kept, by splicing),
        each accumulator, per-execution input and loop iteration entering as
        a new input where a handler first touches it (`_scope.Lazy`). Returns
        the open jaxpr, which takes the constants it closes over first, and
        those constants."""
        scope, b = self.scope, self.boundary

        def fn(_, run_in):
            lazy = Lazy(b, self._index_aval, self.known)
            sub = scope.inner(
                shards=scope.shards + ((b.marker,) if b.stack == "shard" else ()),
                scans=scope.scans + (b.stack == "scan"),
                # (a loop's iteration, entering where a handler reads it; see
                # `_scope._counted`)
                index=scope.index + (() if self.loop is None else (lazy,)),
                lazy=lazy,
            )
            outs = run_in(sub)
            found = Emitted.of(sub)
            self.found.append(found)
            entries = [v for k in found.entries for v, _ in sub.entries[k]]
            state = self._state_out(sub, found, lazy)
            return [*outs, *state, *map(b.leave, jax.tree.leaves(entries))]

        handlers, rewrite = scope.handlers, scope.rewrite
        if b.stack != "shard":
            return trace_rewrite(jaxpr, consts, handlers, rewrite, (), fn)
        with _compat.shard_map_body(b.params):
            return trace_rewrite(jaxpr, consts, handlers, rewrite, (), fn)

    def _state_out(self, sub: Scope, found: Emitted, lazy: Lazy):
        """The state's leaves as a trace in `sub` returns them: the
        accumulators it entered, as it touched them (whether each leaves with
        its types is recorded), and a while_loop's iteration, counted."""
        b = self.boundary
        accs = [jax.tree.map(b.leave, sub.accs[k].value) for k in found.acc_avals]
        leaving = [jax.typeof(x) for x in jax.tree.leaves(accs)]
        entering = [a for k in found.acc_avals for a in lazy.accs[k][1]]
        self.entered.append((lazy, _compat.same_types(leaving, entering)))
        state = jax.tree.leaves(accs)
        if lazy.index_at is not None and self.loop == "lax.while_loop":
            state.append(lazy.index() + 1)
        lazy.done()
        return state

    def leave(self, outs) -> list[Any]:
        """Gives the enclosing scope what the region returned besides the
        equation's own outputs: the carried state, then the entries (stacked
        along their first axis by a scan or shard_map), and what it did (its
        sites, their executions, whether a handler read the loops'
        iterations). Returns the equation's own outputs."""
        scope, b, emitted = self.scope, self.boundary, self.emitted
        done = Emitted.merged(self.found)
        for key, site in done.sites.items():  # known in order of first execution
            scope.sites.setdefault(key, site)
        for key, n in done.calls.items():
            scope.calls[key] = scope.count(key) + n
        scope.wants_index |= done.index
        specs = [(k, *s) for k, specs in emitted.entries.items() for s in specs]
        entries = jax.tree.structure([avals for _, avals, _ in specs])
        n_own = len(outs) - len(self.carried) - entries.num_leaves
        o = n_own if self.at is None else self.at[1]
        carried = self._carried.unflatten(outs[o : o + len(self.carried)])
        for (key, acc), value in zip(emitted.acc_avals.items(), carried["accs"]):
            # (a shard_map's, one per shard, after the batch axes)
            batch = acc.batch
            if b.stack == "shard":
                value, batch = b.from_inside(value, batch), b.after(batch)
            scope.accs[key] = Acc(value, batch)
        values = entries.unflatten(outs[len(outs) - entries.num_leaves :])
        # (a cotangent's count as the trace met it: one backward pass inside
        # is one outside, two are two)
        counts = {k: iter(c) for k, c in emitted.counts.items()}
        for (key, _, lead), value in zip(specs, values):
            count = next(counts[key]) if key in counts else None
            scope.add_entry(key, b.from_inside(value, lead), b.after(lead), count)
        return [*outs[:o], *outs[o + len(self.carried) : n_own + len(self.carried)]]


def _filled(emitted: Emitted, found: Emitted, got, made, fills) -> list[Any]:
    """The entries a trace appended (`got`, in its order) with the
    zeros `made` for those it lacks (`fills`, per name), in the region's
    order: zeros after its own, or before them in a backward pass."""
    values = {
        k: [next(got) for _ in range(_n_leaves(specs))]
        for k, specs in found.entries.items()
    }
    entries = []
    for key, filled in zip(emitted.entries, fills):
        own = values.get(key, [])
        zero = [next(made) for _ in range(_n_leaves(filled))]
        if (found.sites.get(key) or emitted.sites[key]).part == "cotangent":
            own, zero = zero, own
        entries += own + zero
    return entries


def _taken(emitted: Emitted, found: Emitted, entered, lazy: Lazy, inputs):
    """The per-execution inputs a trace took (`entered`: the inputs it
    entered lazily) where the region gives those of `inputs` (per name, the
    types of each entry's leaves): each entry as it was taken, a backward
    pass's last first, and unused inputs for those a branch did not take.
    None where one entered with other types."""
    taken = []
    for key, types in inputs.items():
        calls = lazy.inputs.get(key, [])
        if last_first(key, found.sites.get(key) or emitted.sites[key]):
            calls = calls[::-1]
        own = [entry for call in calls for entry in call]
        for j, avals in enumerate(types):
            if j >= len(own):  # (a branch that takes fewer)
                taken += [_compat.Var(a) for a in avals]
                continue
            leaves = [entered[at] for at in own[j]]
            if not _compat.same_types([v.aval for v in leaves], avals):
                return None
            taken += leaves
    return taken


def _typed_input(x):
    return _compat.vary_over_manual_axes(strong(x))


def _n_leaves(specs) -> int:
    """How many leaves the entries of `specs` (`(avals, lead)` each) have."""
    return sum(len(jax.tree.leaves(avals)) for avals, _ in specs)


#
# Call-like primitives: jit, closed_call, checkpoint
#


def _call_rule(eqn, invals, scope: Scope, name: str) -> list[Any]:
    # In the backward pass's recomputation of a checkpointed region, handlers act
    # on its sites so that it computes the values the forward pass did (a
    # substituted value, a perturbation), but what they report there is dropped:
    # each execution is reported once, by the forward pass.
    if eqn.primitive is _compat.remat_p and recomputes(eqn):
        scope = scope.replay()
    jaxpr = eqn.params[name]  # closed, but for a checkpoint's
    closed = isinstance(jaxpr, _compat.ClosedJaxpr)
    jaxpr, consts = (jaxpr.jaxpr, jaxpr.consts) if closed else (jaxpr, ())
    # One trace (see `trace_rewrite`), on the body's own types: an equation may
    # pass a value that varies over a shard_map's axes where its body was
    # traced with one that does not (JAX's vmap of a cond in a shard_map makes
    # every operand of a branch vary). What the handlers emit leaves as more
    # outputs.
    body, hoisted, leave = scope.traced(
        lambda finish: trace_rewrite(
            jaxpr,
            consts,
            scope.handlers,
            scope.rewrite,
            (),
            lambda _, run_in: finish(run_in(scope)),
        )
    )
    params = {name: _compat.ClosedJaxpr(body, ()) if closed else body}
    if closed:
        # A call rewritten to the program of one rewritten before binds that
        # one's jaxpr: JAX lowers a jaxpr once per module for all its calls,
        # so a jitted function called many times lowers once, as unhandled.
        key = _jaxpr.structure(body)
        if key is not None:
            params[name] = scope.rewrite.jaxprs.setdefault(key, params[name])
    n_out = len(eqn.outvars)
    if eqn.primitive is _compat.pjit_p:
        n_extra_out = len(body.outvars) - n_out
        params |= _jit_params(eqn.params, len(hoisted), 0, n_extra_out)
    outs = _bind(eqn, [*hoisted, *invals], **params)
    leave(outs[n_out:])
    return outs[:n_out]


def _jit_params(params, n_hoisted: int, n_in: int, n_out: int) -> dict[str, Any]:
    """jit's per-input and per-output params, for `n_hoisted` more inputs
    before its own and `n_in` after, and `n_out` more outputs after its own."""

    def pad(name, fill, before, after):
        return (fill,) * before + tuple(params[name]) + (fill,) * after

    unspec = _compat.UNSPECIFIED
    return dict(
        in_shardings=pad("in_shardings", unspec, n_hoisted, n_in),
        in_layouts=pad("in_layouts", None, n_hoisted, n_in),
        donated_invars=pad("donated_invars", False, n_hoisted, n_in),
        out_shardings=pad("out_shardings", unspec, 0, n_out),
        out_layouts=pad("out_layouts", None, 0, n_out),
    )


rules[_compat.pjit_p] = functools.partial(_call_rule, name="jaxpr")
rules[_compat.closed_call_p] = functools.partial(_call_rule, name="call_jaxpr")
rules[_compat.remat_p] = functools.partial(_call_rule, name="jaxpr")

#
# scan
#


def _scan_rule(eqn, invals, scope: Scope) -> list[Any]:
    p = eqn.params
    closed = p["jaxpr"]
    n_consts, n_carry = _compat.scan_counts(p)
    # The body is (hoisted, consts, carry, carried, xs, sliced) -> (carry,
    # carried, ys, entries): the carried state extends the carry, the sliced
    # the xs, and the entries the ys.
    region, [(body, hoisted)] = Region.traced(
        scope,
        [(closed.jaxpr, closed.consts)],
        closed.in_avals,
        Boundary("scan", p["length"]),
        "lax.scan",
        at=(n_consts + n_carry, n_carry),
    )
    n_state = len(region.carried)
    params = _compat.scan_params(
        p,
        _compat.ClosedJaxpr(body, ()),
        n_consts=len(hoisted) + n_consts,
        n_carry=n_carry + n_state,
        n_xs=len(invals) - n_consts - n_carry + len(region.sliced),
        n_ys=len(body.outvars) - n_carry - n_state,
    )
    outs = _bind(eqn, [*hoisted, *region.args(invals)], **params)
    return region.leave(outs)


rules[_compat.scan_p] = _scan_rule

#
# while_loop
#


def _while_rule(eqn, invals, scope: Scope) -> list[Any]:
    p = eqn.params
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    n_cc, n_bc = p["cond_nconsts"], p["body_nconsts"]
    matched = _matched(scope.handlers, sites_in(cond.jaxpr))
    if matched:
        raise ValueError(
            f"{Site.probe(*matched[0]).where()} is inside the "
            "cond_fun of a lax.while_loop, which handlers cannot collect from. "
            "Tag the value in body_fun instead."
        )
    region, [(new_body, hoisted)] = Region.traced(
        scope, [(body.jaxpr, body.consts)], body.in_avals, loop="lax.while_loop"
    )
    _per_example(region.emitted, scope, cond.out_avals[0].shape)
    # (hoisted, body_consts, carry, carried) -> (carry, carried): the carried
    # state extends the carry; cond_fun ignores it.
    new_cond = _jaxpr.insert_invars(
        cond.jaxpr, len(cond.jaxpr.invars), [jax.typeof(x) for x in region.carried]
    )
    params = dict(
        cond_jaxpr=_compat.ClosedJaxpr(new_cond, cond.consts),
        body_jaxpr=_compat.ClosedJaxpr(new_body, ()),
        body_nconsts=len(hoisted) + n_bc,
    )
    args = [*invals[:n_cc], *hoisted, *region.args(invals[n_cc:])]
    return region.leave(_bind(eqn, args, **params))


rules[_compat.while_p] = _while_rule


def _per_example(emitted: Emitted, scope: Scope, batch: tuple[int, ...]) -> None:
    """Refuses what a while_loop whose predicate a vmap batched (`batch`, its
    shape) cannot thread: each example runs its own number of iterations, and
    JAX's loop keeps each example's carry, so what the handlers thread must be
    per example too: neither one count of the iterations nor a reduction over
    the whole batch."""
    if batch and emitted.index:
        where = next(iter(emitted.sites.values())).where()
        raise ValueError(_AT_IN_BATCHED_WHILE.format(where=where))
    for key, acc in emitted.acc_avals.items() if batch else ():
        if acc.batch[: len(batch)] != batch:
            raise ValueError(
                _WHOLE_BATCH_IN_BATCHED_WHILE.format(
                    handler=type(scope.handlers[key[0]]).__name__,
                    where=emitted.sites[key].where(),
                )
            )


_AT_IN_BATCHED_WHILE = (
    "A handler reads `at` in the lax.while_loop holding {where}, whose "
    "predicate a jax.vmap inside the handled function batches: each example "
    "runs its own number of iterations. Put the handler inside the vmap "
    "(`jax.vmap(fx.handle(f, ...))`), which gives each example its own."
)
_WHOLE_BATCH_IN_BATCHED_WHILE = (
    "{handler} reduces {where} over the whole batch (`per_example=False`) in "
    "a lax.while_loop whose predicate a jax.vmap inside the handled function "
    "batches: each example runs its own number of iterations. Put the handler "
    "inside the vmap (`jax.vmap(fx.handle(f, ...))`), or reduce per example."
)

#
# cond / switch
#


def _cond_rule(eqn, invals, scope: Scope) -> list[Any]:
    branches = eqn.params["branches"]
    in_avals = branches[0].in_avals
    # Inside a shard_map, one branch's entry may vary over the mesh where another
    # branch's (or a zeros fill) does not; cond needs them alike.
    bodies = [(b.jaxpr, b.consts) for b in branches]
    region, traced = Region.traced(scope, bodies, in_avals, Boundary(vary=True))
    hoisted_avals = [[jax.typeof(c) for c in h] for _, h in traced]
    new_branches = []
    for i, (body, hoisted) in enumerate(traced):
        # Every branch takes every branch's constants: its own, with the others'
        # as unused inputs around them.
        before = [a for h in hoisted_avals[:i] for a in h]
        after = [a for h in hoisted_avals[i + 1 :] for a in h]
        body = _jaxpr.insert_invars(body, len(hoisted), after)
        body = _jaxpr.insert_invars(body, 0, before)
        new_branches.append(_compat.ClosedJaxpr(body, ()))
    all_hoisted = [c for _, hoisted in traced for c in hoisted]
    args = [invals[0], *all_hoisted, *region.args(invals[1:])]
    return region.leave(_bind(eqn, args, branches=tuple(new_branches)))


rules[_compat.cond_p] = _cond_rule


#
# shard_map (and pmap, which lowers to it)
#

_ACC_GROWS_IN_SHARD_MAP = (
    "{where} is reduced in a shard_map (or pmap) that gives its per-shard "
    "accumulator vmap batch axes it did not have: reduce it under one vmap "
    "throughout, give the tags different names, or use Tag(mode='append')."
)


def _shard_map_rule(eqn, invals, scope: Scope) -> list[Any]:
    # Shards run in parallel, like the examples of a vmap: entries come out
    # stacked over the shards and an accumulator is one per shard, its shard
    # axis after the vmap batch axes (see `_layout`). Inside, each shard holds
    # a slice of size 1 of what is stacked.
    p = eqn.params
    b = Boundary.shard_map(p)
    # An accumulator with this shard axis already (from this shard_map's previous
    # run in a loop, or another over the same axes), or first made here (whole
    # in every shard), enters split along it; any other enters whole in every
    # shard, and leaves split (see `_scope.Lazy.enter`).
    whole = []

    def enter(emitted):
        accs = []
        for key, acc in emitted.acc_avals.items():
            inside, have = acc.batch, scope.entering(key)
            if have is None or b.marker in have.batch:
                if have is not None and have.batch != b.after(inside):
                    raise ValueError(
                        _ACC_GROWS_IN_SHARD_MAP.format(where=emitted.sites[key].where())
                    )
                init = emitted.accs.get(key)
                init = init and functools.partial(b.repeated_init, init, inside)
                value = b.to_inside(scope.acc(key, init, b.after(inside)), inside)
            else:
                whole.append(key)
                value = b.repeated(emitted.acc(scope, key))
            accs.append(value)
        return accs

    body = p["jaxpr"]
    in_avals = [v.aval for v in body.invars]
    region, [(new_body, hoisted)] = Region.traced(
        scope, [(body, ())], in_avals, b, enter=enter
    )
    # The hoisted constants enter whole in every shard; the region's own inputs
    # and outputs are stacked over the shards.
    n_out, replicated = len(eqn.outvars), jax.sharding.PartitionSpec()
    params = dict(
        jaxpr=new_body,
        in_specs=(replicated,) * len(hoisted)
        + tuple(p["in_specs"])
        + (b.spec,) * (len(region.carried) + len(region.sliced)),
        out_specs=tuple(p["out_specs"]) + (b.spec,) * (len(new_body.outvars) - n_out),
    )
    outs = region.leave(_bind(eqn, [*hoisted, *region.args(invals)], **params))
    for key in whole:
        # One made before in a region around, which threads it: what it starts
        # as there, stacked.
        init = scope.acc_inits.get(key)
        if init is not None:
            batch = region.emitted.acc_avals[key].batch
            scope.acc_inits[key] = functools.partial(b.repeated_init, init, batch)
    return outs


rules[_compat.shard_map_p] = _shard_map_rule
