"""`find_nonfinite`: the first tag, or with no tags the first primitive, that
made a NaN or an Inf, forward or backward, found in one compiled program with
a `checkify` check at every site."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import linecache
import math
import os
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# `eager_cached`: `find_nonfinite` caches its compiled check as `handle` caches
# its jitted calls, on the function itself (an Equinox module's per
# structure), dying with it. Public API cannot: a cache of our own keyed by the
# function would keep it alive, as `eqx.filter_jit` does.
from . import _compat
from ._handle import eager_cached, handle
from ._handlers import Handler, Reduce, Tag
from ._jaxpr import holds
from ._layout import one_cond
from ._primitives import handling
from ._sites import traced_sites
from ._stats import _numpy
from ._taps import Tapped


@dataclasses.dataclass(frozen=True)
class BadSite:
    """What [`fx.find_nonfinite`][effects.find_nonfinite] returns: the first
    tag whose value (or, with `backward=True`, whose cotangent) held a NaN or
    an Inf, or the first operation that made one; and which execution.

    `str()` says it in a sentence.

    **Attributes:**

    - `name`, `collection`: the tag's; for an operation found with no tag,
      its tap's name (see [`fx.taps`][effects.taps]) and None.
    - `call`: the index of that execution among the name's executions,
      counting a scan's iterations as one call when the site sits in scans
      alone (then `iteration` says which); else counting every execution.
    - `iteration`: the scan iteration (a tuple for nested scans, outermost
      first), or None: its position, as `Tag()` stacks the values (in a scan
      with `reverse=True`, not how many ran before it).
    - `backward`: whether it is in the gradient: a cotangent that went bad, or
      an operation of the gradient's own; False for a value of the forward
      pass, also from `find_nonfinite(..., backward=True)` when the forward
      pass is already non-finite.
    - `backward_search`: whether `find_nonfinite` was called with
      `backward=True` (not compared: only `str()` differs).
    - `primitive`, `file`, `line`, `scope`: for an operation, its JAX
      primitive (`"log"`), the user's source line, and the
      `jax.named_scope`s around it (the module path under
      [`fx.tag_modules`][effects.tag_modules]); `location` reads
      `"model.py:20"`. `library` (not compared): the line of the installed
      package that made it, if not the user's.
    - `forward`: for an operation of the gradient, the primitives of the
      forward pass that it differentiates: those of the expression it was
      made for (`("sqrt",)`). Empty where that expression holds none of its
      own: a call of a `custom_vjp` or `custom_jvp` function, whose rule made
      the operation; `expression` (not compared) is then its source text
      (`"f(y)"`), where it can be read.
    - `shard`: in a `shard_map`, the shard that made it (per `shard_map`
      around it, outermost first; the index of the shard over its manual mesh
      axes); `example`: under a `jax.vmap` inside that `shard_map`'s body,
      the example. For a tag, of its value (not of a cotangent).
    - `index`: the first bad element of the operation's output (under a
      `jax.vmap` inside `fn`, its batch index among them).
    - `inputs` (not compared): that element and the operands it came from,
      as `"log(-3.0) = nan"`.
    - `operation` (not compared): for a tag, the first operation that made a
      NaN or an Inf, as found with no tag.
    - `output_finite` (not compared): for an operation of the forward pass
      found with `backward=True`, whether the function's output is finite
      all the same: the value was dropped on the way (a `jnp.where`), and
      only the gradient, which still differentiates the operation, went bad.
    - `note` (not compared): where no operation made a NaN or an Inf but the
      output or the gradient is non-finite, what made it so (`primitive` is
      then None).

    **Example:**

    ```python
    bad = fx.find_nonfinite(lambda x: fx.tag(jnp.log(x), "h"), jnp.float32(-1.0))
    print(bad.name, bad.call, bad.iteration, bad.operation.primitive)
    ```

    ```text
    h 0 None log
    ```
    """

    name: str
    collection: str | None
    call: int
    iteration: int | tuple[int, ...] | None
    backward: bool = False
    backward_search: bool = dataclasses.field(default=False, compare=False)
    primitive: str | None = None
    scope: str | None = None
    file: str | None = None
    line: int | None = None
    library: str | None = dataclasses.field(default=None, compare=False)
    shard: tuple[int, ...] | None = None
    example: tuple[int, ...] | None = None
    forward: tuple[str, ...] = ()
    expression: str | None = dataclasses.field(default=None, compare=False)
    index: tuple[int, ...] | None = None
    inputs: str | None = dataclasses.field(default=None, compare=False)
    note: str | None = dataclasses.field(default=None, compare=False)
    output_finite: bool = dataclasses.field(default=False, compare=False)
    operation: BadSite | None = dataclasses.field(default=None, compare=False)

    @property
    def location(self) -> str:
        """`"model.py:20"`: the user's source line of a primitive found; `""`
        where none is known."""
        if self.file is None:
            return ""
        return f"{os.path.basename(self.file)}:{self.line}"

    def __str__(self) -> str:
        if self.note is not None:
            return self.note
        if self.primitive is not None:
            return self._primitive_said()
        where = self._where()
        what = (
            "the first, in the backward pass, whose cotangent holds"
            if self.backward
            else "the first value with"
        )
        said = (
            f"The tag {self.name!r} (collection {self.collection!r}) is {what} a "
            f"NaN or an Inf, at its {where}."
        )
        if self.backward_search and not self.backward:
            said += (
                " The forward pass is already non-finite, so the backward search "
                "does not apply: it reports gradients that go bad while every "
                "tagged value is finite."
            )
        if self.operation is not None:
            said += f"\n{self.operation}"
        return said

    def _where(self) -> str:
        """`"call 0, scan iteration 2, shard 3"`."""
        where = f"call {self.call}"
        if self.iteration is not None:
            where += f", scan iteration {self.iteration}"
        for what, index in (("shard", self.shard), ("example", self.example)):
            if index is not None:
                where += f", {what} {index[0] if len(index) == 1 else index}"
        return where

    def _primitive_said(self) -> str:
        at = f" at {self.location}" if self.file is not None else ""
        scope = f" in {self.scope}" if self.scope else ""
        said = f"`{self.primitive}`{at}{scope}"
        if self.backward:
            of = " and ".join(f"`{p}`" for p in self.forward)
            if not of:
                of = f"`{self.expression}`" if self.expression else "the operations"
            there = " there" if at else ""
            said = f"In the gradient, {said}, part of the derivative of {of}{there},"
        said += (
            " is the first operation to make a NaN or an Inf its inputs did not "
            f"hold ({self._where()})"
        )
        if self.inputs is not None:
            said += f": {self.inputs}"
        said += "."
        if self.library is not None:
            said += f" (Called from {self.library}.)"
        if self.backward_search and not self.backward:
            said += _DROPPED if self.output_finite else _FORWARD_CAUSE
        return said


# What `str()` of a forward operation that `backward=True` found adds.
_DROPPED = (
    " The function's output is finite all the same: the value was dropped on "
    "the way (by a `jnp.where`, say), but the gradient still takes the "
    "derivative of this operation there, whose NaN or Inf, times a zero, makes "
    "the gradient's. Give the operation inputs it is finite at wherever its "
    "result is dropped (`jnp.sqrt(jnp.where(x > 0, x, 1.0))`, not "
    "`jnp.where(x > 0, jnp.sqrt(x), 0.0)`)."
)
_FORWARD_CAUSE = " The forward pass is already non-finite: that is the cause."


_CODE = "effects-nonfinite-site:"


def _finite(tree) -> jax.Array:
    """Whether every inexact array (or Python float) of `tree` is finite."""
    ok = jnp.array(True)
    for x in jax.tree.leaves(tree):
        if _numeric(x) and _inexact(jnp.asarray(x)):
            ok = ok & jnp.all(jnp.isfinite(x))
    return ok


def _count(acc, x):  # (executions so far, the first non-finite one or -1)
    n, first = acc
    return n + 1, jnp.where((first < 0) & ~_finite(x), n, first)


# Of the whole batch under a vmap, not per example: an execution is one
# whatever the examples, and a name executed under vmaps of different sizes
# (`lax.map` with a `batch_size` that does not divide its length) is counted.
_COUNTER = Reduce(_count, lambda _: (jnp.int32(0), jnp.int32(-1)), per_example=False)
_EXECUTIONS = Reduce(lambda n, _: n + 1, lambda _: jnp.int32(0), per_example=False)


class NonfiniteCheck(Handler):
    """At every tag in `keys`: a `checkify` check that its value is finite, the
    first failing check in execution order being the one reported, with the
    tag's index in `keys` as its code; with `backward`, an identity whose
    backward pass checks the cotangent instead, with the execution's index
    among its name's (counted here) in the message, at the tags in `keys` but
    those in `skip`."""

    keys: tuple = dataclasses.field(metadata={"static": True})  # (collection, name)s
    backward: bool = dataclasses.field(default=False, metadata={"static": True})
    # With `backward`: a zero added to every tag, that differentiating with
    # respect to it computes the cotangent of every one.
    zero: Any = None
    skip: tuple = dataclasses.field(default=(), metadata={"static": True})
    # Whether a cotangent's check says which execution it is.
    numbered: bool = dataclasses.field(default=False, metadata={"static": True})

    def matches(self, site):
        key = (site.collection, site.name)
        return site.kind == "tag" and key in self.keys and key not in self.skip

    @property
    def mode(self):  # pyright: ignore[reportIncompatibleVariableOverride]
        return _EXECUTIONS if self.backward else None

    def apply(self, site, value, ctx):
        from jax.experimental import checkify

        code = self.keys.index((site.collection, site.name))
        if not self.backward:
            checkify.check(_finite(value), f"{_CODE}{code}")
            return value
        count = ctx.emit(jnp.int32(0))
        assert count is not None  # (the mode is a reduction)
        said = (code, self.numbered)

        def checked(x):
            if not _inexact(x):
                return x
            return _cotangent_check(x + self.zero.astype(x.dtype), said, count - 1)

        return jax.tree.map(checked, value)


class _PlusZero(NonfiniteCheck):
    """Adds `zero` to the value of every tag in `keys` but those in `skip`:
    differentiating with respect to it computes the cotangent of every one
    (`NonfiniteCheck`'s backward pass, without its checks)."""

    def apply(self, site, value, ctx):
        def plus(x):
            return x + self.zero.astype(x.dtype) if _inexact(x) else x

        return jax.tree.map(plus, value)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _cotangent_check(x, said: tuple[int, bool], n):
    del said, n
    return x


def _cotangent_check_fwd(x, said: tuple[int, bool], n):
    del said
    return x, n


def _cotangent_check_bwd(said: tuple[int, bool], n, ct):
    from jax.experimental import checkify

    code, numbered = said
    if numbered:
        checkify.check(_finite(ct), f"{_CODE}{code}:{{}}", n)
    else:
        checkify.check(_finite(ct), f"{_CODE}{code}:")
    return ct, None


_cotangent_check.defvjp(_cotangent_check_fwd, _cotangent_check_bwd)


def find_nonfinite(
    fn: Callable, *args, backward: bool = False, **kwargs
) -> BadSite | None:
    """Finds where the first NaN or Inf comes from: runs `fn(*args,
    **kwargs)` compiled, with a check at every tag and after every operation,
    and names the first tag whose value went bad and the first operation that
    made a NaN or an Inf: its primitive, source line, scope (module path),
    scan iteration and operands, as in "`log` at model.py:14 in blocks.3 ...:
    log(-3.0) = nan". Nothing needs a tag: with none, or none non-finite, the
    operation is the answer.

    An operation counts when it makes a NaN from inputs holding none, or an
    Inf from finite inputs, element by element where it reads its inputs so
    (an elementwise operation, its broadcast operands; a matmul's or a
    reduction's inputs count whole): constants are inputs, so `x * jnp.inf`
    is not a finding and `jnp.inf - jnp.inf` is. What it names is where the
    values first went bad, not where a NaN passed through. The first in execution
    order is returned, so never a tag that is non-finite only because an
    earlier one was. Works through `jit`, `scan`, `cond`, `while_loop`,
    `checkpoint`, custom derivatives (their functions are searched), `vmap`
    and `shard_map`s (in a program holding one, where several tags, or
    operations, went bad, the first in program order, and in the backward
    pass the last: JAX's `checkify`, which orders them elsewhere, fails on
    checks in two `shard_map`s, or in a loop or a branch around or inside
    one; without a loop, program order is the order they run in). The
    programs are compiled once per argument signature; each operation rounds
    on its own, as when JAX runs the function one operation at a time. Every
    tag counts,
    whatever its collection, `jax.ad_checkpoint.checkpoint_name`s included
    (perturb sites do not); integer values are never non-finite. Arguments
    are treated as `eqx.filter_jit` treats them (arrays traced, other leaves
    static); Flax NNX objects are run on their state, which is left as it
    was.

    With `backward=True` (`fn` returns a scalar), it runs the gradient too
    (with respect to every inexact array among the arguments) when the
    forward pass is finite, and names the first tag whose cotangent went bad,
    in the order the backward pass computes them (the site nearest the
    output), and the first operation of the gradient that made a NaN or an
    Inf, with the forward operation it differentiates: "In the gradient,
    `div` at model.py:14, part of the derivative of `sqrt` there...:
    div(0.5, 0.0) = inf". When the forward pass already holds a non-finite
    value, that value is the cause: it returns what `backward=False` returns
    (`backward` False on it), and `str()` says so. A tag inside a function
    with a custom derivative (`custom_jvp`, `custom_vjp`) has no cotangent of
    its own: the backward check of tags passes over it (the operations of
    the custom rule are searched).

    It returns None when every tag is finite, and the output (and gradient)
    too: then the operations are not searched (one compiled run of the
    function, and of its gradient, says so), so a NaN the function masks
    away, as `jnp.where(x > 0, jnp.log(x), 0.0)` does, is not reported, unless
    `backward=True` and it spoils the gradient. Where the output or gradient
    is non-finite but no operation made a NaN or an Inf (the arguments hold
    one, or a constant of the program does), the [`BadSite`][effects.BadSite]
    has a `note` that says so.

    **Arguments:**

    - `fn`: the function to run.
    - `*args`, `**kwargs`: its arguments.
    - `backward`: whether to search the gradient too, after the values.

    **Returns:**

    A [`BadSite`][effects.BadSite], or None when everything is finite.

    **Raises:**

    - `ValueError`: with `backward=True`, `fn` does not return a scalar
      array, or a name is tagged both inside and outside a function with a
      custom derivative; a `jax.vmap` inside `fn` batches the predicate of a
      `lax.cond` or `lax.while_loop` (every example would run every branch or
      iteration: check one example at a time). From
      [`handle`][effects.handle], which places the checks: a tag inside a
      `custom_linear_solve`.

    **Example:**

    ```python
    def f(x):
        h = fx.tag(jnp.log(x), "h")  # log(-1) is NaN
        y = fx.tag(2 * h, "y")  # NaN only because h is
        return jnp.sum(y)

    print(fx.find_nonfinite(f, jnp.array([1.0, -1.0])))
    ```

    ```text
    The tag 'h' (collection 'intermediates') is the first value with a NaN or
    an Inf, at its call 0.
    `log` is the first operation to make a NaN or an Inf its inputs did not
    hold (call 0): log(-1.0)[1] = nan.
    ```

    With no tag, the operation (its line is the caller's, where the function
    is written in a file):

    ```python
    loss = lambda x: jnp.sum(jnp.sqrt(x - x))  # noqa: E731
    bad = fx.find_nonfinite(loss, jnp.ones(2), backward=True)
    print(bad.primitive, bad.forward, bad.inputs)
    ```

    ```text
    div ('sqrt',) div(0.5, 0.0)[0] = inf
    ```

    With `backward=True`, the site nearest the output whose cotangent goes
    bad (`sqrt`'s derivative at 0 is not finite); with a non-finite value
    already, that value's site, as the forward pass is the cause:

    ```python
    def g(x):
        h = fx.tag(x * 0, "h")
        return jnp.sum(fx.tag(jnp.sqrt(h), "s"))

    print(fx.find_nonfinite(g, jnp.ones(2), backward=True).name)
    bad = fx.find_nonfinite(f, jnp.array([1.0, -1.0]), backward=True)
    print(bad.name, bad.backward)
    ```

    ```text
    h
    h False
    ```
    """
    listed, keys, message, found = _first_failure(fn, args, kwargs, backward, None)
    if message is None:
        # (no tag is non-finite: the operations are searched where the output
        # or the gradient shows something to explain)
        return _operation(fn, args, kwargs, backward)
    code, *n = _code(message)
    collection, name = keys[int(code)]
    # A cotangent's check says it is one (`code:`); checked again at that name
    # alone, which execution (`code:n`). (Numbering every name's in one check
    # costs JAX time quadratic in the number of tags.) A value's, forward,
    # says neither: its first bad execution is the one the counter saw.
    cotangent = bool(n)
    if n == [""]:
        message = _first_failure(fn, args, kwargs, backward, (collection, name))[2]
        assert message is not None  # (the same check fails)
        n = _code(message)[1:]
    if cotangent:
        k, at = int(n[0]), ()
    else:
        assert found is not None  # (a check ran)
        k, at = _first_execution(_numpy(found[collection][name][1]))
    bad = _bad_site(listed[collection][name], collection, name, k, cotangent, at)
    # and the operation that made it, as with no tag
    operation = _tap_search(fn, args, kwargs, backward)
    return dataclasses.replace(bad, backward_search=backward, operation=operation)


def _code(message: str) -> list[str]:
    """A failed check's code, split at `:`: the index of its tag (or tap)
    among those checked, then for a cotangent's the execution, where the
    check says it (see `_cotangent_check_bwd`)."""
    return message.split(_CODE)[1].split()[0].split(":")


def _first_failure(fn, args, kwargs, backward: bool, numbered):
    """`(listed, keys, message, found)` of `_nonfinite_check` run on `fn`:
    `message` the first failing check's, or None. Checked again with the
    function's own `checkify.check`s dropped where one of those failed first
    (checkify reports one failed check). Cached per function, argument
    signature, `backward` and `numbered`: checking every batch of a data loader
    compiles once."""
    for own_checks in (False, True):
        make = functools.partial(_nonfinite_check, backward, own_checks, numbered)
        what = ("find_nonfinite", backward, own_checks, numbered)
        with _every_example_refused():
            (listed, keys, check), dynamic = eager_cached(what, fn, args, kwargs, make)
            if check is None:
                return listed, keys, None, None
            messages, found = check(dynamic)
        message = next(filter(None, messages), None)
        if message is None or _CODE in message:
            return listed, keys, message, found
    raise AssertionError("unreachable")


def _first_counted(keys, found, cotangents) -> str | None:
    """The message of the first failing check, as the counters alone tell it
    where the program holds a `shard_map`, which JAX's checkify fails on (see
    `_sites_and_mesh`): the first tag in program order is taken for the first
    (as for the operations: see `_tap_search`); in the backward pass, the
    last one whose cotangent is not finite, at its last such execution (the
    backward pass runs them last first)."""
    for code, (collection, name) in enumerate(keys):
        if (_numpy(found[collection][name][1]) >= 0).any():
            return f"{_CODE}{code}"
    for code, (collection, name) in reversed(list(enumerate(keys))):
        counted = cotangents.get(f"{collection}:cotangent", {}).get(name)
        if counted is None:  # (not checked: in a custom rule's function)
            continue
        n, first = map(_numpy, counted)
        if (first >= 0).any():
            # (counted in the backward pass's order, last execution first)
            k = int(n.max()) - 1 - int(first[first >= 0].min())
            return f"{_CODE}{code}:{k}"
    return None


# What `handle` says of a predicate a vmap inside the function batches (a
# branch's, and a while loop's, where the checks count executions).
_EVERY_EXAMPLE = ("predicate a `jax.vmap` inside", "whose predicate a jax.vmap inside")
_PER_EXAMPLE = (
    "find_nonfinite: a `jax.vmap` inside the function batches the predicate of "
    "a `lax.cond` or `lax.while_loop`, and runs every branch (or iteration) "
    "for every example, so what would be checked is not what each example "
    'computes ("{}"). Check one example at a time: `fx.find_nonfinite(g, x)` '
    "for each `x` the vmapped function `g` maps over."
)


@contextlib.contextmanager
def _every_example_refused():
    """`handle`'s refusal of a predicate that a vmap inside the function
    batches, said as `find_nonfinite`'s."""
    try:
        yield
    except ValueError as e:
        # (a vmap inside ran every branch, or iteration, for every example)
        if not any(m in str(e) for m in _EVERY_EXAMPLE):
            raise
        said = str(e).removeprefix(f"{NonfiniteCheck.__name__}: ").split(". ")[0]
        raise ValueError(_PER_EXAMPLE.format(said)) from e


def _sites_and_mesh(call, dynamic) -> tuple[dict, bool]:
    """The sites of `call(dynamic)`, and whether it holds a `shard_map`, where
    JAX's checkify fails in general: on checks in two shard_maps, in a loop
    around a shard_map or inside one, and in a cond or a loop around one
    with none (tests/test_jax_facts.py::
    test_checkify_fails_on_checks_in_shard_maps). (Without a loop, the
    program order of the sites is the order they run in, which the counters
    tell.)"""
    found, jaxpr = traced_sites(call, dynamic)
    return found, holds(jaxpr, "shard_map")


def _nonfinite_check(backward: bool, drop_own_checks: bool, numbered, call, dynamic):
    """`(listed, keys, check)` for `find_nonfinite`: the sites of
    `call(dynamic)`, the checked `(collection, name)`s (a message's code is an
    index into them), and `check(dynamic) -> (messages, found)`: the first
    failing check's message in each pass, with `backward` the backward
    pass's after the forward pass's (at the name `numbered` alone, where
    given, saying which execution), and `found` the counters' (each name's
    first non-finite execution); with `drop_own_checks`, the function's own
    `checkify.check`s dropped."""
    # Imported here: on jax 0.7-0.9 importing it registers checkify's rules in
    # JAX's tables, which `import effects` alone must not do.
    from jax.experimental import checkify

    if drop_own_checks:
        call = _without_checks(call)

    # (the tags: a perturbation's value is its input's, checked there)
    every, sharded = _sites_and_mesh(call, dynamic)
    listed = {
        c: tags
        for c, names in every.items()
        if (tags := {n: s for n, s in names.items() if s[0].kind == "tag"})
    }
    keys = tuple((c, n) for c, names in listed.items() for n in names)
    if not keys:  # (then the primitives are checked: see `_tap_search`)
        return listed, keys, None
    # Backward, not a tag inside a function with a custom derivative: it has no
    # cotangent of its own (the custom rule differentiates the function whole);
    # and where one name is numbered, that one alone.
    if numbered is None:
        skip = tuple(
            (c, n) for c, n in keys if all("custom" in i.loops for i in listed[c][n])
        )
    else:
        skip = tuple(key for key in keys if key != numbered)
    counters = [Tag(c, mode=_COUNTER) for c in listed]

    def gradient(plus_zero):
        # (with respect to the zero `plus_zero(zero)` adds to every tag, at 0:
        # the cotangent of every one)
        def output(zero, dynamic):
            return _scalar(handle(call, plus_zero(zero))(dynamic)[0])

        return functools.partial(jax.grad(output), jnp.float32(0))

    def forward(dynamic):
        return handle(call, NonfiniteCheck(keys), *counters)(dynamic)[1]

    def checks(zero):
        return NonfiniteCheck(keys, True, zero, skip, numbered=numbered is not None)

    # The forward checks run on a pass of their own: under `jax.grad`, JAX's
    # partial evaluation of a `scan` drops the checks of its forward part (they
    # have no output to keep). Each pass is checkified apart, their errors read
    # in order (a non-finite value wins over the cotangents it spoils):
    # checkify fails on a program whose checks sit in more than one
    # `shard_map` (`_sites_and_mesh`), which the two passes of one in the same
    # program are.
    forward_checked = checkify.checkify(forward, errors=checkify.user_checks)
    backward_checked = checkify.checkify(gradient(checks), errors=checkify.user_checks)

    @functools.partial(jax.jit, compiler_options=_RUN_ONCE)
    def checked(dynamic):
        err, found = forward_checked(dynamic)
        errors = (err, backward_checked(dynamic)[0]) if backward else (err,)
        return errors, found

    # The counters alone, where checkify cannot run the checks
    # (`_first_counted`): those of the values, and of the cotangents at every
    # tag that has one.
    @jax.jit
    def counted(dynamic):
        found = handle(call, *counters)(dynamic)[1]
        if not backward:
            return found, {}
        grad = gradient(lambda zero: _PlusZero(keys, zero=zero, skip=skip))
        # (but a custom rule's function's tags, which have no cotangent)
        cotangents = [
            Tag(c, names=own, mode=_COUNTER, of="cotangent")
            for c, names in listed.items()
            if (own := [n for n in names if (c, n) not in skip])
        ]
        return found, handle(grad, *cotangents)(dynamic)[1]

    def check(dynamic):
        if not sharded:
            errors, found = checked(dynamic)
            return [err.get() for err in errors], found
        found, cotangents = counted(dynamic)
        return [_first_counted(keys, found, cotangents)], found

    return listed, keys, check


# The tags' check, compiled without XLA's fusion pass. On CPU it copies a
# chain of cheap operations into every fusion that reads a value of it, and a
# check of every cotangent reads each value of the backward pass's chain: the
# program grows with the square of the number of tags (tests/test_jax_facts.py
# ::test_xla_fusion_copies_a_chain_into_each_of_its_values_a_program_returns).
# With backward=True, 400 tags took 66 s to compile, 10 s without it. Run once
# to find a NaN, the program's unfused run costs less than that. Its
# operations are the function's, each rounded on its own as when JAX runs them
# one by one (fused, a multiply and an add may round once). And without the
# compiler's backend optimizations (LLVM's, on CPU), which the program, run
# once, does not pay back. Neither changes what an operation computes (fast
# math stays off). (The operations' search, whose taps hold each output whole,
# is compiled as any function: see `_tap_check`.)
_RUN_ONCE = {
    "xla_disable_hlo_passes": "fusion",
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}


def _without_checks(call):
    from jax.experimental import checkify  # (see `_nonfinite_check`)

    own = checkify.checkify(call, errors=checkify.user_checks)
    return lambda dynamic: own(dynamic)[1]


def _first_execution(firsts) -> tuple[int, tuple[int, ...]]:
    """`(k, at)`: the first execution `k` a counter saw go bad, of its
    `firsts` (-1 where none did), and the index of its leading axes there."""
    k = int(firsts[firsts >= 0].min())
    at = tuple(int(i) for i in np.argwhere(firsts == k)[0]) if firsts.ndim else ()
    return k, at


def _bad_site(infos, collection, name, k: int, backward: bool, at=()) -> BadSite:
    """The `k`-th execution of a name as a call and a scan iteration: when the
    name's only site has scans (and jits) alone around it, each call executes
    it the product of their lengths times. `at`: the index of the counter's
    leading axes where it went bad, one per `shard_map` around the site (its
    shard), then the batch axes of a vmap inside it (its example)."""
    info = infos[0]
    shards = sum(r.startswith("shard_map") for r in info.where.split(" > "))
    shard, example = at[:shards] or None, at[shards:] or None
    # (a scan with `reverse=True` runs its last position first: positions,
    # as `Tag()` stacks them, its label says so)
    regions = zip(info.where.split(" > "), info.loops)
    scans = [(n, label.endswith(", reverse)")) for label, n in regions if n is not None]
    lengths = [n for n, _ in scans]
    call, iteration = k, None
    if len(infos) == 1 and lengths and all(isinstance(n, int) for n in lengths):
        call, k = divmod(k, math.prod(lengths))
        ran = np.unravel_index(k, lengths)
        index = tuple(int(n - 1 - i if rev else i) for i, (n, rev) in zip(ran, scans))
        iteration = index[0] if len(index) == 1 else index
    return BadSite(
        name, collection, call, iteration, backward, shard=shard, example=example
    )


#
# With no tag: the first primitive that made a NaN or an Inf
#

# The collection of find_nonfinite's taps, whose values are their equations'
# (inputs, outputs). A finding is an equation that made a NaN from inputs
# holding none, or an Inf from finite inputs: `inf - inf` is one (a fully
# masked softmax row), `x * inf` of a finite `x` is not (the Inf was there).
_CHECKED = "effects.nonfinite"


def _finite_by_sums(tree):  # (a bool array, or a NumPy bool)
    """Whether every inexact leaf of `tree` is finite, from sums of `x - x`,
    a NaN where an element is not finite, which every device and the
    all-reduce combining a sharded array's shards keep (their maximum's, the
    all-reduce drops: tests/test_jax_facts.py::
    test_the_max_of_a_sharded_array_drops_a_nan). (Not `x * 0`: XLA folds
    `(y * 2) * 0` to `y * 0`, and the Inf the product made went unseen:
    tests/test_jax_facts.py::
    test_xla_folds_a_product_by_zero_into_the_product_before_it.) Sums of
    arithmetic, which XLA's CPU code vectorizes and compiles fast (of
    comparisons, a third slower to compile at every operation of a model).
    (In `lax`: this runs at every operation of the function, and each
    `jax.numpy` call is a jit call to trace.)"""
    finite = np.bool_(True)
    for x in jax.tree.leaves(tree):
        if not _inexact(x) or x.size == 0:
            continue
        bad = lax.sub(x, x)
        if x.ndim:
            bad = lax.reduce_sum(bad, tuple(range(x.ndim)))
        finite = lax.bitwise_and(finite, lax.eq(bad, bad))
    return finite


def _unchecked(taps):
    """The finding and where of a site's taps (`((inputs, outputs), ...)`, see
    `_taps._Inserter.group`), when their outputs are finite: none. (A
    constant: `one_cond` keeps it only where every output is finite, so the
    compiled program holds no negation of each tap's flag.)"""
    finite = _finite_by_sums([outs for _, outs in taps])
    return _varying((np.bool_(False), _nowhere_of(taps))), finite


def _nowhere_of(taps):
    """`_checked`'s where, of a site none of whose taps made anything: the
    first tap, and zeros of each's types."""
    return np.int32(0), tuple(_nowhere(ins, outs) for ins, outs in taps)


def _nowhere(ins, outs):
    """`_checked`'s where, of a tap that made nothing: zeros of its types."""
    ins = jax.tree.leaves(ins)
    return tuple(
        ()
        if not _inexact(y) or y.size == 0
        else (
            np.int32(0),
            np.zeros((), y.dtype),
            tuple(np.zeros((), x.dtype) for x in ins if _elementwise(x, y)),
        )
        for y in jax.tree.leaves(outs)
    )


def _checked(taps):
    """Whether the equation of one of a site's taps made a NaN or an Inf from
    finite inputs, and where: the first that did, and for it, per output leaf
    (zeros for the others), the index of its first element (flattened) that
    went bad, a NaN made before an Inf, as a key (`_said` reads it), that
    element, and each input's element broadcast to it (for an input of one
    element, that one). An element went bad where it is a NaN though its
    inputs' elements there are no NaN and the inputs that do not broadcast
    to it hold none, or an Inf though all of those are finite. (Literals,
    which the tap leaves out, are finite.) Where a leaf has none, the
    element is 0. Read on the host (`_host_checked`), only where a tap's
    outputs are not finite (`one_cond`): one call in the program, where the
    same in XLA is a reduction of each tap's values, compiled for every tap
    whether it runs or not (the search of a 4-block GPT, 230 taps: compiled
    and run in 4.2 s with XLA's, 2.8 s with the call, 1.8 s without this
    branch at all; the plain function, 0.4 s)."""
    taps = _whole(tuple((jax.tree.leaves(i), jax.tree.leaves(o)) for i, o in taps))
    types = jax.eval_shape(lambda: _nowhere_of(taps))
    found = jax.ShapeDtypeStruct((), np.bool_)
    result = jax.pure_callback(
        _host_checked_of, (found, types), taps, vmap_method="sequential"
    )
    return _varying(result)


def _host_checked_of(taps):
    """`_checked`, of NumPy arrays: the first tap that made something."""
    nowhere = _nowhere_of(taps)
    for first, (ins, outs) in enumerate(taps):
        found, where = _host_checked(ins, outs)
        if found:
            wheres = nowhere[1][:first] + (where,) + nowhere[1][first + 1 :]
            return found, (np.int32(first), wheres)
    return np.bool_(False), nowhere


def _host_checked(ins, outs):
    """A tap's `_checked`, of NumPy arrays."""
    found, where = np.bool_(False), []
    ins = [np.asarray(x) for x in ins]
    for y in map(np.asarray, outs):
        if not _inexact(y) or y.size == 0:
            where.append(())
            continue
        out = y.reshape(-1)
        each = [
            np.broadcast_to(x.reshape(()) if x.size == 1 else x, y.shape).reshape(-1)
            for x in ins
            if _elementwise(x, y)
        ]
        # (a complex input read whole: its magnitude, an infinite part beside
        # a NaN one an Inf)
        whole = [
            np.abs(x) if np.iscomplexobj(x) else x
            for x in ins
            if not _elementwise(x, y) and _inexact(x)
        ]
        nan_in = np.full(out.shape, any(np.isnan(x).any() for x in whole))
        finite_in = np.full(out.shape, all(np.isfinite(x).all() for x in whole))
        for x in filter(_inexact, each):
            nan_in |= np.isnan(x)
            finite_in &= np.isfinite(x)
        made_nan = np.isnan(out) & ~nan_in
        made_inf = ~np.isfinite(out) & finite_in
        # (the key: the index of a made NaN, else the size plus that of a made
        # Inf, else twice the size)
        size = out.size
        none = 2 * size if size < 2**30 else size
        key = none
        if made_nan.any():
            key = int(np.argmax(made_nan))
        elif made_inf.any():
            key = int(np.argmax(made_inf)) + (size if size < 2**30 else 0)
        found = found | (key < none)
        at = key % size
        values = tuple(np.asarray(x[at], x.dtype) for x in each)
        where.append((np.int32(key), np.asarray(out[at], out.dtype), values))
    return found, tuple(where)


def _whole(tree):
    """Under an Explicit-axis mesh, whose types carry shardings that the
    selects and the reduction of `_checked` would have to match at every
    step, each value sharded over a mesh axis gathered whole (only where a
    tap went bad: `_checked` runs where `_unchecked` finds something)."""

    def one(x):
        if _compat.explicit_sharding(jax.typeof(x)) is None:
            return x
        return jax.sharding.reshard(x, jax.sharding.PartitionSpec())

    return jax.tree.map(one, tree)


def _elementwise(x, y) -> bool:
    """Whether an input `x` of an equation is read element by element with
    its output `y`: one element, or broadcast to it axis by axis."""
    one = math.prod(x.shape) == 1
    return one or (
        len(x.shape) == len(y.shape)
        and all(n in (1, m) for n, m in zip(x.shape, y.shape))
    )


def _varying(tree):
    # (in a shard_map, both branches' results vary over its every axis)
    return jax.tree.map(_compat.vary_over_manual_axes, tree)


# Whether a tap's equation made a NaN or an Inf its inputs did not hold, and
# where: its inputs read only where its outputs hold one. (One jit: JAX traces
# it once per type, and a program has thousands of taps of a few types.)
_made_nonfinite = jax.jit(one_cond(_unchecked, _checked))


def _count_findings(acc, x):
    """(executions so far, the first that made a NaN or an Inf or -1, where)."""
    n, first, kept = acc
    bad, where = x
    take = lax.bitwise_and(lax.lt(first, np.int32(0)), bad)
    kept = jax.tree.map(lambda a, b: lax.select(take, b, a), kept, where)
    return lax.add(n, np.int32(1)), lax.select(take, n, first), kept


def _no_findings(zeros):  # (zeros shaped like a site's taps)
    return _varying((np.int32(0), np.int32(-1), _nowhere_of(zeros)))


# Per example: under a vmap inside the function, which example went bad first.
_FINDINGS = Reduce(_count_findings, _no_findings)


class TapFindings(Handler):
    """At every tap of `_CHECKED` in `keys`: whether its equation made a NaN
    or an Inf its inputs did not hold, counted over its executions up to the
    first that did (`_FINDINGS`); with `checked`, a `checkify` check of it
    too, the first failing one in execution order being reported, with the
    tap's index in `keys` as its code."""

    keys: tuple = dataclasses.field(metadata={"static": True})  # (collection, name)s
    checked: bool = dataclasses.field(default=False, metadata={"static": True})

    mode = _FINDINGS

    def matches(self, site):
        return (site.collection, site.name) in self.keys

    def apply(self, site, value, ctx):
        bad, where = _made_nonfinite(value)
        if self.checked:
            from jax.experimental import checkify

            code = self.keys.index((site.collection, site.name))
            checkify.check(~bad, f"{_CODE}{code}")
        ctx.emit((bad, where))
        return value


def _programs(backward: bool, call) -> list[Callable]:
    """The programs whose operations are checked: the function, and with
    `backward` its gradient with respect to every inexact array among its
    arguments (its forward pass again, then the backward pass). The
    function's own `checkify.check`s are dropped, and its tags are the
    identity: its operations are what is checked."""
    call = _untagged(_without_checks(call))
    if not backward:
        return [call]
    return [call, eqx.filter_grad(lambda dynamic: _scalar(call(dynamic)))]


# Primitives whose every output element is one of their inputs' (or a
# parameter-free function of one that keeps it finite): they never make a NaN
# or an Inf from finite inputs, and are not checked.
_MOVES = frozenset(
    """broadcast_in_dim reshape transpose squeeze expand_dims slice dynamic_slice
    dynamic_update_slice concatenate pad select_n rev copy copy_p reduce_max
    reduce_min max min sort neg abs sign floor ceil round clamp real imag conj
    cummax cummin scatter all_gather ppermute all_to_all pbroadcast pvary
    sharding_constraint device_put optimization_barrier split stop_gradient""".split()
)


def _can_make(info) -> bool:
    return info.primitive not in _MOVES


def _function(tapped: Tapped):
    """`tapped` as a function of its own, which `handle` caches its traces on
    (an Equinox module's go in a table of every module's, by structure, which
    would keep the user's function alive; this dies with what made it)."""
    return lambda dynamic: tapped(dynamic)


def _untagged(call):
    """`call` with its tags the identity: the operations are what is checked,
    and a tag bound while `handle` traces (a site with its effect) would cost a
    site each, and under `jax.grad` meet JAX's false leak report (see the
    conftest fixture `jax_leak_check_false_report`)."""

    def untagged(dynamic):
        with handling(False):
            return call(dynamic)

    return untagged


def _scalar(out):
    """`out`, the loss `find_nonfinite(backward=True)` differentiates."""
    if not (isinstance(out, jax.Array) and out.shape == ()):
        got = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), out
        )
        raise ValueError(
            "find_nonfinite(backward=True): the function must return a scalar "
            f"(the loss), got {got}."
        )
    return out


