"""Debugging tools on the public API: `Stats`, a handler (on the public handler
protocol) that keeps summary statistics of each execution of a tag instead of
its value; `summary`, which renders what `Tag` or `Stats` found as a table; and
`find_nonfinite`, which finds the first tag holding a NaN or an Inf. (`sites`,
which lists every site of a program, lives with the walk it lists, in
`_sites`.)"""

from __future__ import annotations

import dataclasses
import functools
import html
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.export
import jax.numpy as jnp
import numpy as np

# `eager_cached`, the one internal entry point: `find_nonfinite` caches its
# compiled check as `handle` caches its jitted calls, on the function itself (an
# Equinox module's per structure), dying with it. Public API cannot: a cache of
# our own keyed by the function would keep it alive, as `eqx.filter_jit` does.
from ._handle import eager_cached, handle
from ._handlers import Append, Handler, Names, Reduce, Tag
from ._sites import sites, text_table

STAT_KEYS = ("mean", "std", "min", "max", "mean_abs", "nan_count", "inf_count")


class Statistics(Mapping[str, Any]):
    """The statistics [`fx.Stats`][effects.Stats] keeps of one leaf of a
    tagged value: a read-only dict from `mean`, `std`, `min`, `max`,
    `mean_abs`, `nan_count` and `inf_count` to arrays (a pytree, so it goes
    through `jit` and `vmap`), which also knows the leaf it describes.

    **Attributes:**

    - `shape`, `dtype`: the leaf's, for one example.
    - `stacked`: what the trailing axes of each statistic are, after its
      batch axes (one statistic per example of each `jax.vmap`, inside the
      handled function or outside it): `"shard"` per `shard_map` around the
      tag (one per shard), then `"scan"` per `lax.scan` (one per iteration),
      as [`Context.stacking`][effects.Context] says.
      [`fx.summary`][effects.summary] combines the examples and the shards.

    **Example:**

    ```python
    f = jax.vmap(lambda x: fx.tag(2 * x, "h"))
    _, found = fx.handle(f, fx.Stats())(jnp.arange(6.0).reshape(3, 2))
    (entry,) = found["intermediates"]["h"]
    print(entry.shape, entry.dtype, entry.stacked, entry["mean"])
    ```

    ```text
    (2,) float32 () [1. 5. 9.]
    ```
    """

    __slots__ = ("_stats", "shape", "dtype", "stacked")

    def __init__(self, stats: Mapping[str, Any], shape, dtype, stacked=()):
        self._stats = {k: stats[k] for k in STAT_KEYS}
        self.shape, self.dtype, self.stacked = tuple(shape), str(dtype), tuple(stacked)

    def __getitem__(self, key: str):
        return self._stats[key]

    def __iter__(self):
        return iter(self._stats)

    def __len__(self) -> int:
        return len(self._stats)

    def __repr__(self) -> str:
        about = f"shape={self.shape}, dtype={self.dtype}, stacked={self.stacked}"
        return f"Statistics({self._stats!r}, {about})"

    def _flatten(self):
        keys = tuple((jax.tree_util.DictKey(k), v) for k, v in self._stats.items())
        return keys, (self.shape, self.dtype, self.stacked)

    @classmethod
    def _unflatten(cls, about, stats):
        return cls(dict(zip(STAT_KEYS, stats)), *about)


jax.tree_util.register_pytree_with_keys(
    Statistics,
    Statistics._flatten,
    Statistics._unflatten,
    lambda s: (tuple(s._stats.values()), (s.shape, s.dtype, s.stacked)),
)
jax.export.register_pytree_node_serialization(
    Statistics,
    serialized_name="effects.Statistics",
    serialize_auxdata=lambda about: json.dumps(about).encode(),
    deserialize_auxdata=lambda data: tuple(map(_tuple_or_str, json.loads(data))),
)


