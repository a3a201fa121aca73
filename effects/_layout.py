"""Where the axes go: the one place that knows where vmap batch axes, shard_map
shard axes and scan iteration axes sit in what handlers emit, and how a region's
state (accumulators, per-execution inputs, appended entries) crosses the
boundary of a loop body, a branch or a shard_map's body.

In the layout `found` has, a value leads with its vmap batch axes (outermost
first), then one axis per `shard_map` it came out of, then one per `lax.scan`
it came out of (outermost first)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from . import _compat

# The leading axes of a value in `found`'s layout, outermost first: a vmap batch
# axis by its size, then a shard_map's by its manual mesh axes and number of
# shards (`Boundary.marker`). The axes of the scans a value came out of follow
# them, and are not among these.
Axis = int | tuple[tuple[str, ...], int]
Axes = tuple[Axis, ...]


def n_batch(axes: Axes) -> int:
    """How many of `axes` are vmap batch axes (they come first)."""
    return sum(isinstance(a, int) for a in axes)


def example_axes(n: int) -> tuple[str, ...]:
    """The names of the vmaps a handler's `apply` runs under, one per vmap
    batch axis of the value, outermost first (`Context.batch_index`)."""
    return tuple(f"effects_example_{i}" for i in range(n))


def under_vmaps(fn, names, in_axes: Any = 0):
    """`fn` of one example, under one vmap per name in `names` (None: an
    unnamed one), the first the outermost: it takes and gives values whose
    leading axes are those vmaps' batch axes, the layout `found` has."""
    for name in reversed(names):
        fn = jax.vmap(fn, in_axes=in_axes, axis_name=name)
    return fn


def one_cond(fast, slow):
    """`f(*xs)`: `fast(*xs)` gives `(result, clean)`; where not `clean`,
    `slow(*xs)` gives the result instead. Under vmaps, one cond for all the
    examples (JAX makes a batched cond a select, which runs both branches):
    `fast` for each example, then `slow` for each where any example needs it.
    A check at every value of a program pays for `slow` only where it finds
    something."""
    return _one_cond(fast, slow, ())


def _one_cond(fast, slow, levels: tuple):
    # `levels`: per vmap around the call, innermost first, whether each input
    # is batched there (at its front, where JAX's rule puts it)
    def nested(fn):
        for batched in levels:
            fn = jax.vmap(fn, in_axes=jax.tree.map(lambda b: 0 if b else None, batched))
        return fn

    @jax.custom_batching.custom_vmap
    def f(*xs):
        result, clean = nested(fast)(*xs)
        if levels:
            clean = jax.lax.reduce_and(clean, tuple(range(clean.ndim)))
        return jax.lax.cond(
            clean, lambda r, _: r, lambda _, xs: nested(slow)(*xs), result, xs
        )

    @f.def_vmap
    def _(axis_size, in_batched, *xs):
        del axis_size
        out = _one_cond(fast, slow, (*levels, tuple(in_batched)))(*xs)
        return out, jax.tree.map(lambda _: True, out)

    return f


def grow(tree, have: Axes, want: Axes):
    """`tree`, whose leaves lead with the axes `have`, broadcast to lead with
    `want` (`have` is a prefix of `want`, both outermost first)."""
    new = tuple(range(len(have), len(want)))
    sizes = tuple(s if isinstance(s, int) else s[1] for s in want)

    def one(x):
        x = jnp.expand_dims(x, new)
        return jnp.broadcast_to(x, sizes + x.shape[len(want) :])

    return jax.tree.map(one, tree)


# A site's value under vmaps inside the handled function: per leaf, one
# `(axis, size)` per vmap, outermost first, the axis where the program holds
# it, or None where that vmap left the leaf unbatched.


def batch_sizes(batch) -> tuple[int, ...]:
    """The sizes of the vmap batch axes a site's value has (`batch`, per leaf),
    outermost first."""
    if not batch or not batch[0]:  # (most sites: under no vmap)
        return ()
    return tuple(size for _, size in batch[0])


def found_avals(shape_dtype, batch):
    """The structure and types of a site's value (`shape_dtype`: one
    example's) in the layout `found` has: after the vmap batch axes."""
    sizes = batch_sizes(batch)
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(sizes + a.shape, a.dtype), shape_dtype
    )


def example_part(x, shape, batch, shards, batch_index):
    """Of `x`, a value for one example's leaf of `shape` (its own, or every
    example's and shard's in the layout `found` has: the vmap batch axes, then
    one axis per `shard_map` around the site, `shards`), the part for the
    example at `batch_index` and this shard; None where it is neither, with
    the shape the layout would have."""
    if x.shape == shape:
        return x, shape
    found = (*batch_sizes(batch), *(n for _, n in shards), *shape)
    if x.shape != found or found == shape:
        return None, found
    # (shards numbered as the shard_map rule splits and stacks them)
    return x[(*batch_index, *(jax.lax.axis_index(a) for a, _ in shards))], found


def one_example(aval, batch) -> jax.ShapeDtypeStruct:
    """The type of one example's value of a leaf of type `aval`."""
    shape = list(aval.shape)
    for axis in sorted((a for a, _ in batch if a is not None), reverse=True):
        del shape[axis]
    return jax.ShapeDtypeStruct(tuple(shape), aval.dtype)


def to_found(x, batch):
    """A leaf as the program holds it -> its batch axes first, outermost first
    (an unbatched leaf broadcast along them): the layout `found` has."""
    if not batch:
        return x
    src = [a for a, _ in batch if a is not None]
    x = jnp.moveaxis(x, src, list(range(len(src))))
    for i, (a, size) in enumerate(batch):
        if a is None:
            x = jnp.expand_dims(x, i)
            x = jnp.broadcast_to(x, x.shape[:i] + (size,) + x.shape[i + 1 :])
    return x


