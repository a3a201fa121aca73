"""Every use of JAX internals lives here, so a JAX release that moves one breaks
in one place. Each entry names the JAX versions it was written against."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.core as jax_core
import jax.numpy as jnp

# jax 0.10: private modules with no public equivalent.
from jax._src import config as _config
from jax._src import core as _core
from jax._src import effects as _effects
from jax._src import linear_util as _lu
from jax._src import source_info_util as _source_info_util
from jax._src.api_util import debug_info as _debug_info
from jax._src.api_util import fun_sourceinfo as _fun_sourceinfo
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import lax as _lax_internal
from jax.core import ShapedArray as ShapedArray
from jax.core import Tracer as Tracer
from jax.extend import core as jex_core

ClosedJaxpr = jex_core.ClosedJaxpr
jaxpr_as_fun = jex_core.jaxpr_as_fun
eval_jaxpr = jax_core.eval_jaxpr
Jaxpr = jex_core.Jaxpr
Literal = jex_core.Literal
Var = jex_core.Var

#
# Effects
#


Effect = _effects.Effect

# jax 0.7-0.12: JAX's batching rule of `cond` holds, in its frame, the batch
# axis of the predicate (`index_dim`, None where the vmap does not batch it).
# Where it is batched, the rule traces the branches batched (a jaxpr JAX
# caches, which a cond it keeps may be given too), then evaluates them on the
# current trace, for every example, and selects the outputs: the `cond` is
# gone, and the sites directly in its branches are bound again in that frame,
# those in what the branches call (a jit, a loop body, a cond the vmap keeps)
# where the rule traces the branches, under that frame too (JAX alone:
# tests/test_jax_facts.py::
# test_a_batched_cond_evaluates_its_branches_in_its_batching_rule).
from jax._src.lax.control_flow import conditionals as _conditionals  # noqa: E402

_COND_BATCHING = (_conditionals.__file__, "_cond_batching_rule")
_TRACING = (_pe.__file__, "trace_to_jaxpr_dynamic")
_JAX_FILES = os.path.dirname(jax.__file__) + os.sep


def in_every_branch(deep: bool = False) -> bool:
    """Whether the caller's caller binds where a `cond` a vmap turns into a
    select evaluates its branches: called from JAX's code alone, up to a frame
    of that cond's batching rule, with no trace of a jaxpr in between. With
    `deep`, anywhere in that rule's branches: through the traces of what they
    call, and through the rules of the conds the vmap keeps there (right only
    in a trace whose jaxprs no other trace shares: see
    `_checks.branch_suspects`)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_JAX_FILES):
        where = frame.f_code.co_filename, frame.f_code.co_name
        if where == _TRACING and not deep:
            return False
        if where == _COND_BATCHING:
            batched = frame.f_locals["index_dim"] is not None
            if batched or not deep:
                return batched
        frame = frame.f_back
    return False


#
# Where a site was bound
#

_OWN_FILES = __file__.rsplit("/", 1)[0] + "/"


def outside_level() -> int:
    """The `stacklevel` of a warning its caller gives, that names the first
    frame in neither effects nor JAX: the user's call."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(
        (_OWN_FILES, _JAX_FILES)
    ):
        frame, level = frame.f_back, level + 1
    return level


def call_frames(traceback) -> Iterator[tuple[str, int, int, int, int]]:
    """(file, line, column, end line, end column) of each frame of `traceback` in
    neither JAX nor effects (the span of the expression it runs), innermost
    first, up to the trace that made the equation: where a site's `tag`
    was called, and from where within that trace (jax 0.7-0.12:
    `source_info_util.user_frames`). JAX caches the jaxprs of jits and branches
    with the tracebacks of their first trace (jax 0.7-0.9 keep the frames around
    it; 0.10 drops them), so a frame outside the trace can be another caller's.
    One at a time: reading a frame's line costs, and a tap reads one or two."""
    if traceback is None:
        return
    code, lasti = traceback.raw_frames()
    for c, i in zip(code, lasti):
        if c.co_name.startswith("trace_to_") and c.co_filename.endswith(_PE_FILE):
            return
        if _source_info_util.is_user_filename(c.co_filename) and not (
            c.co_filename.startswith(_OWN_FILES)
        ):
            f = _source_info_util.raw_frame_to_frame(c, i)
            yield f.file_name, f.start_line, f.start_column, f.end_line, f.end_column


