"""`intermediate_grads`: a function's gradients with respect to its sites,
built on `handle` and `Perturb`: the gradient with respect to a `Perturb`'s
deltas, which are zeros, is the gradient with respect to the values."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import _compat
from ._handle import Found, Jitted, P, eager_cached, functional, handle
from ._handlers import Names, Perturb
from ._site import NotVarying

_NO_SITES = {
    "perturb": (
        "intermediate_grads: the function has no perturb site in the collection "
        "{collection!r}, so there is nothing to differentiate with respect to. For "
        "the gradients with respect to tagged values, pass kind='tag'."
    ),
    "tag": (
        "intermediate_grads: the function has no tag in the collection "
        "{collection!r}, so there is nothing to differentiate with respect to. "
        "Check the collection, or pass kind='perturb' for perturb sites."
    ),
}


def intermediate_grads(
    fn: Callable[P, Any],
    *,
    collection: str | None = None,
    kind: str = "perturb",
    names: Names = None,
) -> Callable[P, tuple[Any, dict[str, Any]]]:
    """Returns a function computing `fn` and its gradients with respect to
    its sites: those of [`fx.perturb`][effects.perturb], or with `kind="tag"`
    those of [`fx.tag`][effects.tag].

    The gradient with respect to an intermediate value, one per execution of
    the site: it runs `fn` once under [`Perturb()`][effects.Perturb] to learn
    the sites' shapes, then takes `jax.value_and_grad` with respect to deltas
    added there by `Perturb(deltas)`. With `kind="tag"` it needs no change to
    the function: the gradient with respect to every layer
    [`fx.tag_modules`][effects.tag_modules] tags, for example. Under a
    `jax.vmap` inside `fn` (a loss averaging over a batch), each example has
    its own gradient, also at a value that does not depend on the example (a
    position embedding): the gradient with respect to that example's copy.

    **Arguments:**

    - `fn`: a function returning a scalar.
    - `collection`: the collection of the sites; by default `"perturbations"`
      (`"intermediates"` with `kind="tag"`).
    - `kind`: `"perturb"`, or `"tag"` for the gradients with respect to tagged
      values.
    - `names`: which sites' gradients, see [`Names`][effects.Names]; by
      default every one in the collection.

    **Returns:**

    `g(*args, **kwargs) -> (fn(*args, **kwargs), grads)`, with `grads` a dict
    from site name to a tuple with one gradient per execution (stacked over
    scan iterations), the layout `Perturb()` reports; a value with no
    gradient (integers, booleans, PRNG keys) has a `float0` zero, as
    `jax.grad(..., allow_int=True)` gives. Flax NNX modules among
    the arguments have their state updated, as [`handle`][effects.handle]
    does.

    **Raises:**

    - `ValueError`: `kind` is neither `"perturb"` nor `"tag"`; `fn` has no
      site of that kind in the collection (that `names` matches); a name in
      `names` without glob characters that no site has; or what
      [`handle`][effects.handle] raises for `Perturb` (a site inside a
      `lax.while_loop` or inside a `custom_jvp`/`custom_vjp` function); a
      site whose value holds both a PRNG key and floating values; a site in a
      `shard_map` whose value every shard holds alike (a `psum`'s), which
      takes no delta per shard: `Tag(of="cotangent")` under `jax.grad`
      reports its gradient.
    - `TypeError`: `fn` does not return a scalar (raised by `jax.grad`).

    **Example:**

    ```python
    def loss(x):
        h = fx.tag(jnp.sin(x), "h")
        return (2 * h) ** 2

    value, grads = fx.intermediate_grads(loss, kind="tag")(1.0)
    print(grads)  # d(loss)/dh = 8 h = 8 sin(1)
    ```

    ```text
    {'h': (Array(6.7317677, dtype=float32),)}
    ```
    """

    probe = Perturb(collection=collection, kind=kind, names=names)

    def g(*args, **kwargs):
        # Flax NNX objects among the arguments: their state goes in and the
        # state they end with comes out of the gradient as auxiliary output.
        nnx_call = functional(fn, args, kwargs)
        pure = fn
        if nnx_call is not None:
            pure, args, kwargs = nnx_call[0], nnx_call[1], {}
        # Outside any transformation, through a jit cached per function and
        # argument signature: repeated calls neither trace nor compile.
        top, nnx = _compat.is_top_level(), nnx_call is not None

        def make(call, _):
            grads = functools.partial(_grads, call, probe, nnx)
            return Jitted(grads) if top else grads

        what = ("intermediate_grads", probe.collection, kind, probe.names)
        grads, dynamic = eager_cached(what, pure, args, kwargs, make)
        out = grads(dynamic)
        if nnx_call is None:
            return out
        (out, state), grads = out
        nnx_call[2](state)
        return out, grads

    functools.update_wrapper(g, fn)
    return g


def _grads(call, probe: Perturb, nnx: bool, dynamic):
    """`intermediate_grads` of `call(dynamic)`, at the sites `probe` (a
    `Perturb()`) matches: with `nnx`, `call` returns `(value, state)`, and so
    does this, as `((value, state), grads)`."""
    _, shapes = jax.eval_shape(handle(call, probe), dynamic)
    sites = shapes[probe.collection]
    if not sites:
        raise ValueError(_NO_SITES[probe.kind].format(collection=probe.collection))
    # A value with no gradient (integers, booleans, PRNG keys) has the float0
    # zero `jax.grad(..., allow_int=True)` gives: only floating leaves take a
    # delta that is differentiated (an integer beside them a zero; a key none).
    grads = Found((n, jax.tree.map(_float0, v)) for n, v in sites.items())
    zeros = Found()
    for name, value in sites.items():
        avals = jax.tree.leaves(value)
        if any(jnp.issubdtype(a.dtype, jnp.inexact) for a in avals):
            if any(_compat.is_key(a) for a in avals):
                raise ValueError(_KEY_AND_FLOATS.format(name=name, kind=probe.kind))
            zeros[name] = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), value)
    floats, others = eqx.partition(zeros, eqx.is_inexact_array)

    def loss(floats):
        deltas = eqx.combine(floats, others)
        perturb = Perturb(deltas, collection=probe.collection, kind=probe.kind)
        out, _ = handle(call, perturb)(dynamic)
        return out  # with NNX objects: (value, their state)

    try:
        out, got = jax.value_and_grad(loss, has_aux=nnx)(floats)
    except NotVarying as e:
        raise ValueError(_SAME_IN_EVERY_SHARD.format(e.where, e.axes)) from e
    for name, grad in got.items():
        grads[name] = eqx.combine(grad, grads[name])
    return out, grads


def _float0(aval):
    return np.zeros(aval.shape, jax.dtypes.float0)


_SAME_IN_EVERY_SHARD = (
    "intermediate_grads: {0} is the same in every shard over the mesh axes {1} "
    "(a `psum`'s value, an input with `PartitionSpec()`), so it takes no delta "
    "per shard, and its gradient is not taken here. Its cotangent is: "
    '`fx.handle(jax.grad(f), fx.Tag(of="cotangent"))` reports it, the '
    "gradient with respect to the value, once per shard."
)
_KEY_AND_FLOATS = (
    "intermediate_grads: the {kind} {name!r} holds a PRNG key and floating "
    "values; a key takes no delta. Give the key a name of its own."
)
