"""Shared helpers for the benchmark scripts: interleaved A/B timing, optimized-HLO
comparison, and the Markdown table each script prints (and can append to a
results file).

Each measurement alternates A and B within a round (A first on even rounds, B
first on odd ones, so neither always runs on a warmer cache), with a garbage
collection before each timed call and the collector off while it runs (as
`timeit` does; what existed before the measurement is frozen out of the
collector, so these collections stay cheap). The reported times are the medians
over the rounds of A and of B, and the ratio is the median over the rounds of
A / B: pairing the two calls of a round cancels slow drifts of the machine.

With `--smoke` (what `run_all.py --smoke` passes), every measurement is one
round of one call with no warm-up: the script runs its smallest case once and
checks its values, and its times mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

#
# Timing
#

# Set by `arguments` from `--smoke`. One switch here, rather than one per
# script: every `compare` and `compare_cold` of every script obeys it.
_smoke = False


@dataclasses.dataclass(frozen=True)
class Pair:
    """The times (seconds) of A and of B, one per round."""

    times_a: tuple[float, ...]
    times_b: tuple[float, ...]

    @property
    def a(self) -> float:
        return statistics.median(self.times_a)

    @property
    def b(self) -> float:
        return statistics.median(self.times_b)

    @property
    def ratios(self) -> list[float]:
        return [a / b for a, b in zip(self.times_a, self.times_b)]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def spread(self) -> tuple[float, float]:
        """The interquartile range of the per-round ratios."""
        q = statistics.quantiles(self.ratios, n=4) if len(self.ratios) > 1 else []
        return (q[0], q[2]) if q else (self.ratio, self.ratio)


def _timed(fn: Callable[[], object], number: int) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        return (time.perf_counter() - start) / number
    finally:
        gc.enable()


def _rounds(
    make_a: Callable[[], Callable[[], object]],
    make_b: Callable[[], Callable[[], object]],
    repeats: int,
    number: int,
) -> Pair:
    gc.collect()
    gc.freeze()
    try:
        times_a: list[float] = []
        times_b: list[float] = []
        for i in range(repeats):
            order = ((make_a, times_a), (make_b, times_b))
            for make, times in order if i % 2 == 0 else order[::-1]:
                times.append(_timed(make(), number))
    finally:
        gc.unfreeze()
    return Pair(tuple(times_a), tuple(times_b))


def compare(
    a: Callable[[], object],
    b: Callable[[], object],
    *,
    repeats: int,
    number: int = 1,
    warmup: int = 1,
) -> Pair:
    """Times repeated calls of `a` and of `b` (`number` calls per round, `repeats`
    rounds), interleaved. Use for warm calls: run time, dispatch."""
    if _smoke:
        repeats, number, warmup = 1, 1, 0
    for _ in range(warmup):
        a()
        b()
    return _rounds(lambda: a, lambda: b, repeats, number)


def compare_cold(
    make_a: Callable[[], Callable[[], object]],
    make_b: Callable[[], Callable[[], object]],
    *,
    repeats: int,
    warmup: int = 1,
) -> Pair:
    """Times one call of a fresh thunk from `make_a()` against one from `make_b()`
    per round, interleaved. `make_*` builds new function objects each time (not
    timed), so no cache keyed on them helps: use for cold trace and lowering."""
    if _smoke:
        repeats, warmup = 1, 0
    for _ in range(warmup):
        make_a()()
        make_b()()
    return _rounds(make_a, make_b, repeats, 1)


def blocking(fn: Callable, *args) -> Callable[[], object]:
    """A thunk calling `fn(*args)` and waiting for every array it returns."""
    return lambda: jax.block_until_ready(fn(*args))


#
# Comparing values
#


def plain_dicts(tree):
    """`tree` with every mapping made a plain `dict`, all the way down: what
    `handle` returns (`fx.Found`, and `fx.Statistics` from `fx.Stats`) is a
    pytree of its own type, which `jax.tree.map` will not pair with the dicts
    a hand-written reference returns. Every key and value is kept."""
    if isinstance(tree, Mapping):
        return {k: plain_dicts(v) for k, v in tree.items()}
    if type(tree) in (tuple, list):
        return type(tree)(plain_dicts(v) for v in tree)
    return tree


#
# Optimized HLO, normalised as in tests/helpers.py
#

_LOCATION_TABLES = r"^(\d+ [{\"]|FileNames|FunctionNames|FileLocations|StackFrames)"


def optimized_hlo(fn, *args) -> str:
    """The optimized HLO of `jax.jit(fn)(*args)`, without metadata and names, so
    two programs that compute the same thing the same way compare equal. (A copy
    of `tests/helpers.py`'s, so the benchmarks need nothing from the tests.)"""
    text = jax.jit(fn).lower(*args).compile().as_text()
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"^HloModule \S+", "HloModule m", text, flags=re.M)
    names: dict[str, str] = {}

    def rename(m):
        return names.setdefault(m.group(0), f"%v{len(names)}")

    text = re.sub(r"%[\w.\-]+", rename, text)
    lines = [
        line.rstrip()
        for line in text.splitlines()
        if line.strip() and not re.match(_LOCATION_TABLES, line)
    ]
    return "\n".join(lines)


