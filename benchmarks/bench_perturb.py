"""Group 6: gradients with respect to intermediates, `fx.Perturb` + `jax.grad` vs
a hand-written loss with explicit additive deltas.

The 200-layer MLP of group 2 (width 128, batch 32) with `fx.perturb` on every
layer's output and a squared-sum loss. A: `jax.grad` with respect to the deltas
of `fx.handle(loss, fx.Perturb(deltas))(params, x)[0]`. B: `jax.grad` of the same
loss written with `h = tanh(h @ w) + deltas[name][0]`.

Measured: optimized HLO, run time of the jitted gradients, and cold trace+lower
with fresh function objects every round, also against C: `jax.grad` of the
hand-written loss under `jax.jit`. The handled function is one jitted call (so
that `jax.grad` reuses JAX's cached derivative of it), and JAX differentiates
a jitted call by linearizing each primitive of its jaxpr anew
(`fallback_linearize_rule`), where the un-jitted loss meets jnp's own small
jits, whose linearizations it caches: C is what any jitted loss pays. The last
row is JAX alone: the gradient of the hand-written loss's traced jaxpr
(`jax.make_jaxpr`, `jax.extend.core.jaxpr_as_fun`) against the gradient of the
loss, the cost any rewrite of a jaxpr meets.

Run with `python benchmarks/bench_perturb.py [--append FILE] [--quick]`;
`--smoke` runs it once with 4 layers.
"""

import jax
import jax.extend.core
import jax.numpy as jnp
from _timing import (
    arguments,
    blocking,
    compare,
    compare_cold,
    emit,
    identical_row,
    mlp_params,
    optimized_hlo,
    ratio_row,
    table,
)

import effects as fx

LAYERS = 200


def make_handled_grad(params, x):
    # New function objects on every call: caches keyed on the function miss.
    def loss(params, x):
        h = x
        for i, w in enumerate(params):
            h = fx.perturb(jnp.tanh(h @ w), f"layer{i}")
        return jnp.sum(h**2)

    def grad(deltas):
        return jax.grad(lambda d: fx.handle(loss, fx.Perturb(d))(params, x)[0])(deltas)

    return grad


def make_hand_written_grad(params, x, jit=False):
    def loss(deltas):
        h = x
        for i, w in enumerate(params):
            h = jnp.tanh(h @ w) + deltas[f"layer{i}"][0]
        return jnp.sum(h**2)

    return jax.grad(jax.jit(loss) if jit else loss)


def make_jitted_hand_written_grad(params, x):
    return make_hand_written_grad(params, x, jit=True)


def make_jaxpr_grad(params, x, deltas):
    """JAX alone: the gradient of the hand-written loss's traced jaxpr, what
    any rewrite of a jaxpr hands `jax.grad`."""

    def grad(ds):
        loss = make_hand_written_grad(params, x).__wrapped__  # a fresh loss
        closed = jax.make_jaxpr(loss)(deltas)
        flat_loss = jax.extend.core.jaxpr_as_fun(closed)
        return jax.grad(lambda d: flat_loss(*jax.tree.leaves(d))[0])(ds)

    return grad


def main():
    args = arguments(__doc__.splitlines()[0])
    repeats = 5 if args.quick else 11
    layers = 4 if args.smoke else LAYERS
    x = jax.random.normal(jax.random.key(1), (32, 128))
    params = mlp_params(layers)
    deltas = {f"layer{i}": (jnp.zeros((32, 128)),) for i in range(layers)}

    def trace_lower(make_grad):
        return lambda: lambda: jax.jit(make_grad(params, x)).lower(deltas)

    rows = [
        identical_row(
            "optimized HLO of the gradient",
            optimized_hlo(make_handled_grad(params, x), deltas),
            optimized_hlo(make_hand_written_grad(params, x), deltas),
        )
    ]
    pair = compare(
        blocking(jax.jit(make_handled_grad(params, x)), deltas),
        blocking(jax.jit(make_hand_written_grad(params, x)), deltas),
        repeats=6 * repeats,
        number=3,
        warmup=3,
    )
    rows.append(ratio_row("run time of the gradient", pair, 1.02))
    pair = compare_cold(
        trace_lower(make_handled_grad),
        trace_lower(make_hand_written_grad),
        repeats=repeats,
    )
    rows.append(ratio_row("cold trace+lower of the gradient", pair, 1.3))
    pair = compare_cold(
        trace_lower(make_handled_grad),
        trace_lower(make_jitted_hand_written_grad),
        repeats=repeats,
    )
    rows.append(
        ratio_row(
            "cold trace+lower of the gradient, vs C: `grad(jit(hand-written))`",
            pair,
            1.3,
        )
    )
    pair = compare_cold(
        lambda: lambda: jax.jit(make_jaxpr_grad(params, x, deltas)).lower(deltas),
        trace_lower(make_hand_written_grad),
        repeats=repeats,
    )
    rows.append(
        ratio_row(
            "JAX alone: cold trace+lower of `grad` of the hand-written loss's "
            "jaxpr (A) vs of the loss (B)",
            pair,
            None,
        )
    )
    emit(
        table(
            f"6. `Perturb` + `grad`, {layers} layers: handled (A) vs explicit "
            "deltas (B)",
            ("handled", "hand-written"),
            rows,
        ),
        args,
    )


if __name__ == "__main__":
    main()