_PE_FILE = "interpreters/partial_eval.py"


def literal_array(literal):
    """A literal's value as an array of its type, weak type included (jax
    0.7-0.12: `lax._convert_element_type`; the value is a Python scalar or a
    NumPy array, 0.10 `TypedFloat`s)."""
    aval = literal.aval
    return _lax_internal._convert_element_type(
        literal.val, aval.dtype, weak_type=aval.weak_type
    )


def new_eqn(invars, outvars, primitive, params, effects, source_info, ctx):
    """A new equation (jax 0.7-0.12: `core.new_jaxpr_eqn`; public in
    `jax.extend.core` from jax 0.8 only)."""
    return _core.new_jaxpr_eqn(
        invars, outvars, primitive, params, effects, source_info, ctx
    )


def name_stack(eqn, outer=None):
    """JAX's name stack of `eqn` (after `outer`, the stack of the equation
    whose jaxpr holds it, an inner jaxpr's being relative): its
    `jax.named_scope`s and the transformations that made it; `str()` of it
    reads `"transpose(jvp(blocks.3))"` (jax 0.7-0.12:
    `source_info.name_stack`)."""
    stack = eqn.source_info.name_stack
    return stack if outer is None else outer + stack


def dce(jaxpr):
    """`jaxpr` without the equations no output needs, loop outputs included
    (jax 0.7-0.12: `pe.dce_jaxpr`); equations with effects are kept."""
    return _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)[0]


def allow_effect(effect_type: type) -> None:
    # jax 0.10: an unordered effect must be allowed in each of these sets to pass
    # through control flow, custom derivatives, remat and lowering, and be in
    # `partial_eval_kept_effects` for partial evaluation (a scan's under
    # `jax.grad`) to keep an equation whose outputs are unused. (With the
    # latter, `jax_check_tracer_leaks` falsely reports the partial-evaluation
    # trace as leaked, as it does for `jax.debug.print` in a scan under
    # `jax.grad` with JAX alone.)
    for effect_set in (
        _effects.control_flow_allowed_effects,
        _effects.custom_derivatives_allowed_effects,
        _effects.remat_allowed_effects,
        _effects.lowerable_effects,
        _effects.partial_eval_kept_effects,
    ):
        effect_set.add_type(effect_type)


#
# Batching
#


def register_batch_rule(prim, rule: Callable) -> None:
    # jax 0.10: `fancy_primitive_batchers` rules receive `axis_data` (with
    # `.size`), which plain `primitive_batchers` rules do not.
    def wrapped(axis_data, vals, dims, **params):
        return rule(axis_data.size, vals, dims, **params)

    _batching.fancy_primitive_batchers[prim] = wrapped


def register_partial_eval_custom_rule(prim, rule: Callable) -> None:
    # jax 0.7-0.12: `pe.partial_eval_jaxpr_custom_rules[prim](saveable, unks_in,
    # inst_in, eqn) -> (known eqn | None, staged eqn | None, unks_out, inst_out,
    # residual vars)`, used by `jax.checkpoint`'s partial evaluation and by the
    # loops, conds and calls inside it.
    _pe.partial_eval_jaxpr_custom_rules[prim] = rule


def is_tracer(x) -> bool:
    return isinstance(x, Tracer)


def folding_constants() -> bool:
    """Whether JAX evaluates an operation of constants on the spot while
    tracing (`jax.ensure_compile_time_eval`), staging no equation."""
    return _config.eager_constant_folding.value


def current_trace():
    """The trace values are made in now (jax 0.7-0.12: `core.trace_ctx`)."""
    return _core.trace_ctx.trace


