"""Group 3: a scan-over-layers model with a tag per layer, at 100 and 1000 layers.

- Trace time (`jax.jit(handle(f, Tag())).trace(...)`, fresh function objects
  every time, ten per round) does not depend on the number of layers.
- A handler that threads state through the loop (`mode="sum"`, reading the
  iteration, `ctx.at`, or taking an input per execution) traces the body
  once, as `Tag()` does: its trace time against `Tag()`'s, at 1000 layers,
  is about 1.
- `"sum"` and a custom `fx.Reduce` keep O(1) memory in the scan's length: the
  temporary buffers of the compiled program (`compiled.memory_analysis()`) are
  the same at 100 and 1000 layers. For contrast, `"append"` stacks one entry
  per layer into the program's outputs, O(length) by design: its output size.

Run with `python benchmarks/bench_scan.py [--append FILE] [--quick]`; `--smoke`
runs it once at 10 and 100 layers.
"""

import dataclasses

import jax
import jax.numpy as jnp
from _timing import Row, arguments, compare_cold, emit, nbytes, ratio_row, table

import effects as fx

WIDTH = 128
TRACES = 10  # traces per round


def make_scanned():
    # A new function object on every call: caches keyed on the function miss.
    def f(ws, x):
        def layer(h, w):
            h = fx.tag(jnp.tanh(h @ w), "layer")
            # (a cond and a jitted function in the body, traced with it)
            h = jax.lax.cond(h[0, 0] > 0, jnp.sin, _half, h)
            return _squash(h), None

        h, _ = jax.lax.scan(layer, x, ws)
        return h

    return f


def _half(h):
    return fx.tag(h / 2, "half")


@jax.jit
def _squash(h):
    return fx.tag(jnp.tanh(h), "squash")


def weights(n_layers):
    w = jax.random.normal(jax.random.key(0), (n_layers, WIDTH, WIDTH))
    return w / jnp.sqrt(WIDTH)


def memory(mode, ws, x):
    handled = fx.handle(make_scanned(), fx.Tag(mode=mode))
    return jax.jit(handled).lower(ws, x).compile().memory_analysis()


def main():
    args = arguments(__doc__.splitlines()[0])
    repeats = 5 if args.quick else 41
    short, long = (10, 100) if args.smoke else (100, 1000)
    x = jax.random.normal(jax.random.key(1), (32, WIDTH))
    ws = {n: weights(n) for n in (short, long)}

    def trace(n, handler=fx.Tag()):
        # A trace takes about a millisecond, less than one slice of a shared
        # machine's scheduling noise: each round times TRACES of them, each of
        # a new function (building it costs microseconds).
        def traces():
            for _ in range(TRACES):
                jax.jit(fx.handle(make_scanned(), handler)).trace(ws[n], x)

        return lambda: traces

    def per_trace(pair):
        return dataclasses.replace(
            pair,
            times_a=tuple(t / TRACES for t in pair.times_a),
            times_b=tuple(t / TRACES for t in pair.times_b),
        )

    pair = per_trace(compare_cold(trace(long), trace(short), repeats=repeats))
    rows = [ratio_row("trace time, `Tag()`", pair, 1.2, "≈ 1 (≤ 1.2 †)")]
    state_rows = []
    # (what `Tag()` reports of "layer": one entry, stacked over the layers)
    given = jnp.zeros((long, *x.shape), x.dtype)
    for label, handler in (
        ('`Tag(mode="sum")`', fx.Tag(mode="sum")),
        ("`Intervene` reading `at`", fx.Intervene({"layer": lambda h, at: h + at[1]})),
        (
            "`Substitute(per_call=True)`",
            fx.Substitute({"layer": (given,)}, per_call=True),
        ),
    ):
        pair = per_trace(
            compare_cold(trace(long, handler), trace(long), repeats=repeats)
        )
        state_rows.append(ratio_row(f"trace time, {label}", pair, 1.2, "≈ 1 (≤ 1.2)"))

    running_max = fx.Reduce(jnp.maximum, lambda z: jnp.full_like(z, -jnp.inf))
    for label, mode, field, limit in (
        ('temp memory, `mode="sum"`', "sum", "temp", 1.0),
        ("temp memory, `fx.Reduce` (running max)", running_max, "temp", 1.0),
        ('output memory, `mode="append"` (for contrast)', "append", "output", None),
    ):
        big, small = (
            getattr(memory(mode, ws[n], x), f"{field}_size_in_bytes")
            for n in (long, short)
        )
        rows.append(
            Row(
                label,
                nbytes(big),
                nbytes(small),
                f"{big / small:.2f}",
                "—" if limit is None else "= 1 (O(1))",
                None if limit is None else big <= small * limit,
            )
        )
    emit(
        table(
            f"3. Scan over layers: {long} layers (A) vs {short} (B)",
            (str(long), str(short)),
            rows,
        ),
        args,
    )
    emit(
        table(
            f"3b. A loop's state, {long} layers: a handler threading it (A) vs "
            "`Tag()` (B)",
            ("handler", "Tag()"),
            state_rows,
        ),
        args,
    )


if __name__ == "__main__":
    main()