def _tuple_or_str(x):
    return x if isinstance(x, str) else tuple(x)


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _leaf_stats(x, xp=jnp) -> dict[str, Any]:
    """Statistics of `x`, one example's value: moments and extremes over the
    finite values, counts of the rest. With `xp=np`, in NumPy and float64. A
    PRNG key is summarised by its key data (`jax.random.key_data`)."""
    if _is_key(x):
        x = jax.random.key_data(x)
    if xp.iscomplexobj(x):
        x = xp.abs(x)
    if xp is np or not xp.issubdtype(x.dtype, xp.floating) or x.dtype.itemsize < 4:
        x = x.astype(np.float64 if xp is np else np.float32)
    finite, nan = xp.isfinite(x), xp.array(xp.nan, x.dtype)
    count = xp.sum(finite)
    n = xp.maximum(count, 1)
    # Moments of the values over the largest of them: the sums of finite
    # values near the dtype's largest would overflow.
    scale = xp.max(xp.abs(x), initial=0, where=finite)
    scale = xp.where(scale > 0, scale, xp.ones_like(scale))
    y = x / scale
    mean = xp.sum(y, where=finite) / n

    def some(v):  # NaN where there is no finite value
        return xp.where(count > 0, v, nan)

    return {
        "mean": some(mean * scale),
        "std": some(xp.sqrt(xp.sum((y - mean) ** 2, where=finite) / n) * scale),
        "min": some(xp.min(x, initial=xp.inf, where=finite)),
        "max": some(xp.max(x, initial=-xp.inf, where=finite)),
        "mean_abs": some(xp.sum(xp.abs(y), where=finite) / n * scale),
        "nan_count": xp.sum(xp.isnan(x), dtype=np.int32),
        "inf_count": xp.sum(xp.isinf(x), dtype=np.int32),
    }


def _over_examples(stats: Mapping[str, np.ndarray], size: int, axes: int):
    """`stats` of equal-sized parts (`size` elements each) combined over their
    first `axes` axes: exactly the statistics of the whole, in float64."""
    s = {k: np.asarray(v, np.float64) for k, v in stats.items()}
    over = tuple(range(axes))
    n = size - s["nan_count"] - s["inf_count"]  # finite values of each part
    total = n.sum(over)
    some = total > 0
    w = np.where(some, n / np.where(some, total, 1), 0)  # (NaN moments weigh 0)

    def weighted(v):
        return np.where(some, np.sum(np.where(n > 0, v, 0) * w, over), np.nan)

    mean = weighted(s["mean"])
    square = weighted(s["std"] ** 2 + s["mean"] ** 2)

    def extreme(v, fill, reduce):  # over the parts with a finite value
        return np.where(some, reduce(np.where(n > 0, v, fill), over), np.nan)

    return {
        "mean": mean,
        "std": np.sqrt(np.maximum(square - mean**2, 0)),
        "min": extreme(s["min"], np.inf, np.min),
        "max": extreme(s["max"], -np.inf, np.max),
        "mean_abs": weighted(s["mean_abs"]),
        "nan_count": s["nan_count"].sum(over).astype(np.int64),
        "inf_count": s["inf_count"].sum(over).astype(np.int64),
    }


