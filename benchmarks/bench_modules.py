"""Group 8: `tag_modules` on 100-layer Equinox, Flax linen and Flax NNX MLPs
against the same models with the same `fx.tag` calls written into their code.

The model is a list of 100 blocks (`tanh(Linear(128, 128)(h))`, batch 32 by
`jax.vmap`). Measured, A vs B:

- unhandled: `tag_modules(model)` vs the model itself (optimized HLO);
- handled with `fx.Tag()`: `tag_modules(model)` vs the hand-tagged model
  (optimized HLO, run time, and cold trace+lower, with a new model object every
  round so no cache keyed on the function helps); for linen and NNX, cold
  trace+lower only (their HLO is tested in `tests/test_modules.py`).

Run with `python benchmarks/bench_modules.py [--append FILE] [--quick]`;
`--smoke` runs it once with 4 layers.
"""

import itertools

import equinox as eqx
import flax.linen as nn
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
from flax import nnx

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


def make(tagged: bool, layers: int = LAYERS) -> Model:
    keys = jax.random.split(jax.random.key(0), layers)
    return Model([Block(eqx.nn.Linear(WIDTH, WIDTH, key=k)) for k in keys], tagged)


def handled(model):
    return fx.handle(lambda m, xs: jax.vmap(m)(xs), fx.Tag())


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, h):
        return jnp.tanh(nn.Dense(WIDTH)(h))


class LinenModel(nn.Module):
    tagged: bool = False
    layers: int = LAYERS
    instance: int = 0  # unused: makes each round's module distinct

    @nn.compact
    def __call__(self, h):
        for i in range(self.layers):
            h = LinenBlock()(h)
            if self.tagged:
                h = fx.tag(h, f"LinenBlock_{i}")
        return h


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, h):
        return jnp.tanh(self.lin(h))


class NnxModel(nnx.Module):
    def __init__(self, tagged, rngs, layers=LAYERS):
        self.tagged = tagged
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(layers)])

    def __call__(self, h):
        for i, block in enumerate(self.blocks):
            h = block(h)
            if self.tagged:
                h = fx.tag(h, f"blocks.{i}")
        return h


_instances = itertools.count()


def flax_rows(xs, repeats, layers):
    """Cold trace+lower, `tag_modules` vs hand-tagged, for linen and NNX."""
    params = LinenModel(layers=layers).init(jax.random.key(0), xs)

    def linen(tagged_by_hand):
        def thunk():
            model = LinenModel(tagged_by_hand, layers, next(_instances))
            if not tagged_by_hand:
                model = fx.tag_modules(model, filter=LinenBlock)
            apply = fx.handle(model.apply, fx.Tag())
            return lambda: jax.jit(apply).lower(params, xs)

        return thunk

    def nnx_model(tagged_by_hand):
        def thunk():
            model = NnxModel(tagged_by_hand, nnx.Rngs(0), layers)
            if not tagged_by_hand:
                model = fx.tag_modules(model, filter=NnxBlock)
            run = fx.handle(lambda m, xs: m(xs), fx.Tag())
            return lambda: jax.jit(lambda xs: run(model, xs)).lower(xs)

        return thunk

    rows = []
    for label, make_thunk in (("Flax linen", linen), ("Flax NNX", nnx_model)):
        pair = compare_cold(make_thunk(False), make_thunk(True), repeats=3 * repeats)
        rows.append(
            ratio_row(f"{label}: handled, cold trace+lower", pair, 1.2, "≤ 1.2")
        )
    return rows


def main():
    args = arguments(__doc__.splitlines()[0])
    repeats = 5 if args.quick else 11
    layers = 4 if args.smoke else LAYERS
    xs = jax.random.normal(jax.random.key(1), (32, WIDTH))
    plain, by_hand = make(False, layers), make(True, layers)
    auto = fx.tag_modules(plain, filter=Block)

    rows = [
        identical_row(
            "Equinox: unhandled, optimized HLO, `tag_modules` vs the model",
            optimized_hlo(lambda xs: jax.vmap(auto)(xs), xs),
            optimized_hlo(lambda xs: jax.vmap(plain)(xs), xs),
        ),
        identical_row(
            "Equinox: handled, optimized HLO, `tag_modules` vs hand-tagged",
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
    rows.append(ratio_row("Equinox: handled, run time", pair, 1.02, "≤ 1.02 †"))

    def cold(make_model):
        def thunk():
            model = make_model()
            return lambda: jax.jit(lambda xs: handled(model)(model, xs)).lower(xs)

        return thunk

    pair = compare_cold(
        cold(lambda: fx.tag_modules(make(False, layers), filter=Block)),
        cold(lambda: make(True, layers)),
        repeats=3 * repeats,
    )
    rows.append(ratio_row("Equinox: handled, cold trace+lower", pair, 1.2))
    rows += flax_rows(xs, repeats, layers)
    emit(
        table(
            f"8. `tag_modules`, {layers} layers: `tag_modules` (A) vs B",
            ("A", "B"),
            rows,
        ),
        args,
    )


if __name__ == "__main__":
    main()
