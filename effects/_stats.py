"""Statistics on the public API: `Stats`, a handler (on the public handler
protocol) that keeps summary statistics of each execution of a tag instead of
its value; and `summary`, which renders what `Tag` or `Stats` found as a
table. (`sites`, which lists every site of a program, lives with the walk it
lists, in `_sites`; `find_nonfinite` in `_nonfinite`.)"""

from __future__ import annotations

import functools
import html
import json
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.export
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _compat
from ._handlers import Append, Names, Tag
from ._layout import one_cond
from ._sites import text_table

STAT_KEYS = ("mean", "std", "min", "max", "mean_abs", "nan_count", "inf_count")


class Statistics(Mapping[str, Any]):
    """The statistics [`fx.Stats`][effects.Stats] keeps of one leaf of a
    tagged value: a read-only dict from `mean`, `std`, `min`, `max`,
    `mean_abs`, `nan_count` and `inf_count` to arrays (a pytree, so it goes
    through `jit` and `vmap`), which also knows the leaf it describes.

    **Attributes:**

    - `shape`, `dtype`: the leaf's, for one example.
    - `batch`: how many leading axes of each statistic are the batch axes
      of the `jax.vmap`s inside the handled function (one statistic per
      example).
    - `stacked`: what the trailing axes of each statistic are, after its
      batch axes: `"shard"` per `shard_map` around the tag (one per shard),
      then `"scan"` per `lax.scan` (one per iteration), as
      [`Context.stacking`][effects.Context] says.
      [`fx.summary`][effects.summary] combines the examples and the shards.
      Axes before the batch axes were stacked outside `handle` (a `jax.vmap`
      of the handled function, a `lax.scan` over training steps).

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

    __slots__ = ("_stats", "shape", "dtype", "stacked", "batch")

    def __init__(self, stats: Mapping[str, Any], shape, dtype, stacked=(), batch=0):
        self._stats = {k: stats[k] for k in STAT_KEYS}
        self.shape, self.dtype, self.stacked = tuple(shape), str(dtype), tuple(stacked)
        self.batch = int(batch)

    def __getitem__(self, key: str):
        return self._stats[key]

    def __iter__(self):
        return iter(self._stats)

    def __len__(self) -> int:
        return len(self._stats)

    def __repr__(self) -> str:
        about = f"shape={self.shape}, dtype={self.dtype}, stacked={self.stacked}"
        return f"Statistics({self._stats!r}, {about}, batch={self.batch})"

    def _flatten(self):
        # (JAX flattens with keys every output of a traced function, for its
        # result paths: a program with Stats at every operation has thousands)
        keys = tuple(zip(_DICT_KEYS, self._stats.values()))
        return keys, (self.shape, self.dtype, self.stacked, self.batch)

    @classmethod
    def _unflatten(cls, about, stats):
        return cls(dict(zip(STAT_KEYS, stats)), *about)


_DICT_KEYS = tuple(jax.tree_util.DictKey(k) for k in STAT_KEYS)

jax.tree_util.register_pytree_with_keys(
    Statistics,
    Statistics._flatten,
    Statistics._unflatten,
    lambda s: (tuple(s._stats.values()), (s.shape, s.dtype, s.stacked, s.batch)),
)
jax.export.register_pytree_node_serialization(
    Statistics,
    serialized_name="effects.Statistics",
    serialize_auxdata=lambda about: json.dumps(about).encode(),
    deserialize_auxdata=lambda data: tuple(map(_tuple_or_str, json.loads(data))),
)


def _tuple_or_str(x):
    return x if isinstance(x, (str, int)) else tuple(x)


def _leaf_stats(x, xp=jnp) -> dict[str, Any]:
    """Statistics of `x`, one example's value: moments and extremes over the
    finite values, counts of the rest. With `xp=np`, in NumPy and float64. A
    PRNG key is summarised by its key data (`jax.random.key_data`)."""
    if _compat.is_key(x):
        x = jax.random.key_data(x)
    if xp.iscomplexobj(x):
        x = xp.abs(x)
    if xp is np or not xp.issubdtype(x.dtype, xp.floating) or x.dtype.itemsize < 4:
        x = x.astype(np.float64 if xp is np else np.float32)
    if xp is jnp:
        # (a report's figures, not differentiated: JAX's linearization cannot
        # split a custom_vmap)
        return dict(zip(STAT_KEYS, _traced_once(lax.stop_gradient(x))))
    finite, nan = np.isfinite(x), np.float64(np.nan)
    count = np.sum(finite)
    n = np.maximum(count, 1)
    # Moments of the values over the largest of them: the sums of finite
    # values near the dtype's largest would overflow.
    scale = np.max(np.abs(x), initial=0, where=finite)
    scale = scale if scale > 0 else 1.0
    y = x / scale
    mean = np.sum(y, where=finite) / n

    def some(v):  # NaN where there is no finite value
        return v if count > 0 else nan

    return {
        "mean": some(mean * scale),
        "std": some(np.sqrt(np.sum((y - mean) ** 2, where=finite) / n) * scale),
        "min": some(np.min(x, initial=np.inf, where=finite)),
        "max": some(np.max(x, initial=-np.inf, where=finite)),
        "mean_abs": some(np.sum(np.abs(y), where=finite) / n * scale),
        "nan_count": np.sum(np.isnan(x), dtype=np.int32),
        "inf_count": np.sum(np.isinf(x), dtype=np.int32),
    }


# On device, the same statistics in `lax`, in as few passes over the value as
# XLA's CPU code makes fast: it vectorizes a reduction of arithmetic (a sum, a
# maximum) but not one that reads a comparison (`isfinite`, a mask), several
# times slower, nor one over a value it shares between reductions, which it
# writes out. The common case, every value finite and the sums in range, is
# four passes: the extremes, then the moments' plain sums; a NaN or an Inf in
# the value, or a sum out of range, makes one of them non-finite, and then a
# cond computes them again with masks, over the largest value. Under vmaps,
# one cond for all the examples (JAX would make a batched cond a select, which
# runs both): the masks where any example needs them.


def _fast(x) -> tuple[tuple[Any, ...], Any]:
    """The statistics of `x` if its values are finite and its sums in range,
    and whether they are."""
    axes = tuple(range(x.ndim))
    lo, hi = _extremes(x, x)
    n = np.array(max(x.size, 1), x.dtype)
    mean = lax.reduce_sum(x, axes) / n
    mean_abs = lax.reduce_sum(lax.abs(x), axes) / n
    std = lax.sqrt(lax.reduce_sum(lax.square(x - mean), axes) / n)
    # (in a shard_map, zeros that vary over its axes as the counts computed do)
    zero = _compat.vary_like(np.int32(0), jax.typeof(mean))
    # (XLA's min and max propagate a NaN; the sums overflow to an Inf or a NaN;
    # the squares of tiny values underflow to a std of 0 between unequal ones)
    finite = [lax.is_finite(v) for v in (lo, hi, mean, std, mean_abs)]
    spread = lax.bitwise_or(lax.gt(std, np.array(0, x.dtype)), lax.eq(lo, hi))
    clean = functools.reduce(lax.bitwise_and, finite, spread)
    return (mean, std, lo, hi, mean_abs, zero, zero), clean


def _extremes(lo, hi):
    """The minimum of `lo` and the maximum of `hi`, in one pass over both."""
    inf = np.array(np.inf, lo.dtype)
    return lax.reduce((lo, hi), (inf, -inf), _min_max, tuple(range(lo.ndim)))


def _min_max(a, b):
    return lax.min(a[0], b[0]), lax.max(a[1], b[1])


def _stats_with_masks(x):
    """The statistics over the finite values of `x`, the moments as sums of
    the values over a scale, 2**-20 of the largest: sums of finite values near
    the dtype's largest would overflow, and squares of tiny ones underflow.
    (Not the largest itself: XLA divides by multiplying by the reciprocal,
    which for a divisor near the dtype's largest is below its smallest normal
    value, and flushed to zero.)"""
    axes, dtype = tuple(range(x.ndim)), x.dtype
    finite = lax.is_finite(x)
    # (counted in floats where they are exact, up to 2**24: XLA's CPU compiler
    # takes twice as long over a sum of integers)
    tally = np.float32 if x.size <= 2**24 else np.int32

    def counted(bits):
        total = lax.reduce_sum(lax.convert_element_type(bits, tally), axes)
        return lax.convert_element_type(total, np.int32)

    count, nans = counted(finite), counted(lax.ne(x, x))
    big, zeros = lax.full_like(x, np.inf), lax.full_like(x, 0)
    inf = np.array(np.inf, dtype)
    lo, hi = _extremes(lax.select(finite, x, big), lax.select(finite, x, -big))
    largest = lax.max(lax.abs(lo), lax.abs(hi))  # (Inf where none is finite)
    usable = lax.bitwise_and(
        lax.ge(largest, np.array(2**-100, dtype)), lax.lt(largest, inf)
    )
    scale = lax.select(usable, largest * np.array(2**-20, dtype), np.array(1, dtype))
    n = lax.convert_element_type(lax.max(count, np.int32(1)), dtype)
    y = lax.select(finite, x / scale, zeros)
    mean = lax.reduce_sum(y, axes) / n
    centred = lax.select(finite, y - mean, zeros)
    std = lax.sqrt(lax.reduce_sum(lax.square(centred), axes) / n)
    mean_abs = lax.reduce_sum(lax.abs(y), axes) / n
    some, nan = lax.gt(count, np.int32(0)), np.array(np.nan, dtype)
    mean, std, lo, hi, mean_abs = (
        lax.select(some, v, nan)
        for v in (mean * scale, std * scale, lo, hi, mean_abs * scale)
    )
    return mean, std, lo, hi, mean_abs, nans, np.int32(x.size) - count - nans


# (one jit, so that JAX traces and lowers them once per type: a program
# taps thousands of values of a few types)
_traced_once = jax.jit(one_cond(_fast, _stats_with_masks))


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
    renders them as a table. The statistics are figures to read, not to
    differentiate: `jax.grad` sees them as constants. (To differentiate a
    value's statistics, compute them from what [`Tag`][effects.Tag]
    collects.)

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
            stats = _leaf_stats(x)
            return Statistics(stats, shape, dtype, ctx.stacking, ctx.batch_axes)

        ctx.emit(jax.tree.map(leaf, value))
        return value


_STATS = Append(label="Stats()")
_STATS_OF_BATCH = Append(label="Stats(per_example=False)", per_example=False)


#
# summary
#


# A summary's columns, in order (`outer` and `examples` where a row has one):
# what a row is of, then its statistics.
_COLUMNS = ("name", "call", "outer", "index", "shape", "dtype", "examples")
_COLUMNS += (*STAT_KEYS, "finite")


class Summary:
    """What [`Tag`][effects.Tag] or [`Stats`][effects.Stats] found, as a
    table: [`fx.summary`][effects.summary] returns one.

    `str()` (and `print`) gives plain text, aligned in columns; in a Jupyter
    notebook it renders as an HTML table, non-finite rows highlighted.

    **Attributes:**

    - `rows`: the table's rows, a list of dicts: `name`, `call` (the
      execution's index among the name's), `outer` (for a `Stats` entry that
      a transformation outside `handle` stacked, a `lax.scan` over steps or
      a `jax.vmap` of the handled function: the index along those axes; else
      None), `index` (the index along the
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
      `outer` or `examples` where no row has one.
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
        none = {c for c in ("outer", "examples") if all(r.get(c) is None for r in rows)}
        self.columns = tuple(c for c in _COLUMNS if c not in none)
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

    __repr__ = __str__

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
    transformation outside `handle` stacked (a `lax.scan` over training
    steps, a `jax.vmap` of the handled function) are neither: each index
    along them gets rows of its own, the index in an `outer` column (a step's
    statistics are never pooled with another's).

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
        base: dict[str, Any] = dict(name=name, call=call, outer=None, examples=None)
        stats, base["shape"], base["dtype"] = _host_stats(leaf)
        if not isinstance(leaf, Statistics):
            rows += _indexed(base, stats)
            continue
        base["shape"], base["dtype"] = leaf.shape, leaf.dtype
        # Its axes: those stacked outside `handle`, the batch axes, the
        # shards' (the statistics of parts of one value), then the scans'.
        scans = leaf.stacked.count("scan")
        # (none where the user indexed axes out: those left are taken as the
        # batch's, then the scans')
        n_outer = max(stats["mean"].ndim - leaf.batch - len(leaf.stacked), 0)
        for outer in np.ndindex(stats["mean"].shape[:n_outer]):
            part = {k: v[outer] for k, v in stats.items()}
            batch = part["mean"].shape[: part["mean"].ndim - scans]
            if batch and not per_example:
                part = _over_examples(part, math.prod(leaf.shape), len(batch))
            if batch:
                base["examples"] = 1 if per_example else math.prod(batch)
            rows += _indexed({**base, "outer": outer or None}, part)
    return rows


def _indexed(base: dict[str, Any], stats) -> list[dict[str, Any]]:
    """One row per index of the statistics' axes."""
    rows = []
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
    if _compat.is_key(leaf):
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
