"""The sites of a jaxpr, found by one walk (cached per jaxpr) that the rewriter,
the branch check of `handle` and `fx.sites` (defined here, on the walk) share. A
site is a `tag` or `perturb` equation, or a `jax.ad_checkpoint.checkpoint_name`
seen as a tag in the collection "checkpoint_name"; each is found with the
higher-order equations around it."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax

from . import _compat, _jaxpr, _nnx
from ._primitives import handling, site_p
from ._site import Site, checkpoint_name_params, describe

Key = tuple[str, str, str, str]  # (kind, collection, name, part)


def site_params(eqn) -> dict[str, Any] | None:
    """The params of the site `eqn` is, if it is one: a `checkpoint_name` as
    a tag (see `checkpoint_name_params`)."""
    if eqn.primitive is site_p:
        return eqn.params
    name = _compat.checkpoint_name_of(eqn)
    return None if name is None else checkpoint_name_params(name)


def site_of(eqn, shards=()) -> Site:
    """The site `eqn`, a site's equation, is."""
    params = site_params(eqn)
    assert params is not None
    return Site.from_eqn(params, [v.aval for v in eqn.invars], shards)


class Region(NamedTuple):
    """A higher-order equation around a site, and which of its jaxprs holds it:
    `jaxpr`, the `which`-th `_jaxpr.sub_jaxprs` finds (a cond's branch index)."""

    eqn: Any
    which: int
    jaxpr: Any

    @property
    def name(self) -> str:
        """The primitive as users know it: `scan`, `cond`, `jit`..."""
        return _compat.primitive_name(self.eqn)


class Located(NamedTuple):
    """A site's equation and the regions around it, outermost first."""

    eqn: Any
    path: tuple[Region, ...]

    @property
    def key(self) -> Key:
        p = site_params(self.eqn)
        assert p is not None
        return p["kind"], p["collection"], p["name"], p.get("part", "value")

    @property
    def recomputed(self) -> bool:
        """Whether this is the backward pass's copy of a site (see `recomputes`),
        not a site of its own. (A derivative site is its own, wherever it is:
        the backward pass computes each cotangent once.)"""
        if self.key[3] != "value":
            return False
        return bool(self.eqn.params.get("recompute")) or any(
            recomputes(r.eqn) for r in self.path
        )


class _Walk(NamedTuple):
    sites: tuple[Located, ...]  # program order
    keys: frozenset[Key]
    per_eqn: tuple[frozenset[Key], ...]  # the sites each equation is or holds
    forward: bool  # a site marked `forward` (see `recomputes`)
    primitives: frozenset  # of every equation, in sub-jaxprs too


_walks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def walk(jaxpr) -> _Walk:
    """The sites of an open `jaxpr` and its sub-jaxprs."""
    found = _walks.get(jaxpr)
    if found is not None:
        return found
    sites, per_eqn, primitives = [], [], set()
    for eqn in jaxpr.eqns:
        primitives.add(eqn.primitive)
        if site_params(eqn) is not None:
            sites.append(Located(eqn, ()))
            per_eqn.append(frozenset([sites[-1].key]))
            continue
        mine = frozenset()
        for i, sub in enumerate(_jaxpr.sub_jaxprs(eqn) if eqn.params else ()):
            inner = walk(sub)
            region = (Region(eqn, i, sub),)
            sites += [Located(s.eqn, region + s.path) for s in inner.sites]
            mine |= inner.keys
            primitives |= inner.primitives
        per_eqn.append(mine)
    found = _walks[jaxpr] = _Walk(
        tuple(sites),
        frozenset().union(*per_eqn),
        tuple(per_eqn),
        any(s.eqn.params.get("forward") for s in sites),
        frozenset(primitives),
    )
    return found


def sites_in(jaxpr) -> frozenset[Key]:
    """(kind, collection, name, part) of every site in `jaxpr` and its
    sub-jaxprs."""
    return walk(jaxpr).keys


