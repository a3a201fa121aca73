"""Debugging tools: `Stats`, a handler (on the public handler protocol) that keeps
summary statistics of each execution of a tag instead of its value; `summary`,
which renders what `Tag` or `Stats` found as a table; and `sites`, which lists
every tag and perturb call of a program without running it."""

from __future__ import annotations

import dataclasses
import functools
import html
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import _nnx, _sites
from ._handle import eager_cached, handle
from ._handlers import Append, Handler, Names, Reduce, Tag
from ._site import describe, shape_dtype

STAT_KEYS = ("mean", "std", "min", "max", "mean_abs", "nan_count", "inf_count")


def _leaf_stats(x) -> dict[str, jax.Array]:
    """Statistics of `x`, one example's value: moments and extremes over the
    finite values, counts of the rest."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.abs(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.finfo(x.dtype).bits < 32:
        x = x.astype(jnp.float32)
    axes = tuple(range(x.ndim))
    finite = jnp.isfinite(x)
    n = jnp.sum(finite, axes)
    some = n > 0
    count = jnp.maximum(n, 1).astype(x.dtype)
    safe = jnp.where(finite, x, 0)
    mean = jnp.sum(safe, axes) / count
    centred = jnp.where(finite, x - jnp.expand_dims(mean, axes), 0)
    nan = jnp.array(jnp.nan, x.dtype)
    return {
        "mean": jnp.where(some, mean, nan),
        "std": jnp.where(some, jnp.sqrt(jnp.sum(centred**2, axes) / count), nan),
        "min": jnp.where(some, jnp.min(jnp.where(finite, x, jnp.inf), axes), nan),
        "max": jnp.where(some, jnp.max(jnp.where(finite, x, -jnp.inf), axes), nan),
        "mean_abs": jnp.where(some, jnp.sum(jnp.abs(safe), axes) / count, nan),
        "nan_count": jnp.sum(jnp.isnan(x), axes, dtype=jnp.int32),
        "inf_count": jnp.sum(jnp.isinf(x), axes, dtype=jnp.int32),
    }


class Stats(Tag):
    """Collects summary statistics of every execution of the matching tags,
    computed inside the compiled program, never the values themselves.

    A [`Tag`][effects.Tag] in its `"append"` layout, for when the
    values are too large to keep: each entry is, per leaf of the tagged value,
    a dict with `mean`, `std` (population), `min`, `max` and `mean_abs` over
    the finite values, and `nan_count`, `inf_count`. A leaf with no finite
    value has NaN moments; integers and 16-bit floats are summarised in
    float32, complex numbers by their absolute values. Entries are a tuple
    with one entry per execution; inside a `lax.scan` each statistic is
    stacked along the scan (shape `(length,)`), and under a `jax.vmap` inside
    the handled function it has the batch axes first (statistics per
    example). [`fx.summary`][effects.summary] renders them as a table.

    **Arguments:**

    - `collection`: the collection whose tags are summarised.
    - `names`: which names; see [`Names`][effects.Names].

    **Returns:**

    As a handler: in `found[collection]`, a dict from name to a tuple with one
    entry per execution, each entry the value's pytree with a dict of
    statistics in place of each leaf.

    **Raises:**

    - `TypeError`: `collection` is not a string, or `names` is not a
      [`Names`][effects.Names].
    - `ValueError`, from [`handle`][effects.handle]: a name in `names` without
      glob characters that no tag has; a matched tag inside a
      `lax.while_loop` (use a `lax.scan`, or [`Tag`][effects.Tag] with a
      reduction).

    **Example:**

    ```python
    def f(x):
        h = fx.tag(jnp.log(x), "h")
        return fx.tag(2 * h, "y")

    _, found = fx.handle(f, fx.Stats())(jnp.array([1.0, -1.0]))
    print(found["intermediates"]["h"][0]["nan_count"])  # 1
    print(fx.summary(found))  # one row for h, one for y: both NaN, "NO" finite
    ```
    """

    def __init__(self, collection: str = "intermediates", *, names: Names = None):
        super().__init__(collection, names=names)
        object.__setattr__(self, "mode", _STATS)  # (a frozen dataclass's field)

    def apply(self, site, value, ctx):
        ctx.emit(jax.tree.map(_leaf_stats, value))
        return value


_STATS = Append(label="Stats()")


#
# summary
#


class Summary:
    """What [`Tag`][effects.Tag] or [`Stats`][effects.Stats] found, as a
    table: [`fx.summary`][effects.summary] returns one.

    `str()` (and `print`) gives plain text, aligned in columns; in a Jupyter
    notebook it renders as an HTML table, non-finite rows highlighted.

    **Attributes:**

    - `rows`: the table's rows, a list of dicts with the keys of `columns`:
      `name`, `call` (the execution's index among the name's), `index` (the
      index along stacked scan or vmap axes of a `Stats` entry, else None),
      `shape` and `dtype` (for `Tag` values, else None), the statistics `mean`,
      `std`, `min`, `max`, `mean_abs`, `nan_count`, `inf_count`, and `finite`
      (a bool).
    - `nonfinite`: the rows whose values hold a NaN or an Inf.
    - `columns`: the column names, in order.

    **Example:**

    ```python
    _, found = fx.handle(lambda x: fx.tag(jnp.log(x), "h"), fx.Tag())(-1.0)
    table = fx.summary(found)
    print(table.nonfinite[0]["name"], table.nonfinite[0]["nan_count"])  # h 1
    ```
    """

    columns = ("name", "call", "index", "shape", "dtype", *STAT_KEYS, "finite")

    def __init__(self, rows: list[dict[str, Any]]):
        self.rows = rows

    @property
    def nonfinite(self) -> list[dict[str, Any]]:
        """The rows whose values hold a NaN or an Inf."""
        return [r for r in self.rows if not r["finite"]]

    def _cells(self) -> list[list[str]]:
        return [[_cell(r[c]) for c in self.columns] for r in self.rows]

    def __str__(self) -> str:
        return _text_table([list(self.columns), *self._cells()])

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = []
        for row, cells in zip(self.rows, self._cells()):
            style = "" if row["finite"] else ' style="background:#fdd"'
            tds = "".join(f"<td>{html.escape(c)}</td>" for c in cells)
            body.append(f"<tr{style}>{tds}</tr>")
        return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _text_table(rows) -> str:
    """Rows of strings, the first a header, as aligned plain-text columns."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    if isinstance(v, tuple) and all(isinstance(i, int) for i in v):
        return ",".join(map(str, v))  # an index along stacked axes
    return str(v)


