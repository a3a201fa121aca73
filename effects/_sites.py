"""`fx.sites`: the walk of a program (`_walk`), listed, without running it."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from . import _nnx
from ._site import describe
from ._walk import Region, recomputed_only, site_of, traced, walk


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
      function), `"other"`, or None for a `jit` or a `shard_map` (whose body
      runs once a call, on each shard). Left out of its `repr` and of
      comparisons.
    - `tap`: for a site of [`fx.taps`][effects.taps], its
      [`TapInfo`][effects.TapInfo] (primitive, scope, source line); else
      None. Left out of its `repr` and of comparisons.

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
    tap: Any = dataclasses.field(default=None, repr=False, compare=False)


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
        columns = ["collection", "name", "kind", "part", "value", "where"]
        if all(i.part == "value" for i in infos):
            columns.remove("part")  # a column only when a site has another part
        rows = [{**vars(i), "value": describe(i.value)} for i in infos]
        return text_table([columns, *([row[c] for c in columns] for row in rows)])


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
        return traced_sites(*_traced_arguments(fn, args, kwargs))[0]

    functools.update_wrapper(lister, fn, updated=())
    return lister


def traced_sites(fn, *args) -> tuple[Sites, Any]:
    """The sites of `fn(*args)` (see `sites`), and its jaxpr as `handle`
    sees it."""
    jaxpr, found = traced(fn, *args), Sites()
    # A site is listed by its own copies, not the backward pass's
    # recomputations; one JAX left only recomputed copies of by its first,
    # the forward pass's.
    unlisted = set(recomputed_only(jaxpr))
    for located in walk(jaxpr).sites:
        if located.recomputed and located.key not in unlisted:
            continue
        unlisted.discard(located.key)
        # A call JAX makes, not the user (the forward part of a checkpoint or
        # scan that it split for differentiation), adds no control flow.
        around = [_label(r) for r in located.path if r.name != "closed_call"]
        site = site_of(located.eqn)
        info = SiteInfo(
            site.kind,
            site.collection,
            site.name,
            site.front_avals(),
            where=" > ".join(label for label, _ in around),
            part=site.part,
            loops=tuple(loop for _, loop in around),
            tap=located.eqn.params.get("tap"),
        )
        found.setdefault(site.collection, {}).setdefault(site.name, []).append(info)
    return found, jaxpr


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
    if name in ("jit", "shard_map"):  # (its body runs once a call, per shard)
        return label, None
    custom = name in ("custom_jvp_call", "custom_vjp_call")
    return label, "custom" if custom else "other"
