"""What handlers emit while the rewriter walks one region of a program (the whole
program, or one loop body or branch): appended entries, carried accumulators,
and the per-execution input values they consume."""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _compat
from ._handlers import NO_INPUT, Context, Handler, Misfit, mode_label, mode_of
from ._layout import Axes, batch_sizes, example_axes, grow, to_program, under_vmaps
from ._site import Site, describe, shape_dtype, strong

# (handler index, (site kind, collection, name)); with a third element, the
# part ("tangent", "cotangent") at whose site a handler of the value is
# differentiated: its per-execution inputs and call numbers there are counted
# apart.
Key = tuple[Any, ...]

_STRICT_TWICE = (
    "{where} was executed more than once (or reported twice in one execution), "
    "but {mode} collects a single value. "
    "Use mode='append' to collect every execution, or 'last'."
)
_ACC_CHANGED = (
    "{where}: {mode} turned the accumulator {before} into {after}; the "
    "accumulator must keep its shapes and dtypes. Give differently shaped "
    "values different names, or use mode='append'."
)
_BATCH_MISMATCH = (
    "{where} is reduced over executions under different vmaps (batch axes of "
    "sizes {a} and {b}), which cannot be combined per example: two vmaps of "
    "different sizes, or a `lax.map` whose `batch_size` does not divide its "
    "length (its remainder runs under a smaller vmap). Give the executions "
    "different names, use mode='append', or a handler of the whole batch "
    "(`fx.Reduce(..., per_example=False)`)."
)
_REDUCE_FAILED = (
    "{where}: {mode} failed on the accumulator {acc} and the value {value}: {error}. "
    "Values of one name must have one shape, up to vmap batch axes; give "
    "differently shaped values different names, or use mode='append'."
)
_MISSING_INPUT = (
    "{owner} got fewer entries for {where} than it has executions. Give one entry "
    "per execution, in the layout Tag() reports."
)


_AT_IN_REPLAY = (
    "{where} is in a `jax.checkpoint` region whose executions the backward pass "
    "of a `jax.grad` inside `fx.handle` recomputes, where a handler cannot know "
    "which execution it is (`at`). Handle the function before differentiating it "
    "(`jax.grad(fx.handle(f, ...))`)."
)
_AT_BACKWARD = (
    "{where}: a handler of the cotangent reads `at` in the backward pass of a "
    "`jax.grad` inside `fx.handle`, which runs the executions last first: their "
    "call numbers are not known there (a handler of the value reading `at` gets "
    "its value's). Read `at` from a handler of the value, or handle the "
    "function before differentiating it (`jax.grad(fx.handle(f, ...))`)."
)
_AT_AMBIGUOUS = (
    "{where}: a handler reads `at` where a `jax.grad` (or `jax.jvp`) inside "
    "`fx.handle` differentiates a function called several times (a `jax.jit` "
    "or `jax.checkpoint` function) once for all its calls, and some calls have "
    "no derivative there: which call each derivative belongs to is not known. "
    "Handle the function before differentiating it "
    "(`jax.grad(lambda *a: fx.handle(f, ...)(*a)[0])`)."
)
_INPUT_IN_REPLAY = (
    "{owner} takes one entry per execution, but {where} is in a `jax.checkpoint` "
    "region whose executions the backward pass of a `jax.grad` inside `fx.handle` "
    "recomputes. Handle the function before differentiating it "
    "(`jax.grad(fx.handle(f, ...))`), or give one value for every execution."
)


def _zero(aval):
    # A zero broadcast: a third of what `jnp.zeros` costs to trace (this runs
    # for every accumulator and stand-in).
    shape, dtype = aval.shape, aval.dtype
    if dtype == jax.dtypes.float0:  # (the tangent type of an integer)
        return np.zeros(shape, dtype)
    if jnp.issubdtype(dtype, jax.dtypes.extended):  # (a PRNG key's)
        return jnp.zeros(shape, dtype)
    # Sharded as the value where its type says how (an Explicit-axis mesh):
    # an accumulator a loop carries keeps its type.
    sharding = _compat.explicit_sharding(aval)
    return lax.broadcast_in_dim(np.zeros((), dtype), shape, (), out_sharding=sharding)


class Handlers(tuple):
    """The handlers of one `handle`, with what the rewriter reads of each
    read once: `matches` (a `Select` or a bound method), the mode,
    whether it consumes, and the names it has per-call inputs for."""

    matches: tuple
    modes: tuple
    consumes: tuple[bool, ...]
    input_names: tuple[frozenset, ...]
    per_example: tuple[bool, ...]

    def __new__(cls, handlers):
        self = super().__new__(cls, handlers)
        self.matches = tuple(h.matches for h in handlers)
        self.modes = tuple(mode_of(h) for h in handlers)
        # One site, one report: a handler that reports consumes what it acts
        # at, unless its mode passes it on.
        self.consumes = tuple(m is not None and m.consumes for m in self.modes)
        self.input_names = tuple(frozenset(h.per_call_inputs()) for h in handlers)
        self.per_example = tuple(m is None or m.per_example for m in self.modes)
        return self