def summary(found: Mapping[str, Mapping[str, Any]]) -> Summary:
    """Renders what [`fx.Tag`][effects.Tag] or [`fx.Stats`][effects.Stats]
    found as a table: shapes, statistics and finiteness at a glance.

    One row per execution of each name (and, for `Stats` entries stacked along
    a scan or a vmap, one per index along those axes; for a pytree value, one
    per leaf), in program order: the name (with the collection and the leaf's
    path where there are several), the execution's index, its shape and dtype
    (`Tag` values), the statistics, and whether it is finite. Statistics of
    `Tag` values are computed here, in NumPy, over the whole value.

    **Arguments:**

    - `found`: the `found` dict [`handle`][effects.handle] returned with
      `Tag` (any mode) or `Stats`.

    **Returns:**

    A [`Summary`][effects.Summary]: print it, or read its `rows`.

    **Raises:**

    Nothing of its own; `found` must be a dict from collection to a dict from
    name to value, as `handle` returns it.

    **Example:**

    ```python
    def f(x):
        h = fx.tag(jnp.log(x), "h")
        return fx.tag(2 * h, "y")

    _, found = fx.handle(f, fx.Tag())(jnp.array([1.0, -1.0]))
    print(fx.summary(found))
    # name  call  index  shape  dtype    mean  std  min  max  mean_abs  nan_count ...
    # h     0            2      float32  0     0    0    0    0         1         ...
    ```
    """
    many = len(found) > 1
    rows = []
    for collection, names in found.items():
        for name, entries in names.items():
            label = f"{collection}/{name}" if many else name
            if not isinstance(entries, tuple):  # one entry (a "strict" Tag)
                entries = (entries,)
            for call, entry in enumerate(entries):
                rows.extend(_rows(label, call, entry))
    return Summary(rows)


