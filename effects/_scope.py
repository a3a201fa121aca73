"""What handlers emit while the rewriter walks one region of a program (the whole
program, or one loop body or branch): appended entries, carried accumulators,
and the per-execution input values they consume."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from . import _compat
from ._handlers import Handler, Reduce
from ._site import Site, describe, shape_dtype, strong

Key = tuple[int, str]  # (handler index, site name)

_STRICT_TWICE = (
    "{where} was executed more than once, but Tag(mode='strict') collects a single "
    "value. Use mode='append' to collect every execution, or 'last'."
)
_ACC_CHANGED = (
    "The Reduce for {where} changed its accumulator from {before} to {after}; "
    "`fn(acc, x)` must return an accumulator of the same shapes and dtypes as "
    "`init`."
)
_MISSING_INPUT = (
    "{owner} got fewer entries for {where} than it has executions. Give one entry "
    "per execution, in the layout Tag() reports."
)


def zeros(avals):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), avals)


class Scope:
    def __init__(
        self,
        handlers: tuple[Handler, ...],
        *,
        accs=None,
        inputs=None,
        discovering: bool = False,
    ):
        self.handlers = handlers
        # Unbound methods: going through an `eqx.Module` instance would build a
        # bound-method module at every site, the bulk of the rewrite's cost.
        self.actions = _actions(handlers)
        self.modes = _modes(handlers)
        self.calls_user_code = any(h.calls_user_code() for h in handlers)
        self.discovering = discovering
        self.entries: dict[Key, list[tuple[Any, int]]] = {}
        self.accs: dict[Key, Any] = dict(accs or {})
        self.inputs: dict[Key, list[Any]] = {
            k: list(v) for k, v in (inputs or {}).items()
        }
        # Filled while discovering, for the rule that threads this region.
        self.acc_inits: dict[Key, Any] = {}
        self.input_avals: dict[Key, list[tuple[Any, int]]] = {}
        self.sites: dict[Key, Site] = {}

    def where(self, key: Key) -> str:
        return self.sites[key].where()

    def mode(self, key: Key):
        return self.modes[key[0]]

    # Appended entries -------------------------------------------------------

    def add_entry(self, key: Key, value, nbatch: int, site: Site) -> None:
        self.sites.setdefault(key, site)
        entries = self.entries.setdefault(key, [])
        entries.append((_strong_tree(value), nbatch))
        if len(entries) > 1 and self.mode(key) == "strict":
            raise ValueError(_STRICT_TWICE.format(where=self.where(key)))

    # Accumulators -----------------------------------------------------------

    def reduce(self, key: Key, value, reduce: Reduce, site: Site) -> None:
        self.sites.setdefault(key, site)
        if key not in self.accs:
            init = _acc_init(reduce, site)
            self.acc_inits[key] = init
            self.accs[key] = init()
        acc = self.accs[key]
        new = jax.tree.map(strong, reduce.fn(acc, value))
        before = jax.tree.map(shape_dtype, acc)
        after = jax.tree.map(shape_dtype, new)
        if before != after:
            raise ValueError(
                _ACC_CHANGED.format(
                    where=self.where(key),
                    before=describe(before),
                    after=describe(after),
                )
            )
        self.accs[key] = new

    # Per-execution inputs ---------------------------------------------------

    def take_inputs(
        self, key: Key, expected: list[tuple[Any, int]], site: Site, placeholders=None
    ):
        """Takes one input entry per `(avals, nbatch)` in `expected`: for one
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
        remaining = self.inputs.get(key, [])
        if len(remaining) < len(expected):
            handler = type(self.handlers[key[0]]).__name__
            raise ValueError(_MISSING_INPUT.format(owner=handler, where=site.where()))
        taken, self.inputs[key] = remaining[: len(expected)], remaining[len(expected) :]
        for value, (avals, nbatch) in zip(taken, expected):
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


def _acc_init(reduce: Reduce, site: Site):
    front = site.front_avals()

    def init():
        return jax.tree.map(strong, reduce.init(zeros(front)))

    return init


class SiteCall:
    """What a handler sees at one execution of a site."""

    def __init__(self, scope: Scope, index: int, site: Site, leaves):
        self.scope = scope
        self.leaves = leaves
        self.key: Key = (index, site.name)
        self.site = site

    def emit(self, value) -> None:
        """Reports `value` (in handler layout) under the handler's output mode."""
        mode = self.scope.mode(self.key)
        if isinstance(mode, Reduce):
            self.scope.reduce(self.key, value, mode, self.site)
        else:
            self.scope.add_entry(self.key, value, self.site.nbatch, self.site)

    def next_input(self):
        """The next per-execution input value for this site (handler layout)."""
        expected = [(self.site.front_avals(), self.site.nbatch)]
        # While discovering, the site's own value stands in for the input: it has
        # the right type, including the mesh axes it varies over in a shard_map.
        here = [self.site.to_front(self.leaves)]
        return self.scope.take_inputs(self.key, expected, self.site, here)[0]
