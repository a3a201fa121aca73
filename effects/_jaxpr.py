"""Algorithms on jaxprs, built on the reads and calls of JAX in `_compat`:
tracing a function, copying equations, adding inputs, binding a jaxpr as one
call, and finding the jaxprs inside an equation."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import _compat
from ._compat import ClosedJaxpr, Jaxpr, Literal, Var


def aval(x):
    """`x.aval` where there is one (arrays, tracers): `jax.typeof` costs more,
    and this runs for every argument and site."""
    found = getattr(x, "aval", None)
    return jax.typeof(x) if found is None else found


def trace(
    fn: Callable, in_avals: Sequence[Any], named_after: Callable | None = None
) -> tuple[Jaxpr, list[Any]]:
    """Like `_compat.trace_closed`, with the constants as leading inputs of the
    jaxpr instead of its constvars."""
    jaxpr, consts = _compat.trace_closed(fn, in_avals, named_after)
    return _compat.constvars_as_invars(jaxpr), consts


def equations_jaxpr(jaxpr: Jaxpr, start: int, stop: int) -> tuple[Jaxpr, list[Any]]:
    """`jaxpr.eqns[start:stop]` as a jaxpr of their own: its inputs are the
    variables they read that they do not define (returned too), its outputs
    every variable they define."""
    eqns = jaxpr.eqns[start:stop]
    defined: set = set()
    invars: list[Any] = []
    for eqn in eqns:
        for v in eqn.invars:
            if type(v) is not Literal and v not in defined:
                defined.add(v)
                invars.append(v)
        defined.update(eqn.outvars)
    outvars = [v for e in eqns for v in e.outvars if type(v) is not _compat.DropVar]
    effects = frozenset().union(*(eqn.effects for eqn in eqns))
    dbg = jaxpr.debug_info
    if dbg is not None:
        dbg = dbg._replace(arg_names=None, result_paths=None)
    # Marked as JAX marks a jaxpr its tracing staged a hijax equation into (the
    # mark exists from jax 0.10, as those equations do): lowering expands them.
    high = {"is_high": True} if any(map(_compat.is_high_eqn, eqns)) else {}
    return Jaxpr([], invars, outvars, eqns, effects, dbg, **high), invars


def copy_into_trace(jaxpr: Jaxpr, args: Sequence[Any]) -> list[Any] | None:
    """Copies `jaxpr`'s equations into the jaxpr the current trace builds
    without binding them again (no abstract evaluation, no staging rules: they
    ran when the equations were first staged). Returns the outputs, or None
    where the current trace builds no jaxpr, where an input's type differs from
    the one the equations were traced with (a handler put a value of another
    weak type there: binding them again types them anew), or where `jaxpr`
    holds hijax equations (copying skips the staging that marks the jaxpr being
    built as holding them; binding them again goes through it)."""
    if _compat.is_high(jaxpr):
        return None
    for x, v in zip(args, jaxpr.invars):
        a = aval(x)
        if a is not v.aval and a != v.aval:
            return None
    return _compat.inline_into_trace(jaxpr, args)


def insert_invars(jaxpr: Jaxpr, index: int, avals: Sequence[Any]) -> Jaxpr:
    """Adds unused inputs of the given avals before input `index`."""
    if not avals:
        return jaxpr
    new = [Var(a) for a in avals]
    invars = list(jaxpr.invars)
    dbg = jaxpr.debug_info
    if dbg is not None and dbg.arg_names is not None:
        names = list(dbg.arg_names)
        dbg = dbg._replace(
            arg_names=tuple(names[:index] + [""] * len(new) + names[index:])
        )
    return jaxpr.replace(invars=invars[:index] + new + invars[index:], debug_info=dbg)


@functools.lru_cache(maxsize=16)
def _jit_template(mesh) -> dict[str, Any]:
    # The params of a `jit` equation with one input and two outputs, as JAX
    # makes them where `mesh` is the abstract mesh. A tuple of length 1 holds
    # one entry per input, of length 2 one per output; `call_jaxpr` stretches
    # them. JAX has no function, public or private, that builds them for a
    # given jaxpr (its own rules that bind `jit` write them out), and their
    # values depend on the release (`ctx_mesh`, chosen by private code that
    # differs between jax 0.8 and 0.10; `inline`, a `jax.Inline` from 0.12):
    # tests/test_jax_facts.py::test_jit_params_hold_one_entry_per_input_and_per_output.
    del mesh  # (part of the cache key: `ctx_mesh` is read from the context)
    closed = jax.make_jaxpr(jax.jit(lambda x: (x, x)))(0.0)
    (eqn,) = closed.jaxpr.eqns
    assert eqn.primitive is _compat.pjit_p, eqn
    return dict(eqn.params)


def call_jaxpr(
    closed: ClosedJaxpr, args: Sequence[Any], name: str, inline: bool = True
) -> list[Any]:
    """Binds `closed` on the current trace as one `jit(inline=True)` call, as
    `jax.jit` binds a function it traced: where a jaxpr is being built (under
    `jax.jit`), JAX's staging rule copies its equations into it, so it lowers as
    the same equations written there would; under `grad` and `vmap`, JAX's cached
    JVP and batching of the whole jaxpr apply. With `inline=False`, one
    equation there (which `unwrapped` reads back, as a jaxpr, uncopied)."""
    template = _jit_template(jax.sharding.get_abstract_mesh())
    n_in, n_out = len(closed.in_avals), len(closed.out_avals)
    params = {}
    for key, value in template.items():
        if type(value) is tuple and len(value) == 1:
            value = value * n_in
        elif type(value) is tuple and len(value) == 2:
            value = (value[0],) * n_out
        params[key] = value
    inline = _compat.inline_here() if inline else _compat.NOT_INLINED
    params.update(jaxpr=closed, name=name, inline=inline)
    return _compat.pjit_p.bind(*args, **params)


def unwrapped(jaxpr: Jaxpr) -> Jaxpr:
    """`jaxpr`, or where it is one plain `jit` call (`_compat.plain_jit`) of
    its inputs, in order, giving its outputs, that call's body: the same
    program, with the call's equations at its top level (where the rewrite
    splices what handlers do at its sites, see `_rewrite.trace_rewrite`)."""
    if len(jaxpr.eqns) != 1:
        return jaxpr
    (eqn,) = jaxpr.eqns
    if not _compat.plain_jit(eqn) or (eqn.invars, eqn.outvars) != (
        jaxpr.invars,
        jaxpr.outvars,
    ):
        return jaxpr
    return eqn.params["jaxpr"].jaxpr.replace(debug_info=jaxpr.debug_info)


def structure(jaxpr: Jaxpr):
    """A hashable key that two jaxprs share when they are the same program:
    the same equations (primitives, params, source aside), reading and
    defining the same positions, on the same types; jaxprs in params compared
    the same way, their constants by identity. None where a param or a
    literal is not hashable. (JAX compares jaxprs by identity: a jit call
    lowers its jaxpr once per module for every call of that one object.)"""
    try:
        key = _structure(jaxpr)
        hash(key)
    except (TypeError, KeyError):  # (KeyError: a variable read, never defined)
        return None
    return key


def _exact(x) -> tuple:
    """`x` as a key equal only for the same value of the same type: numbers
    by their bits (0.0 is not -0.0; a NaN is itself)."""
    if isinstance(x, (float, complex, np.generic, np.ndarray)):
        array = np.asarray(x)
        return type(x), array.dtype, array.shape, array.tobytes()
    return type(x), hash(x), x


def _structure(jaxpr: Jaxpr) -> tuple:
    number: dict[Any, int] = {}

    def ref(v):
        return (_exact(v.val), v.aval) if type(v) is Literal else number[v]

    def param(x):
        if isinstance(x, (ClosedJaxpr, Jaxpr)):
            inner = x.jaxpr if isinstance(x, ClosedJaxpr) else x
            return type(x), _structure(inner), tuple(map(id, getattr(x, "consts", ())))
        if isinstance(x, (tuple, list)):
            return type(x), tuple(map(param, x))
        return _exact(x)

    number.update((v, i) for i, v in enumerate([*jaxpr.constvars, *jaxpr.invars]))
    eqns = []
    for eqn in jaxpr.eqns:
        ins = tuple(map(ref, eqn.invars))
        outs = tuple((type(v), v.aval) for v in eqn.outvars)
        base = len(number)
        number.update((v, base + i) for i, v in enumerate(eqn.outvars))
        params = tuple((k, param(v)) for k, v in sorted(eqn.params.items()))
        eqns.append((eqn.primitive, ins, outs, params, frozenset(eqn.effects), eqn.ctx))
    return (
        tuple(v.aval for v in jaxpr.constvars),
        tuple(v.aval for v in jaxpr.invars),
        tuple(eqns),
        tuple(map(ref, jaxpr.outvars)),
        frozenset(jaxpr.effects),
        _compat.is_high(jaxpr),
    )


def sub_jaxprs(eqn) -> list[Any]:
    """Every jaxpr in an equation's params, open: what JAX's `jaxprs_in_params`
    finds (values, and items of tuple values), faster: this runs for every
    equation of every traced function, most of them with tuples of shardings
    and the like in their params. For a hijax primitive, its jaxprs."""
    params = eqn.params
    found = _compat.hi_jaxprs(params)
    if found is not None:
        return found
    found = []
    for v in params.values():
        kind = type(v)
        if kind is tuple or isinstance(v, tuple):  # a named tuple, say
            for x in v:
                if isinstance(x, ClosedJaxpr):
                    found.append(x.jaxpr)
                elif isinstance(x, Jaxpr):
                    found.append(x)
        elif kind is ClosedJaxpr:  # (in jax 0.12 a `Jaxpr`, its own `.jaxpr`)
            found.append(v.jaxpr)
        elif kind is Jaxpr:
            found.append(v)
    return found


def holds(jaxpr: Jaxpr, name: str) -> bool:
    """Whether an equation of `jaxpr`, or of a jaxpr in one, is a `name`."""
    return any(
        eqn.primitive.name == name or any(holds(j, name) for j in sub_jaxprs(eqn))
        for eqn in jaxpr.eqns
    )


def map_jaxprs_in_params(params, fn: Callable[[Jaxpr], Jaxpr]):
    """`params` with `fn` applied to every jaxpr that `sub_jaxprs` finds (given
    open; a closed one keeps its constants); `params` itself where `fn` changes
    none."""

    def one(x):
        # (In jax 0.12 `ClosedJaxpr` is `Jaxpr`, its constants attached, which
        # `Jaxpr.replace` keeps: the first case takes it.)
        if isinstance(x, Jaxpr):
            return fn(x)
        if isinstance(x, ClosedJaxpr):
            new = fn(x.jaxpr)
            return x if new is x.jaxpr else x.replace(jaxpr=new)
        return x

    changed = {}
    for key, v in params.items():
        if isinstance(v, tuple):
            items = [one(x) for x in v]
            if any(a is not b for a, b in zip(items, v)):
                # (a named tuple of jaxprs is rebuilt field by field)
                changed[key] = tuple(items) if type(v) is tuple else type(v)(*items)  # pyright: ignore[reportArgumentType]
        else:
            new = one(v)
            if new is not v:
                changed[key] = new
    return dict(params, **changed) if changed else params
