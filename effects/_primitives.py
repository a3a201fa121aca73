"""The `tag` and `perturb` primitives: the identity, with rules that keep them so
under every JAX transformation, and that cost nothing once lowered."""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

from . import _compat
from ._site import CHECKPOINT_NAME, LEAF

#
# Handling state
#

# True while `handle` traces a function. Sites bound in that state carry
# `SiteEffect`, so JAX's dead-code elimination keeps a tag whose result is
# unused. Outside it they carry no effect, so an unhandled program keeps jit's
# fast dispatch path. The state is a JAX user context (part of JAX's trace
# context and jit key): a `jax.jit` function traced outside `handle` is traced
# again inside it.
handling = jax.make_user_context(False)


# While `handle` traces a function again to find the sites a vmap inside it ran
# for every branch of a `cond` (see `_checks.branch_suspects`): a token of
# that trace alone. Part of the trace context, and so of the key of every
# cache of traces JAX keeps: the jaxprs of that trace are its own, and so are
# the marks made in them.
probing = jax.make_user_context(None)


# While `handle` traces: the names of the sites whose values a handler changes
# per example (given per execution, in the layout `Tag()` reports, or found to
# change while rewriting: see `_scope.Unbatched`). A vmap batches their values
# even where they do not depend on the example (a position embedding inside a
# per-example model), so that each example's copy can take its own value:
# what follows them is then computed per example.
batched_sites = jax.make_user_context(frozenset())


class SiteEffect(_compat.Effect):
    __str__ = lambda self: "EffectsSite"  # noqa: E731


site_effect = SiteEffect()
_compat.allow_effect(SiteEffect)

#
# The primitive
#


class _SitePrimitive(Primitive):
    # Every bind, including a re-bind from a jaxpr or a transformation rule, takes
    # the effect flag from the current handling state, so a site bound outside
    # `handle` never carries the effect. JAX binds a primitive again with the
    # params its equation stored wherever it evaluates a jaxpr (a jit's, a
    # loop's or a branch's body, under any trace), so a flag set at the first
    # bind would be stale there; `bind` is the one place every bind passes
    # through (JAX alone: tests/test_jax_facts.py::
    # test_a_primitive_is_bound_again_with_the_params_its_equation_stored).
    def bind(self, *args, **params):
        # A recomputation's copy of a site (see `_site_partial_eval_custom`)
        # never carries it: JAX may drop it, and a loop may hold it.
        effect = bool(handling.value) and not params.get("recompute")
        params["effect"] = effect
        # Bound where a vmap evaluates every branch of a `cond`: marked, as a
        # param every later bind keeps (see `_checks.branch_marked`).
        if effect and "every_branch" not in params:
            if _compat.in_every_branch(deep=probing.value is not None):
                params["every_branch"] = True
        return super().bind(*args, **params)

    def is_high(self, *avals, **params) -> bool:
        # (JAX's looks for a jaxpr among the params at every bind; a site's
        # params hold none)
        return False


site_p = _SitePrimitive("effects_site")
site_p.multiple_results = True


def bind_site(leaves, params, effect: bool) -> list[Any]:
    """Binds the site primitive carrying the site effect or not, whatever the
    handling state."""
    return Primitive.bind(site_p, *leaves, **dict(params, effect=effect))


# Sites of three parts. A `tag` or `perturb` is a site of the value. While
# `handle` traces, the JVP of a value site makes, beside it, a site of the
# tangent, and transposing that makes a site of the cotangent. A derivative
# site takes the primal value's leaves, then the derivative's, and returns the
# derivative's: handlers act on the derivative knowing the primal (see
# `_rewrite.handle_derivative`). Outside `handle` no derivative site is made:
# tangents pass a site untouched, so the unhandled program and its derivatives
# stay those of the untagged program.
DERIVATIVE = {"tangent": "cotangent", "cotangent": "tangent"}  # part -> transposed


def part_of(params) -> str:
    return params.get("part", "value")