def _is_stats(x) -> bool:
    return isinstance(x, dict) and set(x) == set(STAT_KEYS)


def _rows(label: str, call: int, entry) -> list[dict[str, Any]]:
    leaves = jax.tree_util.tree_flatten_with_path(entry, is_leaf=_is_stats)[0]
    rows = []
    for path, leaf in leaves:
        name = label + (jax.tree_util.keystr(path) if len(leaves) > 1 else "")
        if _is_stats(leaf):
            stats = {k: np.asarray(v) for k, v in leaf.items()}
            for index in np.ndindex(stats["mean"].shape):
                row = {k: v[index].item() for k, v in stats.items()}
                finite = row["nan_count"] == 0 and row["inf_count"] == 0
                rows.append(
                    dict(
                        name=name,
                        call=call,
                        index=index if index else None,
                        shape=None,
                        dtype=None,
                        finite=finite,
                        **row,
                    )
                )
        else:
            x = np.asarray(leaf)
            stats = _numpy_stats(x)
            finite = stats["nan_count"] == 0 and stats["inf_count"] == 0
            rows.append(
                dict(
                    name=name,
                    call=call,
                    index=None,
                    shape=x.shape,
                    dtype=str(x.dtype),
                    finite=finite,
                    **stats,
                )
            )
    return rows


def _numpy_stats(x: np.ndarray) -> dict[str, Any]:
    if np.iscomplexobj(x):
        x = np.abs(x)
    x = x.astype(np.float64)
    finite = x[np.isfinite(x)]
    nan = float("nan")
    some = finite.size > 0
    return {
        "mean": float(finite.mean()) if some else nan,
        "std": float(finite.std()) if some else nan,
        "min": float(finite.min()) if some else nan,
        "max": float(finite.max()) if some else nan,
        "mean_abs": float(np.abs(finite).mean()) if some else nan,
        "nan_count": int(np.isnan(x).sum()),
        "inf_count": int(np.isinf(x).sum()),
    }


#
# sites
#


@dataclasses.dataclass(frozen=True)
class SiteInfo:
    """One [`tag`][effects.tag] or [`perturb`][effects.perturb] call in a
    program, not one execution: what [`fx.sites`][effects.sites] lists.

    **Attributes:**

    - `kind`: `"tag"` or `"perturb"` (a `jax.ad_checkpoint.checkpoint_name` is
      a `"tag"` in the collection `"checkpoint_name"`).
    - `collection`, `name`: as passed to it.
    - `value`: the value of one execution, as `jax.ShapeDtypeStruct`s, in the
      layout handlers report (the batch axes of a `jax.vmap` inside the
      function first).
    - `where`: the control flow around it, outermost first, such as
      `"scan(length=12) > cond branch 1"`; `""` at the top level.
    - `loops`: per enclosing region, outermost first: a scan's length,
      `"while"`, `"branch"`, `"other"`, or None for a `jit`. Left out of its
      `repr` and of comparisons.

    **Example:**

    ```python
    def f(x):
        return jax.lax.scan(lambda c, _: (fx.tag(c * 2, "h"), None), x, None, 3)[0]

    (info,) = fx.sites(f)(jnp.ones(2))["intermediates"]["h"]
    print(info.where)  # scan(length=3)
    print(info.value)  # ShapeDtypeStruct(shape=(2,), dtype=float32)
    ```
    """

    kind: str
    collection: str
    name: str
    value: Any
    where: str
    # Per enclosing region, outermost first: a scan's length, "while",
    # "branch", "custom" (a custom_jvp/custom_vjp function), "other", or None
    # (a jit).
    loops: tuple = dataclasses.field(default=(), repr=False, compare=False)