@dataclasses.dataclass
class Rewrite:
    """What every scope of one rewrite shares."""

    # Per (handler index, `Site.pair`): the call numbers of the value's
    # executions, in order (see `_counted`), and the derivatives (or
    # recomputations) of one whose `at` a handler read, by (handler index,
    # pair, part or "replay"), with their site.
    pairs: dict = dataclasses.field(default_factory=dict)
    orders: dict = dataclasses.field(default_factory=dict)
    # Per (kind, its n-th execution): the value's call it belongs to; per
    # backward kind, how many of the value's calls it has seen, then those
    # of them it has not taken (see `_counted`).
    matched: dict = dataclasses.field(default_factory=dict)
    untaken: dict = dataclasses.field(default_factory=dict)
    # Per (handler index, `Site.pair`): whether the handler returned the
    # value's leaves unchanged at every trace of it. Its derivative there is
    # then the identity: the derivative sites skip differentiating it.
    kept: dict = dataclasses.field(default_factory=dict)
    # Whether a derivative site was dropped (no handler, no `handle` around):
    # then what the program kept for it is dead code (`_handle._rewrite`).
    dropped: bool = False
    # Per site name: a handler changes it per example where a vmap does not
    # batch it (see `Unbatched`).
    unbatched: dict = dataclasses.field(default_factory=dict)
    # Per site (kind, collection, name): its value's executions met so far (a
    # recomputation's left out), which tell one backward pass's cotangents
    # from the next's.
    values: dict = dataclasses.field(default_factory=dict)
    # Whether regions whose handlers keep every value are spliced (see
    # `_rewrite.trace_rewrite`), and whether a handler changed one there after
    # all: then the rewrite is done again, splicing nothing.
    splice: bool = True
    changed: bool = False
    # The jaxprs of the calls rewritten so far, by `_jaxpr.structure` (see
    # `_rules._call_rule`).
    jaxprs: dict = dataclasses.field(default_factory=dict)
    # The `checkpoint_name`s JAX differentiated before the rewrite (see
    # `_walk.differentiated_names`): a handler may look at them, not change them.
    differentiated: frozenset = frozenset()
    # Per (trace, type): zeros made in that trace, which every accumulator
    # and stand-in of the type made there starts from (one broadcast each,
    # not one a site: see `zeros`); emptied as each trace of the rewrite ends
    # (`ending`).
    made: dict = dataclasses.field(default_factory=dict)

    def zeros(self, avals):
        """Zeros of the types `avals`, each made once a trace (see
        `made`)."""
        made, trace = self.made, _compat.current_trace()

        def one(aval):
            if (trace, aval) not in made:
                made[trace, aval] = _zero(aval)
            return made[trace, aval]

        return jax.tree.map(one, avals)

    def ending(self, fn):
        """`fn`, to be traced: no zeros made in its trace stay after it."""

        def traced(*args):
            try:
                return fn(*args)
            finally:
                self.made.clear()

        return traced

    def check_orders(self, scope: Scope) -> None:
        """Refuses a call number `_counted` found by order where that order
        does not hold: the value's executions and its derivatives (or
        recomputations) of one kind do not pair off, one or more passes over
        them all, so which is which is not known."""
        for kind, site in self.orders.items():
            calls = len(self.pairs[kind[:2]])
            if scope.count(kind) % calls:
                raise ValueError(_AT_AMBIGUOUS.format(where=site.where()))

    def check_batched(self) -> None:
        """Raises `Unbatched` for every site found so, at once."""
        if self.unbatched:
            first = next(iter(self.unbatched.values()))
            first.names = frozenset(self.unbatched)
            raise first