def _operation(fn, args, kwargs, backward: bool) -> BadSite | None:
    """None where the output, and with `backward` the gradient, is finite;
    else the first operation that made a NaN or an Inf (`_tap_search`). One
    compiled run says which (`_Results`), until the function has needed a
    search with these types: from then on, the search's own run, which says
    both."""
    make = functools.partial(_Results, backward)
    what = ("find_nonfinite results", backward)
    results, dynamic = eager_cached(what, fn, args, kwargs, make)
    ran = None
    if results.searched:
        ran = _tap_run(fn, args, kwargs, backward, False)
    if all(results.finite(dynamic) if ran is None else ran.finite):
        return None
    results.searched = True
    return _tap_search(fn, args, kwargs, backward, ran)


class _Results:
    """`finite(dynamic)`, jitted: whether the result of each of `_programs`
    is finite (the output, and with `backward` the gradient); and whether the
    function has needed a search with these types (`_operation`)."""

    def __init__(self, backward: bool, call, dynamic):
        del dynamic
        programs = _programs(backward, call)
        self.finite = jax.jit(lambda dynamic: [_finite(p(dynamic)) for p in programs])
        self.searched = False


def _tap_check(backward: bool, checked: bool, call, dynamic):
    """`(listed, check, ordered)`: per pass, its taps' `SiteInfo`s by name;
    `check(dynamic) -> (errors, counters, finite)` per pass, jitted: with
    `checked`, checkify's errors, whose first is the first finding in
    execution order; else None, and only the counters, a
    smaller program; and whether the pass's result (the output, the
    gradient) is finite; and whether checkify can check the program (it
    holds no `shard_map`: see `_sites_and_mesh`)."""
    from jax.experimental import checkify  # (see `_nonfinite_check`)

    listed, runs, ordered = [], [], True
    for program in _programs(backward, call):
        # (tapped at every primitive with an inexact output)
        tapped = Tapped(program, None, _can_make, False, _CHECKED, with_inputs=True)
        found, sharded = _sites_and_mesh(tapped, dynamic)
        found, ordered = found.get(_CHECKED, {}), ordered and not sharded
        tapped = _function(tapped)
        keys = tuple((_CHECKED, name) for name in found)
        listed.append(found)

        def run(dynamic, tapped=tapped, keys=keys):
            if not keys:  # (nothing inexact to check)
                return tapped(dynamic), {}
            out, found = handle(tapped, TapFindings(keys, checked))(dynamic)
            return out, found.get(_CHECKED, {})

        runs.append(
            checkify.checkify(run, errors=checkify.user_checks) if checked else run
        )

    def check(dynamic):
        errors, counters, finite = [], [], []
        for run in runs:
            err, (out, found) = run(dynamic) if checked else (None, run(dynamic))
            errors.append(err)
            counters.append(found)
            finite.append(_finite(out))
        return errors, counters, finite

    # (compiled as any function, with XLA's fusion, which `_RUN_ONCE` leaves
    # out for the tags' check: each tap holds its equation's outputs whole in
    # memory, an optimization barrier (`_taps`), so no chain of operations is
    # copied into the check of each of its values, and each operation still
    # rounds on its own. On a 4-block GPT, width 256, vocabulary 50257, 230
    # taps: compiled in 5.8 s, run in 1.2x the plain function's time; with
    # `_RUN_ONCE`, 6.7 s and 2.0x.)
    return listed, jax.jit(check), ordered