class Stats(Tag):
    """Collects summary statistics of every execution of the matching tags,
    computed inside the compiled program, never the values themselves.

    A [`Tag`][effects.Tag] in its `"append"` layout, for when the
    values are too large to keep: each entry is, per leaf of the tagged value,
    a dict with `mean`, `std` (population), `min`, `max` and `mean_abs` over
    the finite values, and `nan_count`, `inf_count`. A leaf with no finite
    value has NaN moments; integers and 16-bit floats are summarised in
    float32, complex numbers by their absolute values, PRNG keys by their key
    data (`jax.random.key_data`). Entries are a tuple
    with one entry per execution; inside a `lax.scan` each statistic is
    stacked along the scan (shape `(length,)`). Under a `jax.vmap` inside the
    handled function (an Equinox model's `vmap` over tokens, say), they are
    per example by default, with the batch axes first; with
    `per_example=False`, over the whole value, batch axes included: one set
    per execution, whatever the batch. [`fx.summary`][effects.summary]
    renders them as a table.

    **Arguments:**

    - `collection`: the collection whose tags are summarised.
    - `names`: which names; see [`Names`][effects.Names].
    - `per_example`: whether statistics are per example of each `jax.vmap`
      inside the handled function (True) or over the whole batch (False).
    - `of`: `"value"`, `"tangent"` or `"cotangent"`: statistics of the values,
      or of their derivatives as [`Tag(of=...)`][effects.Tag] collects them.

    **Returns:**

    As a handler: in `found[collection]`, a dict from name to a tuple with one
    entry per execution, each entry the value's pytree with an
    [`fx.Statistics`][effects.Statistics] (a read-only dict of the statistics,
    which knows the leaf's shape and dtype) in place of each leaf.

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
    print(found["intermediates"]["h"][0]["nan_count"])
    print(fx.summary(found))
    ```

    ```text
    1
    name  call  index  shape  dtype    mean  std  min  max  mean_abs  nan_count ...
    ----  ----  -----  -----  -------  ----  ---  ---  ---  --------  --------- ...
    h     0            2      float32  0     0    0    0    0         1         ...
    y     0            2      float32  0     0    0    0    0         1         ...
    ```
    """

    def __init__(
        self,
        collection: str = "intermediates",
        *,
        names: Names = None,
        per_example: bool = True,
        of: str = "value",
    ):
        mode = _STATS if per_example else _STATS_OF_BATCH
        super().__init__(collection, names=names, mode=mode, of=of)

    def apply(self, site, value, ctx):
        def leaf(x):
            shape, dtype = jnp.shape(x), jnp.result_type(x)
            return Statistics(_leaf_stats(x), shape, dtype, ctx.stacking)

        ctx.emit(jax.tree.map(leaf, value))
        return value


_STATS = Append(label="Stats()")
_STATS_OF_BATCH = Append(label="Stats(per_example=False)", per_example=False)


#
# summary
#


class Summary:
    """What [`Tag`][effects.Tag] or [`Stats`][effects.Stats] found, as a
    table: [`fx.summary`][effects.summary] returns one.

    `str()` (and `print`) gives plain text, aligned in columns; in a Jupyter
    notebook it renders as an HTML table, non-finite rows highlighted.

    **Attributes:**

    - `rows`: the table's rows, a list of dicts: `name`, `call` (the
      execution's index among the name's), `index` (the index along the
      stacked axes of a `Stats` entry: its scans, and its vmaps and
      shard_maps when shown per example; else None), `shape` and `dtype` (a
      `Tag` value's whole; a `Stats` leaf's for one example), `examples` (for
      a `Stats` entry under vmaps or shard_maps: how many examples, each
      shard counting as one, the row's statistics are over, 1 when shown per
      example; else None), the
      statistics `mean`, `std`, `min`, `max`, `mean_abs`, `nan_count`,
      `inf_count`, and `finite` (a bool).
    - `nonfinite`: the rows whose values hold a NaN or an Inf.
    - `columns`: the columns shown, in order: the keys of a row, without
      `examples` where no row has one.
    - `note`: under `jax.distributed` with several processes, which process
      computed the table (`"process 0 of 2; statistics over the global
      values"`), its first line when printed; else `""`. Every process
      computes the same table.

    **Example:**

    ```python
    _, found = fx.handle(lambda x: fx.tag(jnp.log(x), "h"), fx.Tag())(-1.0)
    table = fx.summary(found)
    print(table.nonfinite[0]["name"], table.nonfinite[0]["nan_count"])
    ```

    ```text
    h 1
    ```
    """

    def __init__(self, rows: list[dict[str, Any]]):
        self.rows = rows
        examples = any(r["examples"] is not None for r in rows)
        self.columns = (
            *("name", "call", "index", "shape", "dtype"),
            *(("examples",) if examples else ()),
            *(*STAT_KEYS, "finite"),
        )
        # Under `jax.distributed` every process computes the same table (of
        # the global values): say which one printed it.
        n, i = jax.process_count(), jax.process_index()
        self.note = f"process {i} of {n}; statistics over the global values"
        self.note = self.note if n > 1 else ""

    @property
    def nonfinite(self) -> list[dict[str, Any]]:
        """The rows whose values hold a NaN or an Inf."""
        return [r for r in self.rows if not r["finite"]]

    def _cells(self) -> list[list[str]]:
        return [[_cell(r[c]) for c in self.columns] for r in self.rows]

    def __str__(self) -> str:
        table = text_table([list(self.columns), *self._cells()])
        return f"{self.note}\n{table}" if self.note else table

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = []
        for row, cells in zip(self.rows, self._cells()):
            style = "" if row["finite"] else ' style="background:#fdd"'
            tds = "".join(f"<td>{html.escape(c)}</td>" for c in cells)
            body.append(f"<tr{style}>{tds}</tr>")
        note = f"<caption>{html.escape(self.note)}</caption>" if self.note else ""
        return f"<table>{note}<tr>{head}</tr>{''.join(body)}</table>"


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