class Scope:
    def __init__(
        self,
        handlers: tuple[Handler, ...],
        *,
        inputs=None,
        replaying: bool = False,
        lazy: Lazy | None = None,
        custom: str | None = None,
        shards: tuple = (),
        rewrite: Rewrite | None = None,
        index: tuple = (),
        scans: int = 0,
        outside: Scope | None = None,
    ):
        if not isinstance(handlers, Handlers):
            handlers = Handlers(handlers)
        self.handlers = handlers
        # Inside a function with a custom derivative (the primitive's name):
        # a handler may look at values there, not change them.
        self.custom = custom
        # The shard_maps of the handled function this region is in (see
        # `Site.shards`).
        self.shards = shards
        # How many `lax.scan`s around this region stack what it appends.
        self.scans = scans
        # The backward pass's recomputation of a `jax.checkpoint` region (see
        # `replay`): per-execution inputs are refused here.
        self.replaying = replaying
        # In a region's trace: the state it enters as a handler first touches
        # it (see `_rules.Region.traced`).
        self.lazy = lazy
        self.entries: dict[Key, list[tuple[Any, Axes]]] = {}
        self.accs: dict[Key, Acc] = {}
        # The scope this region is in. A region's trace (see
        # `_rules.Region.traced`) starts from its accumulators (and those of
        # the scopes it is in): each entering here only when the region first
        # touches it (see `_enter`), as a region touches a few of the many
        # accumulators a program may have. Its call counts likewise (`count`).
        self.outside = outside
        self.given = inputs or {}
        self.inputs: dict[Key, list[Any]] = {k: list(v) for k, v in self.given.items()}
        # What a region's trace learns, for the rule that threads the region:
        # how the accumulators first made here start, and the per-execution
        # inputs taken here.
        self.acc_inits: dict[Key, Any] = {}
        self.touched: dict[Key, None] = {}  # accumulators updated here, in order
        # Per key appended to, how many entries it had before (with `touched`,
        # what `traced` lifts out of a trace).
        self.appended: dict[Key, int] = {}
        self.input_avals: dict[Key, list[tuple[Any, Axes]]] = {}
        self.sites: dict[Key, Site] = {}
        self.rewrite = Rewrite() if rewrite is None else rewrite
        # Per key, its executions so far in program order (the index of the
        # next one's entry in the layout `Tag()` reports), once one is here:
        # before, the scope outside counts them (`count`).
        self.calls: dict[Key, int] = {}
        # Per cotangent key appended to here: per entry, how many of the
        # value's executions the rewrite had met when it was made (see
        # `add_entry`).
        self.counts: dict[Key, list[int]] = {}
        # The iteration of each loop around this region, outermost first (the
        # `Lazy` state of each loop's trace, which enters it where a handler
        # reads it: `Context.at`), and whether a handler read them.
        self.index = index
        self._wants_index = [False]  # (shared with `replay`'s view)

    def inner(self, **fields) -> Scope:
        """A fresh scope for a region inside this one: the same handlers, custom
        rule, shard_maps and rewrite, unless `fields` say otherwise."""
        same: dict[str, Any] = dict(
            custom=self.custom,
            shards=self.shards,
            scans=self.scans,
            rewrite=self.rewrite,
            index=self.index,
            replaying=self.replaying,
            outside=self,
        )
        return Scope(self.handlers, **(same | fields))

    @property
    def wants_index(self) -> bool:
        return self._wants_index[0]

    @wants_index.setter
    def wants_index(self, value: bool) -> None:
        self._wants_index[0] = value

    def replay(self) -> Scope:
        """This scope, for a region that recomputes executions of values
        reported elsewhere: handlers act on the values, but report nothing
        there. (The derivative sites of the backward pass's recomputation of
        a `jax.checkpoint` region are executions of their own: they report.)"""
        replay = copy.copy(self)
        replay.replaying = True
        return replay

    def count(self, key: Key) -> int:
        """The executions of `key` so far, in program order."""
        scope = self
        while key not in scope.calls:
            scope = scope.outside
            if scope is None:
                return 0
        return scope.calls[key]

    def where(self, key: Key) -> str:
        return self.sites[key].where()

    # Appended entries -------------------------------------------------------

    def add_entry(self, key: Key, value, axes: Axes, count: int | None = None) -> None:
        """Appends an entry of `key`: a cotangent with `count`, the value's
        executions met before it (by default, so far). A backward pass is a
        run of entries of one count: between two passes the value executes
        again (two `jax.grad`s), within one it does not."""
        # (the key's site is known: its first execution, or what a region emitted)
        entries = self.entries.setdefault(key, [])
        if self.sites[key].part == "cotangent":
            made = self.rewrite.values.get(key[1], 0) if count is None else count
            self.counts.setdefault(key, []).append(made)
        self.appended.setdefault(key, len(entries))
        entries.append((_strong_tree(value), axes))
        mode = self.handlers.modes[key[0]]
        if len(entries) > 1 and mode.single:
            raise ValueError(
                _STRICT_TWICE.format(
                    where=self.where(key), mode=mode_label(self.handlers[key[0]])
                )
            )

    # Accumulators -----------------------------------------------------------

    def acc(self, key: Key, init, batch: Axes):
        """The key's accumulator: made by `init` (a thunk) if there is none yet,
        grown by the vmap batch axes `batch` has and it lacks."""
        if key not in self.accs and not self._enter(key):
            self.acc_inits[key] = init
            acc = Acc(init(), batch)
            if self.lazy is not None:  # (its types: the region's rule makes it)
                acc = self.lazy.enter(key, acc)
            self.accs[key] = acc
        self.touched[key] = None
        value, have = self.accs[key]
        if batch != have:
            # The name executes both outside and inside a vmap: the accumulator
            # is per example, as if each example ran alone.
            if batch[: len(have)] == have:  # deeper: the accumulator grows
                self.accs[key] = Acc(grow(value, have, batch), batch)
                made = self.acc_inits.get(key)
                if made is not None:  # (a region threading it starts it grown)
                    self.acc_inits[key] = lambda: grow(made(), have, batch)
            elif have[: len(batch)] != batch:
                raise ValueError(
                    _BATCH_MISMATCH.format(where=self.where(key), a=have, b=batch)
                )
        return self.accs[key].value

    def entering(self, key: Key) -> Acc | None:
        """The types and batch axes of the accumulator `key` a region in this
        scope starts from: this scope's, or one a scope outside has; None
        where there is none (the region makes it). (A shard_map's rule reads
        it: such an accumulator enters split over its shards or whole.)"""
        scope = self
        while scope is not None and key not in scope.accs:
            scope = scope.outside
        if scope is None:
            return None
        return scope.accs[key].types()

    def _enter(self, key: Key) -> bool:
        """Enters here the accumulator `key` the region starts from, in a
        region's trace: as new inputs of its trace, the scope outside
        entering it first. False where there is none."""
        outside = self.outside
        if self.lazy is None or outside is None:
            return False
        if key not in outside.accs and not outside._enter(key):
            return False
        self.accs[key] = self.lazy.enter(key, outside.accs[key])
        return True

    def traced(self, trace):
        """Traces a region the handlers act in with this scope, as a jaxpr of
        its own, once: `trace(finish)` traces it, passing its outputs through
        `finish`, and returns the open jaxpr, taking the constants it closes
        over first, and those constants. What the scope holds enters by
        closure (the hoisted constants); the accumulators the region makes or
        updates and the entries it appends leave as outputs after its own.
        Returns that jaxpr, its constants, and `leave`, which puts what the
        bound jaxpr returned after its own outputs back in the scope."""
        journals = self.touched, self.appended
        self.touched, self.appended = {}, {}
        accs: list[Key] = []
        added: list[tuple[Key, int]] = []
        shape: list[Any] = []

        def finish(outs):
            accs[:] = self.touched
            added[:] = self.appended.items()
            new = [self.entries[k][n:] for k, n in added]
            values = [
                [self.accs[k].value for k in accs],
                [v for e in new for v, _ in e],
            ]
            # No tracer of this trace stays in the scope: `leave` puts back
            # what the bound jaxpr returns.
            for k in accs:
                self.accs[k] = self.accs[k]._replace(value=None)
            for k, n in added:
                del self.entries[k][n:]
            leaves, tree = jax.tree.flatten(values)
            shape[:] = [tree, [[a for _, a in e] for e in new]]
            return [*outs, *leaves]

        try:
            jaxpr, hoisted = trace(finish)
        finally:
            journals[0].update(self.touched)
            for k, n in self.appended.items():
                journals[1].setdefault(k, n)
            self.touched, self.appended = journals

        def leave(leaves) -> None:
            tree, axes = shape
            out_accs, new = jax.tree.unflatten(tree, leaves)
            for k, value in zip(accs, out_accs):
                self.accs[k] = self.accs[k]._replace(value=value)
            it = iter(new)
            for (k, _), a in zip(added, axes):
                self.entries[k] += [(next(it), x) for x in a]

        return jaxpr, hoisted, leave

    def fold(self, key: Key, reduce, acc, value, extra: int):
        """`reduce.fn(acc, value)` for one example, where `acc` may have
        `extra` leading batch axes that `value` lacks (the name executed under
        more vmaps elsewhere): then per example of those."""
        fn = under_vmaps(reduce.fn, (None,) * extra, in_axes=(0, None))
        try:
            new = _strong_tree(fn(acc, value))
        except (TypeError, ValueError) as e:
            raise ValueError(
                _REDUCE_FAILED.format(
                    where=self.where(key),
                    mode=mode_label(self.handlers[key[0]]),
                    acc=describe(jax.tree.map(shape_dtype, acc)),
                    value=describe(jax.tree.map(shape_dtype, value)),
                    error=str(e).splitlines()[0].rstrip("."),
                )
            ) from e
        if not _alike(new, acc):
            raise ValueError(
                _ACC_CHANGED.format(
                    where=self.where(key),
                    mode=mode_label(self.handlers[key[0]]),
                    before=describe(types_of(acc)),
                    after=describe(types_of(new)),
                )
            )
        return new

    # Per-execution inputs ---------------------------------------------------

    def take_inputs(self, key: Key, expected: list[tuple[Any, Axes]], site: Site):
        """Takes one input entry per `(avals, lead)` in `expected`: for one
        execution of a site, or for all executions in a region inside this one."""
        remaining = self.inputs.get(key)
        if remaining is None and key[:2] in self.given:
            # a handler of the value, at a derivative site: the value's entries
            remaining = list(self.given[key[:2]])
        owner = _name(self.handlers[key[0]])
        if self.replaying:  # (also in a region's trace: it would take them)
            raise ValueError(_INPUT_IN_REPLAY.format(owner=owner, where=site.where()))
        if remaining is None and self.lazy is not None:
            # (a region's trace: the inputs it takes enter it as new inputs,
            # and are learnt here)
            self.input_avals.setdefault(key, []).extend(expected)
            return self.lazy.take(key, [avals for avals, _ in expected])
        remaining = [] if remaining is None else remaining
        if len(remaining) < len(expected):
            raise ValueError(_MISSING_INPUT.format(owner=owner, where=site.where()))
        n = len(expected)
        if last_first(key, site):
            # A backward pass runs the executions last first: it takes the
            # entries from the end.
            taken, self.inputs[key] = remaining[-n:], remaining[:-n]
        else:
            taken, self.inputs[key] = remaining[:n], remaining[n:]
        for value, (avals, _) in zip(taken, expected):
            _check_input(value, avals, site, owner)
        return taken


