"""Taps: sites the program already has. `fx.taps(fn)` is `fn` with a site after
the output of every selected primitive and at every loop carry, in the
jaxpr `handle` traces, without editing the code: every handler then works on
them as on tags. Outside `handle` it is `fn` itself, at no cost."""

from __future__ import annotations

import dataclasses
import operator
import os
import re
import sysconfig
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import _compat, _jaxpr
from ._primitives import handling, site_effect, site_p
from ._rewrite import rules
from ._site import LEAF

TAPS = "taps"  # the collection taps are in, unless given another


@dataclasses.dataclass(frozen=True)
class TapInfo:
    """Where a tap is, as a selection predicate of [`fx.taps`][effects.taps]
    sees it and as [`fx.find_nonfinite`][effects.find_nonfinite] reports it.

    **Attributes:**

    - `primitive`: the JAX primitive whose output is tapped (`"log"`,
      `"dot_general"`), or `"scan carry"` / `"while carry"` for a loop's carry.
    - `scope`: JAX's name stack there: the `jax.named_scope`s around it (the
      module path under [`fx.tag_modules`][effects.tag_modules]), and under a
      `jax.grad` or `jax.jvp` inside the function the transformations, as in
      `"transpose(jvp(blocks.3))"`. `""` at the top level.
    - `file`, `line`: the user's source line: the first frame outside JAX,
      `effects` and installed packages; where there is none (a Flax layer
      tapped whole), the installed package's; None where JAX kept no
      traceback.
    - `library`: `"file:line"` of the frame in an installed package that made
      it (an Equinox layer's, say), where that is not the user's; else None.
    - `shape`: the output's shapes and dtypes, as `"float32[3,4]"`.
    - `span`: the user's source as `(line, column, end line, end column)`,
      the expression the operation was made for (the operations of its
      derivative share it); None where `line` is.
    """

    primitive: str
    scope: str
    file: str | None
    line: int | None
    library: str | None
    shape: str
    # With find_nonfinite's taps, per operand of the equation: None for a value
    # read at run time (the tap's inputs), else what it says of it (a literal).
    operands: tuple = dataclasses.field(default=(), repr=False)
    # And the primitive that made each operand there, if one did.
    producers: tuple = dataclasses.field(default=(), repr=False)
    span: tuple[int, int, int, int] | None = dataclasses.field(default=None, repr=False)

    @property
    def location(self) -> str:
        """`"model.py:20"`, or `""` where no line is known."""
        return "" if self.file is None else f"{os.path.basename(self.file)}:{self.line}"

    @property
    def derivative(self) -> bool:
        """Whether JAX made it differentiating the function (`jvp` or
        `transpose` in its scope)."""
        return "jvp(" in self.scope or "transpose(" in self.scope

    def base_name(self) -> str:
        where = f"{self.scope}/{self.primitive}" if self.scope else self.primitive
        return f"{where} @ {self.location}" if self.file is not None else where


def _primitive_names(primitives) -> frozenset | None:
    """The selected primitives' names, None for every primitive; checked."""
    if primitives is None:
        return None
    one = isinstance(primitives, str) or not isinstance(primitives, Iterable)
    names = tuple((primitives,) if one else primitives)
    if not all(isinstance(n, str) for n in names):
        raise TypeError(
            "fx.taps: `primitives` must be None, a primitive's name or names "
            f'(like "log" or ("exp", "dot_general")), got {primitives!r}.'
        )
    return frozenset(names)


