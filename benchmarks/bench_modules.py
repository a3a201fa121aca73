"""Group 8: `tag_modules` on a 100-layer Equinox MLP against the same model with
the same `fx.tag` calls written into its code.

The model is a list of 100 blocks (`tanh(Linear(128, 128)(h))`, batch 32 by
`jax.vmap`). Measured, A vs B:

- unhandled: `tag_modules(model)` vs the model itself (optimized HLO);
- handled with `fx.Tag()`: `tag_modules(model)` vs the hand-tagged model
  (optimized HLO, run time, and cold trace+lower, with a new model object every
  round so no cache keyed on the function helps).

Run with `python benchmarks/bench_modules.py [--append FILE]`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from _timing import (
    arguments,
    blocking,
    compare,
    compare_cold,
    emit,
    identical_row,
    optimized_hlo,
    ratio_row,
    table,
)

import effects as fx

LAYERS, WIDTH = 100, 128


class Block(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, h):
        return jnp.tanh(self.lin(h))


class Model(eqx.Module):
    blocks: list
    tagged: bool = eqx.field(static=True, default=False)

    def __call__(self, h):
        for i, block in enumerate(self.blocks):
            h = block(h)
            if self.tagged:  # what tag_modules(filter=Block) does, by hand
                h = fx.tag(h, f"blocks.{i}")
        return h


def make(tagged: bool) -> Model:
    keys = jax.random.split(jax.random.key(0), LAYERS)
    return Model([Block(eqx.nn.Linear(WIDTH, WIDTH, key=k)) for k in keys], tagged)


def handled(model):
    return fx.handle(lambda m, xs: jax.vmap(m)(xs), fx.Tag())


def main():
    args = arguments(__doc__.splitlines()[0])
    repeats = 5 if args.quick else 11
    xs = jax.random.normal(jax.random.key(1), (32, WIDTH))
    plain, by_hand = make(False), make(True)
    auto = fx.tag_modules(plain, filter=Block)

    rows = [
        identical_row(
            "unhandled: optimized HLO, `tag_modules` vs the model",
            optimized_hlo(lambda xs: jax.vmap(auto)(xs), xs),
            optimized_hlo(lambda xs: jax.vmap(plain)(xs), xs),
        ),
        identical_row(
            "handled: optimized HLO, `tag_modules` vs hand-tagged",
            optimized_hlo(lambda xs: handled(auto)(auto, xs), xs),
            optimized_hlo(lambda xs: handled(by_hand)(by_hand, xs), xs),
        ),
    ]
    pair = compare(
        blocking(eqx.filter_jit(lambda m, xs: handled(m)(m, xs)), auto, xs),
        blocking(eqx.filter_jit(lambda m, xs: handled(m)(m, xs)), by_hand, xs),
        repeats=6 * repeats,
        number=4,
        warmup=3,
    )
    rows.append(ratio_row("handled: run time", pair, 1.02, "≤ 1.02 †"))

    def cold(make_model):
        def thunk():
            model = make_model()
            return lambda: jax.jit(lambda xs: handled(model)(model, xs)).lower(xs)

        return thunk

    pair = compare_cold(
        cold(lambda: fx.tag_modules(make(False), filter=Block)),
        cold(lambda: make(True)),
        repeats=3 * repeats,
    )
    rows.append(
        ratio_row(
            "handled: cold trace+lower (model made each round, untimed)", pair, 1.2
        )
    )
    emit(
        table(
            f"8. `tag_modules`, Equinox, {LAYERS} layers: `tag_modules` (A) vs B",
            ("A", "B"),
            rows,
        ),
        args,
    )


if __name__ == "__main__":
    main()