def summary(
    found: Mapping[str, Mapping[str, Any]], *, per_example: bool = False
) -> Summary:
    """Renders what [`fx.Tag`][effects.Tag] or [`fx.Stats`][effects.Stats]
    found as a table: shapes, statistics and finiteness at a glance.

    One row per execution of each name (and, for `Stats` entries stacked along
    a scan, one per iteration; for a pytree value, one per leaf), in program
    order: the name (with the collection and the leaf's path where there are
    several), the execution's index, its shape and dtype, the statistics, and
    whether it is finite. Statistics of `Tag` values are computed here, in
    NumPy, over the whole value, batch axes included; as `Stats` computes
    them, complex numbers by their absolute values (an infinite real part
    with a NaN imaginary one counts as an Inf), PRNG keys by their key data.

    `Stats` keeps statistics per example of each `jax.vmap` (and per shard
    of each `shard_map`); the table combines them over the batch and the
    shards (exactly: the statistics of the whole value, as for `Tag`) and says
    over how many examples in its `examples` column, or, with
    `per_example=True`, shows one row per example and shard, its position in
    `index` (batch axes first, then shards, then scans). Leading axes that a
    transformation outside `handle` stacked (a `jax.vmap` of the handled
    function, a `lax.scan` over training steps) count as more examples; for
    one step's table, index it out first
    (`fx.summary(jax.tree.map(lambda a: a[i], found))`).

    **Arguments:**

    - `found`: the `found` dict [`handle`][effects.handle] returned with
      `Tag` (any mode) or `Stats`.
    - `per_example`: one row per example (and shard) of a `Stats` entry
      under vmaps (and shard_maps) (True), or one over all of them (False,
      the default).

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
    ```

    ```text
    name  call  index  shape  dtype    mean  std  min  max  mean_abs  nan_count ...
    ----  ----  -----  -----  -------  ----  ---  ---  ---  --------  --------- ...
    h     0            2      float32  0     0    0    0    0         1         ...
    y     0            2      float32  0     0    0    0    0         1         ...
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
                rows.extend(_rows(label, call, entry, per_example))
    return Summary(rows)


def _is_stats(x) -> bool:
    return isinstance(x, Statistics) or (
        isinstance(x, dict) and set(x) == set(STAT_KEYS)
    )


def _rows(label: str, call: int, entry, per_example: bool) -> list[dict[str, Any]]:
    """One row per leaf of `entry`, and per index along the stacked axes of a
    `Stats` leaf (those of its vmaps aggregated unless `per_example`); a `Tag`
    leaf's statistics computed here, over all of it."""
    leaves = jax.tree_util.tree_flatten_with_path(entry, is_leaf=_is_stats)[0]
    rows = []
    for path, leaf in leaves:
        name = label + (jax.tree_util.keystr(path) if len(leaves) > 1 else "")
        base: dict[str, Any] = dict(name=name, call=call, examples=None)
        stats, base["shape"], base["dtype"] = _host_stats(leaf)
        if isinstance(leaf, Statistics):
            base["shape"], base["dtype"] = leaf.shape, leaf.dtype
            # (the batch axes, then the shards': the statistics of parts)
            scans = leaf.stacked.count("scan")
            batch = stats["mean"].shape[: stats["mean"].ndim - scans]
            if batch and not per_example:
                stats = _over_examples(stats, math.prod(leaf.shape), len(batch))
            if batch:
                base["examples"] = 1 if per_example else math.prod(batch)
        for index in np.ndindex(stats["mean"].shape):
            row = {k: v[index].item() for k, v in stats.items()}
            finite = row["nan_count"] == row["inf_count"] == 0
            rows.append({**base, "index": index or None, **row, "finite": finite})
    return rows


