"""Every use of JAX internals lives here, so a JAX release that moves one breaks
in one place. Each entry names the JAX versions it was written against."""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax

# jax 0.10: private modules with no public equivalent.
from jax._src import config as _config
from jax._src import core as _core
from jax._src import effects as _effects
from jax._src import linear_util as _lu
from jax._src import source_info_util as _source_info_util
from jax._src.api_util import debug_info as _debug_info
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import partial_eval as _pe
from jax.core import ShapedArray as ShapedArray
from jax.core import Tracer as Tracer
from jax.extend import core as jex_core

ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
Literal = jex_core.Literal
Var = jex_core.Var

#
# Trace-context state
#


def bool_trace_state(name: str, help: str):
    """A boolean that is part of JAX's trace context (jax 0.10): `jax.jit` caches
    keyed on it, so a function traced once with the state off is traced again
    with it on."""
    if "include_in_trace_context" in inspect.signature(_config.bool_state).parameters:
        # jax 0.8+: the state declares itself part of the trace context.
        return _config.bool_state(
            name=name, default=False, help=help, include_in_trace_context=True
        )
    # jax 0.7: `include_in_jit_key` puts it in the C++ jit dispatch key, and a
    # trace-context callback puts it in the Python trace caches' keys.
    state = _config.bool_state(
        name=name, default=False, help=help, include_in_jit_key=True
    )
    _config.register_trace_context_callback.append(lambda: state.value)  # pyright: ignore
    return state


#
# Effects
#


Effect = _effects.Effect


def allow_effect(effect_type: type) -> None:
    # jax 0.10: an unordered effect must be allowed in each of these sets to pass
    # through control flow, custom derivatives, remat and lowering. Not in
    # `partial_eval_kept_effects`: that makes effect handles hold tracers.
    for effect_set in (
        _effects.control_flow_allowed_effects,
        _effects.custom_derivatives_allowed_effects,
        _effects.remat_allowed_effects,
        _effects.lowerable_effects,
    ):
        effect_set.add_type(effect_type)
    _keep_in_partial_eval(effect_type)


def _keep_in_partial_eval(effect_type: type) -> None:
    # jax 0.10: `JaxprTrace` (partial evaluation, e.g. when a scan's
    # loop-invariant work is hoisted under `jax.grad`) drops an equation whose
    # outputs are unused unless its effect is in `partial_eval_kept_effects`;
    # then the trace keeps an `EffectHandle` to it in `trace.effect_handles`.
    # Those handles hold the trace's tracers for as long as the trace lives, and
    # `jax_check_tracer_leaks` reports them (`jax.debug.print` in a scan under
    # `grad` is reported the same way) although nothing outlives the trace. So
    # the handles of equations whose only effect is `effect_type` are dropped
    # once `tracers_to_jaxpr` has read them, the list's only reader.
    _effects.partial_eval_kept_effects.add_type(effect_type)

    class Handles(list):
        def __iter__(self):
            items = list.copy(self)
            self[:] = [h for h in items if not _only(h.recipe.effects)]
            return iter(items)

    def _only(effs) -> bool:
        return bool(effs) and all(isinstance(e, effect_type) for e in effs)

    original_init = _pe.JaxprTrace.__init__

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.effect_handles = Handles(self.effect_handles)

    _pe.JaxprTrace.__init__ = __init__


#
# Batching
#


def register_batch_rule(prim, rule: Callable) -> None:
    # jax 0.10: `fancy_primitive_batchers` rules receive `axis_data` (with
    # `.size`), which plain `primitive_batchers` rules do not.
    def wrapped(axis_data, vals, dims, **params):
        return rule(axis_data.size, vals, dims, **params)

    _batching.fancy_primitive_batchers[prim] = wrapped


def is_top_level() -> bool:
    """True when no JAX transformation is being traced (jax 0.10)."""
    return _core.trace_ctx.is_top_level()


