"""Group 7: a tag in a `lax.while_loop` inside a `jax.custom_vjp` (the pattern of
diffrax's solves): the handled function against the plain one, jitted.

Collecting inside a function with a custom derivative must not run it twice:
the handled run time stays at that of the hand-written function returning the
same values (the loop carrying the collected value). Against the plain
function, which returns less, for context; with diffrax installed, the same for
a real `diffrax.diffeqsolve`.

Run with `python benchmarks/bench_custom_vjp.py [--append FILE]`.
"""

import jax
import jax.numpy as jnp
from _timing import arguments, blocking, compare, emit, ratio_row, table

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
        return []

    def vf(t, y, args):
        return -fx.tag(jnp.tanh(y), "vf") * args

    def solve_ode(y0, k):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(vf), diffrax.Tsit5(), 0.0, 1.0, 0.01, y0, args=k
        )
        return sol.ys[-1]

    y0 = jnp.linspace(-1.0, 1.0, WIDTH)
    k = jnp.float32(0.7)
    pair = compare(
        blocking(jax.jit(fx.handle(solve_ode, fx.Tag(mode="sum"))), y0, k),
        blocking(jax.jit(solve_ode), y0, k),
        repeats=repeats,
        number=20,
        warmup=3,
    )
    what = 'run time, `diffrax.diffeqsolve` (Tsit5), `Tag(mode="sum")`, vs plain'
    return [ratio_row(what, pair, None)]


def main():
    args = arguments(__doc__.splitlines()[0])
    repeats = 10 if args.quick else 40
    y0 = jnp.linspace(-1.0, 1.0, WIDTH)
    k = jnp.float32(0.7)
    rows = []
    for mode in ("last", "sum"):
        handled = blocking(jax.jit(fx.handle(solve, fx.Tag(mode=mode))), y0, k)
        hand = blocking(jax.jit(make_hand_written(mode)), y0, k)
        plain = blocking(jax.jit(solve), y0, k)
        what = f'run time, {STEPS}-step loop, `Tag(mode="{mode}")`'
        pair = compare(handled, hand, repeats=repeats, number=50, warmup=3)
        rows.append(ratio_row(f"{what}, vs hand-written", pair, 1.02))
        pair = compare(handled, plain, repeats=repeats, number=50, warmup=3)
        rows.append(ratio_row(f"{what}, vs plain (returns less)", pair, None))
    rows += _diffrax_rows(repeats)
    emit(
        table(
            "7. A loop inside a `custom_vjp` (the diffrax pattern): handled (A) vs "
            "hand-written or plain (B)",
            ("handled", "B"),
            rows,
        ),
        args,
    )


if __name__ == "__main__":
    main()