def _host_stats(leaf) -> tuple[dict[str, np.ndarray], Any, str | None]:
    """A leaf of what `Tag` or `Stats` found as (its statistics in NumPy, shape,
    dtype), shape and dtype a `Tag` value's (None for a `Stats` leaf).

    Under `jax.distributed`, a `Tag` value that spans processes has its
    statistics computed on its devices, in float32 as `Stats` computes them:
    the results are replicated scalars, the same on every process, and no host
    holds the whole value. A `Stats` entry sharded along a batch or shard axis
    is small: it is gathered. Every process must call this alike, as it runs
    programs over the devices of all."""
    if _is_stats(leaf):
        return {k: _numpy(v) for k, v in leaf.items()}, None, None
    if _spans_processes(leaf):
        stats = {k: np.asarray(v) for k, v in _device_stats(leaf).items()}
        return stats, leaf.shape, str(leaf.dtype)
    if _is_key(leaf):
        return _host_stats(jax.random.key_data(leaf))[0], leaf.shape, str(leaf.dtype)
    x = np.asarray(leaf)
    return _leaf_stats(x, np), x.shape, str(x.dtype)


def _spans_processes(x) -> bool:
    """Whether `x` is a `jax.Array` that no one process holds whole (under
    `jax.distributed`): `np.asarray` cannot fetch it there."""
    return isinstance(x, jax.Array) and not (
        x.is_fully_addressable or x.is_fully_replicated
    )


def _numpy(x) -> np.ndarray:
    """`x` in NumPy, gathered from every process where it spans processes (then
    every process must call this alike)."""
    if _spans_processes(x):
        # (imported here: importing it registers primitives of JAX's own, which
        # importing effects must not do)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