def last_first(key: Key, site: Site) -> bool:
    """Whether the executions of `key` at `site` run last first: a backward
    pass's (a cotangent site, or a handler of the value differentiated
    there)."""
    return site.part == "cotangent" or key[2:] == ("cotangent",)


def _strong_tree(value):
    # Most collected values are already strongly typed arrays: keep them as they
    # are rather than rebuild the tree (this runs at every site).
    aval = getattr(value, "aval", None)  # one array (or tracer)
    if aval is not None:
        return value if not aval.weak_type else strong(value)
    if all(
        isinstance(x, jax.Array) and not x.aval.weak_type
        for x in jax.tree.leaves(value)
    ):
        return value
    return jax.tree.map(strong, value)


def _check_input(value, avals, site: Site, owner: str) -> None:
    got = types_of(value)
    if types_key(got) != types_key(avals):
        raise ValueError(
            f"{owner}: an entry for {site.where()} is {describe(got)}, but the "
            f"tag's value there is {describe(avals)}; shapes and dtypes must match "
            "the layout Tag() reports."
        )


def types_of(tree):
    return jax.tree.map(shape_dtype, tree)


class Acc(NamedTuple):
    """An accumulator (or its types): its value, and the sizes of the vmap
    batch axes it has, leading, outermost first."""

    value: Any
    batch: Axes

    def types(self) -> Acc:
        return Acc(types_of(self.value), self.batch)