def new_input(trace, aval):
    """A new input of the jaxpr `trace` is building, after those it has (jax
    0.7-0.12: `DynamicJaxprTrace.new_arg`, as JAX makes a traced function's
    inputs): a region's state, entering its trace where a handler first
    touches it (see `_rules.Region`)."""
    return trace.new_arg(aval, _source_info_util.current())


def is_top_level() -> bool:
    """True when no JAX transformation is being traced (jax 0.10)."""
    return _core.trace_ctx.is_top_level()


#
# Tracing a Python function to a jaxpr
#


def _nameless_debug_info(fn, named_after=None):
    # jax 0.7-0.12: `api_util.debug_info` names every argument (a `keystr` per
    # flat argument, a millisecond for a few hundred); the functions traced here
    # take flat arrays whose names say nothing, and `arg_names=None` is the
    # documented "unknown". JAX's errors while tracing name the function and its
    # source line: `named_after`'s, a user's function `fn` wraps, where given.
    if named_after is not None:
        try:
            return _debug_info("fx.handle", named_after, (), {})._replace(
                arg_names=None
            )
        except Exception:  # an object `inspect` cannot read: name `fn`
            pass
    # One of ours (a region's body, a rewritten program): its source line, the
    # debug info `debug_info` would make without reading its signature, which
    # was about 15% of the time of tracing small regions (jax 0.7-0.12).
    return _core.DebugInfo(
        "effects", _fun_sourceinfo(fn), None, _lu.initial_result_paths
    )


def trace_context():
    """The JAX settings a trace depends on (`jax_enable_x64`, the axis names in
    scope, ...), hashable: what `jax.jit` keys its caches on (jax 0.7+)."""
    return _config.trace_context()


def trace_closed(
    fn: Callable, in_avals: Sequence[Any], named_after: Callable | None = None
) -> tuple[Jaxpr, list[Any]]:
    """Traces `fn(*flat_args) -> list of arrays` to a jaxpr whose constants
    (which may be tracers of enclosing traces) are its constvars, returned
    too. JAX's errors name `named_after` if given (the user's function that
    `fn` calls), else `fn`."""
    dbg = _nameless_debug_info(fn, named_after)
    wrapped = _lu.wrap_init(fn, debug_info=dbg)
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
    return jaxpr, list(consts)


def constvars_as_invars(jaxpr: Jaxpr) -> Jaxpr:
    """`jaxpr` with its constants as leading inputs (jax 0.10; in jax 0.12 a
    jaxpr traced with its constants apart has them as leading inputs already,
    and this returns it as it is)."""
    return _pe.convert_constvars_jaxpr(jaxpr)


DropVar = _core.DropVar  # jax 0.7-0.12


def is_high_eqn(eqn) -> bool:
    """Whether `eqn` is a "hijax" equation (jax 0.10+; in jax 0.12
    `lax.custom_root` is one, `call_hi_primitive`, and `jax_remat3` and
    `jax_custom_vjp3` make `jax.checkpoint` and `jax.custom_vjp` others): one
    that has no lowering rule of its own. JAX lowers a jaxpr marked `is_high`
    (set by its tracing wherever such an equation is staged) by first expanding
    these equations into plain ones (`to_lojax`); an unmarked jaxpr holding one
    fails to lower ("MLIR translation rule for primitive 'call_hi_primitive'
    not found")."""
    is_high = getattr(eqn.primitive, "is_high", None)  # jax 0.7-0.9: no hijax
    if is_high is None:
        return False
    return is_high(*(v.aval for v in eqn.invars), **eqn.params)


def is_high(jaxpr: Jaxpr) -> bool:
    """Whether `jaxpr` is marked as holding hijax equations (jax 0.10+)."""
    return getattr(jaxpr, "is_high", False)


def inline_into_trace(jaxpr: Jaxpr, args: Sequence[Any]) -> list[Any] | None:
    """Copies `jaxpr`'s equations into the jaxpr the current trace builds
    without binding them again, as `jax.jit`'s staging rule inlines a jaxpr
    (jax 0.7-0.12: `pe.inline_jaxpr_into_trace`): the outputs, or None where
    the current trace builds no jaxpr."""
    trace = current_trace()
    if type(trace) is not _pe.DynamicJaxprTrace:
        return None
    src = _source_info_util.current()
    tracers = [trace.to_jaxpr_tracer(x, src) for x in args]
    return _pe.inline_jaxpr_into_trace(trace, src, jaxpr, (), *tracers)