class Sites(dict):
    """What [`fx.sites`][effects.sites] returns: a dict `collection -> name ->
    [SiteInfo, ...]`, in program order, whose `str()` is a table.

    A `dict` subclass: index it, iterate over it, or `print` it for one row per
    site with its collection, name, kind, shape and dtype, and the control
    flow around it.

    **Attributes:**

    As a dict: `sites[collection][name]` is a list of
    [`SiteInfo`][effects.SiteInfo], one per call in the program.

    **Example:**

    ```python
    def f(x):
        h = fx.tag(jnp.sin(x), "h")
        return fx.perturb(h, "p")

    print(fx.sites(f)(jnp.ones(3)))
    # collection     name  kind     value       where
    # -------------  ----  -------  ----------  -----
    # intermediates  h     tag      float32[3]
    # perturbations  p     perturb  float32[3]
    ```
    """

    def __str__(self) -> str:
        rows = [("collection", "name", "kind", "value", "where")]
        for infos in (i for names in self.values() for i in names.values()):
            rows.extend(
                (i.collection, i.name, i.kind, describe(i.value), i.where)
                for i in infos
            )
        return _text_table(rows)


def sites(fn: Callable) -> Callable[..., Sites]:
    """Lists every [`tag`][effects.tag], [`perturb`][effects.perturb] and
    `jax.ad_checkpoint.checkpoint_name` call `fn` would execute, without
    running anything.

    `fn` is only traced, so arguments may be `jax.ShapeDtypeStruct`s: the
    names and shapes of every layer of a model, at no cost, before choosing
    what to collect. One [`SiteInfo`][effects.SiteInfo] per call in the
    program, not per execution (a tag in a `lax.scan` is listed once), with
    the control flow around it; a site that a backward pass recomputes is not
    listed again. Arguments are treated as `eqx.filter_jit`
    treats them: arrays and `jax.ShapeDtypeStruct`s traced, other leaves (an
    Equinox module's functions, Python numbers) static. Flax NNX objects are
    traced through their state, which is left as it was.

    **Arguments:**

    - `fn`: the function to look into: any callable, or a model from
      [`fx.tag_modules`][effects.tag_modules].

    **Returns:**

    `lister(*args, **kwargs) -> Sites`: a [`Sites`][effects.Sites], the dict
    `collection -> name -> [SiteInfo, ...]`, in program order; `print` it for a
    table.

    **Raises:**

    Nothing of its own; what tracing `fn` raises, as under `jax.jit`, such as
    `jax.errors.TracerBoolConversionError` for Python control flow on the
    values of arrays.

    **Example:**

    ```python
    import equinox as eqx

    model = eqx.nn.MLP(2, 2, width_size=8, depth=2, key=jax.random.key(0))
    print(fx.sites(fx.tag_modules(model))(jax.ShapeDtypeStruct((2,), jnp.float32)))
    # collection     name      kind  value       where
    # -------------  --------  ----  ----------  -----
    # intermediates  layers.0  tag   float32[8]
    # intermediates  layers.1  tag   float32[8]
    # intermediates  layers.2  tag   float32[2]
    ```
    """

    def lister(*args, **kwargs) -> Sites:
        found = Sites()
        call, dynamic = _traced_arguments(fn, args, kwargs)
        for located in _sites.walk(_sites.traced(call, dynamic)).sites:
            if located.recomputed:
                continue
            # A call JAX makes, not the user (the forward part of a checkpoint or
            # scan that it split for differentiation), adds no control flow.
            around = [_label(r) for r in located.path if r.name != "closed_call"]
            site = _sites.site_of(located.eqn)
            info = SiteInfo(
                site.kind,
                site.collection,
                site.name,
                site.front_avals(),
                " > ".join(label for label, _ in around),
                tuple(loop for _, loop in around),
            )
            found.setdefault(site.collection, {}).setdefault(site.name, []).append(info)
        return found

    functools.update_wrapper(lister, fn, updated=())
    return lister


