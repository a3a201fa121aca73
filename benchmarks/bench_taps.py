"""Group 15: taps, sites without editing the code, on the GPT of group 12
(list form; by default 4 blocks, width 256, vocabulary 50257, batch 2, 64
tokens; `--full` for GPT-2 small, 12 blocks, width 768, 128 tokens), against
plain `jax.jit` of the same model:

- `fx.handle(fx.taps(model, "dot_general"), fx.Tag("taps"))`: every matmul's
  output collected (run time, first call);
- the same with `fx.Stats("taps")`: seven statistics of every matmul;
- `fx.find_nonfinite(loss, model, tokens)`: of the finite model (one run
  says the output is finite: no search), and of a loss with a NaN after the
  model (a check after every operation), the first call and the second,
  against the plain loss's;
- cold trace and lowering of `jax.grad(loss)` with a site after every
  primitive of the gradient, handled by `fx.Stats("taps")`, against the plain
  gradient's, and against its floor: the gradient's program traced and
  evaluated by hand with the same statistics of every value taps see.

Every handled result is first checked against the plain one (the output; the
collected matmul outputs against the hand-written matmuls of the first
block). `Stats` is also measured against its floor: the same seven statistics
of the same values, written by hand in one program with them. Targets (the
taps issue): Tag run <= 1.03x, first call <= 1.3x; Stats run <= 1.10x, first
call <= 2x (and against the floor 1.05x, 1.3x; Tag's floor, the plain
program returning the matmuls' outputs, 1.03x); find_nonfinite second call
<= 1.3x, first <= 6x; the tapped gradient's trace and lowering <= 1.5x
(and against its floor, 1.3x, as Stats' first call).

Run with `python benchmarks/bench_taps.py [--append FILE] [--quick] [--full]`.
"""

from __future__ import annotations

import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from _timing import arguments, blocking, compare, compare_cold, emit, ratio_row, table
from bench_gpt import (
    FULL,
    QUICK,
    SMOKE,
    Config,
    batched,
    build,
    fresh,
    leaf_stats,
    loss,
)

import effects as fx

DEFAULT = Config(layers=4, width=256, heads=4, tokens=64)


def _tappable(x) -> bool:
    """Whether taps see a value of `x`'s type (not a key, not `float0`)."""
    dtype = jnp.result_type(x)
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and (
        dtype != jax.dtypes.float0
    )


def _real(x):
    """`x` as `fx.Stats` reads it: integers, booleans and narrow floats as
    float32 (a GPT's gradient has no complex or key values)."""
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize >= 4:
        return x
    return x.astype(jnp.float32)


