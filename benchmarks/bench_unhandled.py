"""Group 1: with no handler, tags cost nothing.

- The optimized HLO of `jax.jit(f_tagged)` equals that of `jax.jit(f_untagged)`,
  after stripping metadata and names: a small function and the 200-layer MLP.
- Dispatch: a jitted tagged function called in a loop on a small input vs the
  untagged one (JAX's C++ fast path must stay on): at most 1.05x.
- Run time of the jitted 200-layer MLP, tagged vs untagged.
- Cold trace+lower of the 200-layer MLP, tagged vs untagged (fresh function
  objects each round): what a tag costs before XLA (no target: a tag is one
  equation more per layer, and JAX's binding of a primitive has its price).

Run with `python benchmarks/bench_unhandled.py [--append FILE] [--quick]`;
`--smoke` runs a 4-layer MLP once.
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


def small(x, tag=fx.tag):
    a = tag(jnp.sin(x), "a")
    b = tag(a * x + 1.0, "b")
    return tag(jnp.sum(b * b), "c")


def small_untagged(x):
    return small(x, tag=lambda v, _: v)


def mlp(params, x, tag=fx.tag):
    h = x
    for i, w in enumerate(params):
        h = tag(jnp.tanh(h @ w), f"layer{i}")
    return h


def mlp_untagged(params, x):
    return mlp(params, x, tag=lambda v, _: v)


def main():
    args = arguments(__doc__.splitlines()[0])
    repeats = 5 if args.quick else 21
    layers = 4 if args.smoke else 200
    x_small = jnp.linspace(0.0, 1.0, 8)
    params = mlp_params(layers)
    x = jax.random.normal(jax.random.key(1), (32, 128))

    rows = [
        identical_row(
            "optimized HLO, small function",
            optimized_hlo(small, x_small),
            optimized_hlo(small_untagged, x_small),
        ),
        identical_row(
            f"optimized HLO, {layers}-layer MLP",
            optimized_hlo(mlp, params, x),
            optimized_hlo(mlp_untagged, params, x),
        ),
    ]
    tagged, untagged = jax.jit(small), jax.jit(small_untagged)
    pair = compare(
        blocking(tagged, x_small),
        blocking(untagged, x_small),
        repeats=3 * repeats,
        number=2000,
        warmup=100,
    )
    rows.append(ratio_row("dispatch per call, small input (8 floats)", pair, 1.05))
    tagged, untagged = jax.jit(mlp), jax.jit(mlp_untagged)
    pair = compare(
        blocking(tagged, params, x),
        blocking(untagged, params, x),
        repeats=3 * repeats,
        number=5,
        warmup=3,
    )
    rows.append(ratio_row(f"run time, {layers}-layer MLP", pair, 1.02, "≤ 1.02 †"))

    def lowering(fn):
        # A new function object each round: no cache keyed on it helps.
        return lambda: lambda: jax.jit(lambda *a: fn(*a)).lower(params, x)

    pair = compare_cold(lowering(mlp), lowering(mlp_untagged), repeats=repeats)
    rows.append(ratio_row(f"cold trace+lower, {layers}-layer MLP", pair, None, "—"))
    emit(
        table("1. Unhandled: tagged (A) vs untagged (B)", ("tagged", "untagged"), rows),
        args,
    )


if __name__ == "__main__":
    main()
