"""Finding the sites a `vmap` inside `handle` ran for every branch of a `cond`.

Under `jax.vmap`, a `cond` (or `switch`) whose predicate is batched becomes a
select between the outputs of all its branches, each evaluated for every
example; no `cond` is left in the program for a rewriter to see, nor anything
that says which branch each example took. A handler outside that vmap would see
every branch's tags, so `handle` refuses them (`vmap(handle(f))` sees each
example's own branch). A site bound in JAX's batching rule of such a `cond` is
marked there, as a param its equation keeps (see `_primitives`):

- In the trace `handle` makes, where the rule evaluates the branches: the
  sites directly in them, at any depth of the `cond`s and loops a vmap keeps
  around it. What the rule traces (what the branches call: a `jax.jit`, a loop
  body, a `cond` the vmap keeps in them) is a jaxpr JAX caches, and may give
  to a `cond` it keeps elsewhere, which a mark made there would follow.
- Where the program may hold a site of a branch unmarked (a select beside a
  site a vmap batches), `handle` traces the function again in a trace context
  of its own (`_primitives.probing`), which is part of the key of every cache
  of traces JAX keeps: the jaxprs of that trace are its own, and a site bound
  anywhere under the rule is marked (`suspects`, `marked`). A site is known
  by its name and the call path of its `tag` (which its equation keeps through
  JAX's transformations), the same in both traces.
"""

from __future__ import annotations

import jax

from . import _compat
from ._primitives import site_p
from ._site import Site
from ._walk import walk

# (kind, collection, name, call path of the `tag`, part): a tangent or
# cotangent site a vmap ran for every branch is one too (a `jax.grad` inside
# the vmap: the branches of the forward pass's cond, and of its transpose).
Key = tuple[str, str, str, tuple, str]


def suspects(jaxpr) -> frozenset[Key]:
    """The sites that may sit in a branch a vmap turned into a select, unmarked:
    every `tag` and `perturb` inside a jaxpr of the program's (a `jit`, a loop,
    a `cond`: what a branch calls is traced apart, and cached), when the program
    has a vmap of a site and a select (every such branch leaves one). One the
    program holds at its top level was bound in the branch itself, and marked
    there. A `checkpoint_name` is JAX's own primitive, which no mark reaches:
    it is left out."""
    found = walk(jaxpr)
    tags = [s for s in found.sites if s.eqn.primitive is site_p]
    if jax.lax.select_n_p not in found.primitives or not any(
        any(s.eqn.params["batch"]) for s in tags
    ):
        return frozenset()
    return frozenset(_key(s) for s in tags if s.path)


def marked(jaxpr) -> frozenset[Key]:
    """The sites bound where a vmap evaluated every branch of a `cond`."""
    return frozenset(
        _key(s) for s in walk(jaxpr).sites if s.eqn.params.get("every_branch")
    )


def _key(located) -> Key:
    kind, collection, name, part = located.key
    path = tuple(_compat.call_frames(located.eqn.source_info.traceback))
    return kind, collection, name, path, part


def probe(key: Key) -> Site:
    """The site a key is, for handlers to match."""
    kind, collection, name, _, part = key
    return Site.probe(kind, collection, name, part)


def where(key: Key) -> str:
    """Where a site's `tag` was called, for messages."""
    path = key[3]
    return f" at {path[0][0]}:{path[0][1]}" if path else ""
