"""Finding the sites a `vmap` inside `handle` ran for every branch of a `cond`.

Under `jax.vmap`, a `cond` (or `switch`) whose predicate is batched becomes a
select between the outputs of all its branches, each evaluated for every
example; no `cond` is left in the program for a rewriter to see, nor anything
that says which branch each example took. A handler outside that vmap would see
every branch's tags, so `handle` refuses them (`vmap(handle(f))` sees each
example's own branch). Two checks find them:

- A site bound where JAX's batching rule evaluates such a `cond`'s branches is
  marked there (see `_primitives`): the sites directly in its branches, at any
  depth of the `cond`s and loops a vmap keeps around it (`marked`).
- Sites in what the branches call (a `jax.jit`, a `lax.scan`) are bound where
  JAX traces that, in a jaxpr it caches, not in the rule: there, JAX's cond
  batching rule refuses JAX's IO effect in a branch, batched predicate or not;
  the check traces the function again with the IO effect on the sites that may
  have lost their `cond`, and a refusal says one did (`suspects`, `mixed`). A
  site is known by its name and the call path of its `tag` (which its equation
  keeps through JAX's transformations), so a tag of the same name in a cond
  the vmap kept is not mistaken for it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from . import _compat
from ._primitives import site_p
from ._walk import Region, walk

# (kind, collection, name, call path of the `tag`)
Key = tuple[str, str, str, tuple]


def suspects(jaxpr) -> frozenset[Key]:
    """Sites that may sit in a branch a vmap turned into a select: those outside
    every `cond` left in the program, when the program has a vmap of a site and
    a select (every such branch leaves one). Sites in a `while_loop` whose
    predicate a vmap batched are left out: the loop masks its carry per example,
    so they are exact, and JAX refuses the IO effect in such a loop (a cond
    inside one is found by its mark). A `checkpoint_name` carries no IO effect,
    and is left out too."""
    found = walk(jaxpr)
    tags = [s for s in found.sites if s.eqn.primitive is site_p]
    if jax.lax.select_n_p not in found.primitives or not any(
        any(s.eqn.params["batch"]) for s in tags
    ):
        return frozenset()
    return frozenset(_key(s) for s in tags if not any(map(_keeps_branches, s.path)))


def marked(jaxpr) -> frozenset[Key]:
    """The sites bound where a vmap evaluated every branch of a `cond`."""
    return frozenset(
        _key(s) for s in walk(jaxpr).sites if s.eqn.params.get("every_branch")
    )


def _key(located) -> Key:
    return (*located.key[:3], _compat.call_path(located.eqn.source_info.traceback))


def _keeps_branches(region: Region) -> bool:
    # A `cond` left in the program runs one branch per example; a vmap leaves a
    # `while` with a batched predicate as one loop whose predicate is a vector.
    eqn = region.eqn
    if eqn.primitive is _compat.while_p:
        return bool(eqn.params["cond_jaxpr"].out_avals[0].shape)
    return eqn.primitive is _compat.cond_p


def mixed(retrace: Callable[[object], object], candidates: frozenset[Key]):
    """The candidates in a branch that a vmap turned into a select.
    `retrace(probe)` traces the function again with the IO effect on the sites
    `probe` names (see `_primitives.probing`); JAX refuses it in the branch of a
    vmapped cond. Found by halving: one trace when there is none, about two per
    such site and halving step otherwise."""

    def refused(keys: list[Key]) -> bool:
        probe = (frozenset(k[:3] for k in keys), frozenset(keys))
        # JAX refuses an IO effect in a branch of a vmapped cond, and that cond
        # is gone from the program (a `select_n`): tests/test_jax_facts.py::
        # test_vmap_of_cond_refuses_io_effects_and_leaves_no_cond.
        try:
            retrace(probe)
        except NotImplementedError as e:  # JAX's refusals of an effect
            return _compat.is_vmap_of_cond_refusal(e)
        return False

    def find(keys: list[Key]) -> set[Key]:
        if len(keys) == 1:
            return set(keys)
        half = len(keys) // 2
        out: set[Key] = set()
        for part in (keys[:half], keys[half:]):
            if refused(part):
                out |= find(part)
        return out

    keys = sorted(candidates)
    if not keys or not refused(keys):
        return frozenset()
    return frozenset(find(keys))


def where(key: Key) -> str:
    """Where a site's `tag` was called, for messages."""
    path = key[3]
    return f" at {path[0][0]}:{path[0][1]}" if path else ""
