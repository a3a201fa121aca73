"""Group 5: against the Flax linen anchors, on the same model and parameters.

A linen MLP of 200 `Layer`s (each `tanh(Dense(128)(h))`, batch 32) that records
every layer's output in one of three ways:

- `fx.tag` in the model, collected by `fx.handle(model.apply, fx.Tag())`;
- `self.sow("intermediates", ...)` with `apply(..., mutable="intermediates")`;
- nothing in the model, and `apply(..., capture_intermediates=...)` with a
  filter that keeps exactly the `Layer` outputs.

Measured: cold trace+lower (fresh function objects every round) and the run time
of the jitted functions, each `fx.tag` (A) vs an anchor (B).

Run with `python benchmarks/bench_flax.py [--append FILE] [--quick]`; `--smoke`
runs it once with 4 layers.
"""

import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
from _timing import (
    arguments,
    blocking,
    compare,
    compare_cold,
    emit,
    identical_row,
    optimized_hlo,
    ratio_row,
    table,
)

import effects as fx

LAYERS, WIDTH = 200, 128


class Layer(nn.Module):
    @nn.compact
    def __call__(self, h):
        return jnp.tanh(nn.Dense(WIDTH)(h))


class MLP(nn.Module):
    record: str  # "tag", "sow" or "none"
    layers: int = LAYERS
    instance: int = 0  # unused by the model: makes each round's module distinct

    @nn.compact
    def __call__(self, h):
        for i in range(self.layers):
            h = Layer()(h)
            if self.record == "tag":
                h = fx.tag(h, f"layer{i}")
            elif self.record == "sow":
                self.sow("intermediates", f"layer{i}", h)
        return h


def only_layers(module, method_name):
    return isinstance(module, Layer) and method_name == "__call__"


# Each returns a new function object on every call, so caches keyed on the
# function miss: linen modules compare equal field by field, and `handle` caches
# what it traced and rewrote per equal module's `apply`, so every round gets a
# module of its own (and a partial, for `jax.jit`'s cache).
_instances = itertools.count()


def with_tag(layers=LAYERS):
    model = MLP("tag", layers, next(_instances))
    return functools.partial(fx.handle(model.apply, fx.Tag()))


def as_plain_dicts(handled):
    @functools.wraps(handled)  # (its parameters' names are in the HLO)
    def fn(*args):
        out, found = handled(*args)
        return out, {c: dict(names) for c, names in found.items()}

    return fn


def with_sow(layers=LAYERS):
    model = MLP("sow", layers, next(_instances))
    return functools.partial(model.apply, mutable="intermediates")


def with_capture(layers=LAYERS):
    model = MLP("none", layers, next(_instances))
    return functools.partial(
        model.apply, capture_intermediates=only_layers, mutable="intermediates"
    )


def main():
    args = arguments(__doc__.splitlines()[0])
    repeats = 5 if args.quick else 11
    layers = 4 if args.smoke else LAYERS
    tag, sow, capture = (
        functools.partial(make, layers) for make in (with_tag, with_sow, with_capture)
    )
    x = jax.random.normal(jax.random.key(1), (32, WIDTH))
    params = MLP("none", layers).init(jax.random.key(0), x)

    def trace_lower(make_fn):
        return lambda: lambda: jax.jit(make_fn()).lower(params, x)

    rows = [
        identical_row(
            "optimized HLO, `fx.tag` vs `sow`",
            # `found` as plain dicts: flattened sorted, as `sow`'s are.
            optimized_hlo(as_plain_dicts(tag()), params, x),
            optimized_hlo(sow(), params, x),
        )
    ]
    for label, anchor, limit in (
        ("`sow`", sow, 1.1),
        ("`capture_intermediates`", capture, None),
    ):
        # Three times the rounds: the two traces differ by about 1%, less than
        # one round's noise on a shared machine.
        pair = compare_cold(trace_lower(tag), trace_lower(anchor), repeats=3 * repeats)
        rows.append(ratio_row(f"cold trace+lower, `fx.tag` vs {label}", pair, limit))
    for label, anchor in (
        ("`sow`", sow),
        ("`capture_intermediates`", capture),
    ):
        pair = compare(
            blocking(jax.jit(tag()), params, x),
            blocking(jax.jit(anchor()), params, x),
            repeats=6 * repeats,
            number=4,
            warmup=3,
        )
        rows.append(ratio_row(f"run time, `fx.tag` vs {label}", pair, 1.02, "≤ 1.02 †"))
    emit(
        table(
            f"5. Flax linen, {layers} layers: `fx.tag` (A) vs anchor (B)",
            ("A", "B"),
            rows,
        ),
        args,
    )


if __name__ == "__main__":
    main()