#
# Tracing a Python function to a jaxpr
#


def _nameless_debug_info(fn):
    # jax 0.7-0.12: `api_util.debug_info` names every argument (a `keystr` per
    # flat argument, a millisecond for a few hundred); the functions traced here
    # take flat arrays whose names say nothing, and `arg_names=None` is the
    # documented "unknown".
    return _debug_info("effects", fn, (), {})._replace(arg_names=None)


def trace(
    fn: Callable, in_avals: Sequence[Any], *, keep_jit: bool = False
) -> tuple[Jaxpr, list[Any]]:
    """Traces `fn(*flat_args) -> list of arrays` to an open jaxpr whose constants
    (which may be tracers of enclosing traces) are returned separately, as leading
    inputs of the jaxpr.

    With `keep_jit`, calls of `jax.jit(..., inline=True)` functions (most of
    `jax.numpy`) made directly in `fn` stay `jit` equations instead of being
    inlined: evaluating the jaxpr later binds them again, so under `jax.grad` they
    reuse JAX's cached derivative of each, as a hand-written function does, and
    under `jax.jit` they are inlined then."""
    dbg = _nameless_debug_info(fn)
    traced_fn = fn
    if keep_jit:

        def traced_fn(*args):
            _keep_jit_in.append(_core.trace_ctx.trace)
            try:
                return fn(*args)
            finally:
                _keep_jit_in.pop()

    wrapped = _lu.wrap_init(traced_fn, debug_info=dbg)
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return _pe.convert_constvars_jaxpr(jaxpr), list(consts)


def trace_closed(fn: Callable, in_avals: Sequence[Any]) -> tuple[Jaxpr, list[Any]]:
    """Like `trace`, but keeps the constants as the jaxpr's constvars."""
    dbg = _nameless_debug_info(fn)
    wrapped = _lu.wrap_init(fn, debug_info=dbg)
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return jaxpr, list(consts)


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


def bind_eqn(eqn, invals, params):
    """Binds `eqn`'s primitive with `params` as `jax.core.eval_jaxpr` does."""
    # jax 0.10: `get_bind_params` returns the params (subfunctions among them);
    # before jax 0.8 it returned `(subfuns, params)`.
    bind_params = eqn.primitive.get_bind_params(params)
    if isinstance(bind_params, tuple):  # pragma: no cover - older JAX
        subfuns, bind_params = bind_params
        return eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return eqn.primitive.bind(*invals, **bind_params)


def eqn_context(eqn):
    """The source-info context `jax.core.eval_jaxpr` binds an equation under
    (jax 0.10), so re-bound equations keep their names and tracebacks."""
    name_stack = _source_info_util.current_name_stack() + eqn.source_info.name_stack
    return _source_info_util.user_context(
        eqn.source_info.traceback, name_stack=name_stack
    )


def eqn_ctx_manager(eqn):
    return eqn.ctx.manager


#
# Primitives the rewriter has rules for
#

_prims = jex_core.primitives

scan_p = _prims.scan_p
while_p = _prims.while_p
cond_p = _prims.cond_p
pjit_p = getattr(_prims, "jit_p", None) or getattr(_prims, "pjit_p")  # jit_p: jax 0.7+
# jax 0.8+: `jax.extend.core.primitives.remat_p`; jax 0.7 exports it only
# from `jax._src.ad_checkpoint`.
if hasattr(_prims, "remat_p"):
    remat_p = _prims.remat_p
else:
    from jax._src.ad_checkpoint import remat_p as remat_p  # noqa: E402
closed_call_p = _prims.closed_call_p
custom_jvp_call_p = _prims.custom_jvp_call_p
custom_vjp_call_p = _prims.custom_vjp_call_p

#
# Staging equations without re-binding them
#

# The traces `trace(..., keep_jit=True)` is building, innermost last.
_keep_jit_in: list[Any] = []
_inline_jit_rule = _pe.custom_staging_rules[pjit_p]
_Ref = getattr(_core, "Ref", ())  # jax 0.7+: mutable array references
_Inline = getattr(jax, "Inline", None)


