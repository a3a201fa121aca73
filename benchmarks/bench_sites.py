"""Group 14: many sites: what each site costs to trace and lower, and that the
cost per site stays the same as sites multiply.

A program with `n` sites on small values (a tap at every operation of a model is
thousands of them), handled, against the hand-written program returning the same
values, cold trace+lower (fresh function objects each round):

- `n` tags at the top level, under `Tag()`;
- `n` jitted helpers, one tag in each (each a region the rewriter traces), under
  `Tag()` and under `Tag(mode="sum")` (an accumulator per name, threaded
  through the regions that touch it);
- one jitted helper called `n` times (a layer function called per layer),
  likewise: unhandled, JAX traces and lowers it once;
- per site, `4n` sites against `n`, handled: the ratio is the cost of a site at
  `4n` over its cost at `n`, 1 where the cost is linear in the number of sites.

Run with `python benchmarks/bench_sites.py [--append FILE] [--quick]`; `--smoke`
runs 4 and 16 sites once and checks the values.
"""

import jax
import jax.numpy as jnp
from _timing import Pair, arguments, compare_cold, emit, plain_dicts, ratio_row, table

import effects as fx

X = jnp.linspace(0.0, 1.0, 4)


def flat(n):
    def f(x):
        for i in range(n):
            x = fx.tag(jnp.sin(x), f"s{i}")
        return x

    return f


def flat_by_hand(n):
    def f(x):
        found = {}
        for i in range(n):
            x = jnp.sin(x)
            found[f"s{i}"] = (x,)
        return x, {"intermediates": found}

    return f


def helpers(n):
    steps = [jax.jit(lambda x, i=i: fx.tag(jnp.sin(x), f"s{i}")) for i in range(n)]

    def f(x):
        for step in steps:
            x = step(x)
        return x

    return f


def helpers_by_hand(n, summed=False):
    steps = [jax.jit(jnp.sin) for _ in range(n)]

    def f(x):
        found = {}
        for i, step in enumerate(steps):
            x = step(x)
            found[f"s{i}"] = x if summed else (x,)
        return x, {"intermediates": found}

    return f


def one_helper(n):
    step = jax.jit(lambda x: fx.tag(jnp.sin(x), "s"))

    def f(x):
        for _ in range(n):
            x = step(x)
        return x

    return f


def one_helper_by_hand(n, summed=False):
    step = jax.jit(jnp.sin)

    def f(x):
        found = []
        for _ in range(n):
            x = step(x)
            found.append(x)
        return x, {"intermediates": {"s": sum(found) if summed else tuple(found)}}

    return f


def handled(make, n, handler):
    f = fx.handle(make(n), handler)  # (built before the clock starts)
    return lambda: jax.jit(f).lower(X)


def by_hand(make, n, **kwargs):
    f = make(n, **kwargs)
    return lambda: jax.jit(f).lower(X)


def check(n):
    """The handled programs return what the hand-written ones do."""
    cases = [
        (flat(n), fx.Tag(), flat_by_hand(n)),
        (helpers(n), fx.Tag(), helpers_by_hand(n)),
        (helpers(n), fx.Tag(mode="sum"), helpers_by_hand(n, summed=True)),
        (one_helper(n), fx.Tag(), one_helper_by_hand(n)),
        (one_helper(n), fx.Tag(mode="sum"), one_helper_by_hand(n, summed=True)),
    ]
    for f, handler, reference in cases:
        got, want = jax.jit(fx.handle(f, handler))(X), reference(X)
        for a, b in zip(jax.tree.leaves(plain_dicts(got)), jax.tree.leaves(want)):
            assert jnp.allclose(a, b), (handler, a, b)


def per_site(pair: Pair, factor: int) -> Pair:
    return Pair(tuple(t / factor for t in pair.times_a), pair.times_b)


def main():
    args = arguments(__doc__.splitlines()[0])
    repeats = 3 if args.quick else 9
    n = 4 if args.smoke else 250
    check(n)
    sum_ = fx.Tag(mode="sum")
    rows = []
    for size in (n, 4 * n):
        for what, make, hand, handler, kwargs in [
            ("tags at the top level, `Tag()`", flat, flat_by_hand, fx.Tag(), {}),
            ("jitted helpers, `Tag()`", helpers, helpers_by_hand, fx.Tag(), {}),
            ("jitted helpers, `Tag(mode='sum')`", helpers, helpers_by_hand, sum_, {}),
            (
                "calls of one jitted helper, `Tag()`",
                one_helper,
                one_helper_by_hand,
                fx.Tag(),
                {},
            ),
            (
                "calls of one jitted helper, `Tag(mode='sum')`",
                one_helper,
                one_helper_by_hand,
                sum_,
                {},
            ),
        ]:
            summed = {"summed": True} if handler is sum_ else kwargs
            pair = compare_cold(
                lambda make=make, handler=handler, size=size: handled(
                    make, size, handler
                ),
                lambda hand=hand, size=size, summed=summed: by_hand(
                    hand, size, **summed
                ),
                repeats=repeats,
            )
            rows.append(ratio_row(f"{size} {what}", pair, None))
    for what, make, handler in [
        ("tags at the top level, `Tag()`", flat, fx.Tag()),
        ("jitted helpers, `Tag(mode='sum')`", helpers, sum_),
    ]:
        pair = compare_cold(
            lambda make=make, handler=handler: handled(make, 4 * n, handler),
            lambda make=make, handler=handler: handled(make, n, handler),
            repeats=repeats,
        )
        label = f"per site, {4 * n} against {n}: {what}"
        rows.append(ratio_row(label, per_site(pair, 4), 1.25, "≤ 1.25 (linear)"))
    emit(
        table(
            "14. Many sites: handled (A) vs hand-written (B), cold trace+lower",
            ("handled", "by hand"),
            rows,
        ),
        args,
    )


if __name__ == "__main__":
    main()