def bind_eqn(eqn, invals, params):
    """Binds `eqn`'s primitive with `params` as `jax.core.eval_jaxpr` does."""
    # jax 0.10: `get_bind_params` returns the params (subfunctions among them);
    # jax 0.8 returns `(subfuns, params)`.
    bind_params = eqn.primitive.get_bind_params(params)
    if isinstance(bind_params, tuple):  # pragma: no cover - jax 0.8
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
pjit_p = _prims.jit_p
remat_p = _prims.remat_p
closed_call_p = _prims.closed_call_p
name_p = _prims.name_p  # `jax.ad_checkpoint.checkpoint_name`'s primitive
custom_jvp_call_p = _prims.custom_jvp_call_p
custom_vjp_call_p = _prims.custom_vjp_call_p

# What `jax.jit(..., inline=True)` asks for, the call inlined where a jaxpr is
# being built: `True` in jax 0.7-0.11; in jax 0.12+ the param is a `jax.Inline`
# and `True` means `JAX_LATE` (inlined when lowering), `JAX_EARLY` this.
_Inline = getattr(jax, "Inline", None)
INLINE_WHEN_TRACED = True if _Inline is None else _Inline.JAX_EARLY
NOT_INLINED = False if _Inline is None else _Inline.JAX_LATE  # (one equation)


def is_key(aval) -> bool:
    """Whether `aval` is of a PRNG key array (a dtype JAX extends)."""
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def inline_here():
    """The `inline` param for a call bound on the current trace. In jax
    0.7-0.11, `True` inlines the call into whatever jaxpr JAX builds next, the
    linear jaxpr of an eager `jax.grad` included: its loops are then
    transposed anew at every call, each compiled again. So there, only where
    the current trace stages into a jaxpr (`jax.jit`), directly or under
    transformations (`trace.parent_trace`)."""
    if _Inline is not None:
        return INLINE_WHEN_TRACED
    trace = current_trace()
    while trace is not None:
        if type(trace) is _pe.DynamicJaxprTrace:
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


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


def explicit_sharding(aval):
    """`aval`'s sharding where it names a mesh axis (under an Explicit-axis
    mesh, where the type carries it), else None."""
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    return aval.sharding if spec is not None and any(spec) else None