def _derivative_leaves(args, params):
    """The derivative's leaves among a site's arguments (all, for a value site)."""
    return args[len(args) // 2 :] if part_of(params) != "value" else args


@site_p.def_impl
def _site_impl(*args, **params):
    return _derivative_leaves(args, params)


@site_p.def_effectful_abstract_eval
def _site_abstract_eval(*avals, effect, **params):
    avals = _derivative_leaves(avals, params)
    return avals, {site_effect} if effect else set()


# The identity, lowered in place: JAX's default emits each equation's lowering
# as a function cached by its params, one per site name (each site's params
# are its own), which made an unhandled tag cost as much to lower as a matmul.
mlir.register_lowering(
    site_p,
    lambda ctx, *args, **params: _derivative_leaves(args, params),
    cacheable=False,
)


def _site_jvp(primals, tangents, **params):
    if not handling.value or all(type(t) is ad.Zero for t in tangents):
        # (a derivative site's outputs are its derivative's leaves, which it
        # passes on: their tangents are the last half)
        return site_p.bind(*primals, **params), _derivative_leaves(tangents, params)
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    if part_of(params) == "value":
        # The value's site and its derivatives' share a `pair` number: a
        # handler of the value reading `at` at the cotangent, in a backward
        # pass that runs the executions last first, gets the value's call.
        params = dict(params, pair=next(_pairs))
        outs = site_p.bind(*primals, **params)
        return outs, site_p.bind(*primals, *tangents, **dict(params, part="tangent"))
    outs = site_p.bind(*primals, **params)
    # The derivative of a derivative site, linear in the derivative: handlers
    # that change values are refused there (`higher`), others pass it on.
    n = len(primals) // 2
    higher = site_p.bind(*primals[:n], *tangents[n:], **dict(params, higher=True))
    return outs, higher


ad.primitive_jvps[site_p] = _site_jvp
_pairs = itertools.count()


def _site_transpose(cts, *args, **params):
    part = part_of(params)
    if part == "value":
        # A value site in a function `jax.linear_transpose` transposes: the
        # transposed program never computes the value. Marked, the identity on
        # the cotangents, so that a handler of it is refused by name
        # (`_checks._check_transposed`) rather than find nothing.
        cts = [ad.instantiate_zeros(c) for c in cts]
        return site_p.bind(*cts, **dict(params, transposed=True))
    n = len(args) // 2
    cts = [ad.instantiate_zeros(c) for c in cts]
    flipped = part if params.get("higher") else DERIVATIVE[part]
    return [None] * n + list(site_p.bind(*args[:n], *cts, **dict(params, part=flipped)))


ad.primitive_transposes[site_p] = _site_transpose


def _site_batch(axis_size, vals, dims, *, batch, **params):
    # Leaves stay where vmap put their batch axis (moving it would add a transpose
    # to the unhandled program); the axis, or None with the size for an unbatched
    # leaf, is recorded outermost-first for handlers to use when they collect.
    vals, dims = list(vals), list(dims)
    if params["name"] in batched_sites.value and None in dims:
        vals = [
            v if d is not None else _broadcast(v, axis_size) for v, d in zip(vals, dims)
        ]
        dims = [0 if d is None else d for d in dims]
    n = len(vals) // 2
    if part_of(params) != "value":
        # A primal leaf and its derivative are batched alike (the derivative is
        # batched alone under `jax.jacfwd`): handlers see them per example.
        for i in range(n):
            vals[i], vals[n + i], dims[i], dims[n + i] = _alike(
                vals[i], vals[n + i], dims[i], dims[n + i], axis_size
            )
        dims_out = dims[n:]
    else:
        dims_out = dims
    new_batch = []
    for d, entries in zip(dims_out, batch):
        shifted = tuple(
            (None if a is None else a + (d is not None and a >= d), size)
            for a, size in entries
        )
        new_batch.append(((d, axis_size),) + shifted)
    outs = site_p.bind(*vals, batch=tuple(new_batch), **params)
    return outs, dims_out


def _alike(p, t, dp, dt, size: int):
    """A primal leaf and its derivative with their batch axes at one place."""
    if dp == dt:
        return p, t, dp, dt
    if dp is None:
        return jnp.moveaxis(_broadcast(p, size), 0, dt), t, dt, dt
    if dt is None:
        return p, jnp.moveaxis(_broadcast(t, size), 0, dp), dp, dp
    return jnp.moveaxis(p, dp, dt), t, dt, dt


_compat.register_batch_rule(site_p, _site_batch)


def _broadcast(x, size: int):
    return jax.lax.broadcast_in_dim(x, (size, *x.shape), tuple(range(1, x.ndim + 1)))


def _site_partial_eval_custom(saveable, unks_in, inst_in, eqn):
    # `jax.checkpoint` under differentiation splits its region into the forward
    # pass's part (known) and the backward pass's recomputation (staged). A site
    # with known inputs executes in the former; the latter gets an effect-free
    # copy of it, the identity on the same inputs, marked `recompute`: handlers
    # act on it, so the backward pass sees the values the forward pass saw, but
    # it reports nothing (see `_rewrite._site_rule`). JAX's rule for an
    # effectful equation would save its outputs as residuals instead: a
    # `lax.while_loop` in the region, which cannot save residuals, then fails on
    # an assertion. A site with unknown inputs executes only where it is staged.
    #
    # The site itself is marked `forward`. JAX marks a `remat` region
    # `differentiated` both when it is the backward pass's recomputation and
    # when it is the forward part of a checkpoint in a scan in another
    # checkpoint (the scan's rule partially evaluates that part again, to hoist
    # what does not vary over the iterations); a `forward` site in it tells the
    # rewriter which (see `_sites.recomputes`). Marks are params, which every
    # later bind keeps, through transposition too.
    del saveable
    n = len(eqn.outvars)
    residuals = [
        v for v, inst in zip(eqn.invars, inst_in) if not inst and type(v) is _compat.Var
    ]
    copy = eqn  # a copy already (a region partially evaluated again) stays one
    if part_of(eqn.params) != "value":
        # A derivative site executes where its derivative is computed, once.
        if any(unks_in):
            return None, eqn, [True] * n, [True] * n, residuals
        params = dict(eqn.params, effect=False, recompute=True)
        copy = eqn.replace(params=params, effects=set())
        return eqn, copy, [False] * n, [True] * n, residuals
    if not eqn.params.get("recompute"):
        params = dict(eqn.params, forward=True)
        copy = eqn.replace(
            params=dict(params, forward=False, effect=False, recompute=True),
            effects=set(),
        )
        eqn = eqn.replace(params=params)
    if any(unks_in):
        return None, eqn, [True] * n, [True] * n, residuals
    return eqn, copy, [False] * n, [True] * n, residuals


_compat.register_partial_eval_custom_rule(site_p, _site_partial_eval_custom)

#
# Public functions
#

_BAD_NAME = "{fn}: the name must be a string, got {name!r} of type {type}."
_BAD_LEAF = (
    "{fn}: every leaf of the value tagged {name!r} (collection {collection!r}) "
    "must be an array or a number, got {leaf!r} of type {type}{path}. Tag "
    "only the array parts, e.g. with `eqx.filter(value, eqx.is_array)`."
)


_RESERVED = (
    "{fn}: the collection {collection!r} (of {name!r}) is reserved: handlers "
    "see every `jax.ad_checkpoint.checkpoint_name` as a tag in it. Mark the "
    "value with `checkpoint_name(x, {name!r})` to make it one, or choose "
    "another collection."
)


_FOLDED = (
    "{fn}: the value of {name!r} (collection {collection!r}) is computed "
    "while the function is traced, under `jax.ensure_compile_time_eval()` (JAX's "
    "eager constant folding): it is a constant there, and no program holds it for "
    "a handler to see or change. Tag it after the `with` block."
)


def _to_array(fn: str, name: str, collection: str, path, leaf) -> Any:
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
        return jnp.asarray(leaf)
    raise TypeError(
        _BAD_LEAF.format(
            fn=fn,
            name=name,
            collection=collection,
            leaf=leaf,
            type=type(leaf).__name__,
            path=f" at {jax.tree_util.keystr(path)}" if path else "",
        )
    )


# Types whose instances are `jax.Array`s (arrays, tracers), as met: a set look-up
# costs less than `isinstance` against the abstract `jax.Array`.
_ARRAY_TYPES: set[type] = set()


def _is_array(x) -> bool:
    if isinstance(x, jax.Array):
        _ARRAY_TYPES.add(type(x))
        return True
    return False


def _bind_site(fn: str, value, name, collection, kind):
    if not isinstance(name, str):
        raise TypeError(_BAD_NAME.format(fn=fn, name=name, type=type(name).__name__))
    if not isinstance(collection, str):
        raise TypeError(
            f"{fn}: the collection of {name!r} must be a string, got {collection!r}."
        )
    if collection == CHECKPOINT_NAME:
        raise ValueError(_RESERVED.format(fn=fn, name=name, collection=collection))
    if type(value) in _ARRAY_TYPES:  # one array: the common case, made short
        leaves, treedef = [value], LEAF
    else:
        leaves, treedef = jax.tree.flatten(value)
        if not all(type(x) in _ARRAY_TYPES or _is_array(x) for x in leaves):
            # Paths (for the error message) and `jnp.asarray` only where needed.
            paths_leaves, _ = jax.tree_util.tree_flatten_with_path(value)
            leaves = [_to_array(fn, name, collection, p, x) for p, x in paths_leaves]
        if not leaves:
            return value
    if not handling.value:
        # Nothing handles it: the identity, with no equation in the program.
        # (JAX's caches of traces key on the handling state, a user context:
        # `handle` traces its own, with the site.)
        return leaves[0] if treedef is LEAF else jax.tree.unflatten(treedef, leaves)
    if _compat.folding_constants() and not any(map(_compat.is_tracer, leaves)):
        raise ValueError(_FOLDED.format(fn=fn, name=name, collection=collection))
    params = dict(
        name=name,
        collection=collection,
        kind=kind,
        treedef=treedef,
        batch=((),) * len(leaves),
    )
    # Bound with the effect, unmarked: `site_p.bind`'s checks, done here. (A
    # site `tag` binds is never bound by a cond's batching rule: only one
    # bound again from a branch's jaxpr is; see `_compat.in_every_branch`.)
    outs = bind_site(leaves, params, True)
    return outs[0] if treedef is LEAF else jax.tree.unflatten(treedef, outs)


def tag(value, name: str, *, collection: str = "intermediates"):
    """Marks `value` as the intermediate value `name` of `collection`, for
    handlers to collect, replace or transform.

    With no handler active, `tag` is the identity and costs nothing: it
    returns `value` and leaves no equation, so a jitted function traces and
    compiles to the same program with or without its tags. Under
    [`fx.handle`][effects.handle], [`fx.Tag`][effects.Tag] collects the value,
    [`fx.Substitute`][effects.Substitute] replaces it and
    [`fx.Intervene`][effects.Intervene] transforms it, at every execution: in a
    `lax.scan`, a `lax.cond` branch or a `jax.jit` call as well. A name may be
    tagged several times; each execution is one entry. For the gradient with
    respect to a value, mark it with [`fx.perturb`][effects.perturb] instead, or
    tag it and use [`fx.intermediate_grads`][effects.intermediate_grads] with
    `kind="tag"`.

    **Arguments:**

    - `value`: a pytree whose leaves are JAX arrays, NumPy arrays or Python
      numbers.
    - `name`: the tag's name. Handlers select tags by name (see
      [`Names`][effects.Names]).
    - `collection`: the collection the tag belongs to; each handler acts on one
      collection.

    **Returns:**

    `value`, with its numbers and NumPy arrays converted to JAX arrays, unless a
    handler replaces it. A `value` without leaves (`None`, `{}`) is returned as
    it is and makes no site.

    **Raises:**

    - `TypeError`: `name` or `collection` is not a string, or a leaf of `value`
      is neither an array nor a number (a string, a function). Tag only the
      array parts, for example `eqx.filter(value, eqx.is_array)`.

    **Example:**

    ```python
    def f(x):
        h = fx.tag(jnp.sin(x), "h")
        return 2 * h

    out, found = fx.handle(f, fx.Tag())(1.0)
    print(found)
    ```

    ```text
    {'intermediates': {'h': (Array(0.84147096, dtype=float32),)}}
    ```
    """
    return _bind_site("tag", value, name, collection, "tag")


def perturb(value, name: str, *, collection: str = "perturbations"):
    """Marks an additive zero at `value`, the point at which to take the
    gradient with respect to an intermediate value.

    With no handler active, `perturb` is the identity and costs nothing, as
    [`fx.tag`][effects.tag] is. [`fx.Perturb(deltas)`][effects.Perturb] adds
    `deltas[name]` here, so the gradient with respect to the deltas is the
    gradient with respect to this value;
    [`fx.intermediate_grads`][effects.intermediate_grads] does both in one
    call. A perturb site is a site of its own kind: [`fx.Tag`][effects.Tag],
    [`fx.Substitute`][effects.Substitute] and [`fx.Intervene`][effects.Intervene]
    never see it, and [`fx.Perturb`][effects.Perturb] sees only perturb sites
    (unless given `kind="tag"`). To both patch and differentiate one value, tag
    it and use `fx.Perturb(kind="tag")` or `fx.intermediate_grads(fn,
    kind="tag")`.

    **Arguments:**

    - `value`: a pytree whose leaves are JAX arrays, NumPy arrays or Python
      numbers.
    - `name`: the site's name. Handlers select sites by name (see
      [`Names`][effects.Names]).
    - `collection`: the collection [`fx.Perturb`][effects.Perturb] selects sites
      by.

    **Returns:**

    `value`, with its numbers and NumPy arrays converted to JAX arrays, plus the
    delta a [`Perturb`][effects.Perturb] handler adds. A `value` without leaves
    is returned as it is and makes no site.

    **Raises:**

    - `TypeError`: `name` or `collection` is not a string, or a leaf of `value`
      is neither an array nor a number.

    **Example:**

    ```python
    def loss(x):
        h = fx.perturb(jnp.sin(x), "h")
        return (2 * h) ** 2

    value, grads = fx.intermediate_grads(loss)(1.0)
    print(grads)  # d(loss)/dh = 8 h = 8 sin(1)
    ```

    ```text
    {'h': (Array(6.7317677, dtype=float32),)}
    ```
    """
    return _bind_site("perturb", value, name, collection, "perturb")