def _numeric(x) -> bool:
    return eqx.is_array(x) or isinstance(x, (float, complex))


def _tap_search(fn, args, kwargs, backward: bool, ran=None) -> BadSite | None:
    """The first primitive, in execution order, that made a NaN or an Inf
    from finite inputs: in the function, then in its gradient. (`ran`: what
    `_tap_run` gave for these arguments, if it ran.)"""
    # Where one tap alone made a NaN or an Inf from finite inputs (a NaN made
    # once is in the inputs of what follows), it is the first: the counters
    # tell it. Where several did, checkify's errors order them; but in a
    # program holding a shard_map, which checkify fails on (`_sites_and_mesh`),
    # the first in program order.
    ran = ran or _tap_run(fn, args, kwargs, backward, False)
    listed, counters, finite = ran.listed, ran.counters, ran.finite
    bad = [
        [n for n in names if (_numpy(found[n][1]) >= 0).any()]
        for names, found in zip(listed, counters)
    ]
    which = next((i for i, names in enumerate(bad) if names), None)
    if which is None:
        return _unexplained(args, kwargs, [bool(ok) for ok in finite])
    name = bad[which][0]
    if len(bad[which]) > 1 and ran.ordered:
        listed, errors, counters, *_ = _tap_run(fn, args, kwargs, backward, True)
        messages = [err.get() for err in errors]
        which, message = next((i, m) for i, m in enumerate(messages) if m)
        name = list(listed[which])[int(_code(message)[0])]
    _, firsts, where = jax.tree.map(_numpy, counters[which][name])
    k, at = _first_execution(firsts)
    infos = listed[which][name]
    bad = _bad_site(infos, _CHECKED, name, k, which == 1, at)
    # (the site's tap that went bad: see `_taps._Inserter.group`)
    first, where = jax.tree.map(lambda x: x[at], where)
    tap, name = infos[0].tap[int(first)], name.split("\n")[int(first)]
    said, index = _said(tap, infos[0].value[int(first)], where[int(first)])
    forward, expression = (), None
    if which == 1:
        forward = _forward_primitives(listed[0], tap)
        expression = None if forward else _expression(tap)
    return dataclasses.replace(
        bad,
        name=tap.base_name() if name.startswith(tap.base_name()) else name,
        collection=None,
        primitive=tap.primitive,
        scope=_scope(tap.scope),
        file=tap.file,
        line=tap.line,
        library=tap.library,
        forward=forward,
        expression=expression,
        output_finite=backward and which == 0 and bool(finite[0]),
        index=index,
        inputs=said,
        backward_search=backward,
    )