def recomputes(eqn) -> bool:
    """Whether `eqn` is the backward pass's recomputation of a `jax.checkpoint`
    region: the sites in it are executions of the forward pass's, computed
    again, not executions of their own (see `_rules._call_rule`). JAX marks
    it `differentiated`, but also the forward part of a checkpoint in a scan in
    another checkpoint, which holds the tags that JAX's partial evaluation
    kept where they execute, marked `forward` (see
    `_primitives._site_partial_eval_custom`); the recomputation holds their
    copies, and those of its loops JAX recomputes whole. A region holding only
    `checkpoint_name`s has JAX's mark alone to go by: it is taken for a
    recomputation."""
    if eqn.primitive is not _compat.remat_p or not eqn.params.get("differentiated"):
        return False
    return not walk(eqn.params["jaxpr"]).forward


def traced(fn, *args):
    """The jaxpr of `fn(*args)` as `handle` sees it: traced with its sites
    carrying their effect, so that none is dropped as unused."""
    with handling(True):
        return jax.make_jaxpr(fn)(*args).jaxpr


#
# fx.sites: the walk of a program, listed
#


@dataclasses.dataclass(frozen=True)
class SiteInfo:
    """One [`tag`][effects.tag] or [`perturb`][effects.perturb] call in a
    program, not one execution: what [`fx.sites`][effects.sites] lists.

    **Attributes:**

    - `kind`: `"tag"` or `"perturb"` (a `jax.ad_checkpoint.checkpoint_name` is
      a `"tag"` in the collection `"checkpoint_name"`).
    - `collection`, `name`: as passed to it.
    - `value`: the value of one execution, as `jax.ShapeDtypeStruct`s, in the
      layout handlers report (the batch axes of a `jax.vmap` inside the
      function first).
    - `where`: the control flow around it, outermost first, such as
      `"scan(length=12) > cond branch 1"`; `""` at the top level.
    - `part`: `"value"`; `"tangent"` or `"cotangent"` for the derivative of
      the value that a `jax.jvp` or `jax.grad` inside the function takes (see
      [`Tag(of=...)`][effects.Tag]).
    - `loops`: per enclosing region, outermost first: a scan's length,
      `"while"`, `"branch"`, `"custom"` (a `custom_jvp` or `custom_vjp`
      function), `"other"`, or None for a `jit`. Left out of its `repr` and of
      comparisons.

    **Example:**

    ```python
    def f(x):
        return jax.lax.scan(lambda c, _: (fx.tag(c * 2, "h"), None), x, None, 3)[0]

    (info,) = fx.sites(f)(jnp.ones(2))["intermediates"]["h"]
    print(info.where)
    print(info.value)
    ```

    ```text
    scan(length=3)
    ShapeDtypeStruct(shape=(2,), dtype=float32)
    ```
    """

    kind: str
    collection: str
    name: str
    value: Any
    where: str
    part: str = "value"
    loops: tuple = dataclasses.field(default=(), repr=False, compare=False)


class Sites(dict):
    """What [`fx.sites`][effects.sites] returns: a dict `collection -> name ->
    [SiteInfo, ...]`, in program order, whose `str()` is a table.

    A `dict` subclass: index it, iterate over it, or `print` it for one row per
    site with its collection, name, kind, shape and dtype, and the control
    flow around it.

    **Attributes:**

    As a dict: `sites[collection][name]` is a list of
    [`SiteInfo`][effects.SiteInfo], one per call in the program.

    **Example:**

    ```python
    def f(x):
        h = fx.tag(jnp.sin(x), "h")
        return fx.perturb(h, "p")

    print(fx.sites(f)(jnp.ones(3)))
    ```

    ```text
    collection     name  kind     value       where
    -------------  ----  -------  ----------  -----
    intermediates  h     tag      float32[3]
    perturbations  p     perturb  float32[3]
    ```
    """

    def __str__(self) -> str:
        infos = [i for names in self.values() for v in names.values() for i in v]
        parts = any(i.part != "value" for i in infos)  # a column only then
        rows = [("collection", "name", "kind", *("part",) * parts, "value", "where")]
        rows += [
            (
                i.collection,
                i.name,
                i.kind,
                *(i.part,) * parts,
                describe(i.value),
                i.where,
            )
            for i in infos
        ]
        return text_table(rows)


