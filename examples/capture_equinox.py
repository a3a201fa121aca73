"""Extracting intermediate values from an Equinox CNN with `fx.tag_modules`:
one feature map, every Linear layer, a finiteness check and the gradient of
the loss with respect to a layer's output, each checked against the layers
called by hand. The model's code is not edited. Run with
`python examples/capture_equinox.py`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import effects as fx


class CNN(eqx.Module):
    """conv -> relu -> avg pool -> flatten -> dense -> relu -> dense, unbatched."""

    conv: eqx.nn.Conv2d
    pool: eqx.nn.AvgPool2d
    hidden: eqx.nn.Linear
    logits: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv = eqx.nn.Conv2d(1, 4, kernel_size=3, padding=1, key=k1)
        self.pool = eqx.nn.AvgPool2d(kernel_size=2, stride=2)
        self.hidden = eqx.nn.Linear(4 * 4 * 4, 16, key=k2)
        self.logits = eqx.nn.Linear(16, 10, key=k3)

    def __call__(self, x):  # x: (channels, height, width)
        x = jax.nn.relu(self.conv(x))
        x = self.pool(x).reshape(-1)  # flatten
        x = jax.nn.relu(self.hidden(x))
        return self.logits(x)


def check(name, got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    print(f"{name}: ok, shape {jnp.shape(got)}")


model_key, data_key = jax.random.split(jax.random.key(0))
model = CNN(model_key)
xs = jax.random.normal(data_key, (2, 1, 8, 8))  # a batch of two 8x8 images
labels = jnp.array([3, 7])

# Equinox layers are unbatched: the batch goes through `jax.vmap`. `fx.handle`
# stays outside the vmap, so every value found carries the batch axis first.
batched = lambda m, xs: jax.vmap(m)(xs)  # noqa: E731


# 1. One feature map: tag only the conv layer, selected by its path.
tagged = fx.tag_modules(model, filter=lambda path, m: path == "conv")
out, found = fx.handle(batched, fx.Tag())(tagged, xs)
(conv_out,) = found["intermediates"]["conv"]  # one entry: conv ran once
check("conv feature map", conv_out, jax.vmap(model.conv)(xs))
check("output unchanged", out, jax.vmap(model)(xs))

# 2. Every layer of one type: the two Linear layers, named by attribute.
tagged = fx.tag_modules(model, filter=eqx.nn.Linear)
_, found = fx.handle(batched, fx.Tag())(tagged, xs)
print("Linear layers found:", list(found["intermediates"]))
assert list(found["intermediates"]) == ["hidden", "logits"]
pooled = jax.vmap(lambda x: model.pool(jax.nn.relu(model.conv(x))).reshape(-1))(xs)
hidden = jax.vmap(model.hidden)(pooled)
check("hidden", found["intermediates"]["hidden"][0], hidden)
check("logits", found["intermediates"]["logits"][0], out)

# 3. Are all intermediates finite? Tag every layer (filter=None).
_, found = fx.handle(batched, fx.Tag())(fx.tag_modules(model), xs)
print("all layers found:", list(found["intermediates"]))
assert all(jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(found))
print("all intermediates finite: ok")


# 4. Gradient of the loss with respect to the output of `hidden`. Substitute
# replaces that output by `value`; differentiating with respect to `value` at
# the original output gives dL/d(hidden output).
def loss_fn(m, xs):
    logp = jax.nn.log_softmax(jax.vmap(m)(xs))
    return -jnp.take_along_axis(logp, labels[:, None], axis=1).mean()


tagged = fx.tag_modules(model, filter=lambda path, m: path == "hidden")


def loss_given_hidden(value):
    loss, _ = fx.handle(loss_fn, fx.Substitute({"hidden": value}))(tagged, xs)
    return loss


def rest_by_hand(h):
    """The network after `hidden`, written by hand, as a function of its output."""
    logp = jax.nn.log_softmax(jax.vmap(model.logits)(jax.nn.relu(h)))
    return -jnp.take_along_axis(logp, labels[:, None], axis=1).mean()


dhidden = jax.grad(loss_given_hidden)(hidden)
assert jnp.any(dhidden != 0)
check("loss", loss_given_hidden(hidden), loss_fn(model, xs))
check("dL/dhidden", dhidden, jax.grad(rest_by_hand)(hidden))

print("all checks passed")
