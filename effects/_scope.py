"""What handlers emit while the rewriter walks one region of a program (the whole
program, or one loop body or branch): appended entries, carried accumulators,
and the per-execution input values they consume."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from . import _compat
from ._handlers import Handler
from ._site import Axis, Lead, Site, describe, shape_dtype, strong

Key = tuple[int, str]  # (handler index, site name)

_STRICT_TWICE = (
    "{where} was executed more than once, but {mode} collects a single value. "
    "Use mode='append' to collect every execution, or 'last'."
)
_ACC_CHANGED = (
    "{where}: {mode} turned the accumulator {before} into {after}; the "
    "accumulator must keep its shapes and dtypes. Give differently shaped "
    "values different names, or use mode='append'."
)
_BATCH_MISMATCH = (
    "{where} is reduced over executions under different vmaps (batch axes of "
    "sizes {a} and {b}), which cannot be combined per example. Give them "
    "different names, or use mode='append'."
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


_INPUT_IN_REPLAY = (
    "{owner} takes one entry per execution, but {where} is in a `jax.checkpoint` "
    "region whose executions the backward pass of a `jax.grad` inside `fx.handle` "
    "recomputes. Handle the function before differentiating it "
    "(`jax.grad(fx.handle(f, ...))`), or give one value for every execution."
)


def zeros(avals):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), avals)


class Scope:
    def __init__(
        self,
        handlers: tuple[Handler, ...],
        *,
        accs=None,
        acc_batch=None,
        inputs=None,
        discovering: bool = False,
        replaying: bool = False,
        shards: tuple = (),
    ):
        self.handlers = handlers
        # The shard_maps of the handled function this region is in (see
        # `Site.shards`).
        self.shards = shards
        # Unbound methods: going through an `eqx.Module` instance would build a
        # bound-method module at every site, the bulk of the rewrite's cost.
        self.actions = _actions(handlers)
        self.modes = _modes(handlers)
        self.calls_user_code = any(h.calls_user_code() for h in handlers)
        self.discovering = discovering
        # The backward pass's recomputation of a `jax.checkpoint` region (see
        # `replay`): per-execution inputs are refused here.
        self.replaying = replaying
        self.entries: dict[Key, list[tuple[Any, Lead]]] = {}
        self.accs: dict[Key, Any] = dict(accs or {})
        self.inputs: dict[Key, list[Any]] = {
            k: list(v) for k, v in (inputs or {}).items()
        }
        # Filled while discovering, for the rule that threads this region.
        self.acc_inits: dict[Key, Any] = {}
        self.touched: dict[Key, None] = {}  # accumulators updated here, in order
        # Per accumulator: the sizes of the vmap batch axes it has, outermost
        # first (leading, in the layout handlers see).
        self.acc_batch: dict[Key, tuple[Axis, ...]] = dict(acc_batch or {})
        self.input_avals: dict[Key, list[tuple[Any, Lead]]] = {}
        self.sites: dict[Key, Site] = {}

    def replay(self) -> Scope:
        """A scope for a region that recomputes executions reported elsewhere:
        the same handlers, and nothing it collects leaves it."""
        return Scope(
            self.handlers,
            discovering=self.discovering,
            replaying=True,
            shards=self.shards,
        )

    def where(self, key: Key) -> str:
        return self.sites[key].where()

    def mode(self, key: Key):
        return self.modes[key[0]]

    # Appended entries -------------------------------------------------------

    def add_entry(self, key: Key, value, lead: Lead, site: Site) -> None:
        self.sites.setdefault(key, site)
        entries = self.entries.setdefault(key, [])
        entries.append((_strong_tree(value), lead))
        mode = self.mode(key)
        if len(entries) > 1 and mode.single:
            raise ValueError(
                _STRICT_TWICE.format(where=self.where(key), mode=mode.label)
            )

    # Accumulators -----------------------------------------------------------

    def reduce(self, key: Key, value, reduce, site: Site):
        """Folds `value` into the key's accumulator; returns the new one."""
        self.sites.setdefault(key, site)
        batch = site.batch_sizes()
        if key not in self.accs:
            init = _acc_init(reduce, site)
            self.acc_inits[key] = init
            self.accs[key] = init()
            self.acc_batch[key] = batch
        self.touched[key] = None
        acc, have = self.accs[key], self.acc_batch[key]
        if batch != have:
            # The name executes both outside and inside a vmap: the accumulator
            # is per example, as if each example ran alone.
            if batch[: len(have)] == have:  # deeper: the accumulator grows
                acc = grow(acc, have, batch)
                self.acc_batch[key] = batch
            elif have[: len(batch)] == batch:  # shallower: the same per example
                value = grow(value, batch, have)
            else:
                raise ValueError(
                    _BATCH_MISMATCH.format(where=self.where(key), a=have, b=batch)
                )
        new = self._fold(key, reduce, acc, value)
        if types_of(new) != types_of(acc):
            raise ValueError(
                _ACC_CHANGED.format(
                    where=self.where(key),
                    mode=reduce.label,
                    before=describe(types_of(acc)),
                    after=describe(types_of(new)),
                )
            )
        self.accs[key] = new
        return new

    def _fold(self, key: Key, reduce, acc, value):
        try:
            return jax.tree.map(strong, reduce.fn(acc, value))
        except (TypeError, ValueError) as e:
            raise ValueError(
                _REDUCE_FAILED.format(
                    where=self.where(key),
                    mode=reduce.label,
                    acc=describe(jax.tree.map(shape_dtype, acc)),
                    value=describe(jax.tree.map(shape_dtype, value)),
                    error=str(e).splitlines()[0],
                )
            ) from e

    # Per-execution inputs ---------------------------------------------------

    def take_inputs(
        self, key: Key, expected: list[tuple[Any, Lead]], site: Site, placeholders=None
    ):
        """Takes one input entry per `(avals, lead)` in `expected`: for one
        execution of a site, or for all executions in a region inside this one."""
        self.sites.setdefault(key, site)
        if self.discovering:
            self.input_avals.setdefault(key, []).extend(expected)
            if placeholders is not None:
                return placeholders
            return [
                jax.tree.map(_compat.vary_over_manual_axes, zeros(avals))
                for avals, _ in expected
            ]
        if self.replaying:
            handler = type(self.handlers[key[0]]).__name__
            raise ValueError(_INPUT_IN_REPLAY.format(owner=handler, where=site.where()))
        remaining = self.inputs.get(key, [])
        if len(remaining) < len(expected):
            handler = type(self.handlers[key[0]]).__name__
            raise ValueError(_MISSING_INPUT.format(owner=handler, where=site.where()))
        taken, self.inputs[key] = remaining[: len(expected)], remaining[len(expected) :]
        for value, (avals, _) in zip(taken, expected):
            _check_input(value, avals, site, key, self.handlers)
        return taken


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


