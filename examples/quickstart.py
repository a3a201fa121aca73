"""Quickstart for `effects`: tag an intermediate, then collect, patch and
differentiate it. Run with `python examples/quickstart.py`."""

import jax
import jax.numpy as jnp
import numpy as np

import effects as fx

k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
W1 = jax.random.normal(k1, (4, 8))
W2 = jax.random.normal(k2, (8, 2))
x = jax.random.normal(k3, (3, 4))


def mlp(x):
    h = fx.tag(jnp.tanh(x @ W1), "hidden")
    return fx.perturb(h, "hidden") @ W2


def reference(x, delta=0.0):
    """`mlp` written by hand, with an explicit additive perturbation of `hidden`."""
    return (jnp.tanh(x @ W1) + delta) @ W2


def check(name, got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    print(f"{name}: ok, shape {jnp.shape(got)}")


# With no handler, tag/perturb are the identity.
check("plain call", mlp(x), reference(x))

# Collect tagged intermediates.
out, found = fx.handle(mlp, fx.Tag())(x)
(h,) = found["intermediates"]["hidden"]
check("collected hidden", h, jnp.tanh(x @ W1))
check("output under Tag", out, reference(x))

# Patch an intermediate with a new value.
out, _ = fx.handle(mlp, fx.Substitute({"hidden": jnp.zeros_like(h)}))(x)
check("substituted output", out, jnp.zeros_like(h) @ W2)

# Differentiate with respect to an intermediate.
out, grads = fx.intermediate_grads(lambda x: mlp(x).sum())(x)
(dh,) = grads["hidden"]
want = jax.grad(lambda d: reference(x, d).sum())(jnp.zeros_like(h))
check("loss", out, reference(x).sum())
check("dL/dhidden", dh, want)

# The same works under jit.
out, found = jax.jit(fx.handle(mlp, fx.Tag()))(x)
check("collected hidden under jit", found["intermediates"]["hidden"][0], h)

print("all checks passed")
