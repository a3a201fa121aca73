"""A site as handlers see it: one executed `tag` or `perturb`, with its value in
the layout users see (vmap batch axes first, outermost first)."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import _compat
from ._layout import found_avals, one_example, to_found


def strong(x):
    # Weak types would make the avals of a loop carry or of cond branches differ.
    if not isinstance(x, jax.Array):  # `jnp.asarray` costs a few µs even on one
        x = jnp.asarray(x)
    return lax.convert_element_type(x, x.dtype) if x.aval.weak_type else x


def shape_dtype(x) -> jax.ShapeDtypeStruct:
    aval = getattr(x, "aval", None)  # an array or a tracer: its type as it is
    if aval is not None:  # (`jnp.result_type` costs a promotion: 40 µs a call)
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype)
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def describe(tree) -> str:
    return str(jax.tree.map(lambda a: f"{_dtype_name(a.dtype)}{list(a.shape)}", tree))


def _dtype_name(dtype) -> str:
    if jnp.issubdtype(dtype, jax.dtypes.extended):  # (a PRNG key's: key<fry>)
        return str(dtype)
    return jnp.dtype(dtype).name


_SITE_PARAMS = operator.itemgetter("name", "collection", "kind", "treedef", "batch")
CHECKPOINT_NAME = "checkpoint_name"
LEAF = jax.tree.structure(0)


def checkpoint_name_params(name: str) -> dict[str, Any]:
    """The params under which handlers see a `jax.ad_checkpoint.checkpoint_name`
    (JAX's `name` primitive, on one array): a tag named `name` in the collection
    `"checkpoint_name"`. JAX's batching rule for it keeps no record of vmap's
    axes, so its value is seen as the program holds it."""
    return dict(
        name=name, collection=CHECKPOINT_NAME, kind="tag", treedef=LEAF, batch=((),)
    )


@dataclasses.dataclass(frozen=True, init=False)
class Site:
    """A site as a handler sees it: one [`fx.tag`][effects.tag] or
    [`fx.perturb`][effects.perturb] call of the program (or a
    `jax.ad_checkpoint.checkpoint_name`, a tag in the collection
    `"checkpoint_name"`).

    **Attributes:**

    - `name`, `collection`: as given to `tag` or `perturb`.
    - `kind`: `"tag"` or `"perturb"`.
    - `part`: `"value"`, or under a `jax.jvp` or `jax.grad` inside
      [`handle`][effects.handle], `"tangent"` or `"cotangent"`: the
      derivative of the value that `apply` then receives (see
      [`Handler`][effects.Handler]).
    - `shape_dtype`: the structure, shapes and dtypes of the value `apply`
      receives (one example's), a pytree of `jax.ShapeDtypeStruct`; None when
      `matches` is asked before the value is known.

    `where()` names the site for messages: `"tag 'h' (collection
    'intermediates')"`. The other fields say how the program holds the value
    (its leaves' types and the vmap axes they carry) and are the rewriter's.
    """

    name: str
    collection: str
    kind: str  # "tag" or "perturb"
    treedef: Any
    batch: tuple  # per leaf: ((axis or None, size), ...) outermost vmap first
    avals: tuple  # per leaf, program layout
    # Per `shard_map` (or pmap) of the handled function the site runs in,
    # outermost first: its manual mesh axes and its number of shards.
    shards: tuple[tuple[tuple[str, ...], int], ...] = ()
    part: str = "value"  # "value", "tangent" or "cotangent"
    # The number a value's site shares with its tangent's and cotangent's
    # (`_primitives._site_jvp`); None for a value nothing differentiates.
    pair: int | None = None

    def __init__(
        self,
        name: str,
        collection: str,
        kind: str,
        treedef: Any,
        batch: tuple,
        avals: tuple,
        shards: tuple = (),
        part: str = "value",
        pair: int | None = None,
    ):
        # The fields set in one step: a frozen dataclass's own `__init__` sets
        # them one by one, which costs twice as much, and a site is made at
        # every execution the rewriter meets and for every check by name.
        fields: dict[str, Any] = {"name": name, "collection": collection, "kind": kind}
        fields["treedef"], fields["batch"], fields["avals"] = treedef, batch, avals
        fields["shards"], fields["part"], fields["pair"] = shards, part, pair
        object.__setattr__(self, "__dict__", fields)

    @classmethod
    def from_eqn(cls, params, avals, shards=()) -> Site:
        """The site of an equation with `params` whose inputs have `avals`
        (a derivative site's: the primal leaves, then the derivative's)."""
        name, collection, kind, treedef, batch = _SITE_PARAMS(params)
        part = params.get("part", "value")
        if part != "value":
            avals = avals[len(avals) // 2 :]
        pair = params.get("pair")
        avals = tuple(avals)
        return cls(name, collection, kind, treedef, batch, avals, shards, part, pair)

    @classmethod
    def probe(cls, kind: str, collection: str, name: str, part="value") -> Site:
        """A site known only by name, for matching and messages before any value
        is at hand (e.g. from `sites_in`)."""
        return cls(name, collection, kind, None, (), (), (), part)

    def of(self, part: str, avals=None) -> Site:
        """This site's `part` ("value", "tangent" or "cotangent"), whose leaves
        have `avals` (by default, this part's)."""
        avals = self.avals if avals is None else tuple(avals)
        return dataclasses.replace(self, part=part, avals=avals)

    @property
    def nbatch(self) -> int:
        return len(self.batch[0]) if self.batch else 0

    def where(self) -> str:
        what = "tag" if self.kind == "tag" else "perturb site"
        where = f"{what} {self.name!r} (collection {self.collection!r})"
        return where if self.part == "value" else f"the {self.part} of {where}"

    @property
    def shape_dtype(self):
        """The shapes and dtypes of one example's value (a pytree of
        `jax.ShapeDtypeStruct`): what a handler's `apply` receives. None for a
        site known only by name."""
        if self.treedef is None:
            return None
        leaves = map(one_example, self.avals, self.batch)
        return jax.tree.unflatten(self.treedef, list(leaves))

    def front_avals(self):
        """The value's structure and shapes in the layout `found` has: one
        example's, after the vmap batch axes."""
        return found_avals(self.shape_dtype, self.batch)

    def to_front(self, leaves):
        """Program layout -> the layout `found` has (see `_layout.to_found`)."""
        if self.treedef is LEAF and not self.batch[0]:  # (most sites: as it is)
            return leaves[0]
        return jax.tree.unflatten(self.treedef, list(map(to_found, leaves, self.batch)))

    def vary_like(self, x, aval, handler: str):
        """`x`, which a handler gives to replace a leaf of type `aval` in a
        shard_map's body, typed as varying over the mesh axes that leaf
        varies over (a value built from a replicated one, a closed-over array
        or zeros, replaces one that differs per shard)."""
        extra = _compat.extra_varying_axes(x, aval)
        if extra:
            raise NotVarying(handler, self.where(), sorted(extra))
        return _compat.vary_like(x, aval)


class NotVarying(ValueError):
    """A handler gives a value that differs per shard where the site's value
    is the same in every shard (see `Site.vary_like`)."""

    def __init__(self, handler: str, where: str, axes: list[str]):
        super().__init__(_NOT_VARYING.format(handler=handler, where=where, axes=axes))
        self.where, self.axes = where, axes


_NOT_VARYING = (
    "{handler} gives a value for {where} that differs per shard over the mesh "
    "axes {axes}, but the tagged value is the same in every shard there (the "
    "program holds one value for all of them), so it cannot be replaced per "
    "shard. Handle inside the shard_map (call fx.handle within the function "
    "passed to it)."
)
