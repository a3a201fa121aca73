"""Group 11: time to the first result of a 4-block Equinox transformer: trace,
lower, compile and run, with a new model object and new functions every round
so no cache keyed on them helps.

- `fx.handle(model, fx.Tag())` with every block's output tagged, against the
  hand-written model returning the same values;
- `fx.handle(model, fx.Tag(names="nothing*"))` (a handler matching no site)
  against the plain model.

Targets: at most 1.15x the hand-written model under `Tag()`; at most 1.05x
the plain model under a handler matching nothing.

Run with `python benchmarks/bench_first_result.py [--append FILE]`.
"""

import itertools

import equinox as eqx
import jax
from _timing import arguments, compare_cold, emit, ratio_row, table

import effects as fx

BLOCKS, WIDTH, HEADS, TOKENS = 4, 64, 4, 16
_SALT = itertools.count()


class Block(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.attn = eqx.nn.MultiheadAttention(HEADS, WIDTH, key=k1)
        self.mlp = eqx.nn.MLP(WIDTH, WIDTH, 4 * WIDTH, 1, key=k2)
        self.norm1 = eqx.nn.LayerNorm(WIDTH)
        self.norm2 = eqx.nn.LayerNorm(WIDTH)

    def __call__(self, h):
        x = jax.vmap(self.norm1)(h)
        h = h + self.attn(x, x, x)
        return h + jax.vmap(self.mlp)(jax.vmap(self.norm2)(h))


class Transformer(eqx.Module):
    blocks: list
    tagged: bool = eqx.field(static=True)
    by_hand: bool = eqx.field(static=True)
    # A new value every round: a new structure, so neither `eqx.filter_jit`
    # nor `fx.handle` (which caches per Equinox module structure) reuses work.
    salt: int = eqx.field(static=True)

    def __init__(self, key, *, tagged, by_hand=False):
        self.blocks = [Block(k) for k in jax.random.split(key, BLOCKS)]
        self.tagged, self.by_hand = tagged, by_hand
        self.salt = next(_SALT)

    def __call__(self, h):
        found = {}
        for i, block in enumerate(self.blocks):
            h = block(h)
            if self.tagged:
                h = fx.tag(h, f"blocks.{i}")
            if self.by_hand:
                found[f"blocks.{i}"] = (h,)
        return (h, {"intermediates": found}) if self.by_hand else h


def first_result(make_call, x):
    """A thunk factory: each thunk builds a new model and function, then runs
    it once, waiting for the result."""

    def make():
        call = make_call()
        return lambda: jax.block_until_ready(call(x))

    return make


def main():
    args = arguments(__doc__.splitlines()[0])
    repeats = 5 if args.quick else 11
    x = jax.random.normal(jax.random.key(1), (TOKENS, WIDTH))
    key = jax.random.key(0)

    def handled(handler):
        return lambda: fx.handle(Transformer(key, tagged=True), handler)

    def model(**kw):
        return lambda: eqx.filter_jit(Transformer(key, **kw))

    rows = [
        ratio_row(
            "first result, `Tag()` (A) vs hand-written (B)",
            compare_cold(
                first_result(handled(fx.Tag()), x),
                first_result(model(tagged=False, by_hand=True), x),
                repeats=repeats,
            ),
            1.15,
        ),
        ratio_row(
            "first result, a handler matching nothing (A) vs plain (B)",
            compare_cold(
                first_result(handled(fx.Tag(names="nothing*")), x),
                first_result(model(tagged=False), x),
                repeats=repeats,
            ),
            1.05,
        ),
    ]
    emit(
        table(
            f"11. Time to the first result, {BLOCKS}-block Equinox transformer",
            ("A", "B"),
            rows,
        ),
        args,
    )


if __name__ == "__main__":
    main()