class _TapRun(NamedTuple):
    """The tap check (`_tap_check`) run on the arguments."""

    listed: list
    errors: list
    counters: list
    finite: list
    ordered: bool


def _tap_run(fn, args, kwargs, backward: bool, checked: bool) -> _TapRun:
    make = functools.partial(_tap_check, backward, checked)
    what = ("find_nonfinite taps", backward, checked)
    with _every_example_refused():
        (listed, check, ordered), dynamic = eager_cached(what, fn, args, kwargs, make)
        errors, counters, finite = check(dynamic)
    return _TapRun(listed, errors, counters, finite, ordered)


def _scope(scope: str) -> str:
    """A tap's scope without the transformations JAX names there:
    `transpose(jvp(blocks.3))` is `blocks.3`."""
    return re.sub(r"\w+\(|\)", "", scope)


def _forward_primitives(forward: dict, tap) -> tuple[str, ...]:
    """The primitives of the forward pass at the location of `tap`, a tap of
    the gradient: what its operation differentiates. Those among them that
    made its operands, where some did (`sqrt` for `div(0.5, sqrt(x))`, the
    derivative of `sqrt`). None where the expression it differentiates holds
    no primitive of its own: a call of a function with a custom derivative,
    whose rule made the operation (see `_expression`)."""
    taps = [tap for infos in forward.values() for tap in infos[0].tap]
    if tap.span is not None:
        # JAX makes the operations of a derivative with the source of the
        # operation they differentiate: the same expression, in any scope (a
        # diffrax adjoint's backward pass runs in `checkpointed-bwd`).
        at = [t for t in taps if (t.file, t.span) == (tap.file, tap.span)]
    else:
        line = [t for t in taps if (t.file, t.line) == (tap.file, tap.line)]
        at = [t for t in line if _scope(t.scope) == _scope(tap.scope)] or line
    found = list(dict.fromkeys(t.primitive for t in at))
    read = [p for p in found if p in tap.producers]
    return tuple(read or found)