_device_stats = jax.jit(_leaf_stats)


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
      first), or None: its position, as `Tag()` stacks the values (in a scan
      with `reverse=True`, not how many ran before it).
    - `backward`: whether it is the cotangent that went bad; False for a
      value, also from `find_nonfinite(..., backward=True)` when the forward
      pass is already non-finite.
    - `backward_search`: whether `find_nonfinite` was called with
      `backward=True`. Not compared: the forward site it returns equals the
      one `backward=False` returns, and only `str()` differs, saying that the
      forward pass is already non-finite.

    **Example:**

    ```python
    bad = fx.find_nonfinite(lambda x: fx.tag(jnp.log(x), "h"), -1.0)
    print(bad.name, bad.call, bad.iteration)
    ```

    ```text
    h 0 None
    ```
    """

    name: str
    collection: str
    call: int
    iteration: int | tuple[int, ...] | None
    backward: bool = False
    backward_search: bool = dataclasses.field(default=False, compare=False)

    def __str__(self) -> str:
        where = f"call {self.call}"
        if self.iteration is not None:
            where += f", scan iteration {self.iteration}"
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
        return said


_CODE = "effects-nonfinite-site:"


def _finite(leaves) -> jax.Array:
    ok = jnp.array(True)
    for x in leaves:
        if jnp.issubdtype(x.dtype, jnp.inexact):
            ok = ok & jnp.all(jnp.isfinite(x))
    return ok


def _count(acc, x):  # (executions so far, the first non-finite one or -1)
    n, first = acc
    return n + 1, jnp.where((first < 0) & ~_finite(jax.tree.leaves(x)), n, first)


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
            checkify.check(_finite(jax.tree.leaves(value)), f"{_CODE}{code}")
            return value
        count = ctx.emit(jnp.int32(0))
        assert count is not None  # (the mode is a reduction)
        said = (code, self.numbered)

        def checked(x):
            if not jnp.issubdtype(x.dtype, jnp.inexact):
                return x
            return _cotangent_check(x + self.zero.astype(x.dtype), said, count - 1)

        return jax.tree.map(checked, value)


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
        checkify.check(_finite([ct]), f"{_CODE}{code}:{{}}", n)
    else:
        checkify.check(_finite([ct]), f"{_CODE}{code}:")
    return ct, None


_cotangent_check.defvjp(_cotangent_check_fwd, _cotangent_check_bwd)


def find_nonfinite(
    fn: Callable, *args, backward: bool = False, **kwargs
) -> BadSite | None:
    """Finds the first tag whose value holds a NaN or an Inf: runs
    `fn(*args, **kwargs)` once, compiled, with a check at every tag.

    Returns the first failing tag in execution order, so never a tag that is
    non-finite only because an earlier one was. The program is compiled
    without XLA's fusion of operations, whose compile time on CPU grows with
    the square of the number of checks: each operation rounds on its own, as
    when JAX runs the function one operation at a time. Works through `jit`, `scan`,
    `cond` and `while_loop`; pass a model from
    [`fx.tag_modules`][effects.tag_modules] to check every layer. Every tag
    counts, whatever its collection, `jax.ad_checkpoint.checkpoint_name`s
    included (perturb sites do not); integer values are never non-finite.
    Arguments are treated as `eqx.filter_jit` treats them (arrays traced,
    other leaves static); Flax NNX objects are run on their state, which is
    left as it was.

    With `backward=True` (`fn` returns a scalar), it runs the backward pass
    too and, when every tagged value is finite, returns the first tag, in the
    order the backward pass computes cotangents, whose cotangent (the gradient
    of the output with respect to the tag's value) holds a NaN or an Inf: the
    site nearest the output where the gradient goes bad. In `h = tag(x * 0,
    "h"); s = tag(jnp.sqrt(h), "s")` that is `h`: the cotangent of `s` is
    finite, `sqrt`'s derivative at 0 is not. When the forward pass already
    holds a non-finite value, that value is the cause, and no cotangent it
    spoils is reported: it returns the site `backward=False` returns
    (`backward` False on it), whose `str()` says that the forward pass is
    already non-finite. Both run in one compiled program: the checked forward
    pass, then the gradient (its own forward pass and the backward pass). The
    value `fn` returns is not checked. A tag inside a function with a custom
    derivative (`custom_jvp`, `custom_vjp`) has no cotangent of its own (the
    custom rule differentiates the function as a whole): the backward check
    passes over it, and the forward check covers it.

    **Arguments:**

    - `fn`: the function to run.
    - `*args`, `**kwargs`: its arguments.
    - `backward`: whether to check the cotangents of the backward pass too,
      after the values.

    **Returns:**

    A [`BadSite`][effects.BadSite] naming the tag and the execution, or None
    when every checked value (and cotangent) is finite.

    **Raises:**

    - `ValueError`: `fn` has no tag (only tagged values are checked); with
      `backward=True`, `fn` does not return a scalar array,
      or a name is tagged both inside and outside a function with a custom
      derivative; a `jax.vmap` inside `fn` batches the predicate of a
      `lax.cond` or `lax.while_loop` (every example would run every branch or
      iteration: check one example at a time); tags sit in more than one
      `shard_map`, or in one called more than once (JAX's `checkify` fails
      on checks in two shard_maps: check one shard_map's function, or count
      non-finite values with [`fx.Stats`][effects.Stats]). From
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
        return None
    code, *n = message.split(_CODE)[1].split()[0].split(":")
    collection, name = keys[int(code)]
    # A cotangent's check says it is one (`code:`); checked again at that name
    # alone, which execution (`code:n`). (Numbering every name's in one check
    # costs JAX time quadratic in the number of tags.) A value's, forward,
    # says neither: its first bad execution is the one the counter saw.
    cotangent = bool(n)
    if n == [""]:
        message = _first_failure(fn, args, kwargs, backward, (collection, name))[2]
        assert message is not None  # (the same check fails)
        n = message.split(_CODE)[1].split()[0].split(":")[1:]
    if not cotangent:
        first = _numpy(found[collection][name][1])
        n = [first[first >= 0].min()]
    infos = listed[collection][name]
    bad = _bad_site(infos, collection, name, int(n[0]), cotangent)
    return dataclasses.replace(bad, backward_search=backward)


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
        try:
            (listed, keys, check), dynamic = eager_cached(what, fn, args, kwargs, make)
            errors, found = _run(check, dynamic, listed)
        except ValueError as e:
            # (a vmap inside ran every branch, or iteration, for every example)
            if not any(m in str(e) for m in _EVERY_EXAMPLE):
                raise
            said = str(e).removeprefix(f"{NonfiniteCheck.__name__}: ").split(". ")[0]
            raise ValueError(_PER_EXAMPLE.format(said)) from e
        message = next(filter(None, (err.get() for err in errors)), None)
        if message is None or _CODE in message:
            return listed, keys, message, found
    raise AssertionError("unreachable")


def _run(check, dynamic, listed):
    """`check(dynamic)`, where JAX's checkify fails on checks in two
    shard_maps (tests/test_jax_facts.py::
    test_checkify_fails_on_checks_in_two_shard_maps) an error that says so."""
    try:
        return check(dynamic)
    except TypeError as e:
        infos = [i for names in listed.values() for s in names.values() for i in s]
        in_shard_maps = any("shard_map" in i.where.split(" > ") for i in infos)
        if not (in_shard_maps and str(e).startswith(_CHECKIFY_SHARD_MAPS)):
            raise
        raise ValueError(_SHARD_MAPS) from e


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
_CHECKIFY_SHARD_MAPS = "select cases must have the same shapes"
_SHARD_MAPS = (
    "find_nonfinite: the function's tags sit in more than one `shard_map` "
    "(or in one it calls more than once), and JAX's `checkify`, which runs the "
    "checks, fails on checks in more than one shard_map in one program (jax "
    "0.7 to 0.12). Check the function that one shard_map maps "
    "(`fx.find_nonfinite(body, x_shard)`, on one shard's inputs), or count the "
    "non-finite values of every tag with `fx.summary(fx.handle(f, "
    "fx.Stats())(x)[1])`."
)
_NO_TAG = (
    "find_nonfinite: the function has no tag, and only tagged values are "
    "checked (not the value it returns). Tag the values to check "
    '(`fx.tag(h, "h")`), or pass a model through `fx.tag_modules(model)` to '
    "check every layer."
)


def _nonfinite_check(backward: bool, drop_own_checks: bool, numbered, call, dynamic):
    """`(listed, keys, check)` for `find_nonfinite`: the sites of
    `call(dynamic)`, the checked `(collection, name)`s (a message's code is an
    index into them), and `check(dynamic) -> (checkify errors, found)`, jitted,
    `found` the counters' (each name's first non-finite execution), with
    `backward` the backward pass's checks after the forward pass's (at the
    name `numbered` alone, where given, saying which execution); with
    `drop_own_checks`, the function's own `checkify.check`s dropped."""
    # Imported here: on jax 0.7-0.9 importing it registers checkify's rules in
    # JAX's tables, which `import effects` alone must not do.
    from jax.experimental import checkify

    if drop_own_checks:
        call = _without_checks(checkify, call)

    listed = sites(call)(dynamic)
    keys = tuple((c, n) for c, names in listed.items() for n in names)
    if not keys:
        raise ValueError(_NO_TAG)
    # Backward, not a tag inside a function with a custom derivative: it has no
    # cotangent of its own (the custom rule differentiates the function whole).
    custom = tuple(
        key
        for key in keys
        if all("custom" in info.loops for info in listed[key[0]][key[1]])
    )

    if numbered is not None:
        custom = tuple(key for key in keys if key != numbered)

    def output(zero, dynamic):
        numbering = numbered is not None
        checks = NonfiniteCheck(keys, True, zero, skip=custom, numbered=numbering)
        out, _ = handle(call, checks)(dynamic)
        if not (isinstance(out, jax.Array) and out.shape == ()):
            got = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), out
            )
            raise ValueError(
                "find_nonfinite(backward=True): the function must return a scalar "
                f"(the loss), got {got}."
            )
        return out

    def forward(dynamic):
        handlers = (NonfiniteCheck(keys), *(Tag(c, mode=_COUNTER) for c in listed))
        return handle(call, *handlers)(dynamic)[1]

    def backward_pass(dynamic):
        jax.grad(output)(jnp.float32(0), dynamic)

    # The forward checks run on a pass of their own: under `jax.grad`, JAX's
    # partial evaluation of a `scan` drops the checks of its forward part (they
    # have no output to keep). Each pass is checkified apart, their errors read
    # in order (a non-finite value wins over the cotangents it spoils):
    # checkify fails on a program whose checks sit in more than one
    # `shard_map` (tests/test_jax_facts.py::
    # test_checkify_fails_on_checks_in_two_shard_maps), which the two passes
    # of one in the same program are.
    forward_checked = checkify.checkify(forward, errors=checkify.user_checks)
    backward_checked = checkify.checkify(backward_pass, errors=checkify.user_checks)

    def check(dynamic):
        err, found = forward_checked(dynamic)
        errors = (err, backward_checked(dynamic)[0]) if backward else (err,)
        return errors, found

    return listed, keys, jax.jit(check, compiler_options=_NO_FUSION)