def _has_refs(closed) -> bool:
    """Whether a closed jaxpr closes over mutable array references, which jit's
    staging rule moves out rather than staging the equation as it is."""
    return any(isinstance(c, _Ref) for c in closed.consts)


def _inlines_when_traced(inline) -> bool:
    """Whether a `jit` equation's `inline` param asks for its jaxpr to be inlined
    into the enclosing trace: `inline=True` in jax 0.7-0.11; in jax 0.12+ the
    param is a `jax.Inline` and only `JAX_EARLY` does (`True` became
    `JAX_LATE`, inlined only when lowering)."""
    if _Inline is not None and isinstance(inline, _Inline):
        return inline is _Inline.JAX_EARLY
    return bool(inline)


def _jit_staging_rule(trace, source_info, *args, **params):
    # jax 0.7-0.12: `pjit_staging_rule(trace, source_info, *args, **params)`
    # inlines a `jit(inline=True)` call's jaxpr into the trace; in a trace that
    # keeps jit calls, stage the equation as a non-inlined call is staged (the
    # rule's default path, minus its handling of mutable constants).
    if (
        _inlines_when_traced(params["inline"])
        and _keep_jit_in
        and _keep_jit_in[-1] is trace
        and not _has_refs(params["jaxpr"])
    ):
        return trace.default_process_primitive(
            pjit_p, args, params, source_info=source_info
        )
    return _inline_jit_rule(trace, source_info, *args, **params)


_pe.custom_staging_rules[pjit_p] = _jit_staging_rule


def _inlined_when_staged(params) -> bool:
    # jax 0.7-0.12: the condition under which `pjit_staging_rule` inlines.
    return (
        _inlines_when_traced(params["inline"])
        and not params["compiler_options_kvs"]
        and all(isinstance(s, _Unspecified) for s in params["in_shardings"])
        and all(isinstance(s, _Unspecified) for s in params["out_shardings"])
        and all(lay is None for lay in params["in_layouts"])
        and all(lay is None for lay in params["out_layouts"])
        and not _has_refs(params["jaxpr"])
    )


def _stages_as_is(params) -> bool:
    # jax 0.7-0.12: `pjit_staging_rule` stages a jit equation that it does not
    # inline through `default_process_primitive`, unless mutable constants
    # need moving or compiler options make it raise.
    closed = params["jaxpr"]
    return (
        not params["compiler_options_kvs"]
        and not getattr(closed.jaxpr, "is_high", False)
        and not _has_refs(closed)
    )


def staging_trace():
    """The current trace if it builds a jaxpr (`jax.jit`, `make_jaxpr`, `trace`
    above), else None (jax 0.7-0.12: a `DynamicJaxprTrace`)."""
    current = _core.trace_ctx.trace
    kind = type(current)
    return current if kind is _Staging or kind in _intercepting_classes else None


#
# Intercepting what is staged into a jaxpr being built
#

_Staging = _pe.DynamicJaxprTrace
_TracingEqn = _pe.TracingEqn
_intercepting_classes: set[type] = set()