class Tapped(eqx.Module):
    """What [`fx.taps`][effects.taps] returns: `fn` with taps, callable as
    `fn`. An Equinox module, so that `handle` caches its trace as it caches
    any module's (by `fn` and the selection)."""

    fn: Callable
    primitives: frozenset | None = eqx.field(static=True)
    where: Callable | None = eqx.field(static=True)
    carries: bool | Callable = eqx.field(static=True)
    collection: str = eqx.field(static=True)
    # find_nonfinite's taps: each site's value is (the equation's inexact
    # inputs, its outputs), to tell a value made non-finite from finite
    # inputs from one that was handed a non-finite input.
    with_inputs: bool = eqx.field(static=True, default=False)

    @property
    def __wrapped__(self) -> Callable:
        # (read by `inspect.signature`: `jax.jit` names the program's
        # parameters after `fn`'s, as for `fn` itself)
        return self.fn

    def __call__(self, *args, **kwargs):
        if not handling.value:
            # Nothing handles it: the function itself, as an unhandled tag is.
            return self.fn(*args, **kwargs)
        dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
        leaves, treedef = jax.tree.flatten(dynamic)
        out_info = {}

        def flat(*leaves):
            args, kwargs = eqx.combine(jax.tree.unflatten(treedef, leaves), static)
            # (the static part alone: the arrays are this trace's tracers)
            arrays, out_info["static"] = eqx.partition(
                self.fn(*args, **kwargs), eqx.is_array
            )
            out, out_info["tree"] = jax.tree.flatten(arrays)
            return out

        avals = [_jaxpr.aval(x) for x in leaves]
        jaxpr, consts = _jaxpr.trace(flat, avals, self.fn)
        closed = _compat.ClosedJaxpr(_Inserter(self).jaxpr(jaxpr), ())
        # (one equation in the caller's trace: `handle`, whose trace of this
        # call alone is this program (`_jaxpr.unwrapped`), copies nothing)
        outs = _jaxpr.call_jaxpr(closed, [*consts, *leaves], "taps", inline=False)
        arrays = jax.tree.unflatten(out_info["tree"], outs)
        return eqx.combine(arrays, out_info["static"])


def taps(
    fn: Callable,
    primitives: str | Iterable[str] | None = None,
    *,
    where: Callable[[TapInfo], bool] | None = None,
    carries: bool | Callable[[TapInfo], bool] = False,
    collection: str = TAPS,
) -> Tapped:
    """`fn` with a site after the output of every selected primitive, and at
    every loop carry if asked: the values a program computes, seen by
    handlers without editing its code.

    Under [`fx.handle`][effects.handle], every handler works on taps as on
    tags: [`fx.Tag("taps")`][effects.Tag] collects them,
    [`fx.Stats("taps")`][effects.Stats] gives their statistics,
    [`fx.Substitute`][effects.Substitute] and [`fx.Intervene`][effects.Intervene]
    change them, `Tag(of="cotangent")` differentiates at them, and
    [`fx.sites`][effects.sites] lists them without running. Taps are chosen
    in the program `handle` traces: `fx.taps(jax.grad(loss))` taps the
    gradient's own operations, its backward pass included. Outside `handle`,
    the returned function is `fn`: it traces and compiles to the same
    program.

    A tap is named after where it is: JAX's name stack (the
    `jax.named_scope`s around it, so the module path of a model from
    [`fx.tag_modules`][effects.tag_modules]), the primitive and the user's
    source line: `"blocks.3/sqrt @ model.py:20"`. Outputs of one location
    with different shapes are told apart by `#1`, `#2`... in program order.
    Every execution of a location (a loop's iterations, a function called
    twice) is an entry of its name, as for a tag. The outputs of higher-order
    primitives (`scan`, `cond`, `while_loop`, `jit`, `checkpoint`, custom
    derivatives) are not tapped, their bodies are; neither is a while loop's
    predicate, nor a value of a key or `float0` type.

    **Arguments:**

    - `fn`: the function to tap (any callable: an Equinox model too).
    - `primitives`: which primitives' outputs to tap, by name (`"log"`,
      `("exp", "dot_general")`); None (the default) for every primitive.
    - `where`: a predicate on a [`TapInfo`][effects.TapInfo] (primitive,
      scope, file and line) that a tap must also pass.
    - `carries`: `True` for a site at the carry of every `lax.scan` and
      `lax.while_loop` body (its new carry, each iteration), or a predicate
      on the loop's `TapInfo` (primitive `"scan carry"` or `"while carry"`,
      the loop's line).
    - `collection`: the collection of the taps.

    **Returns:**

    A callable with `fn`'s signature and results.

    **Raises:**

    - `TypeError`: `primitives` is not a primitive's name or names, `where`
      is not callable, or `collection` is not a string.
    - From [`handle`][effects.handle], naming the tap, what it raises for a
      tag there: `Tag(mode="append")` of a tap in a `lax.while_loop` (use
      `"last"` or a reduction), a tap in a `cond` whose predicate a `vmap`
      inside the function batches (put the handler inside the `vmap`).

    **Example:**

    ```python
    def f(x):
        return jnp.sum(jnp.log(x - 1.0))

    _, found = fx.handle(fx.taps(f, "log"), fx.Tag("taps"))(jnp.arange(3.0))
    ((name, (value,)),) = found["taps"].items()
    print(name.split(" @ ")[0], value)  # (name: "log @ model.py:2" in a file)
    ```

    ```text
    log [ nan -inf   0.]
    ```
    """
    if not isinstance(collection, str):
        raise TypeError(f"fx.taps: `collection` must be a string, got {collection!r}.")
    if where is not None and not callable(where):
        raise TypeError(f"fx.taps: `where` must be a predicate, got {where!r}.")
    return Tapped(fn, _primitive_names(primitives), where, carries, collection)


