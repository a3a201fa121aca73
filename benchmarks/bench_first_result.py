"""Group 11: what a 4-block Equinox transformer costs, tagged, against the
program written by hand that returns the same values:

- its tags unhandled (the tagged model under `eqx.filter_jit`), against the
  plain model;
- `fx.handle(model, fx.Tag())` with every block's output tagged, against the
  hand-written model returning the same values;
- `fx.handle(model, fx.Stats())`, against the hand-written model returning
  the same statistics;
- `fx.handle(model, fx.Tag(names=lambda name: False))` (a handler matching
  no site; a glob matching none is refused as a typo) against the plain model.

For each: the time to the first result (trace, lower, compile and run, with a
new model object and new functions every round so no cache keyed on them
helps), the run time of the compiled program, and its memory (the temporary
and output buffers of the compiled program, from `memory_analysis()`).
Every handled result is checked against the hand-written one first.

Targets: first result at most 1.15x the hand-written model under `Tag()`; at
most 1.05x the plain model under a handler matching nothing.

Run with `python benchmarks/bench_first_result.py [--append FILE] [--quick]`;
`--smoke` runs it once with 1 block.
"""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _timing import (
    Row,
    arguments,
    compare,
    compare_cold,
    emit,
    nbytes,
    plain_dicts,
    ratio_row,
    table,
)

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


def stats_by_hand(x):
    """What `fx.Stats()` keeps of a value, written out (over the whole value)."""
    finite = jnp.isfinite(x)
    count = jnp.sum(finite)
    n = jnp.maximum(count, 1)
    mean = jnp.sum(x, where=finite) / n

    def some(v):
        return jnp.where(count > 0, v, jnp.nan)

    return {
        "mean": some(mean),
        "std": some(jnp.sqrt(jnp.sum((x - mean) ** 2, where=finite) / n)),
        "min": some(jnp.min(x, initial=jnp.inf, where=finite)),
        "max": some(jnp.max(x, initial=-jnp.inf, where=finite)),
        "mean_abs": some(jnp.sum(jnp.abs(x), where=finite) / n),
        "nan_count": jnp.sum(jnp.isnan(x), dtype=jnp.int32),
        "inf_count": jnp.sum(jnp.isinf(x), dtype=jnp.int32),
    }


class Transformer(eqx.Module):
    blocks: list
    tagged: bool = eqx.field(static=True)
    # None: the plain model; "values" or "stats": what `Tag()` or `Stats()`
    # returns, written by hand.
    by_hand: str | None = eqx.field(static=True)
    # A new value every round: a new structure, so neither `eqx.filter_jit`
    # nor `fx.handle` (which caches per Equinox module structure) reuses work.
    salt: int = eqx.field(static=True)

    def __init__(self, key, *, tagged, by_hand=None, blocks=BLOCKS):
        self.blocks = [Block(k) for k in jax.random.split(key, blocks)]
        self.tagged, self.by_hand = tagged, by_hand
        self.salt = next(_SALT)

    def __call__(self, h):
        found = {}
        for i, block in enumerate(self.blocks):
            h = block(h)
            if self.tagged:
                h = fx.tag(h, f"blocks.{i}")
            if self.by_hand == "values":
                found[f"blocks.{i}"] = (h,)
            elif self.by_hand == "stats":
                found[f"blocks.{i}"] = (stats_by_hand(h),)
        return (h, {"intermediates": found}) if self.by_hand else h


def first_result(make_call, x):
    """A thunk factory: each thunk builds a new model and function, then runs
    it once, waiting for the result."""

    def make():
        call = make_call()
        return lambda: jax.block_until_ready(call(x))

    return make


def jitted(model, handler=None):
    """The model under `eqx.filter_jit`, handled by `handler` if one is given,
    with its parameters as arguments (not constants of the program)."""
    if handler is None:
        return eqx.filter_jit(lambda m, x: m(x))
    return eqx.filter_jit(lambda m, x: fx.handle(m, handler)(x))


def memory(model, handler, x) -> int:
    """The temporary and output buffers of the compiled program, in bytes."""
    params, static = eqx.partition(model, eqx.is_array)

    def run(params, x):
        model = eqx.combine(params, static)
        return (model if handler is None else fx.handle(model, handler))(x)

    analysis = jax.jit(run).lower(params, x).compile().memory_analysis()
    return analysis.temp_size_in_bytes + analysis.output_size_in_bytes


def check_same(what, a, b):
    if isinstance(a, tuple):  # (out, found): `Found` is a pytree of its own,
        # as is each `fx.Statistics` that `Stats()` keeps
        found = plain_dicts(a[1])
        # A handler matching nothing finds nothing: compare the outputs.
        a = (a[0], found) if isinstance(b, tuple) else a[0]
        if not isinstance(b, tuple) and any(found.values()):
            raise SystemExit(f"{what}: found {found}, expected nothing")
    same = jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.allclose(u, v, rtol=1e-5, atol=1e-5, equal_nan=True)
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )
    if not same:
        raise SystemExit(f"{what}: the handled result differs from the reference")


def main():
    args = arguments(__doc__.splitlines()[0])
    repeats = 5 if args.quick else 11
    blocks = 1 if args.smoke else BLOCKS
    x = jax.random.normal(jax.random.key(1), (TOKENS, WIDTH))
    key = jax.random.key(0)
    plain = {"tagged": False, "blocks": blocks}
    # (label, handler or None for unhandled, the reference's keywords, first
    # result target)
    cases = [
        ("tags unhandled (A) vs plain (B)", None, plain),
        ("`Tag()` (A) vs hand-written (B)", fx.Tag(), {**plain, "by_hand": "values"}),
        (
            "`Stats()` (A) vs hand-written (B)",
            fx.Stats(),
            {**plain, "by_hand": "stats"},
        ),
        (
            "a handler matching nothing (A) vs plain (B)",
            fx.Tag(names=lambda name: False),
            plain,
        ),
    ]
    targets = {1: 1.15, 3: 1.05}
    rows = []
    for i, (label, handler, reference, *_) in enumerate(cases):

        def handled(handler=handler):
            model = Transformer(key, tagged=True, blocks=blocks)
            if handler is None:
                return eqx.filter_jit(model)
            return fx.handle(model, handler)

        def by_hand(reference=reference):
            return eqx.filter_jit(Transformer(key, **reference))

        rows.append(
            ratio_row(
                f"first result, {label}",
                compare_cold(
                    first_result(handled, x),
                    first_result(by_hand, x),
                    repeats=repeats,
                ),
                targets.get(i),
            )
        )
        a_model = Transformer(key, tagged=True, blocks=blocks)
        b_model = Transformer(key, **reference)
        run_a, run_b = jitted(a_model, handler), jitted(b_model)
        check_same(label, run_a(a_model, x), run_b(b_model, x))
        rows.append(
            ratio_row(
                f"run time, {label}",
                compare(
                    lambda: jax.block_until_ready(run_a(a_model, x)),
                    lambda: jax.block_until_ready(run_b(b_model, x)),
                    repeats=6 * repeats,
                    number=20,
                    warmup=5,
                ),
                None,
            )
        )
        a, b = memory(a_model, handler, x), memory(b_model, None, x)
        rows.append(
            Row(
                f"memory, {label}",
                nbytes(a),
                nbytes(b),
                f"{a / b:.3f}",
                "—",
                None,
            )
        )
    emit(
        table(
            f"11. What it costs, {blocks}-block Equinox transformer",
            ("A", "B"),
            rows,
        ),
        args,
    )


if __name__ == "__main__":
    main()