#
# Shared model
#


def mlp_params(n_layers: int, width: int = 128, seed: int = 0) -> list[jax.Array]:
    """`n_layers` weight matrices (drawn at once: op-by-op draws are slow)."""
    w = jax.random.normal(jax.random.key(seed), (n_layers, width, width))
    return [jnp.asarray(m) for m in np.asarray(w / np.sqrt(width))]


#
# Tables
#


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of a table: what is compared, the two measured values, their ratio
    (or another derived number), the target, and whether it is met (None: no
    target, shown for context)."""

    what: str
    a: str
    b: str
    ratio: str
    target: str
    met: bool | str | None  # a string: "within noise"
    spread: str = "—"  # the interquartile range of the per-round ratios
    timed: bool = False  # a ratio of times (meaningless in a smoke run)


def seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} µs"


def nbytes(n: int) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def ratio_row(what: str, pair: Pair, limit: float | None, target: str = "") -> Row:
    """A timing row whose target, if any, is `ratio <= limit`: met when the
    whole interquartile range of the per-round ratios is, missed when none of
    it is, and within noise when the range straddles the limit."""
    low, high = pair.spread
    met: bool | str | None = None
    if limit is not None:
        met = True if high <= limit else (False if low > limit else "within noise")
    return Row(
        what,
        seconds(pair.a),
        seconds(pair.b),
        f"{pair.ratio:.3f}",
        target or ("—" if limit is None else f"≤ {limit:g}"),
        met,
        f"{low:.3f}–{high:.3f}",
        timed=True,
    )


def identical_row(what: str, a: str, b: str) -> Row:
    same = a == b
    return Row(
        what,
        f"{len(a.splitlines())} lines",
        f"{len(b.splitlines())} lines",
        "identical" if same else "differs",
        "identical",
        same,
    )


def heading(title: str) -> str:
    """A section's Markdown heading, which in a smoke run says so."""
    note = " (smoke run: one call each, times mean nothing)" if _smoke else ""
    return f"### {title}{note}"


def table(title: str, columns: tuple[str, str], rows: Sequence[Row]) -> str:
    """A Markdown section: `columns` names the A and B columns.

    In a smoke run no ratio of times is shown or judged, and a row that is
    not timed and misses its target (an HLO that differs, memory that grows,
    a compilation) fails the script, with the table as the message."""
    head = ["benchmark", *columns, "ratio A/B", "spread (IQR)", "target", "met"]
    if _smoke:
        rows = [
            dataclasses.replace(r, ratio="—", spread="—", met="smoke") if r.timed else r
            for r in rows
        ]
    lines = [
        heading(title),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" for _ in head) + "|",
    ]
    for r in rows:
        if isinstance(r.met, str):
            met = r.met
        else:
            met = "—" if r.met is None else ("yes" if r.met else "**no**")
        cells = (r.what, r.a, r.b, r.ratio, r.spread, r.target, met)
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    missed = [r.what for r in rows if r.met is False]
    if _smoke and missed:
        raise SystemExit(f"{text}\nsmoke run: targets missed: {missed}")
    return text


def arguments(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--append", metavar="FILE", help="also append the table to this file"
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest case once, to check that it runs and that its values "
        "agree: times mean nothing, and `--append` is refused",
    )
    args = parser.parse_args()
    if args.smoke and args.append:
        parser.error("--smoke writes no results: leave out --append")
    global _smoke
    _smoke = args.smoke
    if args.smoke:
        # A smoke run compiles much and runs little: XLA's backend (LLVM)
        # optimisation would be most of its time. Both sides of every
        # comparison are compiled alike.
        jax.config.update("jax_disable_most_optimizations", True)
    return args


def emit(text: str, args: argparse.Namespace) -> None:
    print(text, flush=True)
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write(text + "\n")