def _traced_arguments(fn, args, kwargs):
    """`fn` as a function of the arrays (and `jax.ShapeDtypeStruct`s) among its
    arguments, with every other leaf (an Equinox module's functions, Python
    numbers) held static as `eqx.filter_jit` holds it; and those arrays. Flax
    NNX objects go in as their state, and the state they end with is dropped:
    looking at a model leaves it as it was."""
    nnx_call = _nnx.functional(fn, args, kwargs)
    if nnx_call is not None:
        pure, args, kwargs = nnx_call[0], nnx_call[1], {}
        fn = lambda *args: pure(*args)[0]  # noqa: E731
    dynamic, static = eqx.partition((args, kwargs), _is_traced)

    def call(dynamic):
        args, kwargs = eqx.combine(dynamic, static)
        return fn(*args, **kwargs)

    return call, dynamic


def _is_traced(x) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _label(region: _sites.Region) -> tuple[str, Any]:
    """`(label, loop)` for a region around a site (see `SiteInfo.loops`)."""
    p, name = region.eqn.params, region.name
    if name == "scan":
        reverse = ", reverse" if p.get("reverse") else ""
        return f"scan(length={p['length']}{reverse})", p["length"]
    if name == "cond":
        return f"cond branch {region.which}", "branch"
    if name == "while":
        which = "cond" if region.jaxpr is p["cond_jaxpr"].jaxpr else "body"
        return f"while_loop {which}", "while"
    label = f"{name}({p['name']})" if isinstance(p.get("name"), str) else name
    if name == "jit":
        return label, None
    custom = name in ("custom_jvp_call", "custom_vjp_call")
    return label, "custom" if custom else "other"


#
# find_nonfinite
#


@dataclasses.dataclass(frozen=True)
class BadSite:
    """What [`fx.find_nonfinite`][effects.find_nonfinite] returns: the first
    tag whose value (or, with `backward=True`, whose cotangent) held a NaN or
    an Inf, and which execution of it.

    `str()` says it in a sentence.

    **Attributes:**

    - `name`, `collection`: the tag's.
    - `call`: the index of that execution among the name's executions,
      counting a scan's iterations as one call when the tag's only site sits
      in scans (then `iteration` says which); else counting every execution.
    - `iteration`: the scan iteration (a tuple for nested scans, outermost
      first), or None.
    - `backward`: whether it is the cotangent that went bad.

    **Example:**

    ```python
    bad = fx.find_nonfinite(lambda x: fx.tag(jnp.log(x), "h"), -1.0)
    print(bad.name, bad.call, bad.iteration)  # h 0 None
    ```
    """

    name: str
    collection: str
    call: int
    iteration: int | tuple[int, ...] | None
    backward: bool = False

    def __str__(self) -> str:
        where = f"call {self.call}"
        if self.iteration is not None:
            where += f", scan iteration {self.iteration}"
        what = (
            "the first, in the backward pass, whose cotangent holds"
            if self.backward
            else "the first value with"
        )
        return (
            f"The tag {self.name!r} (collection {self.collection!r}) is {what} a "
            f"NaN or an Inf, at its {where}."
        )


_CODE = "effects-nonfinite-site:"


def _finite(leaves) -> jax.Array:
    ok = jnp.array(True)
    for x in leaves:
        if jnp.issubdtype(x.dtype, jnp.inexact):
            ok = ok & jnp.all(jnp.isfinite(x))
    return ok


def _count(acc, x):
    n, first = acc
    bad = ~_finite(jax.tree.leaves(x))
    return n + 1, jnp.where((first < 0) & bad, n, first)


def _count_init(z):
    del z
    return jnp.int32(0), jnp.int32(-1)


_COUNTER = Reduce(_count, _count_init)


