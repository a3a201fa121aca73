"""Interpretability on a small Equinox transformer: cache every residual stream,
activation patching over every layer and position in one compiled program,
attribution patching from one forward and one backward pass, ablation and a
steering vector. The model's code carries no tags: `fx.tag_modules` adds them.

The toy task: read a sequence of tokens and predict, at the last position, the
first token. Clean and corrupted inputs differ only in that first token, so
patching shows where the model carries it from position 0 to the last.

Run with `python examples/interpretability.py`; with matplotlib installed
(`pip install -e ".[plot]"`) it also writes the two patching grids side by side
to docs/assets/patching.png (or the path given as its argument)."""

import sys
import time
from pathlib import Path

# --8<-- [start:imports]
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import effects as fx

# --8<-- [end:imports]
start = time.perf_counter()

# --8<-- [start:model]
VOCAB, LENGTH, WIDTH, DEPTH = 10, 6, 32, 2


class Embed(eqx.Module):
    """Token and position embeddings: the residual stream before block 0."""

    tokens: jax.Array
    positions: jax.Array

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.tokens = jax.random.normal(k1, (VOCAB, WIDTH)) * 0.5
        self.positions = jax.random.normal(k2, (LENGTH, WIDTH)) * 0.5

    def __call__(self, tokens):
        return self.tokens[tokens] + self.positions


