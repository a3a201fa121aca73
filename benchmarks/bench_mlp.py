"""Group 2: a handled 200-layer MLP against the hand-written function that returns
the same intermediates.

The MLP has width 128 and batch 32; every layer's output is tagged with `fx.tag`
and collected with `fx.handle(f, fx.Tag())`. The hand-written function returns
`(out, {"intermediates": {name: (h,)}})`, what the handled one returns.

- Optimized HLO identical.
- Run time of the two jitted functions.
- Cold trace+lower (`jax.jit(...).lower(...)`) with fresh function objects every
  round, so no cache keyed on the function helps, at 200, 800 and 1600 layers,
  and at 800 layers with only 20 of them tagged; and how the handled cost grows
  from 200 to 800 layers (4x the layers).
- Tracing the same handled function again under a new outer `jax.jit` (the
  rewrite is cached, so only lowering is left) against the cold hand-written
  trace+lower.

Targets: identical optimized HLO; run time at most 1.02x; cold trace+lower at
most 1.25x the hand-written one at every depth; 800 layers at most 4.3x the
handled 200 layers; the trace again under a new outer jit at most 0.75x the cold
hand-written trace+lower.

Run with `python benchmarks/bench_mlp.py [--append FILE] [--quick]`; `--smoke`
runs it once at 4, 8 and 16 layers.
"""

import jax
import jax.numpy as jnp
from _timing import (
    arguments,
    blocking,
    compare,
    compare_cold,
    emit,
    identical_row,
    mlp_params,
    optimized_hlo,
    ratio_row,
    table,
)

import effects as fx


def make_tagged(every: int = 1):
    # A new function object on every call: caches keyed on the function miss.
    # Every `every`-th layer is tagged.
    def f(params, x):
        h = x
        for i, w in enumerate(params):
            h = jnp.tanh(h @ w)
            h = fx.tag(h, f"layer{i}") if i % every == 0 else h
        return h

    return f


def make_hand_written(every: int = 1):
    def hand(params, x):
        h = x
        found = {}
        for i, w in enumerate(params):
            h = jnp.tanh(h @ w)
            if i % every == 0:
                found[f"layer{i}"] = (h,)
        # In program order, as `found` is (a plain dict flattens sorted).
        return h, fx.Found(intermediates=fx.Found(found))

    return hand


def handled(every: int = 1):
    return fx.handle(make_tagged(every), fx.Tag())


def trace_lower(make_fn, *args):
    return lambda: lambda: jax.jit(make_fn()).lower(*args)


def main():
    args = arguments(__doc__.splitlines()[0])
    repeats = 5 if args.quick else 15
    small, large = (4, 16) if args.smoke else (200, 800)
    x = jax.random.normal(jax.random.key(1), (32, 128))
    params = mlp_params(small)

    rows = [
        identical_row(
            f"optimized HLO, {small} layers",
            optimized_hlo(handled(), params, x),
            optimized_hlo(make_hand_written(), params, x),
        )
    ]
    pair = compare(
        blocking(jax.jit(handled()), params, x),
        blocking(jax.jit(make_hand_written()), params, x),
        repeats=4 * repeats,
        number=5,
        warmup=3,
    )
    rows.append(ratio_row(f"run time, {small} layers", pair, 1.02))

    sized = {small: params, large: mlp_params(large), 2 * large: mlp_params(2 * large)}
    for n, p in sized.items():
        pair = compare_cold(
            trace_lower(handled, p, x),
            trace_lower(make_hand_written, p, x),
            repeats=repeats,
        )
        rows.append(ratio_row(f"cold trace+lower, {n} layers", pair, 1.25))
    # Few sites in a long program: the rewrite costs what the sites cost.
    every = max(large // 20, 1)
    n_tagged = len(range(0, large, every))
    pair = compare_cold(
        trace_lower(lambda: handled(every), sized[large], x),
        trace_lower(lambda: make_hand_written(every), sized[large], x),
        repeats=repeats,
    )
    rows.append(
        ratio_row(
            f"cold trace+lower, {large} layers, {n_tagged} of them tagged", pair, 1.25
        )
    )
    # The same handled function under a new outer jit each round: its rewrite
    # is cached (it was traced once before), the hand-written one is traced
    # afresh, as a new training step function would be.
    again = handled()
    jax.jit(again).lower(params, x)

    def retrace():
        return lambda: jax.jit(lambda p, x: again(p, x)).lower(params, x)

    pair = compare_cold(
        retrace, trace_lower(make_hand_written, params, x), repeats=repeats
    )
    rows.append(
        ratio_row(
            "trace+lower again under a new outer jit (A) vs cold hand-written (B), "
            f"{small} layers",
            pair,
            0.75,
        )
    )
    # The growth is measured side by side too: 800 layers (A) vs 200 (B).
    for label, make_fn, limit in (
        ("handled", handled, 4.3),
        ("hand-written", make_hand_written, None),
    ):
        pair = compare_cold(
            trace_lower(make_fn, sized[large], x),
            trace_lower(make_fn, params, x),
            repeats=repeats,
        )
        rows.append(
            ratio_row(
                f"growth {small} → {large} layers, {label} (A: {large}, B: {small})",
                pair,
                limit,
            )
        )
    emit(
        table(
            "2. Handled MLP: `handle(f, Tag())` (A) vs hand-written (B)",
            ("handled", "hand-written"),
            rows,
        ),
        args,
    )


if __name__ == "__main__":
    main()