class _Check(Handler):
    """At every tag: a `checkify` check that its value is finite, the first
    failing check in execution order being the one reported; with `backward`,
    an identity whose backward pass checks the cotangent instead, with the
    execution's index among its name's (counted here) in the message."""

    collection: ClassVar[str] = ""
    codes: Any = dataclasses.field(metadata={"static": True})  # {(coll, name): code}
    backward: bool = dataclasses.field(default=False, metadata={"static": True})
    # With `backward`: a zero added to every tag, that differentiating with
    # respect to it computes the cotangent of every one.
    zero: Any = None

    def matches(self, site):
        return site.kind == "tag" and (site.collection, site.name) in self.codes

    @property
    def mode(self):  # pyright: ignore[reportIncompatibleVariableOverride]
        return _EXECUTIONS if self.backward else None

    def apply(self, site, value, ctx):
        from jax.experimental import checkify

        code = self.codes[(site.collection, site.name)]
        if not self.backward:
            checkify.check(_finite(jax.tree.leaves(value)), f"{_CODE}{code}")
            return value
        count = ctx.emit(jnp.int32(0))
        assert count is not None  # (the mode is a reduction)
        n = count - 1  # this execution's index

        def checked(x):
            if not jnp.issubdtype(x.dtype, jnp.inexact):
                return x
            return _cotangent_check(x + self.zero.astype(x.dtype), code, n)

        return jax.tree.map(checked, value)