class Lazy:
    """The state a region's trace enters as a handler first touches it: the
    accumulators, the per-execution inputs, and a loop's iteration
    (`index_aval` gives its type), each leaf a new input of the trace, after
    its own."""

    def __init__(self, boundary, index_aval=None, known=None):
        self.trace = _compat.current_trace()
        self.boundary = boundary
        # The types of the inputs a region gives, by shape and dtype, where
        # known (a region traced again): an input enters with them.
        self.known = known or {}
        # key -> (the position of its first leaf among the new inputs, the
        # types of its leaves)
        self.accs: dict[Key, tuple[int, list[Any]]] = {}
        # key -> per `take`, the positions of each entry's leaves
        self.inputs: dict[Key, list[list[list[int]]]] = {}
        self.n = 0
        self.index_aval = index_aval
        self.index_at: int | None = None  # (its position, once entered)
        self._index = None

    def index(self):
        """The loop's iteration, entering at its first use."""
        if self._index is None:
            assert self.index_aval is not None  # (a loop's)
            self.index_at, self.n = self.n, self.n + 1
            self._index = _compat.new_input(self.trace, self.index_aval())  # (a loop's)
        return self._index

    def done(self):
        """Lets go of the trace, once it is over."""
        self.trace = self._index = None

    def enter(self, key: Key, acc: Acc) -> Acc:
        """The accumulator `key` inside, entering as new inputs, from `acc`
        as the scope outside has it (or as `init` makes it inside)."""
        b = self.boundary
        leaves, tree = jax.tree.flatten(acc.value)
        avals = [b.entering(jax.typeof(x), acc.batch) for x in leaves]
        self.accs[key] = (self.n, avals)
        return Acc(tree.unflatten(self._new(avals)), b.inside(acc.batch))

    def take(self, key: Key, specs) -> list[Any]:
        """New inputs for the per-execution input entries of `key` whose
        types are `specs` (a tree each), as the region gives them: strongly
        typed, varying over a shard_map's manual axes (see `Region`)."""
        taken, call = [], []
        self.inputs.setdefault(key, []).append(call)
        for avals in specs:
            leaves, tree = jax.tree.flatten(avals)
            made, _ = _compat.trace_closed(
                lambda: [_compat.vary_over_manual_axes(_zero(a)) for a in leaves], []
            )
            avals = [self.boundary.entering(v.aval) for v in made.outvars]
            avals = [self.known.get((a.shape, a.dtype), a) for a in avals]
            call.append(list(range(self.n, self.n + len(leaves))))
            taken.append(tree.unflatten(self._new(avals)))
        return taken

    def _new(self, avals) -> list[Any]:
        """New inputs of the types `avals`, as values inside."""
        self.n += len(avals)
        new = [_compat.new_input(self.trace, a) for a in avals]
        return [self.boundary.enter(x) for x in new]


