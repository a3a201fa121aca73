"""Where a cold `jax.jit(fx.handle(f, fx.Tag())).lower(...)` of the 200-layer MLP
spends its time: tracing `f`, rewriting its jaxpr, and lowering, against tracing
and lowering the hand-written function. CPU time, garbage collector off, median
over interleaved rounds with new function objects each round.

Run with `python benchmarks/handle_breakdown.py`.
"""

import gc
import statistics
import time

import jax
import jax.numpy as jnp
from _timing import mlp_params
from bench_mlp import make_hand_written, make_tagged

import effects as fx
from effects import _handle

ROUNDS = 15


def cpu(fn) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()
        fn()
        return time.process_time() - start
    finally:
        gc.enable()


def main():
    params, x = mlp_params(200), jax.random.normal(jax.random.key(1), (32, 128))
    args = (params, x)
    parts: dict[str, list[float]] = {}

    def add(name, seconds):
        parts.setdefault(name, []).append(seconds)

    for _ in range(ROUNDS):
        f = make_tagged()
        dynamic, static, treedef = _handle._split((args, {}))
        add(
            "trace f to a jaxpr",
            cpu(lambda: _handle._trace(f, static, treedef, dynamic)),
        )
        traced = _handle._trace(f, static, treedef, dynamic)
        config, leaves = _handle._Config.of((fx.Tag(),))
        add(
            "rewrite the jaxpr",
            cpu(lambda: _handle._rewrite(traced, config, leaves, "handled")),
        )
        add(
            "handled: trace+lower",
            cpu(lambda: jax.jit(fx.handle(make_tagged(), fx.Tag())).lower(*args)),
        )
        add(
            "hand-written: trace",
            cpu(lambda: jax.make_jaxpr(make_hand_written())(*args)),
        )
        add(
            "hand-written: trace+lower",
            cpu(lambda: jax.jit(make_hand_written()).lower(*args)),
        )
        handled = fx.handle(make_tagged(), fx.Tag())
        # The first use builds the program and caches it; from then on it is
        # reused.
        jax.jit(handled).lower(*args)
        add(
            "handled again, new outer jit",
            cpu(lambda: jax.jit(lambda p, x: handled(p, x)).lower(*args)),
        )
    for name, times in parts.items():
        print(f"{name:32s} {statistics.median(times) * 1e3:8.1f} ms")


if __name__ == "__main__":
    jnp.zeros(())  # backend start-up outside the timings
    main()