class Interceptor:
    """Routes what is staged into a jaxpr being built through hooks, while
    `on(trace)` is active: `on_primitive(trace, primitive, tracers, params)`
    for primitives, `on_other(trace, base_method, args, kwargs)` for the other
    `process_*` methods (custom_jvp/vjp calls, shard_map, ...). Hooks fall back
    on `stage_primitive`, or on calling `base_method`."""

    def __init__(self, on_primitive: Callable, on_other: Callable):
        # jax 0.7-0.12: everything staged into a `DynamicJaxprTrace` goes
        # through `process_primitive` or another `process_*` method. The
        # subclass adds no state (`__slots__ = ()`), so a trace can switch to it
        # and back by assigning `__class__`.
        namespace: dict[str, Any] = {
            "__slots__": (),
            "__module__": __name__,
            # `on_primitive(self, primitive, tracers, params)` is the method.
            "process_primitive": on_primitive,
        }
        for name in dir(_Staging):
            if name.startswith("process_") and name != "process_primitive":
                namespace[name] = _forwarding(getattr(_Staging, name), on_other)
        self.cls = type("InterceptedJaxprTrace", (_Staging,), namespace)
        _intercepting_classes.add(self.cls)

    @contextlib.contextmanager
    def on(self, trace):
        """Re-entrant: the outermost use switches `trace` back."""
        if type(trace) is self.cls:
            yield
            return
        if type(trace) is not _Staging:
            raise RuntimeError(f"cannot intercept a {type(trace).__name__}")
        trace.__class__ = self.cls
        try:
            yield
        finally:
            trace.__class__ = _Staging


def _forwarding(base: Callable, on_other: Callable) -> Callable:
    def method(self, *args, **kwargs):
        return on_other(self, base, args, kwargs)

    return method


def trace_context():
    """The object whose `.trace` is the current trace (jax 0.7-0.12)."""
    return _core.trace_ctx


def current_trace():
    return _core.trace_ctx.trace


def set_current_trace(trace) -> None:
    """Makes `trace` current (jax 0.7-0.12: `bind` makes no trace current while
    a trace processes a primitive; code run there that binds must set one)."""
    _core.trace_ctx.set_trace(trace)


# `stage_primitive(trace, primitive, tracers, params)`: what staging `primitive`
# into `trace` does without interception.
stage_primitive = _Staging.process_primitive


def staged_mark(trace) -> tuple[int, set]:
    """Where `trace`'s jaxpr is now: its equation count and effects."""
    frame = trace.frame
    return len(frame.tracing_eqns), set(frame.effects)


def staged_since(trace, mark) -> list[tuple[Any, list[Any]]]:
    """The equations staged into `trace` since `mark`, each as a jaxpr equation
    with the tracers its inputs read."""
    eqns = []
    for entry in trace.frame.tracing_eqns[mark[0] :]:
        # jax 0.7-0.12: an entry is the equation, a weak reference to it (it is
        # dropped with its outputs), or a function returning it.
        if isinstance(entry, (weakref.ReferenceType, types.FunctionType)):
            entry = entry()
        if entry is None:
            continue
        if isinstance(entry, _TracingEqn):  # as `JaxprStackFrame.get_eqns` does
            tracers = list(entry.in_tracers)
            entry = _core.JaxprEqn(
                [t.val for t in tracers],
                entry.outvars,
                entry.primitive,
                entry.params,
                entry.effects,
                entry.source_info,
                entry.ctx,
            )
        else:
            tracers = None
        eqns.append((entry, tracers))
    return eqns


def one_eqn_jaxpr(eqn) -> tuple[Jaxpr, list[int]]:
    """A jaxpr of `eqn` alone, and which of its inputs are its invars."""
    positions, invars = [], []
    for i, v in enumerate(eqn.invars):
        if type(v) is not Literal and v not in invars:
            positions.append(i)
            invars.append(v)
    dbg = _nameless_debug_info(eqn.primitive.bind)._replace(result_paths=None)
    jaxpr = Jaxpr([], invars, list(eqn.outvars), [eqn], eqn.effects, dbg)
    return jaxpr, positions


def output_values(out, outvars) -> tuple[list[Any], Callable] | None:
    """The tracers a `process_*` method returned (a list, or a jax 0.10+
    `FlatTree`) if they are exactly `outvars`' tracers, and how to return others
    in their place; else None."""
    if isinstance(out, (list, tuple)):
        vals, rebuild = list(out), list
    elif hasattr(out, "vals") and hasattr(out, "update"):  # FlatTree
        vals, rebuild = list(out.vals), out.update
    else:
        return None
    if len(vals) != len(outvars) or any(
        getattr(t, "val", None) is not v for t, v in zip(vals, outvars)
    ):
        return None
    return vals, rebuild