def _alike(a, b) -> bool:
    """Whether two trees of arrays have the same types (`types_key`)."""
    x, y = getattr(a, "aval", None), getattr(b, "aval", None)  # (one array each)
    if x is not None and y is not None:
        return x.shape == y.shape and x.dtype == y.dtype
    return types_key(a) == types_key(b)


def types_key(types) -> tuple:
    """What two trees of types must share to be alike: structure, shapes and
    dtypes."""
    leaves, tree = jax.tree.flatten(types)
    return tree, tuple((t.shape, t.dtype) for t in leaves)


def _batch_spec(site: Site):
    """How the value's vmap batch axes are sharded, outermost first, where its
    type says (an Explicit-axis mesh) and one of them is; else None."""
    sharding = _compat.explicit_sharding(site.avals[0]) if site.avals else None
    if sharding is None:
        return None
    spec = tuple(sharding.spec) + (None,) * len(site.avals[0].shape)
    batch = tuple(None if a is None else spec[a] for a, _ in site.batch[0])
    return batch if any(batch) else None


def _acc_init(rewrite: Rewrite, reduce, site: Site, sizes: tuple[int, ...]):
    # One example's accumulator, the same for every example (of the vmaps of
    # `sizes`; none for a handler of the whole batch, whose `init` gets zeros
    # shaped like the whole value). Inside a shard_map an accumulator differs
    # per shard: it varies over the manual mesh axes from the start, as a loop
    # carrying it needs.
    if sizes:
        avals = site.shape_dtype
    elif site.nbatch:
        avals = site.front_avals()
    else:  # (the program's types, with the shardings an Explicit-axis mesh gives)
        avals = jax.tree.unflatten(site.treedef, list(site.avals))
    value = reduce.init(rewrite.zeros(avals))
    spec = _batch_spec(site) if sizes else None

    def per_example(x):
        x = strong(x)
        x = grow(x, (), sizes) if sizes else x
        if spec is not None:  # (batch axes sharded as the value's)
            x = jax.sharding.reshard(x, jax.sharding.PartitionSpec(*spec))
        return _compat.vary_over_manual_axes(x)

    return jax.tree.map(per_example, value)


#
# One handler at one execution of a site
#

_CHANGED_IN_CUSTOM = (
    "{where} is inside a function with a custom derivative (`{prim}`); "
    "{handler} changes its value there without the custom rule knowing. Move "
    "the tag out of the custom_jvp/custom_vjp function, or handle inside it."
)


class Unbatched(ValueError):
    """A handler changes per example a value a vmap inside the handled function
    does not batch: `handle` traces the function again with the vmap batching
    the sites `names` (see `_primitives.batched_sites`), every such site found
    in one rewrite (`Rewrite.unbatched`), so once. Raised for a site that is
    batched already, it is an error."""

    def __init__(self, handler, site: Site):
        super().__init__(
            f"{_name(handler)} changes {site.where()}, a value that the vmap "
            "inside the handled function does not batch, differently per "
            "example. Move the handler inside the vmap "
            "(`jax.vmap(fx.handle(f, ...))`)."
        )
        self.names = frozenset([site.name])


_BAD_VALUE = (
    "{handler} gives {got} for {where}, whose value is {want}; the shape and "
    "dtype must stay the same (and the pytree structure)."
)
_EMIT_UNKNOWN = (
    "{handler} uses what `ctx.emit` returns (the accumulator) at {where}, "
    "where `fx.handle` runs `apply` again without reporting: to differentiate "
    "it under a `jax.grad` or `jax.jvp` inside the handled function, or in "
    "the backward pass's recomputation of a `jax.checkpoint`. The accumulator "
    "is not known there: return a value that does not depend on it, or handle "
    "the function before differentiating it "
    "(`jax.grad(lambda *a: fx.handle(f, ...)(*a)[0])`)."
)
_NO_MODE = (
    "{handler} emits at {where} but has no `mode`: say how its values are "
    "reported (`mode = 'append'`, 'sum', fx.Reduce(...), ...)."
)


