"""Group 13: derivative sites, `Tag(of="cotangent")` under `jax.grad` and
`Tag(of="tangent")` under `jax.jvp`, against the hand-written programs.

The 200-layer MLP of group 2 (width 128, batch 32, tanh layers) with every
layer's output tagged, and a squared-sum loss.

- Reverse: `fx.handle(jax.grad(loss), fx.Tag(of="cotangent"))(params, x)`, the
  gradient with respect to the parameters and to every layer's output in one
  backward pass, against the gradient of a hand-written loss that adds an
  explicit zero at every layer's output, with respect to the parameters and
  those zeros: optimized HLO, run time, and cold trace+lower (fresh function
  objects every round) against `jax.jit(jax.grad(hand-written loss))`, and for
  context against C: the same loss under a `jax.jit` inside the `jax.grad`,
  what JAX charges to differentiate any jitted function (see group 6).
- Forward: `fx.handle(jvp of f, fx.Tag(of="tangent"))` against `jax.jvp` of
  the hand-written function returning every layer's output: optimized HLO and
  run time.
- Unhandled: `jax.grad` of the tagged loss against `jax.grad` of the untagged
  one: optimized HLO and the compiled program's temporary memory.

Every handled result is checked against the hand-written one before it is
timed. Targets: identical optimized HLO and temporary memory; run time at most
1.02x; cold trace+lower of the reverse pass at most 1.3x.

Run with `python benchmarks/bench_derivatives.py [--append FILE] [--quick]`;
`--smoke` runs it once with 4 layers.
"""

import jax
import jax.numpy as jnp
import numpy as np
from _timing import (
    Row,
    arguments,
    blocking,
    compare,
    compare_cold,
    emit,
    identical_row,
    mlp_params,
    nbytes,
    optimized_hlo,
    ratio_row,
    table,
)

import effects as fx

LAYERS = 200


# New function objects on every call of a `make_*`: caches keyed on the
# function miss.


def make_loss(tag=True):
    mark = fx.tag if tag else (lambda v, name: v)

    def loss(params, x):
        h = x
        for i, w in enumerate(params):
            h = mark(jnp.tanh(h @ w), f"layer{i}")
        return jnp.sum(h**2)

    return loss


def make_handled_grad():
    # (gradient w.r.t. params, [gradient w.r.t. each layer's output])
    grad = fx.handle(jax.grad(make_loss()), fx.Tag(of="cotangent"))

    def cotangents(params, x):
        g, found = grad(params, x)
        part = found["intermediates:cotangent"]
        return g, [part[f"layer{i}"][0] for i in range(len(params))]

    return cotangents


def make_hand_written_grad(jit=False):
    def loss(params, zeros, x):
        h = x
        for w, z in zip(params, zeros):
            h = jnp.tanh(h @ w) + z
        return jnp.sum(h**2)

    grad = jax.grad(jax.jit(loss) if jit else loss, argnums=(0, 1))

    def zeros_by_hand(params, x):
        zeros = [jnp.zeros((x.shape[0], w.shape[1])) for w in params]
        g, gz = grad(params, zeros, x)
        return g, gz

    return zeros_by_hand


def make_jitted_hand_written_grad():
    return make_hand_written_grad(jit=True)


def make_handled_tangents(v):
    tagged = make_forward()
    jvp = fx.handle(
        lambda params, x: jax.jvp(lambda x: tagged(params, x), (x,), (v,)),
        fx.Tag(of="tangent"),
    )

    def tangents(params, x):
        (_, t), found = jvp(params, x)
        part = found["intermediates:tangent"]
        return t, [part[f"layer{i}"][0] for i in range(len(params))]

    return tangents


def make_forward(tag=True):
    mark = fx.tag if tag else (lambda v, name: v)

    def f(params, x):
        h = x
        for i, w in enumerate(params):
            h = mark(jnp.tanh(h @ w), f"layer{i}")
        return h

    return f


def make_hand_written_tangents(v):
    def every_layer(params, x):
        hs, h = [], x
        for w in params:
            h = jnp.tanh(h @ w)
            hs.append(h)
        return h, hs

    def tangents(params, x):
        return jax.jvp(lambda x: every_layer(params, x), (x,), (v,))[1]

    return tangents


def check(a, b, what):
    for u, w in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(u, w, rtol=1e-4, atol=1e-5, err_msg=what)


def temp_bytes(fn, *args) -> int | None:
    memory = jax.jit(fn).lower(*args).compile().memory_analysis()
    return None if memory is None else memory.temp_size_in_bytes


def main():
    args = arguments(__doc__.splitlines()[0])
    repeats = 5 if args.quick else 15
    layers = 4 if args.smoke else LAYERS
    x = jax.random.normal(jax.random.key(1), (32, 128))
    v = jax.random.normal(jax.random.key(2), (32, 128))
    params = mlp_params(layers)

    def same_program(name, handled, by_hand, number):
        """The rows saying that `handled` is `by_hand`'s program: the same
        values, optimized HLO and run time."""
        check(jax.jit(handled)(params, x), jax.jit(by_hand)(params, x), name)
        hlo = optimized_hlo(handled, params, x), optimized_hlo(by_hand, params, x)
        pair = compare(
            blocking(jax.jit(handled), params, x),
            blocking(jax.jit(by_hand), params, x),
            repeats=4 * repeats,
            number=number,
            warmup=3,
        )
        return [
            identical_row(f"{name}: optimized HLO", *hlo),
            ratio_row(f"{name}: run time", pair, 1.02),
        ]

    rows = same_program("reverse", make_handled_grad(), make_hand_written_grad(), 3)

    def trace_lower(make_fn):
        return lambda: lambda: jax.jit(make_fn()).lower(params, x)

    pair = compare_cold(
        trace_lower(make_handled_grad),
        trace_lower(make_hand_written_grad),
        repeats=repeats,
    )
    rows.append(ratio_row("reverse: cold trace+lower", pair, 1.3))
    pair = compare_cold(
        trace_lower(make_handled_grad),
        trace_lower(make_jitted_hand_written_grad),
        repeats=repeats,
    )
    rows.append(
        ratio_row(
            "reverse: cold trace+lower, vs C: `grad(jit(hand-written))`", pair, None
        )
    )

    rows += same_program(
        "forward", make_handled_tangents(v), make_hand_written_tangents(v), 5
    )

    # Unhandled
    tagged, untagged = jax.grad(make_loss()), jax.grad(make_loss(tag=False))
    check(jax.jit(tagged)(params, x), jax.jit(untagged)(params, x), "unhandled")
    rows.append(
        identical_row(
            "unhandled gradient, tagged vs untagged: optimized HLO",
            optimized_hlo(tagged, params, x),
            optimized_hlo(untagged, params, x),
        )
    )
    a, b = temp_bytes(tagged, params, x), temp_bytes(untagged, params, x)
    if a is not None and b is not None:
        rows.append(
            Row(
                "unhandled gradient, tagged vs untagged: temp memory",
                nbytes(a),
                nbytes(b),
                f"{a / b:.2f}" if b else "—",
                "= 1",
                a == b,
            )
        )
    emit(
        table(
            f"13. Derivative sites, {layers} layers: handled (A) vs hand-written (B)",
            ("handled", "hand-written"),
            rows,
        ),
        args,
    )


if __name__ == "__main__":
    main()
