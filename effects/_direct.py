"""Handling in one pass. When `handle`d code runs while a jaxpr is being built
(under `jax.jit`, in a loop body, in `make_jaxpr`), the function is not traced
to a jaxpr of its own and then rewritten: it runs on the caller's trace, with
what reaches that trace intercepted.

- A site bound there is handled at once.
- An equation holding sites in its sub-jaxprs (a `jit` call, a loop, a
  branch, ...) is traced alone and rewritten by the rewriter's rule for it.
- Everything else is staged as it would be without `handle`.

So the caller's program is built once, with no copy. Handles nested on one trace
form a chain (`Frame.next`): a frame lets the ones further out see what it does
not consume, as `handle(handle(f, A), B)` does when traced in two passes.

A region staged through a path other than `process_primitive` (a custom_jvp or
custom_vjp call, shard_map, ...) is checked once staged; if it holds sites a
frame must rewrite, it is taken out of the trace and rewritten in its place. In
the rare case that cannot be done (the path staged more than one equation), what
the function staged is removed and the frame falls back on the two-pass rewrite
(`_handle.py`).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from . import _compat, _primitives
from ._primitives import handling, site_p
from ._rewrite import handle_site, needs_rewrite, run, sites_in
from ._scope import Scope
from ._site import aval


class Frame:
    """One `handle` running on `trace`."""

    __slots__ = ("trace", "scope", "outside", "seen", "next")

    def __init__(self, trace, scope: Scope, outside: bool, next: Frame | None):
        self.trace = trace
        self.scope = scope
        self.outside = outside  # the handling state where `handle` was called
        self.seen: set[tuple[str, str, str]] = set()  # sites met, for messages
        self.next = next


class Fallback(BaseException):  # noqa: N818  (control flow, never seen by users)
    """Raised through the handled function when `frame` must use two passes (a
    `BaseException`, so that the function's own `except Exception` lets it
    through)."""

    def __init__(self, frame: Frame):
        super().__init__()
        self.frame = frame


class _State(threading.local):
    top: Frame | None = None


_state = _State()


def call(fn, args, kwargs, scope: Scope) -> tuple[Any, set]:
    """Runs `fn(*args, **kwargs)` on the current trace (one that builds a
    jaxpr) with the scope's handlers acting. Returns its output and the sites
    met. Raises `Fallback` for this frame when it must use two passes; what the
    call staged is removed then."""
    trace = _compat.staging_trace()
    frame = Frame(trace, scope, bool(handling.value), _state.top)
    mark = _compat.staged_mark(trace)
    _state.top = frame
    try:
        with _interceptor.on(trace), handling(True):
            out = fn(*args, **kwargs)
    except Fallback as e:
        if e.frame is frame:
            _compat.reset_staged(trace, mark)
        raise
    finally:
        _state.top = frame.next
    return out, frame.seen


def _on_primitive(trace, primitive, tracers, params):
    # Runs for every primitive staged into a trace a frame runs on: kept short.
    frame = _state.top
    while frame is not None and frame.trace is not trace:
        frame = frame.next
    if frame is None:
        return _stage(trace, primitive, tracers, params)
    if primitive is site_p:
        return _site(frame, tracers, params)
    if primitive is _jit_p:  # the most common by far: its one jaxpr's sites
        closed = params["jaxpr"]
        known = _jit_sites.get(id(closed))
        if known is None or known[0]() is not closed:
            known = _remember_jit_sites(closed)
        if not known[1]:
            return _stage(trace, primitive, tracers, params)
        subs = [closed.jaxpr]
    elif params:
        subs = _compat.open_jaxprs_in_params(params)
        if not subs:
            return _stage(trace, primitive, tracers, params)
    else:
        return _stage(trace, primitive, tracers, params)
    sites = frozenset().union(*map(sites_in, subs))
    if not sites:
        return _stage(trace, primitive, tracers, params)
    effects = set().union(*(j.effects for j in subs))
    while frame is not None:
        if frame.trace is trace:
            frame.seen |= sites
            if needs_rewrite(frame.scope.handlers, sites, effects, frame.outside):
                return _rewrite(frame, primitive, tracers, params)
        frame = frame.next
    return _stage(trace, primitive, tracers, params)


_stage = _compat.stage_primitive
_jit_p = _compat.pjit_p

# id(closed jaxpr of a jit equation) -> (weak reference to it, its sites): a
# look-up without a Python call, for every jit equation staged.
_jit_sites: dict[int, tuple[weakref.ref, frozenset]] = {}


def _remember_jit_sites(closed) -> tuple[weakref.ref, frozenset]:
    key = id(closed)
    # The entry goes when the jaxpr does (before its id can be reused).
    known = (
        weakref.ref(closed, lambda _: _jit_sites.pop(key, None)),
        sites_in(closed.jaxpr),
    )
    _jit_sites[key] = known
    return known


class _Acting:
    """While `frame` acts: what is staged meanwhile goes to the frames further
    out, and user code that handlers call runs under the handling state outside
    it (as in a two-pass rewrite, which evaluates the rewritten program where
    `handle` was called). From a trace's `process_primitive`, where `bind` left
    no trace current, its trace is made current."""

    __slots__ = ("frame", "saved", "state", "trace", "set_trace", "outside")

    def __init__(self, frame: Frame, set_trace: bool = True, outside: bool = True):
        self.frame = frame
        self.set_trace = set_trace
        # Whether to enter the handling state outside (if it differs): always
        # when interpreting a jaxpr, which reads it.
        self.outside = outside and not frame.outside

    def __enter__(self):
        self.saved = _state.top
        _state.top = self.frame.next
        if self.set_trace:
            self.trace = _compat.current_trace()
            _compat.set_current_trace(self.frame.trace)
        self.state = None
        if self.outside:
            self.state = handling(False)
            self.state.__enter__()

    def __exit__(self, *exc):
        if self.state is not None:
            self.state.__exit__(*exc)
        if self.set_trace:
            _compat.set_current_trace(self.trace)
        _state.top = self.saved


def _handle_here(leaves, params):
    """A site bound with the current trace a frame's: handled without binding.
    (`tag` calls this at every site, `handle` or not: kept short.)"""
    top = frame = _state.top
    if frame is None:
        return None
    trace = _trace_ctx.trace
    while frame.trace is not trace:
        frame = frame.next
        if frame is None:
            return None
    frame.seen.add((params["kind"], params["collection"], params["name"]))
    avals = [x.aval for x in leaves]  # `tag` passes arrays
    scope = frame.scope
    if scope.calls_user_code and not frame.outside:
        with _Acting(frame, set_trace=False):
            return handle_site(params, avals, leaves, scope, False)
    # Nothing reads the handling state: only the frames further out change.
    _state.top = frame.next
    try:
        return handle_site(params, avals, leaves, scope, frame.outside)
    finally:
        _state.top = top


_trace_ctx = _compat.trace_context()
_primitives.direct_site.append(_handle_here)


def _site(frame: Frame, tracers, params):
    frame.seen.add((params["kind"], params["collection"], params["name"]))
    avals = [aval(x) for x in tracers]
    # Only user code reads the handling state here; the site, if no handler
    # consumes it, is bound with the effect of the state outside.
    with _Acting(frame, outside=frame.scope.calls_user_code):
        return handle_site(params, avals, tracers, frame.scope, frame.outside)


def _rewrite(frame: Frame, primitive, tracers, params):
    # The equation alone, as tracing the function to a jaxpr would stage it
    # (a `jit(inline=True)` call inlined, say), then rewritten onto `trace`.
    avals = [aval(x) for x in tracers]
    jaxpr, consts = _compat.trace(lambda *xs: _bind(primitive, xs, params), avals)
    with _Acting(frame):
        outs = run(jaxpr, (), [*consts, *tracers], frame.scope)
    return outs if primitive.multiple_results else outs[0]


def _bind(primitive, args, params):
    out = primitive.bind(*args, **params)
    return list(out) if primitive.multiple_results else [out]


def _on_other(trace, base, args, kwargs):
    # A region staged some other way (a custom_jvp/vjp call, shard_map, ...):
    # staged as usual, then rewritten if a frame must.
    frame = _state.top
    while frame is not None and frame.trace is not trace:
        frame = frame.next
    if frame is None:
        return base(trace, *args, **kwargs)
    mark = _compat.staged_mark(trace)
    out = base(trace, *args, **kwargs)
    staged = _compat.staged_since(trace, mark)
    acting = None
    for eqn, _ in staged:
        subs = _compat.open_jaxprs_in_params(eqn.params) if eqn.params else ()
        sites = frozenset().union(*map(sites_in, subs))
        if not sites:
            continue
        outer = frame
        while outer is not None:
            if outer.trace is trace:
                outer.seen |= sites
                if acting is None and needs_rewrite(
                    outer.scope.handlers, sites, eqn.effects, outer.outside
                ):
                    acting = outer
            outer = outer.next
    if acting is None:
        return out
    # One equation, returning its outputs as they are: taken out of the trace
    # and rewritten in its place. Anything else: `acting` uses two passes.
    if len(staged) != 1 or staged[0][1] is None:
        raise Fallback(acting)
    eqn, tracers = staged[0]
    outputs = _compat.output_values(out, eqn.outvars)
    if outputs is None:
        raise Fallback(acting)
    _compat.reset_staged(trace, mark)
    jaxpr, positions = _compat.one_eqn_jaxpr(eqn)
    with _Acting(acting):
        outs = run(jaxpr, (), [tracers[i] for i in positions], acting.scope)
    return outputs[1](outs)


_interceptor = _compat.Interceptor(_on_primitive, _on_other)