def to_program(x, batch):
    """A leaf with its batch axes first -> where the program holds them (every
    one batched)."""
    if not batch:
        return x
    return jnp.moveaxis(x, list(range(len(batch))), [a for a, _ in batch])


@dataclasses.dataclass(frozen=True)
class Boundary:
    """How a region's state crosses into it and out of it.

    - `stack`: None, or how entries leave the region stacked along a new axis:
      `"scan"` (one per iteration, after the batch and shard axes) or
      `"shard"` (one per shard, after the batch axes and before the axes of
      shard_maps inside). Per-execution inputs enter stacked the same way.
    - `size`: the number of iterations or shards.
    - `params`: a shard_map's params (its body sees one shard of what is stacked).
    - `vary`: entries leave varying over the manual mesh axes (the branches of a
      cond inside a shard_map must agree on it).
    """

    stack: str | None = None
    size: int = 0
    params: Any = None
    vary: bool = False

    @classmethod
    def shard_map(cls, params) -> Boundary:
        mesh, manual = params["mesh"], _compat.shard_map_manual_axes(params)
        return cls("shard", math.prod(mesh.shape[a] for a in manual), params)

    @property
    def axes(self) -> tuple[str, ...]:
        """A shard_map's manual mesh axes, in mesh order."""
        manual = _compat.shard_map_manual_axes(self.params)
        return tuple(a for a in self.params["mesh"].axis_names if a in manual)

    @property
    def spec(self):
        """A shard_map's spec for what is stacked over its shards."""
        return jax.sharding.PartitionSpec(self.axes)

    # Stacked entries and inputs, outside the region -------------------------

    @property
    def marker(self) -> Axis:
        """A shard_map's axis among a value's leading axes."""
        return (self.axes, self.size)

    def _axis(self, axes: Axes) -> int:
        # A scan's axis after the batch and shard axes; a shard_map's after the
        # batch axes, before those of shard_maps inside it.
        return len(axes) if self.stack == "scan" else n_batch(axes)

    def after(self, axes: Axes) -> Axes:
        """A value's leading axes once it has left the region."""
        if self.stack == "shard":
            i = n_batch(axes)
            return (*axes[:i], self.marker, *axes[i:])
        return axes

    def stacked(self, avals, axes: Axes):
        """The types of an entry's values stacked over the region."""
        if self.stack is None:
            return avals
        axis = self._axis(axes)
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(
                a.shape[:axis] + (self.size,) + a.shape[axis:], a.dtype
            ),
            avals,
        )

    def to_inside(self, value, axes: Axes):
        """Stacked values (layout above) -> the stacked axis first, as a scan
        slices its inputs and a shard_map splits them."""
        if self.stack is None:
            return value
        axis = self._axis(axes)
        return jax.tree.map(lambda x: jnp.moveaxis(x, axis, 0), value)

    def from_inside(self, value, axes: Axes):
        """Values stacked along their first axis by the region -> the layout
        above."""
        if self.stack is None:
            return value
        axis = self._axis(axes)
        return jax.tree.map(lambda x: jnp.moveaxis(x, 0, axis), value)

    def repeated(self, tree):
        """`tree`, whole in every shard: repeated along a new leading axis, one
        per shard."""
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (self.size, *x.shape)), tree)

    def repeated_init(self, init, axes: Axes):
        """An accumulator made by `init` whole in every shard, in the layout
        above, where its leading axes are `axes` inside."""
        return self.from_inside(self.repeated(init()), axes)

    def without(self, types, axes: Axes):
        """The types of an accumulator whose leading axes `axes` hold this
        shard_map's, one shard's: without that axis."""
        i = axes.index(self.marker)
        return jax.tree.map(
            lambda t: jax.ShapeDtypeStruct(t.shape[:i] + t.shape[i + 1 :], t.dtype),
            types,
        )

    # Flat values crossing the boundary --------------------------------------

    def input_aval(self, aval):
        """The type inside of a per-execution input leaf of type `aval` outside."""
        if self.stack == "scan":
            return _compat.mapped_aval(self.size, aval)
        return self.acc_aval(aval)

    def acc_aval(self, aval):
        """The type inside of an accumulator leaf of type `aval` outside (a
        shard_map's, stacked over its shards, enters split)."""
        if self.stack == "shard":
            return _compat.shard_aval(self.params, self.spec, aval)
        return aval

    def entering(self, aval, axes: Axes = ()):
        """The type of the region's input leaf that `enter` makes a value of
        type `aval` inside, or, for a shard_map, of an accumulator leaf of
        type `aval` with leading axes `axes` outside: one shard's, without
        this shard_map's axis where it has one."""
        if self.stack != "shard":
            return aval
        shape = list(aval.shape)
        if self.marker in axes:
            del shape[axes.index(self.marker)]
        return self.acc_aval(aval.update(shape=(self.size, *shape)))

    def inside(self, axes: Axes) -> Axes:
        """An accumulator's leading axes inside the region."""
        if self.stack != "shard":
            return axes
        return tuple(a for a in axes if a != self.marker)

    def enter(self, x):
        """An input or accumulator leaf inside, from what the region gives."""
        if self.stack == "shard":  # this shard's slice of size 1
            return _compat.vary_over_manual_axes(x[0])
        return x

    def leave(self, x):
        """An accumulator or entry leaf, as the region returns it."""
        if self.stack == "shard":
            return _compat.vary_over_manual_axes(x)[None]
        return _compat.vary_over_manual_axes(x) if self.vary else x


WHOLE = Boundary()
