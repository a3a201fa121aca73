"""Extracting intermediate values from a Flax linen CNN with `fx.tag_modules`:
one feature map, every Dense layer (one of them called twice), a finiteness
check and the gradient of the loss with respect to a layer's output, each
checked against the layers called by hand. The model's code is not edited, and
the names are those `capture_intermediates` gives. Run with
`python examples/capture_linen.py`."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import effects as fx


class CNN(nn.Module):
    """conv -> relu -> avg pool -> flatten -> dense -> relu -> dense (shared,
    applied twice) -> dense."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(features=4, kernel_size=(3, 3))(x))  # Conv_0
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nn.relu(nn.Dense(16)(x))  # Dense_0
        mix = nn.Dense(16)  # Dense_1, called twice
        x = nn.relu(mix(nn.relu(mix(x))))
        return nn.Dense(10)(x)  # Dense_2


def check(name, got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    print(f"{name}: ok, shape {jnp.shape(got)}")


model_key, data_key = jax.random.split(jax.random.key(0))
x = jax.random.normal(data_key, (2, 8, 8, 1))  # a batch of two 8x8 images
labels = jnp.array([3, 7])
model = CNN()
variables = model.init(model_key, x)
params = variables["params"]

# The layers called by hand, from their own parameters.
conv = nn.Conv(features=4, kernel_size=(3, 3)).apply({"params": params["Conv_0"]}, x)
pooled = nn.avg_pool(nn.relu(conv), window_shape=(2, 2), strides=(2, 2))
dense0 = nn.Dense(16).apply({"params": params["Dense_0"]}, pooled.reshape(2, -1))
mix = lambda h: nn.Dense(16).apply({"params": params["Dense_1"]}, h)  # noqa: E731
mix1 = mix(nn.relu(dense0))
mix2 = mix(nn.relu(mix1))
head = lambda h: nn.Dense(10).apply({"params": params["Dense_2"]}, h)  # noqa: E731

# 1. One feature map: tag only the conv layer, selected by its scope path.
tagged = fx.tag_modules(model, filter=lambda path, m: path == "Conv_0")
out, found = fx.handle(tagged.apply, fx.Tag())(variables, x)
(conv_out,) = found["intermediates"]["Conv_0"]  # one entry: Conv_0 ran once
check("Conv_0 feature map", conv_out, conv)
check("output unchanged", out, model.apply(variables, x))

# 2. Every layer of one type. Dense_1 ran twice, so it has two entries.
tagged = fx.tag_modules(model, filter=nn.Dense)
_, found = fx.handle(tagged.apply, fx.Tag())(variables, x)
dense = found["intermediates"]
print("Dense layers found:", {name: len(calls) for name, calls in dense.items()})
check("Dense_0", dense["Dense_0"][0], dense0)
check("Dense_1, first call", dense["Dense_1"][0], mix1)
check("Dense_1, second call", dense["Dense_1"][1], mix2)
check("Dense_2", dense["Dense_2"][0], out)

# The same names and values as linen's own `capture_intermediates`.
_, state = model.apply(
    variables,
    x,
    capture_intermediates=lambda m, method: isinstance(m, nn.Dense),
    mutable=["intermediates"],
)
for name, calls in dense.items():  # linen files each under its method's name
    want = state["intermediates"][name]["__call__"]
    check(f"{name} as capture_intermediates", jnp.stack(calls), jnp.stack(want))

# 3. Are all intermediates finite? Tag every layer (filter=None).
_, found = fx.handle(fx.tag_modules(model).apply, fx.Tag())(variables, x)
print("all layers found:", list(found["intermediates"]))
assert all(jnp.isfinite(leaf).all() for leaf in jax.tree.leaves(found))
print("all intermediates finite: ok")


# 4. Gradient of the loss with respect to the output of Dense_0. Substitute
# replaces that output by `value`; differentiating with respect to `value` at
# the original output gives dL/d(Dense_0 output).
tagged = fx.tag_modules(model, filter=lambda path, m: path == "Dense_0")


def loss_fn(variables, x):
    logp = jax.nn.log_softmax(tagged.apply(variables, x))
    return -jnp.take_along_axis(logp, labels[:, None], axis=1).mean()


def loss_given_dense0(value):
    loss, _ = fx.handle(loss_fn, fx.Substitute({"Dense_0": value}))(variables, x)
    return loss


def rest_by_hand(h):
    """The network after Dense_0, written by hand, as a function of its output."""
    logp = jax.nn.log_softmax(head(nn.relu(mix(nn.relu(mix(nn.relu(h)))))))
    return -jnp.take_along_axis(logp, labels[:, None], axis=1).mean()


ddense0 = jax.grad(loss_given_dense0)(dense0)
assert jnp.any(ddense0 != 0)
check("loss", loss_given_dense0(dense0), rest_by_hand(dense0))
check("dL/dDense_0", ddense0, jax.grad(rest_by_hand)(dense0))

print("all checks passed")
