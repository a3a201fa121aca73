"""Where the Flax row's trace time goes: the linen model of `bench_flax.py`
traced (not lowered) four ways, interleaved, with CPU time (`process_time`, so
time the machine spends elsewhere does not count) and the collector off:

- recording nothing;
- `sow` with `apply(..., mutable="intermediates")`;
- `fx.tag` in the model, unhandled (the tags are bound and left in);
- `fx.tag` collected by `fx.handle(model.apply, fx.Tag())`.

Prints the median trace time of each and its ratio to the first two. A
diagnostic, not part of `run_all.py`: the differences it resolves (a few tenths
of a percent) are below the noise of the cold trace+lower row.

Run with `python benchmarks/flax_breakdown.py [--rounds N]`.
"""

import argparse
import functools
import gc
import statistics
import time

import jax
from bench_flax import MLP, WIDTH, with_sow, with_tag

VARIANTS = {
    "nothing recorded": lambda: functools.partial(MLP("none").apply),
    "sow": with_sow,
    "fx.tag, unhandled": lambda: functools.partial(MLP("tag").apply),
    "fx.tag, handled": with_tag,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    rounds = parser.parse_args().rounds
    x = jax.random.normal(jax.random.key(1), (32, WIDTH))
    params = MLP("none").init(jax.random.key(0), x)
    for make in VARIANTS.values():  # warm JAX's caches of everything but the model
        jax.jit(make()).trace(params, x)
    names = list(VARIANTS)
    times: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    gc.freeze()
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = jax.jit(VARIANTS[name]())
            gc.collect()
            gc.disable()
            start = time.process_time()
            fn.trace(params, x)
            times[name].append(time.process_time() - start)
            gc.enable()
    gc.unfreeze()
    base, sow = (statistics.median(times[n]) for n in names[:2])
    print(f"| {'variant':20} | trace (median) | vs nothing | vs sow |")
    print(f"|{'-' * 22}|---|---|---|")
    for name in names:
        t = statistics.median(times[name])
        print(f"| {name:20} | {t * 1e3:.1f} ms | {t / base:.3f} | {t / sow:.3f} |")


if __name__ == "__main__":
    main()
