"""Group 9: `fx.Stats()`, which keeps summary statistics of every execution of a
tag instead of its value.

- Run time: a 100-layer MLP, 1024 wide (batch 32), with a tag on every layer,
  `jax.jit(fx.handle(f, fx.Stats()))` (A) against the plain program (B).
- Memory: a `lax.scan` over 100 layers of 4096-wide activations (batch 32),
  tagged in the body: the compiled program's temporary and output buffers with
  `fx.Stats()` (A) against `fx.Tag()` (B), which keeps every activation.

Run with `python benchmarks/bench_stats.py [--append FILE] [--quick]`; `--smoke`
runs it once with 4 layers, 64 wide (256 in the scan).
"""

import jax
import jax.numpy as jnp
from _timing import Row, arguments, blocking, compare, emit, nbytes, ratio_row, table

import effects as fx

LAYERS = 100


def mlp(layers: int, width: int):
    keys = jax.random.split(jax.random.key(0), layers)
    return [jax.random.normal(k, (width, width)) / width**0.5 for k in keys]


def tagged(ws, x):
    for i, w in enumerate(ws):
        x = fx.tag(jnp.tanh(x @ w), f"layer{i}")
    return x


def scanned(ws, x):
    def body(x, w):
        return fx.tag(jnp.tanh(x @ w), "layer"), None

    return jax.lax.scan(body, x, ws)[0]


def main():
    args = arguments(__doc__.splitlines()[0])
    repeats = 5 if args.quick else 11
    layers, width, scan_width = (4, 64, 256) if args.smoke else (LAYERS, 1024, 4096)
    ws, x = mlp(layers, width), jax.random.normal(jax.random.key(1), (32, width))
    pair = compare(
        blocking(jax.jit(fx.handle(tagged, fx.Stats())), ws, x),
        blocking(jax.jit(tagged), ws, x),
        repeats=6 * repeats,
        number=3,
        warmup=3,
    )
    rows = [
        ratio_row(f"run time, {layers} layers x {width}, vs plain", pair, 1.3, "≤ 1.3")
    ]

    # Compiled only, never run: shapes suffice (the weights would be 6.7 GB).
    stacked = jax.ShapeDtypeStruct((layers, scan_width, scan_width), jnp.float32)
    x = jax.ShapeDtypeStruct((32, scan_width), jnp.float32)

    def memory(handler):
        run = jax.jit(fx.handle(scanned, handler))
        return run.lower(stacked, x).compile().memory_analysis()

    stats, tags = memory(fx.Stats()), memory(fx.Tag())
    for field in ("temp", "output"):
        a = getattr(stats, f"{field}_size_in_bytes")
        b = getattr(tags, f"{field}_size_in_bytes")
        rows.append(
            Row(
                f"{field} memory, scan of {layers} x {scan_width}, vs `Tag()` "
                "(every activation)",
                nbytes(a),
                nbytes(b),
                f"{a / b:.3f}",
                "—",
                None,
            )
        )
    emit(table("9. `Stats()` (A) vs B", ("Stats", "B"), rows), args)


if __name__ == "__main__":
    main()
