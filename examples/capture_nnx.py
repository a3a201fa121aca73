"""Extracting intermediate values from a Flax NNX CNN with `fx.tag_modules`:
one feature map, every Linear layer, a finiteness check and the gradient of
the loss with respect to a layer's output, each checked against the layers
called by hand. The model's code is not edited. Run with
`python examples/capture_nnx.py`."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import effects as fx


class CNN(nnx.Module):
    """conv -> relu -> avg pool -> flatten -> dense -> relu -> dense."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
        self.mlp = nnx.List(  # a list of submodules must be an nnx.List
            [nnx.Linear(4 * 4 * 4, 16, rngs=rngs), nnx.Linear(16, 10, rngs=rngs)]
        )

    def __call__(self, x):  # x: (batch, height, width, channels)
        x = nnx.relu(self.conv(x))
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nnx.relu(self.mlp[0](x))
        return self.mlp[1](x)


def check(name, got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    print(f"{name}: ok, shape {jnp.shape(got)}")


model = CNN(nnx.Rngs(0))
x = jax.random.normal(jax.random.key(1), (2, 8, 8, 1))  # two 8x8 images
labels = jnp.array([3, 7])

# The layers called by hand.
conv = model.conv(x)
pooled = nnx.avg_pool(nnx.relu(conv), window_shape=(2, 2), strides=(2, 2))
hidden = model.mlp[0](pooled.reshape((2, -1)))

# 1. One feature map: tag only the conv layer, selected by its path. The
# tagged model shares the model's Variables; it is called like the model.
tagged = fx.tag_modules(model, filter=lambda path, m: path == "conv")
out, found = fx.handle(tagged, fx.Tag())(x)
(conv_out,) = found["intermediates"]["conv"]  # one entry: conv ran once
check("conv feature map", conv_out, conv)
check("output unchanged", out, model(x))

# 2. Every layer of one type: the Linear layers, named "mlp.<index>".
tagged = fx.tag_modules(model, filter=nnx.Linear)
_, found = fx.handle(tagged, fx.Tag())(x)
print("Linear layers found:", list(found["intermediates"]))
assert list(found["intermediates"]) == ["mlp.0", "mlp.1"]
check("mlp.0", found["intermediates"]["mlp.0"][0], hidden)
check("mlp.1", found["intermediates"]["mlp.1"][0], out)

# 3. Are all intermediates finite? Tag every layer (filter=None).
_, found = fx.handle(fx.tag_modules(model), fx.Tag())(x)
print("all layers found:", list(found["intermediates"]))
assert all(jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(found))
print("all intermediates finite: ok")


# 4. Gradient of the loss with respect to the output of mlp.0. Substitute
# replaces that output by `value`; differentiating with respect to `value` at
# the original output gives dL/d(mlp.0 output).
def loss_fn(m, x):
    logp = jax.nn.log_softmax(m(x))
    return -jnp.take_along_axis(logp, labels[:, None], axis=1).mean()


def loss_given_hidden(value, m):
    loss, _ = fx.handle(loss_fn, fx.Substitute({"mlp.0": value}))(m, x)
    return loss


def rest_by_hand(h):
    """The network after mlp.0, written by hand, as a function of its output."""
    logp = jax.nn.log_softmax(model.mlp[1](nnx.relu(h)))
    return -jnp.take_along_axis(logp, labels[:, None], axis=1).mean()


# The module goes in as an argument of `nnx.grad` (not closed over by
# `jax.grad`), so that NNX carries its state through the transformation.
tagged = fx.tag_modules(model, filter=lambda path, m: path == "mlp.0")
dhidden = nnx.grad(loss_given_hidden)(hidden, tagged)  # d/d(value) only
assert jnp.any(dhidden != 0)
check("loss", loss_given_hidden(hidden, tagged), loss_fn(model, x))
check("dL/dmlp.0", dhidden, jax.grad(rest_by_hand)(hidden))

print("all checks passed")