#
# Inserting the sites
#

# find_nonfinite's equations checked by one site: at most 16, and once they
# hold 4 MiB, no more (see `group`).
_GROUP, _GROUP_BYTES = 16, 4 << 20

# Never tapped: sites already (a tag, a `checkpoint_name`).
_SKIP = frozenset({"effects_site", "name"})
_SITE_PACKAGES = tuple({sysconfig.get_path(p) + os.sep for p in ("purelib", "platlib")})


def _tappable(v) -> bool:
    """Whether taps see the value of variable `v`: not a dropped output, a
    key, a `float0`."""
    dtype = getattr(v.aval, "dtype", None)
    if type(v) is _compat.DropVar or dtype is None or _compat.is_key(v.aval):
        return False
    return dtype != jax.dtypes.float0


def _inexact(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


_NONFINITE = "non-finite constant"


def _operand(v) -> str | None:
    """What `fx.find_nonfinite` says of an operand: None for a value it reads
    at run time; a literal's value; `"…"` for a value it does not read (a key);
    `_NONFINITE` for a non-finite literal."""
    if type(v) is not _compat.Literal:
        return None if _tappable(v) else "…"
    value = np.asarray(v.val)
    if _inexact(v.aval) and not np.all(np.isfinite(value)):
        return _NONFINITE
    if value.size == 1:
        return str(value.reshape(())[()])
    return f"{_describe(v.aval)} constant"


class _Outer(NamedTuple):
    """Where the equations of a sub-jaxpr are: JAX's name stack of the
    equation holding it (an inner equation's own is relative to it), and
    that equation's source line (JAX keeps no frame outside a `jit`'s or a
    branch's own trace in its equations' tracebacks)."""

    stack: Any = None
    file: str | None = None
    line: int | None = None
    library: str | None = None


def _frames(traceback):
    """The first frame of `traceback` outside JAX and effects, and the first
    outside installed packages too (the user's), or None."""
    frames = _compat.call_frames(traceback)
    first = next(frames, None)
    user = first
    if first is not None and first[0].startswith(_SITE_PACKAGES):
        user = next((f for f in frames if not f[0].startswith(_SITE_PACKAGES)), None)
    return first, user


def _nested_paths(scope: str) -> str:
    """A scope with a module path's scope inside its parent's read as the
    path alone: `blocks.3/blocks.3.lin` is `blocks.3.lin`
    ([`fx.tag_modules`][effects.tag_modules] enters each module's full path)."""
    return re.sub(r"(?<![\w.])([\w.]+)/(?=\1\.)", "", scope)


def _describe(aval) -> str:
    return f"{aval.dtype.name}[{','.join(map(str, aval.shape))}]"


class _Inserter:
    """One insertion pass over a traced program: names are given in program
    order, so the same program gets the same names."""

    def __init__(self, tapped: Tapped):
        # (the selection, read at every equation: plain attributes, cheaper to
        # read than a module's)
        self.primitives, self.where = tapped.primitives, tapped.where
        self.carries, self.collection = tapped.carries, tapped.collection
        self.with_inputs = tapped.with_inputs
        self.shapes: dict[str, dict] = {}  # base name -> shape -> its number
        self.done: dict[Any, Any] = {}  # key -> (jaxpr, tapped jaxpr)
        self.outer = _Outer()
        # find_nonfinite's: the equations of this jaxpr tapped since its last
        # site, `(info, name, inputs, outputs, equation)`, which one site
        # checks (`group`)
        self.members: list[tuple[TapInfo, str, list[Any], list[Any], Any]] = []
        # (what `info` reads of a traceback, of a scope and of a type, which
        # many equations share: read once a pass)
        self.frames = _Memo(_frames)
        self.paths = _Memo(_nested_paths)
        self.shapes_of = _Memo(_describe)

    def location(self, eqn, outer: _Outer) -> tuple:
        """`eqn`'s `(file, line, library, span)`, as `TapInfo` says them."""
        first, user = self.frames[eqn.source_info.traceback]
        if first is None:  # (no frame of its own: the outer equation's)
            return outer.file, outer.line, outer.library, None
        library = None if first is user else f"{os.path.basename(first[0])}:{first[1]}"
        if user is not None:
            return *user[:2], library, user[1:]
        if outer.file is not None:
            return outer.file, outer.line, library, None
        # (only an installed package's frames: the first of them)
        return *first[:2], None, first[1:]

    def info(self, eqn, primitive: str, outvars, outer, operands=(), producers=()):
        file, line, library, span = self.location(eqn, outer)
        scope = self.paths[str(_compat.name_stack(eqn, outer.stack))]
        shape = ",".join(self.shapes_of[v.aval] for v in outvars)
        return TapInfo(
            primitive, scope, file, line, library, shape, operands, producers, span
        )

    def name(self, info: TapInfo, inputs) -> str:
        # (find_nonfinite's, whose value holds the inputs: by their types too)
        shape = info.shape if not inputs else (info.shape, *(v.aval for v in inputs))
        base = info.base_name()
        seen = self.shapes.setdefault(base, {})
        k = seen.setdefault(shape, len(seen))
        return base if k == 0 else f"{base} #{k}"

    def jaxpr(self, jaxpr, carries: int = 0, loop=None):
        """`jaxpr` with its taps, and a site at its first `carries` outputs (a
        loop body's new carry) made by `loop`: the loop equation and the
        `_Outer` around it."""
        key = (id(jaxpr), carries, str(self.outer.stack), self.outer[1:])
        hit = self.done.get(key)
        if hit is not None and hit[0] is jaxpr:
            return hit[1]
        eqns: list[Any] = []
        made: dict[Any, str] = {}  # variable -> the primitive that made it
        # (the outputs of a `jit` inlined here: what its body gave them)
        given: dict[Any, Any] = {}
        outside, self.members = self.members, []
        for eqn in jaxpr.eqns:
            if given:
                eqn = eqn.replace(invars=_substituted(eqn.invars, given))
            eqns += self.equation(eqn, given, made)
            made.update((v, _compat.primitive_name(eqn)) for v in eqn.outvars)
        eqns += self.group()
        self.members = outside
        outvars = _substituted(jaxpr.outvars, given)
        site = self.carry_site(loop, outvars[:carries]) if carries else None
        if site is not None:
            eqns.append(site)
            # (the carry outputs the site reads: its outputs instead)
            swap = dict(zip(site.invars, site.outvars))
            outvars[:carries] = _substituted(outvars[:carries], swap)
        new_jaxpr = jaxpr
        if len(eqns) != len(jaxpr.eqns) or any(map(operator.is_not, eqns, jaxpr.eqns)):
            effects = jaxpr.effects | {site_effect}
            new_jaxpr = jaxpr.replace(eqns=eqns, outvars=outvars, effects=effects)
        self.done[key] = (jaxpr, new_jaxpr)
        return new_jaxpr

    def equation(self, eqn, given: dict, made: dict) -> list[Any]:
        """The equations in the place of `eqn`: it and its tap, or it with its
        body's taps."""
        # The bodies of the higher-order primitives the rewriter knows are
        # tapped; another's jaxprs (a scatter's combiner, a reduction's) are
        # its own: its outputs are tapped as any primitive's.
        if eqn.primitive in rules and _jaxpr.sub_jaxprs(eqn):
            before = self.group()  # (its body's taps execute after these)
            tapped = self.higher_order(eqn)
            if tapped is not eqn and _compat.plain_jit(eqn):
                return before + self.inlined(eqn, tapped, given, made)
            return [*before, tapped]
        prim = eqn.primitive.name
        if prim in _SKIP or _compat.checkpoint_name_of(eqn) is not None:
            return [eqn]
        if self.primitives is not None and prim not in self.primitives:
            return [eqn]
        outs = eqn.outvars
        if not outs or not all(map(_tappable, outs)):
            return [eqn]
        inputs, operands, producers = [], (), ()
        if self.with_inputs:
            if not any(_inexact(v.aval) for v in outs):
                return [eqn]
            operands = tuple(map(_operand, eqn.invars))
            if _NONFINITE in operands:
                return [eqn]  # (from a non-finite constant: never a finding)
            inputs = [v for v, o in zip(eqn.invars, operands) if o is None]
            producers = tuple(
                None if type(v) is _compat.Literal else made.get(v) for v in eqn.invars
            )
        primitive = _compat.primitive_name(eqn)
        info = self.info(eqn, primitive, outs, self.outer, operands, producers)
        if self.where is not None and not self.where(info):
            return [eqn]
        fresh = [_compat.Var(v.aval) for v in outs]
        if not self.with_inputs:
            return [eqn.replace(outvars=fresh), self.site(eqn, info, fresh, outs)]
        # find_nonfinite's: the outputs kept whole in memory, as the values
        # the program reads from here on. XLA then fuses no chain of
        # operations across them, which it would copy into the check of each
        # value of the chain (see `_nonfinite._RUN_ONCE`), and each operation
        # rounds on its own, as when JAX runs the function one at a time.
        # The site that checks them comes after this and the next equations
        # (`group`).
        barrier = _after(eqn, fresh, outs, jax.lax.optimization_barrier_p, {}, set())
        self.members.append((info, self.name(info, inputs), inputs, outs, eqn))
        due = self.group() if self.full() else []
        return [eqn.replace(outvars=fresh), barrier, *due]

    def full(self) -> bool:
        """Whether the site of `members` is due."""
        if len(self.members) >= _GROUP:
            return True
        values = [v.aval for m in self.members for v in (*m[2], *m[3])]
        return sum(a.size * a.dtype.itemsize for a in values) >= _GROUP_BYTES

    def group(self) -> list[Any]:
        """find_nonfinite's site of the equations tapped since the last one in
        this jaxpr (`members`, up to `_GROUP` of them, in program order: the
        first that went bad is the first of its group), none where there are
        none. Its value is each one's `(inputs, outputs)`, its `tap` their
        `TapInfo`s, its name theirs, one a line; its outputs are read by
        nothing: the program goes on with the values it checks. (One site of
        a few equations, not one each: its check is a conditional that
        compiles in about 2 ms on CPU, whatever it holds; where it finds
        something, it hands every value it holds to the host, so a few MiB at
        most.)"""
        members, self.members = self.members, []
        if not members:
            return []
        infos, names, inputs, outputs, eqns = zip(*members)
        value = tuple((tuple(i), tuple(o)) for i, o in zip(inputs, outputs))
        ins, treedef = jax.tree.flatten(value)
        return [self.site_eqn(eqns[-1], "\n".join(names), ins, treedef, infos)]

    def site(self, eqn, info: TapInfo, ins, outs=None):
        """A tap's site equation reading `ins`, its value one array or a
        tuple of several."""
        treedef = LEAF if len(ins) == 1 else jax.tree.structure(tuple(ins))
        return self.site_eqn(eqn, self.name(info, ()), ins, treedef, info, outs)

    def site_eqn(self, eqn, name: str, ins, treedef, tap, outs=None):
        """The site `name` of the value `treedef` of `ins`, after `eqn`; its
        outputs `outs`, or new variables."""
        if outs is None:
            outs = [_compat.Var(v.aval) for v in ins]
        params = dict(
            name=name,
            collection=self.collection,
            kind="tag",
            treedef=treedef,
            batch=((),) * len(ins),
            tap=tap,
            effect=True,
            # An execution of its own, wherever it is: a tap in the backward
            # pass's recomputation of a `jax.checkpoint` region (taps of a
            # gradient) taps what runs there, and tells the rewriter the
            # region is not a copy of the forward pass's (see
            # `_walk.recomputes`), as a forward site does.
            forward=True,
        )
        return _after(eqn, ins, outs, site_p, params, {site_effect})

    def carry_site(self, loop, carry):
        """The site at a loop body's new carry `carry`, where one is asked
        for; else None. `loop`: the loop equation and the `_Outer` around it."""
        loop, outer = loop
        kept = [v for v in carry if type(v) is not _compat.Literal]
        if not self.carries or not kept or not all(map(_tappable, kept)):
            return None
        info = self.info(loop, f"{_compat.primitive_name(loop)} carry", kept, outer)
        if callable(self.carries) and not self.carries(info):
            return None
        return self.site(loop, info, kept)

    def inlined(self, eqn, tapped, given: dict, made: dict) -> list[Any]:
        """The equations of the body of `tapped`, a `jit` call `eqn`
        (`_compat.plain_jit`) with its taps, in its place. So that every tap
        of a program made of operations and `jit`s (JAX's own `jnp.where`,
        `jnp.tril`, ... in a gradient) sits at its top level, where the
        rewrite splices what the handlers do beside it instead of tracing
        the program again (`_rewrite._spliced`). `given` learns what the
        call's outputs are; `made`, who made them."""
        body = tapped.params["jaxpr"].jaxpr
        env = dict(zip(body.invars, eqn.invars))
        stack = eqn.source_info.name_stack
        eqns = []
        for inner in body.eqns:
            invars = _substituted(inner.invars, env)
            outvars = [
                v if type(v) is _compat.DropVar else _compat.Var(v.aval)
                for v in inner.outvars
            ]
            env.update(zip(inner.outvars, outvars))
            if inner.primitive is jax.lax.optimization_barrier_p:
                # (find_nonfinite's, after the equation it keeps: whose)
                made.update((v, made.get(x)) for v, x in zip(outvars, invars))
            else:
                made.update((v, _compat.primitive_name(inner)) for v in outvars)
            name_stack = _compat.name_stack(inner, stack)  # (the call's, then its)
            source_info = inner.source_info.replace(name_stack=name_stack)
            eqns.append(
                inner.replace(invars=invars, outvars=outvars, source_info=source_info)
            )
        given.update(zip(eqn.outvars, _substituted(body.outvars, env)))
        return eqns

    def higher_order(self, eqn):
        """`eqn` with the jaxprs in its params tapped, a loop body's carry
        too; `eqn` itself where they hold no tap."""
        params, body, carries, predicate = eqn.params, None, 0, None
        if eqn.primitive is _compat.scan_p:
            body, carries = params["jaxpr"].jaxpr, _compat.scan_counts(params)[1]
        elif eqn.primitive is _compat.while_p:
            body, predicate = params["body_jaxpr"].jaxpr, params["cond_jaxpr"].jaxpr
            carries = len(body.outvars)

        def one(jaxpr):
            if jaxpr is predicate:  # (a while loop's predicate: not tapped)
                return jaxpr
            return self.jaxpr(jaxpr, carries if jaxpr is body else 0, (eqn, outer))

        outer = self.outer
        stack = _compat.name_stack(eqn, outer.stack)
        self.outer = _Outer(stack, *self.location(eqn, outer)[:3])
        params = _jaxpr.map_jaxprs_in_params(params, one)
        self.outer = outer
        if params is eqn.params:
            return eqn
        return eqn.replace(params=params, effects=eqn.effects | {site_effect})


class _Memo(dict):
    """A dict that makes a missing value from its key, once."""

    def __init__(self, make: Callable):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        value = self[key] = self.make(key)
        return value


def _after(eqn, invars, outvars, primitive, params, effects):
    """A new equation at `eqn`'s place in the user's source and in JAX's context."""
    return _compat.new_eqn(
        invars, outvars, primitive, params, effects, eqn.source_info, eqn.ctx
    )


def _substituted(atoms, given: dict) -> list[Any]:
    """`atoms` with each variable in `given` replaced by what it maps to."""
    return [given.get(v, v) if type(v) is _compat.Var else v for v in atoms]
