"""Group 7: a tag in a `lax.while_loop` inside a `jax.custom_vjp` (the pattern of
diffrax's solves): the handled function against the plain one, jitted.

The function: 200 steps of `y <- y + 0.01 * dy`, `dy = fx.tag(-k * tanh(y))`,
on a 64-vector, in a `jax.custom_vjp` whose forward pass saves the inputs and
whose backward pass returns something simple. Handled with `fx.Tag(mode="last")`
and with `fx.Tag(mode="sum")`, jitted, against:

- the plain function (no handler), jitted: run time at most 1.02x;
- the hand-written function returning the same values (the loop carrying the
  collected value): optimized HLO identical, run time at most 1.02x. This
  separates what collecting costs by itself from what `handle` adds.

With diffrax installed (it is optional), the same against a real
`diffrax.diffeqsolve` (Tsit5, 100 steps, a tag in the vector field), handled vs
plain; without it, a row says it was skipped.

Run with `python benchmarks/bench_custom_vjp.py [--append FILE]`.
"""

import jax
import jax.numpy as jnp
from _timing import (
    Row,
    arguments,
    blocking,
    compare,
    emit,
    identical_row,
    optimized_hlo,
    ratio_row,
    table,
)

import effects as fx

STEPS, WIDTH = 200, 64


@jax.custom_vjp
def solve(y0, k):
    def cond(c):
        return c[0] < STEPS

    def body(c):
        i, y = c
        dy = fx.tag(-k * jnp.tanh(y), "dy")
        return i + 1, y + 0.01 * dy

    return jax.lax.while_loop(cond, body, (0, y0))[1]


def _fwd(y0, k):
    return solve(y0, k), (y0, k)


def _bwd(res, g):
    y0, k = res
    return g * jnp.exp(-k), -jnp.sum(g * y0)


solve.defvjp(_fwd, _bwd)


def make_hand_written(mode):
    """The same function returning what `Tag(mode=mode)` collects, by hand."""

    @jax.custom_vjp
    def hand(y0, k):
        def cond(c):
            return c[0] < STEPS

        def body(c):
            i, y, acc = c
            dy = -k * jnp.tanh(y)
            return i + 1, y + 0.01 * dy, dy if mode == "last" else acc + dy

        _, y, acc = jax.lax.while_loop(cond, body, (0, y0, jnp.zeros_like(y0)))
        return y, acc

    def fwd(y0, k):
        return hand(y0, k), (y0, k)

    def bwd(res, g):
        return _bwd(res, g[0])

    hand.defvjp(fwd, bwd)

    def f(y0, k):
        y, acc = hand(y0, k)
        return y, {"intermediates": {"dy": acc}}

    return f


def _diffrax_rows(repeats):
    try:
        import diffrax
    except ImportError:
        note = "skipped: diffrax is not installed"
        return [
            Row("run time, `diffrax.diffeqsolve` (Tsit5)", note, "—", "—", "—", None)
        ]

    def vf(t, y, args):
        return -fx.tag(jnp.tanh(y), "vf") * args

    def solve_ode(y0, k):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(vf), diffrax.Tsit5(), 0.0, 1.0, 0.01, y0, args=k
        )
        return sol.ys[-1]

    y0 = jnp.linspace(-1.0, 1.0, WIDTH)
    k = jnp.float32(0.7)
    plain = blocking(jax.jit(solve_ode), y0, k)
    rows = []
    for mode in ("last", "sum"):
        pair = compare(
            blocking(jax.jit(fx.handle(solve_ode, fx.Tag(mode=mode))), y0, k),
            plain,
            repeats=repeats,
            number=10,
            warmup=3,
        )
        what = (
            f'run time, `diffrax.diffeqsolve` (Tsit5, 100 steps), `Tag(mode="{mode}")`'
            ", vs plain"
        )
        rows.append(ratio_row(what, pair, 1.02))
    return rows


def main():
    args = arguments(__doc__.splitlines()[0])
    repeats = 10 if args.quick else 40
    y0 = jnp.linspace(-1.0, 1.0, WIDTH)
    k = jnp.float32(0.7)
    rows = []
    plain = blocking(jax.jit(solve), y0, k)
    for mode in ("last", "sum"):
        handled = fx.handle(solve, fx.Tag(mode=mode))
        hand = make_hand_written(mode)
        what = f'{STEPS}-step loop, `Tag(mode="{mode}")`'
        rows.append(
            identical_row(
                f"optimized HLO, {what}, vs hand-written",
                optimized_hlo(handled, y0, k),
                optimized_hlo(hand, y0, k),
            )
        )
        handled, hand = (blocking(jax.jit(g), y0, k) for g in (handled, hand))
        # A call takes tens of µs: 400 calls per round keep a round near 10 ms.
        kwargs = dict(repeats=repeats, number=400, warmup=20)
        pair = compare(handled, plain, **kwargs)
        rows.append(ratio_row(f"run time, {what}, vs plain", pair, 1.02))
        pair = compare(handled, hand, **kwargs)
        rows.append(ratio_row(f"run time, {what}, vs hand-written", pair, 1.02))
    rows += _diffrax_rows(repeats)
    emit(
        table(
            "7. A loop inside a `custom_vjp` (the diffrax pattern): handled (A) vs "
            "plain or hand-written (B)",
            ("handled", "B"),
            rows,
        ),
        args,
    )


if __name__ == "__main__":
    main()