def _check_input(value, avals, site: Site, key: Key, handlers) -> None:
    got = jax.tree.map(shape_dtype, value)
    if jax.tree.structure(got) != jax.tree.structure(avals) or any(
        g.shape != a.shape or g.dtype != a.dtype
        for g, a in zip(jax.tree.leaves(got), jax.tree.leaves(avals))
    ):
        handler = type(handlers[key[0]]).__name__
        raise ValueError(
            f"{handler}: an entry for {site.where()} is {describe(got)}, but the "
            f"tag's value there is {describe(avals)}; shapes and dtypes must match "
            "the layout Tag() reports."
        )


def _actions(handlers) -> tuple:
    return tuple((type(h).matches, type(h).apply) for h in handlers)


def _modes(handlers) -> tuple:
    return tuple(type(h).output_mode(h) for h in handlers)


def types_of(tree):
    return jax.tree.map(shape_dtype, tree)


def grow(tree, have: tuple[Axis, ...], want: tuple[Axis, ...]):
    """`tree`, whose leaves lead with vmap batch axes of sizes `have`, broadcast
    to lead with `want` (`have` outermost-first is a prefix of `want`)."""
    new = tuple(range(len(have), len(want)))

    sizes = tuple(s if isinstance(s, int) else s[1] for s in want)

    def one(x):
        x = jnp.expand_dims(x, new)
        return jnp.broadcast_to(x, sizes + x.shape[len(want) :])

    return jax.tree.map(one, tree)


def _acc_init(reduce, site: Site):
    front = site.front_avals()

    def init():
        # Inside a shard_map an accumulator differs per shard: it varies over
        # the manual mesh axes from the start, as a loop carrying it needs.
        value = reduce.init(zeros(front))
        return jax.tree.map(lambda x: _compat.vary_over_manual_axes(strong(x)), value)

    return init


class SiteCall:
    """What a handler sees at one execution of a site."""

    def __init__(self, scope: Scope, index: int, site: Site, leaves):
        self.scope = scope
        self.leaves = leaves
        self.key: Key = (index, site.name)
        self.site = site

    def emit(self, value):
        """Reports `value` (in handler layout) under the handler's output mode.
        Under a `Reduce` mode, returns the accumulator after folding it in (what
        the executions so far add up to); else None."""
        mode = self.scope.mode(self.key)
        if mode.reduces:
            return self.scope.reduce(self.key, value, mode, self.site)
        self.scope.add_entry(self.key, value, Lead(self.site.nbatch), self.site)
        return None

    def next_input(self):
        """The next per-execution input value for this site (handler layout)."""
        expected = [(self.site.front_avals(), Lead(self.site.nbatch))]
        # While discovering, the site's own value stands in for the input: it has
        # the right type, including the mesh axes it varies over in a shard_map.
        here = [self.site.to_front(self.leaves)]
        return self.scope.take_inputs(self.key, expected, self.site, here)[0]