def act(
    scope: Scope,
    index: int,
    site: Site,
    leaves: list[Any],
    primal: list[Any] | None = None,
    within: str | None = None,
) -> list[Any]:
    """Handler `index` acts at one execution of `site` (leaves in program
    layout): the leaves the program goes on with. Under vmaps inside the
    handled function, `apply` runs under the same vmaps, on one example, so
    that every handler is the same inside and outside a vmap (unless the
    handler's mode asks for the whole batch: `Append(per_example=False)`).

    At a derivative site, `primal` is the value's leaves (`ctx.primal`).
    `within` names the part ("tangent", "cotangent") of the derivative site at
    which a handler of the value runs only to be differentiated: it reports
    nothing, and counts its executions and inputs apart."""
    handlers = scope.handlers
    handler, mode = handlers[index], handlers.modes[index]
    named = (site.kind, site.collection, site.name)  # (one name, two collections)
    key: Key = (index, named) if within is None else (index, named, within)
    quiet = within is not None or (scope.replaying and site.part == "value")
    mode = None if quiet else mode
    scope.sites.setdefault(key, site)
    front = site.to_front(leaves)
    front_primal = None if primal is None else site.to_front(primal)
    # The vmaps `apply` runs under, and those of what it emits.
    every = batch_sizes(site.batch)
    sizes = every if handlers.per_example[index] else ()
    entry, has_input = None, site.name in handlers.input_names[index]
    if has_input:
        expected: list[tuple[Any, Axes]] = [(site.front_avals(), every)]
        entry = scope.take_inputs(key, expected, site)[0]
    acc, extra = None, 0
    if mode is not None and mode.reduces:
        init = functools.partial(_acc_init, scope.rewrite, mode, site, sizes)
        acc = scope.acc(key, init, sizes)
        extra = len(scope.accs[key].batch) - len(sizes)
    axes = example_axes(len(sizes))
    at = _counted(scope, index, site, key, within)
    same: list[bool] = []

    def one(value, entry, acc, primal):
        # Returns the leaves `apply` changed, what it appended, and the
        # accumulator; `same` records (at trace time) which leaves it kept.
        appended, state, unknown = [], [acc], []

        def emit(x):
            if quiet:  # (recomputed, or differentiated only: reports nothing)
                unknown.append(getattr(handlers.modes[index], "reduces", False))
                return None
            if mode is None:
                where = site.where()
                raise ValueError(_NO_MODE.format(handler=_name(handler), where=where))
            x = _strong_tree(x)
            if not mode.reduces:
                appended.append(x)
                return None
            state[0] = scope.fold(key, mode, state[0], x, extra)
            return state[0]

        primal = NO_INPUT if primal is None else primal
        stacking = ("shard",) * len(site.shards) + ("scan",) * scope.scans
        entry = entry if has_input else NO_INPUT
        ctx = Context(site, emit, entry, axes, at, primal, stacking)
        same[:], changed = _applied(handler, site, value, ctx, unknown)
        return changed, appended, state[0]

    fn = under_vmaps(one, axes)
    changed, appended, acc = fn(front, entry, acc, front_primal)
    for value in appended:
        scope.add_entry(key, value, sizes)
    if mode is not None and mode.reduces:
        scope.accs[key] = Acc(acc, scope.accs[key].batch)
    return _into_program(scope, handler, site, leaves, same, changed)


def _applied(handler, site: Site, value, ctx: Context, unknown: list[bool]):
    """`apply` at one example, checked (see `_checked`). `unknown` records
    whether `emit` returned None for an accumulator it does not know."""
    try:
        new = type(handler).apply(handler, site, value, ctx)
        return _checked(new, value, site, handler)
    except Exception as e:
        where, name = site.where(), _name(handler)
        if isinstance(e, Misfit):  # (from `ctx.example`)
            raise ValueError(f"{name}: {e}") from e
        if not any(unknown):
            if where not in str(e):  # (a user's own error: at which site)
                e.add_note(f"(raised in {name}.apply at {where})")
            raise
        raise ValueError(_EMIT_UNKNOWN.format(handler=name, where=where)) from e