def vary_over_manual_axes(x):
    """Inside a `shard_map` that checks varying axes, marks `x` as varying over
    every manual mesh axis, so values built inside (zeros) and values computed
    from shards can meet in one cond output or one stacked entry (jax 0.10)."""
    if not _config._check_vma.value:
        return x
    return _vary(x, getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def vary_like(x, aval):
    """`x` marked as varying over the manual mesh axes a value of type `aval`
    varies over, where the current `shard_map` checks varying axes (jax 0.10):
    a value built from a replicated one (a closed-over array, zeros) can then
    replace one that differs per shard."""
    if not _config._check_vma.value:
        return x
    return _vary(x, varying_axes(aval))


def extra_varying_axes(x, aval) -> frozenset:
    """The manual mesh axes `x` varies over but a value of type `aval` does not,
    where the current `shard_map` checks varying axes (jax 0.10): `x` differs
    per shard where `aval` says the program holds one value for every shard."""
    if not _config._check_vma.value:
        return frozenset()
    return varying_axes(jax.typeof(x)) - varying_axes(aval)


def _vary(x, axes):
    missing = tuple(a for a in axes if a not in varying_axes(jax.typeof(x)))
    if not missing:
        return x
    return jax.lax.pcast(x, missing, to="varying")


def same_types(avals, others) -> bool:
    """Whether JAX takes values of the types `avals` for those of `others`,
    one for one, as a loop's carry or a cond's branch outputs: their shapes,
    dtypes, weak types and varying axes agree, and their shardings where
    both name a mesh (`core.typematch`, jax 0.7-0.12)."""
    return len(avals) == len(others) and all(
        a.weak_type == b.weak_type and _core.typematch(a, b)
        for a, b in zip(avals, others)
    )


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


def plain_jit(eqn) -> bool:
    """Whether `eqn` is a `jax.jit` call that holds nothing but its jaxpr: no
    constants, shardings, layouts, donated inputs or compiler options (jax
    0.8-0.12 params), so that its equations in its place compute the same
    program (XLA inlines every call)."""
    if eqn.primitive is not pjit_p:
        return False
    params = eqn.params
    shardings = (*params["in_shardings"], *params["out_shardings"])
    layouts = (*params.get("in_layouts", ()), *params.get("out_layouts", ()))
    return (
        not params["jaxpr"].consts
        and all(type(s) is type(UNSPECIFIED) for s in shardings)
        and all(x is None for x in layouts)
        and not any(params["donated_invars"])
        and not params.get("compiler_options_kvs")
    )


def scan_counts(params) -> tuple[int, int]:
    """`(num_consts, num_carry)` of a scan equation."""
    if "num_consts" in params:  # jax <= 0.10
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()  # jax 0.11+: flat-tree params
    return len(consts), len(carry)


def scan_params(params, jaxpr, *, n_consts: int, n_carry: int, n_xs: int, n_ys: int):
    """The params of a scan equation rebuilt around a new body, whose inputs
    the rewriter adds before the consts, after the carry and after the xs."""
    if "num_consts" in params:  # jax <= 0.10
        new: dict[str, Any] = dict(jaxpr=jaxpr, num_consts=n_consts, num_carry=n_carry)
        if "linear" in params:  # jax 0.7-0.9
            # Which inputs are linear, kept: jax 0.8's transpose of a scan
            # takes an input marked non-linear for a residual, and fails on a
            # linear one (a rewritten derivative, as in a custom_jvp's rule).
            linear = params["linear"]
            k, c = params["num_consts"], params["num_carry"]
            new["linear"] = (
                (False,) * (n_consts - k)
                + linear[: k + c]
                + (False,) * (n_carry - c)
                + linear[k + c :]
                + (False,) * (n_xs - (len(linear) - k - c))
            )
        return new
    from jax._src import flattree as ft  # pyright: ignore  # jax 0.11+

    return dict(
        jaxpr=jaxpr,
        ft_in=ft.pack((ft.nones(n_consts), ft.nones(n_carry), ft.nones(n_xs))),
        ft_out=ft.pack((ft.nones(n_carry), ft.nones(n_ys))),
    )


# jax 0.10+: "hijax" primitives, JAX's higher-level primitives, are all bound as
# one primitive, `call_hi_primitive`, whose one param `_prim` is an object
# holding the jaxprs (and Python functions) the primitive is made of. From jax
# 0.11 `lax.custom_root` is one (`CustomRoot`), and so are `jax.checkpoint`,
# `jax.custom_vjp` and `jax.custom_jvp` under the `jax_remat3`,
# `jax_custom_vjp3` and `jax_custom_jvp3` flags (`RematTraced`,
# `CustomVJPTraced`, `CustomJVPTraced`).
# The module is taken only where JAX itself imported it: on older JAX importing
# it registers rules for its primitives in JAX's tables, which is JAX's business.
_hijax = sys.modules.get("jax._src.hijax")
try:
    from jax._src import stages as _stages

    # (`_hijax` is None where JAX has not imported it: an AttributeError too)
    call_hi_primitive_p = _hijax.call_hi_primitive_p  # pyright: ignore[reportOptionalMemberAccess]
    # jax 0.12: `HiPrim`; jax 0.10: `VJPHiPrimitive`.
    _HiPrim = getattr(_hijax, "HiPrim", None) or _hijax.VJPHiPrimitive  # pyright: ignore[reportOptionalMemberAccess]
except AttributeError:  # pragma: no cover - jax 0.7-0.9
    call_hi_primitive_p = _HiPrim = _stages = None


def checkpoint_name_of(eqn) -> str | None:
    """The name of a `jax.ad_checkpoint.checkpoint_name` equation: JAX's `name`
    primitive, or in jax 0.12 under the `jax_remat3` flag the hijax
    `CheckpointName`; None for any other equation."""
    if eqn.primitive is name_p:
        return eqn.params["name"]
    if eqn.primitive is call_hi_primitive_p:
        prim = eqn.params["_prim"]
        if type(prim).__name__ == "CheckpointName":
            return prim.params["name"]
    return None


def primitive_name(eqn) -> str:
    """An equation's primitive as users know it: a hijax primitive by its class
    (`CustomRoot`, `RematTraced`), not `call_hi_primitive`; `jit` (`pjit` in
    jax 0.7-0.9), `checkpoint` (`remat2`), `closed_call` (`eval_jaxpr` in jax
    0.12)."""
    if eqn.primitive is call_hi_primitive_p:
        return type(eqn.params["_prim"]).__name__
    if eqn.primitive is closed_call_p:
        return "closed_call"
    return _USER_NAMES.get(eqn.primitive.name) or eqn.primitive.name


_USER_NAMES = {"pjit": "jit", "remat2": "checkpoint"}


# jax 0.12: the flag that makes each of these hijax primitives where JAX's
# older, first-order primitive would be.
_HI_FLAGS = {
    "RematTraced": ("jax.checkpoint", "jax_remat3"),
    "CustomVJPTraced": ("jax.custom_vjp", "jax_custom_vjp3"),
    "CustomJVPTraced": ("jax.custom_jvp", "jax_custom_jvp3"),
}


def hijax_flag(eqn) -> tuple[str, str] | None:
    """`(function, flag)` where `eqn` is the hijax form of `function` that JAX's
    `flag` makes (`jax.checkpoint` under `jax_remat3`, say); else None."""
    if eqn.primitive is not call_hi_primitive_p:
        return None
    return _HI_FLAGS.get(type(eqn.params["_prim"]).__name__)


def hi_jaxprs(params) -> list[Any] | None:
    """The jaxprs of a hijax primitive's equation, open, as JAX finds them to
    print it: jaxprs and traced functions among the primitive's params, and
    those of hijax primitives among them (its Python functions, a
    `custom_root`'s `tangent_solve` say, hold jaxprs no param shows). None for
    any other equation."""
    prim = params.get("_prim")
    if prim is None or _HiPrim is None or not isinstance(prim, _HiPrim):
        return None
    assert _stages is not None  # (only on jax 0.10+)
    found = []
    for v in prim.params.values():
        for x in v if type(v) is tuple else (v,):
            if isinstance(x, (Jaxpr, ClosedJaxpr)):
                found.append(getattr(x, "jaxpr", x))
            elif isinstance(x, _stages.Traced):
                found.append(x.jaxpr.jaxpr)
            elif isinstance(x, _HiPrim):
                found += hi_jaxprs({"_prim": x}) or []
    return found


def jaxprs_in_params(params) -> list[Any]:
    """Every sub-jaxpr (open or closed) in an equation's params."""
    # jax 0.10: `jax.extend.core.jaxprs_in_params`; jax 0.7-0.9 have it only in
    # `jax._src.core`.
    return list(getattr(jex_core, "jaxprs_in_params", _core.jaxprs_in_params)(params))


# The params of a custom_jvp/custom_vjp equation holding the thunk that traces
# its rule when a transformation first needs it (jax 0.7-0.12: an
# `lu.WrappedFun` returning the rule's jaxpr with its constants, and for
# custom_jvp the tangents that are symbolic zeros; memoized by `pe._memoize`).
rule_thunk_params = {
    custom_jvp_call_p: "jvp_jaxpr_fun",
    custom_vjp_call_p: "fwd_jaxpr_thunk",
}


def like_thunk(fn: Callable, thunk) -> Any:
    """`fn` as a rule thunk that JAX accepts in place of `thunk` (jax 0.7-0.12:
    an `lu.WrappedFun` with its debug info)."""
    return _lu.wrap_init(fn, debug_info=thunk.debug_info)