_EXECUTIONS = Reduce(lambda n, _: n + 1, lambda _: jnp.int32(0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _cotangent_check(x, code: int, n):
    del code, n
    return x


def _cotangent_check_fwd(x, code: int, n):
    del code
    return x, n


def _cotangent_check_bwd(code: int, n, ct):
    from jax.experimental import checkify

    checkify.check(_finite([ct]), f"{_CODE}{code}:{{}}", n)
    return ct, None


_cotangent_check.defvjp(_cotangent_check_fwd, _cotangent_check_bwd)


def find_nonfinite(
    fn: Callable, *args, backward: bool = False, **kwargs
) -> BadSite | None:
    """Finds the first tag whose value holds a NaN or an Inf: runs
    `fn(*args, **kwargs)` once, compiled, with a check at every tag.

    Returns the first failing tag in execution order, so never a tag that is
    non-finite only because an earlier one was. Works through `jit`, `scan`,
    `cond` and `while_loop`; pass a model from
    [`fx.tag_modules`][effects.tag_modules] to check every layer. Every tag
    counts, whatever its collection, `jax.ad_checkpoint.checkpoint_name`s
    included (perturb sites do not); integer values are never non-finite.
    Arguments are treated as `eqx.filter_jit` treats them (arrays traced,
    other leaves static); Flax NNX objects are run on their state, which is
    left as it was.

    With `backward=True` (`fn` returns a scalar), it runs the backward pass
    too and returns the first tag, in the order the backward pass computes
    cotangents, whose cotangent (the gradient of the output with respect to
    the tag's value) holds a NaN or an Inf: the site nearest the output where
    the gradient goes bad. In `h = tag(x * 0, "h"); s = tag(jnp.sqrt(h), "s")`
    that is `h`: the cotangent of `s` is finite, `sqrt`'s derivative at 0 is
    not. The value `fn` returns is not checked. A tag inside a function with a
    custom derivative (`custom_jvp`, `custom_vjp`) has no cotangent of its own
    (the custom rule differentiates the function as a whole): the backward
    check passes over it, and the forward check covers it.

    **Arguments:**

    - `fn`: the function to run.
    - `*args`, `**kwargs`: its arguments.
    - `backward`: whether to check the cotangents of the backward pass instead
      of the values.

    **Returns:**

    A [`BadSite`][effects.BadSite] naming the tag and the execution, or None
    when every checked value is finite (or `fn` has no tag).

    **Raises:**

    - `ValueError`: with `backward=True`, `fn` does not return a scalar array,
      or a name is tagged both inside and outside a function with a custom
      derivative. From [`handle`][effects.handle], which places the checks: a
      tag inside a `custom_linear_solve`.

    **Example:**

    ```python
    def f(x):
        h = fx.tag(jnp.log(x), "h")  # log(-1) is NaN
        y = fx.tag(2 * h, "y")  # NaN only because h is
        return jnp.sum(y)

    print(fx.find_nonfinite(f, jnp.array([1.0, -1.0])))
    # The tag 'h' (collection 'intermediates') is the first value with a NaN or
    # an Inf, at its call 0.

    def g(x):
        h = fx.tag(x * 0, "h")
        return jnp.sum(fx.tag(jnp.sqrt(h), "s"))

    print(fx.find_nonfinite(g, jnp.ones(2), backward=True).name)  # h
    ```
    """
    # The sites and the compiled check, cached per function, argument signature
    # and `backward`: checking every batch of a data loader compiles once.
    nnx_call = _nnx.functional(fn, args, kwargs)
    if nnx_call is not None:  # run on the NNX objects' state, left as it was
        fn, args, kwargs = nnx_call[0], nnx_call[1], {}
    what = ("find_nonfinite", backward, nnx_call is not None)
    make = functools.partial(_nonfinite_check, backward, nnx_call is not None)
    (listed, keys, check), dynamic = eager_cached(what, fn, args, kwargs, make)
    if check is None:
        return None
    err, found = check(dynamic)
    message = err.get()
    if message is None or _CODE not in message:
        return None
    if backward:
        code, n = message.split(_CODE)[1].split()[0].split(":")
        collection, name = keys[int(code)]
        return _bad_site(listed, collection, name, int(n), True)
    collection, name = keys[int(message.split(_CODE)[1].split()[0])]
    first = np.asarray(found[collection][name][1])
    return _bad_site(listed, collection, name, int(first[first >= 0].min()), False)


def _nonfinite_check(backward: bool, nnx: bool, call, dynamic):
    """`(listed, keys, check)` for `find_nonfinite`: the sites of
    `call(dynamic)`, the checked `(collection, name)`s (a message's code is an
    index into them), and `check(dynamic) -> (checkify error, found)`, jitted;
    `check` is None when there is nothing to check."""
    # Imported here: on jax 0.7-0.9 importing it registers checkify's rules in
    # JAX's tables, which `import effects` alone must not do.
    from jax.experimental import checkify

    fn = (lambda dynamic: call(dynamic)[0]) if nnx else call  # the state dropped
    listed = sites(fn)(dynamic)
    keys = [(c, n) for c, names in listed.items() for n in names]
    if backward:
        # A tag inside a function with a custom derivative has no cotangent of
        # its own: the custom rule differentiates the function as a whole.
        keys = [
            (c, n)
            for c, n in keys
            if not all("custom" in info.loops for info in listed[c][n])
        ]
    if not keys:
        return listed, keys, None
    codes = {key: i for i, key in enumerate(keys)}
    if backward:
        check = _backward_check(fn, codes)
    else:
        handlers = (_Check(codes), *(Tag(c, mode=_COUNTER) for c in listed))

        def check(dynamic):
            return handle(fn, *handlers)(dynamic)[1]

    return listed, keys, jax.jit(checkify.checkify(check, errors=checkify.user_checks))


def _backward_check(fn, codes):
    def output(zero, dynamic):
        out, _ = handle(fn, _Check(codes, True, zero))(dynamic)
        if not (isinstance(out, jax.Array) and out.shape == ()):
            raise ValueError(
                "find_nonfinite(backward=True): the function must return a scalar "
                f"(the loss), got {jax.tree.map(shape_dtype, out)}."
            )
        return out

    def check(dynamic):
        return jax.grad(output)(jnp.float32(0), dynamic)

    return check


def _bad_site(listed, collection, name, k: int, backward: bool) -> BadSite:
    """The `k`-th execution of a name as a call and a scan iteration."""
    lengths = _scan_lengths(listed[collection][name])
    if lengths is None:
        return BadSite(name, collection, k, None, backward)
    per_call = math.prod(lengths)
    index = tuple(int(i) for i in np.unravel_index(k % per_call, lengths))
    iteration = index[0] if len(index) == 1 else index
    return BadSite(name, collection, k // per_call, iteration, backward)


def _scan_lengths(infos) -> tuple[int, ...] | None:
    """The lengths of the scans around a name's only site, when scans (and
    jits) are all there is around it: then each call executes it the product
    of the lengths times."""
    if len(infos) != 1:
        return None
    loops = infos[0].loops
    if not loops or any(
        not isinstance(loop, int) for loop in loops if loop is not None
    ):
        return None
    lengths = tuple(loop for loop in loops if loop is not None)
    return lengths or None