def _counted(scope: Scope, index: int, site: Site, key: Key, within: str | None):
    """Counts this execution of `site` for handler `index` (under `key`) and
    gives its `ctx.at`: the execution's call number and the iterations of the
    loops around it. A recomputation, and a handler of the value differentiated
    at a derivative site (`within`), have the number of the value's execution.

    That is found by order: JAX differentiates a function once for all its
    calls (a `jax.jit` or `jax.checkpoint` function called twice), so one
    `pair` number may be several executions of the value. Their tangents come
    in the same order, the n-th the value's n-th execution; a backward pass
    (cotangents, recomputations) runs them last first, each the latest
    execution before it that no other of its kind took, as several backward
    passes (two `jax.grad`s) each take their own (see `Rewrite.check_orders`)."""
    backward = "cotangent" in (site.part, within)
    call = scope.count(key)
    replay = scope.replaying and site.part == "value" and within is None
    # (A recomputation has no call number of its own; its key is known to
    # the region all the same: see `_rules.Region`.)
    scope.calls[key] = call + (not replay)
    pair, number, kind = (index, site.pair), call, None
    rewrite = scope.rewrite
    if site.pair is not None and (replay or within is not None):
        kind = (*pair, "replay" if replay else within)
        order = scope.count(kind)
        scope.calls[kind] = order + 1
        # (a region traced again finds what its first trace matched)
        number = rewrite.matched.get((kind, order))
        if number is None:
            calls = rewrite.pairs.get(pair, [])
            if backward or replay:
                # (the executions since the last of this kind join those no
                # execution of this kind took, the latest this one's; where
                # none is left, a backward pass runs again over them all, as
                # a vjp pulled twice does)
                stack = rewrite.untaken.setdefault(kind, [0])
                if stack[0] < len(calls):
                    stack += calls[stack[0] :]
                elif len(stack) == 1:
                    stack += calls
                stack[0] = len(calls)
                number = stack.pop() if len(stack) > 1 else None
            else:  # (a linearized function applied twice: its calls again)
                number = calls[order % len(calls)] if calls else None
            if number is not None:
                rewrite.matched[kind, order] = number
    elif site.pair is not None:
        calls = rewrite.pairs.setdefault(pair, [])
        if not calls or call > calls[-1]:  # (a region traced again: known)
            calls.append(call)

    def at():
        if kind is not None and number is not None:
            rewrite.orders[kind] = site
        if replay and number is None:
            raise ValueError(_AT_IN_REPLAY.format(where=site.where()))
        if number is None and within is not None:
            raise ValueError(_AT_AMBIGUOUS.format(where=site.where()))
        if number is None or (backward and within is None):
            raise ValueError(_AT_BACKWARD.format(where=site.where()))
        scope.wants_index = True
        # (each loop's trace enters its iteration here)
        loops = (lazy.index() for lazy in scope.index)
        return (jnp.int32(number), *loops)

    return at


def _into_program(scope: Scope, handler, site: Site, leaves, same, changed) -> list:
    """`leaves` with those the handler did not keep (`same`) replaced by
    `changed`, its new values for one example, put back in program layout."""
    if all(same):
        return leaves
    if scope.custom is not None:
        raise ValueError(
            _CHANGED_IN_CUSTOM.format(
                where=site.where(), prim=scope.custom, handler=_name(handler)
            )
        )
    out, it = list(leaves), iter(changed)
    for j, (kept, entries) in enumerate(zip(same, site.batch)):
        if kept:
            continue
        x = next(it)
        if any(a is None for a, _ in entries):
            # (the rewrite goes on with the leaf as it was, to find the others)
            scope.rewrite.unbatched.setdefault(site.name, Unbatched(handler, site))
            continue
        x = to_program(x, entries)
        if site.shards:
            x = site.vary_like(x, site.avals[j], _name(handler))
        out[j] = x
    return out


def _name(handler) -> str:
    return type(handler).__name__


def _checked(new, value, site: Site, handler) -> tuple[list[bool], list[Any]]:
    """Which leaves of `value` (one example's, at `site`) a handler's `new`
    value keeps, and its leaves that differ, after checking its structure,
    shapes and dtypes (a weakly typed number takes the site's dtype)."""
    if new is value:  # kept whole, as a handler that only looks keeps it
        return [True] * len(site.avals), []
    want_leaves, want_tree = jax.tree.flatten(value)
    leaves, tree = jax.tree.flatten(new)
    if tree == want_tree:
        out = []
        for x, w in zip(leaves, want_leaves):
            if x is not w:
                x, w = jnp.asarray(x), shape_dtype(w)  # (a leaf may be a literal)
                if x.shape == w.shape and x.dtype != w.dtype and x.aval.weak_type:
                    x = x.astype(w.dtype)
                if x.shape != w.shape or x.dtype != w.dtype:
                    break
            out.append(x)
        else:
            same = [a is b for a, b in zip(out, want_leaves)]
            return same, [a for a, kept in zip(out, same) if not kept]
    raise ValueError(
        _BAD_VALUE.format(
            handler=_name(handler),
            got=describe(jax.tree.map(shape_dtype, new)),
            where=site.where(),
            want=describe(jax.tree.map(shape_dtype, value)),
        )
    )