def reset_staged(trace, mark) -> None:
    """Removes what was staged into `trace` since `mark`."""
    frame = trace.frame
    del frame.tracing_eqns[mark[0] :]
    frame.effects = set(mark[1])


def current_name_stack():
    """The name stack equations are bound under here, or None when empty."""
    stack = _source_info_util.current_name_stack()
    return stack if stack.stack else None


_DynamicJaxprTracer = _pe.DynamicJaxprTracer
_base_is_high = getattr(_core.Primitive, "is_high", None)


@functools.cache
def _is_high(prim_type) -> bool:
    # jax 0.7+: a primitive class overriding `is_high` may need lowering to
    # other primitives when staged ("hijax"); such equations are bound.
    return getattr(prim_type, "is_high", None) is not _base_is_high


def emit_eqn(trace, eqn, invals, name_stack) -> list[Any] | None:
    """Adds a copy of `eqn`, on `invals`, to the jaxpr `trace` is building, as
    `pe.inline_jaxpr_into_trace` copies equations (jax 0.7-0.12): the output
    types are the equation's, so nothing is evaluated abstractly and no source
    context is entered. Like it, this skips staging rules (other than jit's):
    they ran when the equation was first staged. None when a copy would not be
    what binding it does (the caller binds it then): an equation with effects or
    a constant-folding rule, or inputs whose types differ from the equation's (a
    handler replaced a value by one of another weak type)."""
    prim = eqn.primitive
    inline = False
    if prim is pjit_p:
        # What its staging rule does: inline the jaxpr, or stage the equation as
        # it is (its forwarding rule already ran when it was first staged).
        inline = _inlined_when_staged(eqn.params)
        if not inline and (eqn.effects or not _stages_as_is(eqn.params)):
            return None
    elif eqn.effects or prim in _pe.const_fold_rules or _is_high(type(prim)):
        return None
    src = eqn.source_info
    if name_stack is not None:
        src = src.replace(name_stack=name_stack + src.name_stack)
    tracers = []
    for x, v in zip(invals, eqn.invars):
        if type(v) is Literal:
            tracers.append(_DynamicJaxprTracer(trace, v.aval, v, src))
            continue
        if type(x) is not _DynamicJaxprTracer or x._trace is not trace:
            x = trace.to_jaxpr_tracer(x, src)
        aval = x.aval
        if aval is not v.aval and aval != v.aval:
            return None
        tracers.append(x)
    if inline:  # what the jit staging rule does, without binding
        closed = eqn.params["jaxpr"]
        outs = _pe.inline_jaxpr_into_trace(
            trace, src, closed.jaxpr, closed.consts, *tracers
        )
        return [trace.to_jaxpr_tracer(x, src) for x in outs]
    out_avals = [v.aval for v in eqn.outvars]
    return trace.emit_eqn(
        tracers, out_avals, prim, eqn.params, eqn.effects, src, eqn.ctx
    )


from jax._src import mesh as _mesh_lib  # noqa: E402
from jax._src import shard_map as _shard_map  # noqa: E402

shard_map_p = _shard_map.shard_map_p


def shard_map_manual_axes(params) -> frozenset:
    """The mesh axes a `shard_map` equation makes manual: the `newly_manual_axes`
    param in jax 0.10, `manual_axes` in jax 0.7-0.9."""
    if "newly_manual_axes" in params:  # jax 0.10
        return params["newly_manual_axes"]
    return params["manual_axes"]  # jax 0.7-0.9


@contextlib.contextmanager
def shard_map_body(params):
    """The context `shard_map` traces its body in (jax 0.10): the manual mesh
    axes bound, the abstract mesh manual over them, and its vma checking."""
    mesh, manual = params["mesh"], shard_map_manual_axes(params)
    with (
        _shard_map._extend_axis_env(mesh, manual),
        _mesh_lib.use_abstract_mesh(_shard_map._as_manual_mesh(mesh, manual)),
        _config._check_vma(params["check_vma"]),
    ):
        yield


