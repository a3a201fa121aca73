"""Group 4: repeated calls of a handled function, as in a training loop.

- Eager: `fx.handle(f, fx.Tag())(params, x)` written inline in the loop, with no
  outer jit, vs the jitted hand-written function `jax.jit(hand)` held in a
  variable; and, to show what that gap is made of, the same call with the
  handler object made once outside the loop.
- Inline jit: `jax.jit(fx.handle(f, fx.Tag()))(params, x)` written inline in the
  loop vs `jax.jit(hand)(params, x)` written inline too. This is the target's
  row: an inline `jax.jit(...)` costs JAX itself a new wrapper and a cache look-up
  per call (see the floor row), which no `handle` can remove.
- For context, the same inline call vs `g(params, x)` with
  `g = jax.jit(fx.handle(f, fx.Tag()))` made once, and JAX's own cost of writing
  `jax.jit(hand)` inline (no `handle`) vs holding it: the floor under that row.
- Outside any jit, `jax.grad` of a handled loss, `fx.handle(loss, fx.Tag())` made
  once and differentiated with respect to `x` (`has_aux=True`, so the collected
  intermediates come back too), vs `jax.grad(loss)`; and
  `jax.vmap(fx.handle(f, fx.Tag()))(params, xs)` written inline vs
  `jax.vmap(f)(params, xs)`, over a batch of 8 inputs. `loss` and `f` are the
  same tagged functions, unhandled in B. No target: JAX runs the plain ones op
  by op, the handled ones as one `jit` call, differentiated or batched.

Targets: the eager and the inline-jit rows at most 1.3x their reference. Each
on a small MLP (4 layers, where per-call overhead dominates) and on the
200-layer MLP of group 2 (width 128, batch 32, a tag per layer).

Run with `python benchmarks/bench_repeated.py [--append FILE] [--quick]`;
`--smoke` runs the small MLP once.
"""

import jax
import jax.numpy as jnp
from _timing import arguments, blocking, compare, emit, mlp_params, ratio_row, table
from bench_mlp import make_hand_written, make_tagged

import effects as fx

# The same models as the MLP benchmark, held once: these rows measure calls.
f = make_tagged()
hand = make_hand_written()


def loss(params, x):
    return jnp.sum(f(params, x) ** 2)


handled_loss = fx.handle(loss, fx.Tag())


def main():
    args = arguments(__doc__.splitlines()[0])
    repeats = 5 if args.quick else 21
    x = jax.random.normal(jax.random.key(1), (32, 128))
    xs = jax.random.normal(jax.random.key(2), (8, 32, 128))
    rows = []
    # (layers, calls per round)
    sizes = ((4, 200),) if args.smoke else ((4, 200), (200, 10))
    for n, number in sizes:
        params = mlp_params(n)

        def eager():
            return jax.block_until_ready(fx.handle(f, fx.Tag())(params, x))

        def inline_jit():
            return jax.block_until_ready(jax.jit(fx.handle(f, fx.Tag()))(params, x))

        held = jax.jit(fx.handle(f, fx.Tag()))
        kwargs = dict(repeats=repeats, number=number, warmup=3)
        pair = compare(eager, blocking(jax.jit(hand), params, x), **kwargs)
        rows.append(
            ratio_row(f"eager `handle(f)(x)` vs `jit(hand)(x)`, {n} layers", pair, 1.3)
        )
        # What the row above is made of: the same call with the handler object
        # made once, outside the loop (building `fx.Tag()` is part of the gap).
        tag = fx.Tag()
        pair = compare(
            lambda: jax.block_until_ready(fx.handle(f, tag)(params, x)),
            blocking(jax.jit(hand), params, x),
            **kwargs,
        )
        rows.append(
            ratio_row(
                f"(part) eager `handle(f, tag)(x)`, `tag` made once, {n} layers",
                pair,
                None,
            )
        )
        pair = compare(
            inline_jit,
            lambda: jax.block_until_ready(jax.jit(hand)(params, x)),
            **kwargs,
        )
        rows.append(
            ratio_row(
                f"inline `jit(handle(f))(x)` vs inline `jit(hand)(x)`, {n} layers",
                pair,
                1.3,
            )
        )
        pair = compare(inline_jit, blocking(held, params, x), **kwargs)
        rows.append(
            ratio_row(f"inline `jit(handle(f))(x)` vs held jit, {n} layers", pair, None)
        )
        # JAX's own cost of `jax.jit(...)` written inline, with no `handle`: the
        # floor under the row above (the fair reference is the inline row).
        held_hand = jax.jit(hand)
        pair = compare(
            lambda: jax.block_until_ready(jax.jit(hand)(params, x)),
            blocking(held_hand, params, x),
            **kwargs,
        )
        rows.append(
            ratio_row(
                f"(floor) inline `jit(hand)(x)` vs held `jit(hand)`, {n} layers",
                pair,
                None,
            )
        )
        # Outside jit: grad and vmap of a handled function, called repeatedly.
        kwargs = dict(repeats=repeats, number=max(1, number // 40), warmup=2)
        pair = compare(
            lambda: jax.block_until_ready(
                jax.grad(handled_loss, argnums=1, has_aux=True)(params, x)
            ),
            lambda: jax.block_until_ready(jax.grad(loss, argnums=1)(params, x)),
            **kwargs,
        )
        rows.append(
            ratio_row(
                f"`grad(handle(loss, tag))(x)` vs `grad(loss)(x)`, no jit, {n} layers",
                pair,
                None,
            )
        )
        pair = compare(
            lambda: jax.block_until_ready(
                jax.vmap(fx.handle(f, fx.Tag()), in_axes=(None, 0))(params, xs)
            ),
            lambda: jax.block_until_ready(jax.vmap(f, in_axes=(None, 0))(params, xs)),
            **kwargs,
        )
        rows.append(
            ratio_row(
                f"`vmap(handle(f, Tag()))(xs)` vs `vmap(f)(xs)`, no jit, {n} layers",
                pair,
                None,
            )
        )
    emit(table("4. Repeated calls: per call", ("A", "B"), rows), args)


if __name__ == "__main__":
    main()
