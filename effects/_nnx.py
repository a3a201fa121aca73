"""Flax NNX modules through `handle`: their state goes in, their updates come out.

An NNX module is a graph of mutable Python objects. `handle` traces its function
with the arrays of its arguments as inputs, so a module among the arguments
would be rebuilt from those arrays inside the trace, and what the function
writes to it (BatchNorm's running statistics, an RNG stream's counter) would die
with the trace, as under a bare `jax.jit`. As `nnx.jit` does, the NNX objects
among the function and its arguments are split (`nnx.split`) into a graph
definition, which is static, and their state, which is an input; inside the
trace they are merged again and called; the state they end with is an output,
written back into the caller's objects with `nnx.update`.

Flax is optional: nothing here imports it. An NNX object can only reach
`handle` once `flax.nnx` is imported, so that is where it is looked up.
"""

from __future__ import annotations

import functools
import itertools
import operator
import sys
import types
from collections.abc import Callable
from typing import Any

import jax

_CLOSED_OVER = (
    "handle: an NNX Variable is written inside a JAX transformation its module "
    "was made outside of: a module the handled function closes over, or a "
    "module made outside a `jax.grad` or `jax.jit` that calls `handle`. `handle` "
    "carries the state of the NNX modules among its arguments in and out, as "
    "`nnx.jit` does: pass the module as an argument, "
    "`fx.handle(lambda model, x: model(x), ...)(model, x)`, or handle the module "
    "itself, `fx.handle(model, ...)(x)`; around `handle`, use `nnx.grad` and "
    "`nnx.jit`, which carry the state too."
)
_REMOVED_VARIABLES = (
    "handle: the handled function removed NNX Variables from a module among "
    "its arguments; `handle` carries the Variables a module has, and those it "
    "adds (`sow`), out of the call. Remove them outside the handled function."
)


class _Hole:
    """Where an NNX object was among the leaves (hashable, one instance)."""

    def __repr__(self) -> str:
        return "<NNX object>"


_HOLE = _Hole()


def is_node(x) -> bool:
    """Whether `x` is an NNX object, or a method bound to one."""
    nnx = sys.modules.get("flax.nnx")
    if isinstance(x, types.MethodType):
        x = x.__self__
    return nnx is not None and _is_object(nnx, x)


def _is_object(nnx, x) -> bool:
    return isinstance(x, (nnx.Pytree, nnx.Variable))


def functional(fn, args, kwargs) -> tuple[Callable, tuple, Callable] | None:
    """`(pure, pure_args, finish)` when NNX objects are among `fn` (a module, or
    a method bound to one) and its arguments, else None. `pure(*pure_args)`
    returns `(fn(*args, **kwargs), state)`, with `state` what the objects hold
    after the call; `finish(state)` writes it into the caller's objects."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None or fn is _pure or getattr(fn, "__wrapped__", None) is _pure:
        return None  # `handle` calling itself with the state split off

    is_object = functools.partial(_is_object, nnx)
    if isinstance(fn, types.MethodType) and is_object(fn.__self__):
        fn, args = fn.__func__, (fn.__self__, *args)
    leaves, treedef = jax.tree.flatten((fn, args, kwargs), is_leaf=is_object)
    nodes = [x for x in leaves if is_object(x)]
    if not nodes:
        return None
    graphdef, state = nnx.split(nodes)
    rest = tuple(_HOLE if is_object(x) else x for x in leaves)
    variables = _variables(nnx, state)  # the caller's own Variable objects

    def finish(updates) -> None:
        # Only the Variables the call wrote: writing an unchanged one would be
        # refused where Flax refuses any write (a module made outside an
        # enclosing `jax.grad`), though the plain call writes nothing there.
        # Then those it added (`sow`), as `nnx.jit` adds them.
        written, values, added = updates
        for variable, value in zip(itertools.compress(variables, written), values):
            _set(variable, value)
        if added is not None:
            nnx.update(nodes, added)

    return _pure, (graphdef, state, treedef, rest), finish


def _pure(graphdef, state, treedef, rest) -> tuple[Any, Any]:
    nnx = sys.modules["flax.nnx"]
    nodes = nnx.merge(graphdef, state)
    it = iter(nodes)
    leaves = [next(it) if x is _HOLE else x for x in rest]
    fn, args, kwargs = jax.tree.unflatten(treedef, leaves)
    variables = _variables(nnx, nnx.state(nodes))
    before = [_get(v) for v in variables]
    out = fn(*args, **kwargs)
    had = set(map(id, variables))
    now = set(map(id, _variables(nnx, nnx.state(nodes))))
    if not now >= had:
        raise ValueError(_REMOVED_VARIABLES)
    added = nnx.state(nodes, lambda _, v: id(v) not in had) if now > had else None
    after = [_get(v) for v in variables]
    # A Variable the call did not write still holds the very value it got
    # (a write may change its structure: a `sow` appends to a tuple).
    written = tuple(map(_written, before, after))
    return out, (written, list(itertools.compress(after, written)), added)


def _written(before, after) -> bool:
    leaves, tree = jax.tree.flatten(after)
    old, old_tree = jax.tree.flatten(before)
    return tree != old_tree or not all(map(operator.is_, leaves, old))


def _variables(nnx, state) -> list:
    return jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _get(variable):
    get = getattr(variable, "get_value", None)
    return get() if get is not None else variable.value


def _set(variable, value) -> None:
    set_ = getattr(variable, "set_value", None)
    if set_ is not None:
        set_(value)
    else:
        variable.value = value


def explain(e: BaseException) -> Exception | None:
    """A clearer error for Flax's refusal to write a Variable from inside
    `handle`'s trace, or None."""
    errors = sys.modules.get("flax.errors")
    if errors is not None and isinstance(e, errors.TraceContextError):
        return ValueError(_CLOSED_OVER)
    return None