def main():
    full = "--full" in sys.argv
    if full:
        sys.argv.remove("--full")
    args = arguments(__doc__.split("\n\n")[0])
    cfg = SMOKE if args.smoke else QUICK if args.quick else FULL if full else DEFAULT
    repeats = 3 if args.quick or args.smoke else 7
    model, _ = build(cfg)
    tokens = jnp.asarray(
        np.random.default_rng(1).integers(0, cfg.vocab, (cfg.batch, cfg.tokens))
    )
    plain = jax.jit(batched)
    want = plain(model, tokens)

    tag = fx.handle(fx.taps(batched, "dot_general"), fx.Tag("taps"))
    stats = fx.handle(fx.taps(batched, "dot_general"), fx.Stats("taps"))
    tagged = jax.jit(tag)
    out, found = tagged(model, tokens)
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)
    names = list(found["taps"])
    first = found["taps"][names[0]][0]  # the first block's qkv projection
    block = model.blocks[0]
    x = model.wte.weight[tokens] + model.wpe.weight[: cfg.tokens]
    want_first = jax.vmap(jax.vmap(block.ln_1))(x) @ block.attn.c_attn.weight
    np.testing.assert_allclose(first, want_first, rtol=1e-4, atol=1e-4)
    stats_jit = jax.jit(stats)
    np.testing.assert_allclose(stats_jit(model, tokens)[0], want, rtol=2e-5, atol=2e-5)

    def stats_by_hand(model, tokens):
        # The floor of Stats: the same seven statistics of the same values,
        # written by hand in one program with them.
        out, found = tag(model, tokens)
        kept = {n: tuple(map(leaf_stats, v)) for n, v in found["taps"].items()}
        return out, kept

    # The floor of Tag: the plain program returning every matmul's output
    # beside its own, as the model edited to return them would (its jaxpr,
    # evaluated with those outputs kept).
    closed = jax.make_jaxpr(batched)(model, tokens)

    def tag_by_hand(model, tokens):
        env = dict(zip(closed.jaxpr.constvars, closed.consts))
        env.update(zip(closed.jaxpr.invars, jax.tree.leaves((model, tokens))))

        def read(v):
            return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

        kept = []
        for eqn in closed.jaxpr.eqns:
            outs = eqn.primitive.bind(*map(read, eqn.invars), **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
            if eqn.primitive.name == "dot_general":
                kept += outs
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in closed.jaxpr.outvars], kept

    rows = []
    by_hand = jax.jit(tag_by_hand)
    assert len(by_hand(model, tokens)[1]) == sum(map(len, found["taps"].values()))
    pair = compare(
        blocking(tagged, model, tokens),
        blocking(by_hand, model, tokens),
        repeats=repeats,
        number=3,
    )
    rows.append(ratio_row("Tag at every dot_general: run, against by hand", pair, 1.03))
    floor = jax.jit(stats_by_hand)
    got, want_stats = stats_jit(model, tokens), floor(model, tokens)
    for name, entries in want_stats[1].items():
        for entry, stat in zip(got[1]["taps"][name], entries):
            np.testing.assert_allclose(entry["max"], stat["max"], rtol=1e-5)
    pair = compare(
        blocking(stats_jit, model, tokens),
        blocking(floor, model, tokens),
        repeats=repeats,
        number=3,
    )
    rows.append(
        ratio_row("Stats at every dot_general: run, against by hand", pair, 1.05)
    )
    pair = compare_cold(
        lambda: blocking(jax.jit(stats), fresh(model), tokens),
        lambda: blocking(jax.jit(stats_by_hand), fresh(model), tokens),
        repeats=max(repeats // 2, 1),
    )
    rows.append(
        ratio_row("Stats at every dot_general: first call, against by hand", pair, 1.3)
    )
    for what, handled, limit_run, limit_first in (
        (f"Tag at every dot_general ({len(names)} sites)", tag, 1.03, 1.3),
        ("Stats at every dot_general", stats, 1.10, 2.0),
    ):
        held = jax.jit(handled)
        pair = compare(
            blocking(held, model, tokens),
            blocking(plain, model, tokens),
            repeats=repeats,
            number=3,
        )
        rows.append(ratio_row(f"{what}: run", pair, limit_run))
        pair = compare_cold(
            lambda h=handled: blocking(jax.jit(h), fresh(model), tokens),
            lambda: blocking(jax.jit(batched), fresh(model), tokens),
            repeats=max(repeats // 2, 1),
        )
        rows.append(ratio_row(f"{what}: first call", pair, limit_first))

    def loss_nan(m, t):  # a NaN after the model: every operation is searched
        out = loss(m, t)
        return out + jnp.sqrt(-1.0 - out * out)

    assert fx.find_nonfinite(loss, model, tokens) is None
    assert fx.find_nonfinite(loss_nan, model, tokens).primitive == "sqrt"
    for what, fn in (
        ("a finite model (no search of the operations)", loss),
        ("a NaN after the model (every operation searched)", loss_nan),
    ):
        pair = compare_cold(
            lambda fn=fn: lambda m=fresh(model): fx.find_nonfinite(fn, m, tokens),
            lambda fn=fn: blocking(jax.jit(fn), fresh(model), tokens),
            repeats=max(repeats // 3, 1),
            warmup=0,
        )
        rows.append(ratio_row(f"find_nonfinite, {what}: first call", pair, 6.0))
        pair = compare(
            lambda fn=fn: fx.find_nonfinite(fn, model, tokens),
            blocking(jax.jit(fn), model, tokens),
            repeats=repeats,
        )
        rows.append(ratio_row(f"find_nonfinite, {what}: second call", pair, 1.3))

    grad = jax.grad(loss)
    stats_one = jax.jit(leaf_stats)

    def stats_of_grad_by_hand(m, t):
        # The floor of Stats at the tapped gradient: the gradient's program,
        # traced and evaluated with the same statistics of every value taps
        # see (every primitive's output, jits inlined), one jit call each.
        closed = jax.make_jaxpr(grad)(m, t)
        kept = []

        def run(jaxpr, consts, args):
            env = dict(zip(jaxpr.constvars, consts))
            env.update(zip(jaxpr.invars, args))

            def read(v):
                return v.val if isinstance(v, jax.extend.core.Literal) else env[v]

            for eqn in jaxpr.eqns:
                ins = list(map(read, eqn.invars))
                if eqn.primitive.name in ("pjit", "jit"):
                    inner = eqn.params["jaxpr"]
                    outs = run(inner.jaxpr, inner.consts, ins)
                else:
                    outs = eqn.primitive.bind(*ins, **eqn.params)
                    outs = outs if eqn.primitive.multiple_results else [outs]
                    if all(type(v) is jax.extend.core.Var for v in eqn.outvars):
                        kept.extend(stats_one(_real(o)) for o in outs if _tappable(o))
                env.update(zip(eqn.outvars, outs))
            return [read(v) for v in jaxpr.outvars]

        return run(closed.jaxpr, closed.consts, jax.tree.leaves((m, t))), kept

    # (the same statistics: one per value, the leaves of a tap's value)
    _, found = jax.eval_shape(fx.handle(fx.taps(grad), fx.Stats("taps")), model, tokens)
    kept = jax.eval_shape(stats_of_grad_by_hand, model, tokens)[1]
    taps_stats = jax.tree.leaves(
        found, is_leaf=lambda x: type(x).__name__ == "Statistics"
    )
    assert len(kept) == len(taps_stats), (len(kept), len(taps_stats))
    pair = compare_cold(
        lambda: (
            lambda m=fresh(model): jax.jit(
                fx.handle(fx.taps(grad), fx.Stats("taps"))
            ).lower(m, tokens)
        ),
        lambda: lambda m=fresh(model): jax.jit(stats_of_grad_by_hand).lower(m, tokens),
        repeats=max(repeats // 3, 1),
    )
    rows.append(
        ratio_row(
            "grad, taps at every primitive, Stats: trace+lower, against by hand",
            pair,
            1.3,
        )
    )
    for what, handler in (
        ("Stats", fx.Stats("taps")),
        ("the last value (Tag mode='last')", fx.Tag("taps", mode="last")),
    ):
        pair = compare_cold(
            lambda h=handler: (
                lambda m=fresh(model): jax.jit(fx.handle(fx.taps(grad), h)).lower(
                    m, tokens
                )
            ),
            lambda: lambda m=fresh(model): jax.jit(grad).lower(m, tokens),
            repeats=max(repeats // 3, 1),
        )
        what = f"grad, taps at every primitive, {what}: trace+lower"
        rows.append(ratio_row(what, pair, 1.5))
    title = (
        f"Taps on a GPT ({cfg.layers} blocks, width {cfg.width}, vocabulary "
        f"{cfg.vocab}, batch {cfg.batch}, {cfg.tokens} tokens) against plain jax.jit"
    )
    emit(table(title, ("effects", "plain"), rows), args)


if __name__ == "__main__":
    main()