def shard_aval(params, spec, aval):
    """The per-shard aval of a `shard_map` input with `spec` (jax 0.10)."""
    shard = _core.shard_aval  # jax 0.7+
    return shard(
        params["mesh"], shard_map_manual_axes(params), params["check_vma"], spec, aval
    )


def vary_over_manual_axes(x):
    """Inside a `shard_map` that checks varying axes, marks `x` as varying over
    every manual mesh axis, so values built inside (zeros) and values computed
    from shards can meet in one cond output or one stacked entry (jax 0.10)."""
    if not _config._check_vma.value:
        return x
    axes = tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
    missing = tuple(a for a in axes if a not in varying_axes(jax.typeof(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):  # jax 0.8+
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # pyright: ignore  # jax 0.7


def mapped_aval(length: int, aval):
    """The aval of one slice along the leading axis."""
    # jax 0.10: `jax.extend.core.mapped_aval`; jax 0.7-0.9 have it only in
    # `jax._src.core` (`jax.core.mapped_aval` warns there).
    return getattr(jex_core, "mapped_aval", _core.mapped_aval)(length, 0, aval)


def varying_axes(aval) -> frozenset:
    """The manual mesh axes a value inside `shard_map` varies over: `aval.mat`
    in jax 0.10, `aval.vma` in earlier releases."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


from jax._src.named_sharding import UNSPECIFIED as UNSPECIFIED  # noqa: E402  jax 0.10

_Unspecified = type(UNSPECIFIED)


def scan_counts(params) -> tuple[int, int]:
    """`(num_consts, num_carry)` of a scan equation."""
    if "num_consts" in params:  # jax <= 0.10
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()  # jax 0.11+: flat-tree params
    return len(consts), len(carry)


def scan_params(params, jaxpr, *, n_consts: int, n_carry: int, n_xs: int, n_ys: int):
    """The params of a scan equation rebuilt around a new body."""
    if "num_consts" in params:  # jax <= 0.10
        new: dict[str, Any] = dict(jaxpr=jaxpr, num_consts=n_consts, num_carry=n_carry)
        if "linear" in params:  # jax 0.7-0.9
            new["linear"] = (False,) * (n_consts + n_carry + n_xs)
        return new
    from jax._src import flattree as ft  # pyright: ignore  # jax 0.11+

    return dict(
        jaxpr=jaxpr,
        ft_in=ft.pack((ft.nones(n_consts), ft.nones(n_carry), ft.nones(n_xs))),
        ft_out=ft.pack((ft.nones(n_carry), ft.nones(n_ys))),
    )


def open_jaxprs_in_params(params) -> list[Any]:
    """Every sub-jaxpr in an equation's params, open: what `jaxprs_in_params`
    finds (values, and items of tuple values), faster. This runs for every
    equation a one-pass `handle` stages, most of them with tuples of shardings
    and the like in their params."""
    found = []
    for v in params.values():
        kind = type(v)
        if kind is tuple or isinstance(v, tuple):  # a named tuple, say
            for x in v:
                if isinstance(x, ClosedJaxpr):
                    found.append(x.jaxpr)
                elif isinstance(x, Jaxpr):
                    found.append(x)
        elif kind is ClosedJaxpr:
            found.append(v.jaxpr)
        elif kind is Jaxpr:
            found.append(v)
    return found


def jaxprs_in_params(params) -> list[Any]:
    """Every sub-jaxpr (open or closed) in an equation's params."""
    # jax 0.10: `jax.extend.core.jaxprs_in_params`; jax 0.7-0.9 have it only in
    # `jax._src.core`.
    return list(getattr(jex_core, "jaxprs_in_params", _core.jaxprs_in_params)(params))