# Compiled without XLA's fusion pass. On CPU it copies a chain of cheap
# operations into every fusion that reads a value of it, and a check of every
# cotangent reads each value of the backward pass's chain: the program grows
# with the square of the number of tags (tests/test_jax_facts.py::
# test_xla_fusion_copies_a_chain_into_each_of_its_values_a_program_returns). With
# backward=True, 400 tags took 66 s to compile, 10 s without it. Run once to
# find a NaN, the program's unfused run costs less than that. Its operations
# are the function's, each rounded on its own as when JAX runs them one by one
# (fused, a multiply and an add may round once).
_NO_FUSION = {"xla_disable_hlo_passes": "fusion"}


def _without_checks(checkify, call):
    own = checkify.checkify(call, errors=checkify.user_checks)
    return lambda dynamic: own(dynamic)[1]


def _bad_site(infos, collection, name, k: int, backward: bool) -> BadSite:
    """The `k`-th execution of a name as a call and a scan iteration: when the
    name's only site has scans (and jits) alone around it, each call executes
    it the product of their lengths times."""
    info = infos[0]
    # (a scan with `reverse=True` runs its last position first: positions,
    # as `Tag()` stacks them, its label says so)
    regions = zip(info.where.split(" > "), info.loops)
    scans = [(n, label.endswith(", reverse)")) for label, n in regions if n is not None]
    lengths = [n for n, _ in scans]
    if len(infos) > 1 or not lengths or not all(isinstance(n, int) for n in lengths):
        return BadSite(name, collection, k, None, backward)
    call, k = divmod(k, math.prod(lengths))
    ran = np.unravel_index(k, lengths)
    index = tuple(int(n - 1 - i if rev else i) for i, (n, rev) in zip(ran, scans))
    iteration = index[0] if len(index) == 1 else index
    return BadSite(name, collection, call, iteration, backward)