def _expression(tap) -> str | None:
    """The source text of the expression at `tap`'s span (`"f(y)"`), where it
    is on one line that `linecache` can read."""
    if tap.file is None or tap.span is None:
        return None
    line, column, end_line, end_column = tap.span
    text = linecache.getline(tap.file, line)
    if end_line != line or not text or end_column > len(text.rstrip("\n")):
        return None
    return text[column:end_column].strip() or None


def _said(tap, value, where) -> tuple[str, tuple[int, ...]]:
    """`"log(-3.0) = nan"`: the operands of the equation that went bad and
    its output, at the first bad element of its first output holding one
    (`where`, from `_checked`, for the tap's `value` of types `(inputs,
    outputs)`); and that element's index."""
    ins, outs = (jax.tree.leaves(v) for v in value)
    (y, (k, bad, read)) = next(
        (y, w) for y, w in zip(outs, where) if w and not np.isfinite(w[1])
    )
    k = int(k) % math.prod(y.shape)  # (`_checked`'s key)
    index = tuple(int(i) for i in np.unravel_index(k, y.shape))
    read, inputs = iter(read), iter(ins)

    def operand(said: str | None) -> str:  # (a value's is None: see `TapInfo`)
        if said is not None:
            return said
        x = next(inputs)
        if _elementwise(x, y):
            return _number(next(read))
        return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"

    said = ", ".join(map(operand, tap.operands))
    at = f"[{', '.join(map(str, index))}]" if index else ""
    return f"{tap.primitive}({said}){at} = {_number(bad)}", index