class Block(eqx.Module):
    """Pre-norm causal self-attention and MLP, each added to the residual."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(WIDTH)
        self.attn = eqx.nn.MultiheadAttention(2, WIDTH, key=k1)
        self.norm2 = eqx.nn.LayerNorm(WIDTH)
        self.mlp = eqx.nn.MLP(WIDTH, WIDTH, 4 * WIDTH, 1, key=k2)

    def __call__(self, x):  # x: (LENGTH, WIDTH)
        h = jax.vmap(self.norm1)(x)
        causal = jnp.tril(jnp.ones((LENGTH, LENGTH), bool))
        x = x + self.attn(h, h, h, mask=causal)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class Transformer(eqx.Module):
    embed: Embed
    blocks: list[Block]
    unembed: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, DEPTH + 2)
        self.embed = Embed(keys[0])
        self.blocks = [Block(k) for k in keys[1:-1]]
        self.unembed = eqx.nn.Linear(WIDTH, VOCAB, key=keys[-1])

    def __call__(self, tokens):  # tokens: (LENGTH,) -> the last position's logits
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.unembed(x[-1])


# --8<-- [end:model]

#
# A few seconds of training on the toy task
#


# --8<-- [start:train]
def batch_of(key, n):
    return jax.random.randint(key, (n, LENGTH), 0, VOCAB)


def loss_fn(model, tokens):
    logits = jax.vmap(model)(tokens)
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(tokens)), tokens[:, 0]])


def adam_step(params, moments, step, key, static):
    # Adam, written out: the example needs nothing beyond the library's own.
    tokens = batch_of(key, 128)
    loss_of = lambda p: loss_fn(eqx.combine(p, static), tokens)  # noqa: E731
    loss, grads = jax.value_and_grad(loss_of)(params)
    m, v = moments
    m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, grads)
    v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g**2, v, grads)
    lr = 3e-3 * jnp.sqrt(1 - 0.999**step) / (1 - 0.9**step)
    updates = jax.tree.map(lambda m, v: -lr * m / (jnp.sqrt(v) + 1e-8), m, v)
    return jax.tree.map(jnp.add, params, updates), (m, v), loss


@eqx.filter_jit
def train(model, keys):
    # Every step in one compiled `lax.scan`: one call, however many steps.
    params, static = eqx.partition(model, eqx.is_array)
    zeros = jax.tree.map(jnp.zeros_like, params)

    def step(carry, step_and_key):
        params, moments, loss = adam_step(*carry, *step_and_key, static)
        return (params, moments), loss

    steps = jnp.arange(1, len(keys) + 1, dtype=jnp.float32)
    (params, _), losses = jax.lax.scan(step, (params, (zeros, zeros)), (steps, keys))
    return eqx.combine(params, static), losses[-1]


keys = jax.random.split(jax.random.key(1), 300)
model, loss = train(Transformer(jax.random.key(0)), keys)
test = batch_of(jax.random.key(2), 512)
accuracy = jnp.mean(jnp.argmax(jax.vmap(model)(test), -1) == test[:, 0])
print(f"trained: loss {loss:.4f}, accuracy {accuracy:.0%}")
# --8<-- [end:train]


def check(what, got, want, tol=1e-4):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    print(f"{what}: ok")


#
# Cache every residual stream on a clean and a corrupted input
#

# --8<-- [start:cache]
clean = jnp.array([3, 7, 1, 4, 1, 5])
corrupt = clean.at[0].set(8)  # only the first token differs


def metric(logits):
    """How much the model prefers the clean answer over the corrupted one."""
    return logits[clean[0]] - logits[corrupt[0]]


RESIDUALS = ["embed", *(f"blocks.{i}" for i in range(DEPTH))]
tagged = fx.tag_modules(model, filter=(Embed, Block, eqx.nn.MultiheadAttention))
print(fx.sites(tagged)(clean))

cache = fx.handle(tagged, fx.Tag())
clean_logits, clean_found = cache(clean)
corrupt_logits, corrupt_found = cache(corrupt)
clean_cache = {n: v[0] for n, v in clean_found["intermediates"].items()}
corrupt_cache = {n: v[0] for n, v in corrupt_found["intermediates"].items()}
clean_metric, corrupt_metric = metric(clean_logits), metric(corrupt_logits)
print(f"logit difference: clean {clean_metric:.2f}, corrupted {corrupt_metric:.2f}")
# --8<-- [end:cache]


def by_hand(tokens, on_residual):
    """The model run block by block, `on_residual(layer, x)` applied to each
    residual stream: the reference the handled runs are checked against."""
    x = on_residual(0, model.embed(tokens))
    for i, block in enumerate(model.blocks, start=1):
        x = on_residual(i, block(x))
    return model.unembed(x[-1])


hand = [model.embed(clean)]
for block in model.blocks:
    hand.append(block(hand[-1]))
check("cached residuals", [clean_cache[n] for n in RESIDUALS], hand)

#
# Activation patching: every (layer, position) at once
#


# --8<-- [start:patching]
def patched(layer, position):
    """The corrupted run with the clean residual of `layer` at `position`."""

    def patch(index, name):
        def fn(x):
            here = (index == layer) & (jnp.arange(LENGTH) == position)[:, None]
            return jnp.where(here, clean_cache[name], x)

        return fn

    fns = {name: patch(i, name) for i, name in enumerate(RESIDUALS)}
    logits, _ = fx.handle(tagged, fx.Intervene(fns))(corrupt)
    return metric(logits)


layers, positions = jnp.arange(len(RESIDUALS)), jnp.arange(LENGTH)
grid_fn = jax.jit(jax.vmap(jax.vmap(patched, (None, 0)), (0, None)))
exact = (grid_fn(layers, positions) - corrupt_metric) / (clean_metric - corrupt_metric)
# --8<-- [end:patching]


def patched_by_hand(layer, position):
    def on_residual(i, x):
        return (
            x.at[position].set(clean_cache[RESIDUALS[i]][position]) if i == layer else x
        )

    return metric(by_hand(corrupt, on_residual))


check(
    "patching block 0 at position 0",
    grid_fn(layers, positions)[1, 0],
    patched_by_hand(1, 0),
)
check("patching the last block at the last position", exact[-1, -1], 1.0)

# --8<-- [start:chunked]
# The same grid in chunks: `jax.lax.map` runs a `vmap` over each chunk of 6
# patches and a `scan` over the chunks, so memory grows with the chunk, not
# with the grid.
patches = [a.reshape(-1) for a in jnp.meshgrid(layers, positions, indexing="ij")]
chunked_fn = jax.jit(
    lambda patches: jax.lax.map(lambda p: patched(*p), patches, batch_size=6)
)
chunked = chunked_fn(patches).reshape(len(RESIDUALS), LENGTH)
# --8<-- [end:chunked]
check("the grid in chunks of 6", chunked, grid_fn(layers, positions))

#
# Attribution patching: the same grid to first order, from one backward pass
#

# --8<-- [start:attribution]
# d metric / d residual on the corrupted run, for every tagged module at once.
_, grads = fx.intermediate_grads(lambda t: metric(tagged(t)), kind="tag")(corrupt)
attribution = jnp.stack(
    [
        jnp.sum((clean_cache[n] - corrupt_cache[n]) * grads[n][0], axis=-1)
        for n in RESIDUALS
    ]
) / (clean_metric - corrupt_metric)
# --8<-- [end:attribution]


def delta_by_hand(delta):
    return metric(by_hand(corrupt, lambda i, x: x + delta if i == 1 else x))


check(
    "gradient at blocks.0 against jax.grad of a hand-placed delta",
    grads["blocks.0"][0],
    jax.grad(delta_by_hand)(jnp.zeros((LENGTH, WIDTH))),
)

# --8<-- [start:show-grids]
np.set_printoptions(precision=2, suppress=True)
print("restored fraction of the logit difference (rows: " + ", ".join(RESIDUALS) + ")")
print("exact (activation patching):")
print(np.round(np.asarray(exact), 2) + 0.0)  # + 0.0: no "-0."
print("first-order (attribution patching):")
print(np.round(np.asarray(attribution), 2) + 0.0)
# --8<-- [end:show-grids]

#
# Ablation: what each attention layer contributes on the clean input
#

# --8<-- [start:ablation]
reference = batch_of(jax.random.key(3), 256)
_, found = jax.vmap(fx.handle(tagged, fx.Tag()))(reference)
for i in range(DEPTH):
    name = f"blocks.{i}.attn"
    mean = jnp.mean(found["intermediates"][name][0], axis=0)  # over the batch
    zero_ablated = fx.handle(tagged, fx.Intervene({name: jnp.zeros_like}))(clean)[0]
    mean_ablated = fx.handle(tagged, fx.Intervene({name: lambda x: mean}))(clean)[0]
    print(
        f"{name} ablated: logit difference {metric(zero_ablated):.2f} (zero), "
        f"{metric(mean_ablated):.2f} (mean), against {clean_metric:.2f}"
    )
# --8<-- [end:ablation]

#
# Steering: add the direction that separates the two answers to the
# corrupted run's last position after block 0
#

# --8<-- [start:steering]
_, clean_runs = jax.vmap(fx.handle(tagged, fx.Tag()))(reference.at[:, 0].set(clean[0]))
_, corrupt_runs = jax.vmap(fx.handle(tagged, fx.Tag()))(
    reference.at[:, 0].set(corrupt[0])
)
direction = jnp.mean(
    clean_runs["intermediates"]["blocks.0"][0][:, -1]
    - corrupt_runs["intermediates"]["blocks.0"][0][:, -1],
    axis=0,
)


def steered(scale):
    steer = {"blocks.0": lambda x: x.at[-1].add(scale * direction)}
    return metric(fx.handle(tagged, fx.Intervene(steer))(corrupt)[0])


scales = jnp.array([0.0, 0.5, 1.0, 1.5])
differences = jax.jit(jax.vmap(steered))(scales)  # every scale in one program
print("steering the corrupted run: scale -> logit difference")
print(", ".join(f"{a:.1f} -> {d:.2f}" for a, d in zip(scales, differences)))
# --8<-- [end:steering]

#
# The figure
#

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("matplotlib is not installed: no figure (pip install -e '.[plot]')")
else:
    root = Path(__file__).resolve().parent.parent
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else root / "docs/assets/patching.png"
    out.parent.mkdir(parents=True, exist_ok=True)

    def label(value):
        text = f"{value:.2f}"
        return "0.00" if float(text) == 0 else text  # never "-0.00"

    def ink(rgba):
        """White on dark cells, black on light ones (relative luminance)."""
        r, g, b = (
            c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4
            for c in rgba[:3]
        )
        return "white" if 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.18 else "black"

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True, layout="constrained")
    for ax, grid, title in zip(
        axes,
        (exact, attribution),
        ("activation patching (exact)", "attribution patching (first order)"),
    ):
        values = np.asarray(grid)
        image = ax.imshow(values, cmap="RdBu", vmin=-1, vmax=1)
        for (row, col), value in np.ndenumerate(values):
            colour = ink(image.cmap(image.norm(value)))
            ax.text(
                col,
                row,
                label(value),
                ha="center",
                va="center",
                fontsize=10,
                color=colour,
            )
        ax.set_title(title, fontsize=12)
        ax.set_xlabel("position patched", fontsize=11)
        ax.set_xticks(range(LENGTH))
        ax.set_yticks(range(len(RESIDUALS)), RESIDUALS)
        ax.tick_params(labelsize=10)
    axes[0].set_ylabel("residual stream", fontsize=11)
    bar = fig.colorbar(image, ax=axes, shrink=0.9)
    bar.set_label("restored fraction", fontsize=11)
    bar.ax.tick_params(labelsize=9)
    fig.savefig(out, dpi=150)
    print(f"figure: {out}")
print(f"all checks passed in {time.perf_counter() - start:.1f} s")