def text_table(rows) -> str:
    """Rows of strings, the first a header, as aligned plain-text columns: the one
    table layout, `fx.sites`' and `fx.summary`'s."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def sites(fn: Callable) -> Callable[..., Sites]:
    """Lists every [`tag`][effects.tag], [`perturb`][effects.perturb] and
    `jax.ad_checkpoint.checkpoint_name` call `fn` would execute, without
    running anything.

    `fn` is only traced, so arguments may be `jax.ShapeDtypeStruct`s: the
    names and shapes of every layer of a model, at no cost, before choosing
    what to collect. One [`SiteInfo`][effects.SiteInfo] per call in the
    program, not per execution (a tag in a `lax.scan` is listed once), with
    the control flow around it; a site that a backward pass recomputes is not
    listed again. Arguments are treated as `eqx.filter_jit`
    treats them: arrays and `jax.ShapeDtypeStruct`s traced, other leaves (an
    Equinox module's functions, Python numbers) static. Flax NNX objects are
    traced through their state, which is left as it was.

    **Arguments:**

    - `fn`: the function to look into: any callable, or a model from
      [`fx.tag_modules`][effects.tag_modules].

    **Returns:**

    `lister(*args, **kwargs) -> Sites`: a [`Sites`][effects.Sites], the dict
    `collection -> name -> [SiteInfo, ...]`, in program order; `print` it for a
    table.

    **Raises:**

    Nothing of its own; what tracing `fn` raises, as under `jax.jit`, such as
    `jax.errors.TracerBoolConversionError` for Python control flow on the
    values of arrays.

    **Example:**

    ```python
    import equinox as eqx

    model = eqx.nn.MLP(2, 2, width_size=8, depth=2, key=jax.random.key(0))
    print(fx.sites(fx.tag_modules(model))(jax.ShapeDtypeStruct((2,), jnp.float32)))
    ```

    ```text
    collection     name      kind  value       where
    -------------  --------  ----  ----------  -----
    intermediates  layers.0  tag   float32[8]
    intermediates  layers.1  tag   float32[8]
    intermediates  layers.2  tag   float32[2]
    ```
    """

    def lister(*args, **kwargs) -> Sites:
        found = Sites()
        for located in walk(traced(*_traced_arguments(fn, args, kwargs))).sites:
            if located.recomputed:
                continue
            # A call JAX makes, not the user (the forward part of a checkpoint or
            # scan that it split for differentiation), adds no control flow.
            around = [_label(r) for r in located.path if r.name != "closed_call"]
            site = site_of(located.eqn)
            where = " > ".join(label for label, _ in around)
            loops = tuple(loop for _, loop in around)
            info = SiteInfo(
                site.kind,
                site.collection,
                site.name,
                site.front_avals(),
                where,
                site.part,
                loops,
            )
            found.setdefault(site.collection, {}).setdefault(site.name, []).append(info)
        return found

    functools.update_wrapper(lister, fn, updated=())
    return lister


def _traced_arguments(fn, args, kwargs):
    """`(call, dynamic)`: `fn` as a function of the arrays (and
    `jax.ShapeDtypeStruct`s) among its arguments, every other leaf (an Equinox
    module's functions, Python numbers) held static as `eqx.filter_jit` holds
    it; and those arrays. Flax NNX objects go in as their state, and the state
    they end with is dropped: looking at a model leaves it as it was."""
    nnx_call = _nnx.functional(fn, args, kwargs)
    if nnx_call is not None:
        pure, args, kwargs = nnx_call[0], nnx_call[1], {}
        fn = lambda *args: pure(*args)[0]  # noqa: E731
    is_traced = lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    dynamic, static = eqx.partition((args, kwargs), is_traced)

    def call(dynamic):
        args, kwargs = eqx.combine(dynamic, static)
        return fn(*args, **kwargs)

    return call, dynamic


def _label(region: Region) -> tuple[str, Any]:
    """`(label, loop)` for a region around a site (see `SiteInfo.loops`)."""
    p, name = region.eqn.params, region.name
    if name == "scan":
        reverse = ", reverse" if p.get("reverse") else ""
        return f"scan(length={p['length']}{reverse})", p["length"]
    if name == "cond":
        return f"cond branch {region.which}", "branch"
    if name == "while":
        which = "cond" if region.jaxpr is p["cond_jaxpr"].jaxpr else "body"
        return f"while_loop {which}", "while"
    label = f"{name}({p['name']})" if isinstance(p.get("name"), str) else name
    if name == "jit":
        return label, None
    custom = name in ("custom_jvp_call", "custom_vjp_call")
    return label, "custom" if custom else "other"