def _inexact(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _number(x) -> str:
    return str(np.asarray(x)[()])  # (in its own precision: -4.3165593)


def _unexplained(args, kwargs, finite: list[bool]) -> BadSite | None:
    """None where every checked result is finite; else what made them
    non-finite though no primitive made a NaN or an Inf from finite inputs:
    an argument's values, or a constant of the program."""
    if all(finite):
        return None
    what = "output" if not finite[0] else "gradient"
    paths = [
        ("args", "kwargs")[path[0].idx] + jax.tree_util.keystr(path[1:])
        for path, x in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
        if _numeric(x)
        and jnp.issubdtype(jnp.result_type(x), jnp.inexact)
        and not np.all(np.isfinite(_numpy(x)))
    ]
    if paths:
        note = (
            f"The {what} is non-finite, and no primitive made a NaN or an Inf "
            f"from finite inputs: the arguments hold them, at {', '.join(paths)}."
        )
    else:
        note = _UNSEEN.format(what=what)
    return BadSite("", None, 0, None, backward=bool(finite[0]), note=note)


_UNSEEN = (
    "The {what} is non-finite, and no primitive made a NaN or an Inf from "
    "finite inputs: it comes from a non-finite constant of the program (a "
    "literal `jnp.inf` or `jnp.nan`, a closed-over array), read by an "
    "operation whose other inputs do not make up for it, or from a value no "
    "tap sees (a primitive JAX stages whole, such as a hijax primitive)."
)
