"""The sites of a jaxpr, found by one walk (cached per jaxpr) that the rewriter,
the branch check of `handle` and `fx.sites` share. A site is a `tag` or
`perturb` equation, or a `jax.ad_checkpoint.checkpoint_name` seen as a tag in
the collection "checkpoint_name"; each is found with the higher-order equations
around it."""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import jax

from . import _compat, _jaxpr
from ._primitives import handling, site_p
from ._site import CHECKPOINT_NAME, Site, checkpoint_name_params

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


NOT_YET = object()  # (a part of an `Analysis` not computed yet)


class Analysis:
    """What is read of one jaxpr, each part computed where first read and kept
    as long as the jaxpr lives: its sites (`walk`), and the rewriter's views of
    it (see `_rewrite`): the runs of its equations that hold no site
    (`runs`), its equations as if each site kept its value (`kept`), and its
    copy whose custom rules trace once per handling state (`per_state`). No
    part holds the jaxpr itself, which the table keeps weakly."""

    __slots__ = ("walk", "runs", "kept", "per_state")
    walk: Any
    runs: Any
    kept: Any
    per_state: Any

    def __init__(self):
        self.walk = self.runs = self.kept = self.per_state = NOT_YET


_analyses: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def analysis(jaxpr) -> Analysis:
    """`jaxpr`'s analysis, as far as it is computed."""
    found = _analyses.get(jaxpr)
    if found is None:
        found = _analyses[jaxpr] = Analysis()
    return found


def walk(jaxpr) -> _Walk:
    """The sites of an open `jaxpr` and its sub-jaxprs."""
    known = analysis(jaxpr)
    if known.walk is not NOT_YET:
        return known.walk
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
    found = known.walk = _Walk(
        tuple(sites),
        frozenset().union(*per_eqn),
        tuple(per_eqn),
        # (not in a while loop: JAX stages one whole into a recomputation,
        # the marks of its sites as they were: see `recomputes`)
        any(
            s.eqn.params.get("forward")
            and not any(r.eqn.primitive is _compat.while_p for r in s.path)
            for s in sites
        ),
        frozenset(primitives),
    )
    return found


def sites_in(jaxpr) -> frozenset[Key]:
    """(kind, collection, name, part) of every site in `jaxpr` and its
    sub-jaxprs."""
    return walk(jaxpr).keys


def recomputed_only(jaxpr) -> frozenset[Key]:
    """The sites of `jaxpr` none of whose copies is its own: each found only
    where the backward pass recomputes (see `Located.recomputed`)."""
    sites = walk(jaxpr).sites
    own = {s.key for s in sites if not s.recomputed}
    return frozenset(s.key for s in sites if s.key not in own)


def recomputes(eqn) -> bool:
    """Whether `eqn` is the backward pass's recomputation of a `jax.checkpoint`
    region: the sites in it are executions of the forward pass's, computed
    again, not executions of their own (see `_rules._call_rule`). JAX marks
    it `differentiated`, but also the forward part of a checkpoint in a scan in
    another checkpoint, which holds the tags that JAX's partial evaluation
    kept where they execute, marked `forward` (see
    `_primitives._site_partial_eval_custom`); the recomputation holds their
    copies, and those of its loops JAX recomputes whole. A `lax.while_loop`
    JAX stages whole, as the program had it (`_while_partial_eval_custom`:
    "Staged eqn is same as input eqn"): its sites keep the `forward` marks an
    earlier partial evaluation gave them, and tell nothing. A region holding
    no other `forward` site has JAX's mark alone to go by: it is taken for a
    recomputation (`_checks._check_recomputed_only` refuses a handler that
    would then report a site none of whose copies it takes for its own)."""
    if eqn.primitive is not _compat.remat_p or not eqn.params.get("differentiated"):
        return False
    return not walk(eqn.params["jaxpr"]).forward


def traced(fn, *args):
    """The jaxpr of `fn(*args)` as `handle` sees it: traced with its sites
    carrying their effect, so that none is dropped as unused, its constants
    as its first inputs, and one `jit` call of them all its body
    (`_jaxpr.unwrapped`)."""
    with handling(True):
        jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return _jaxpr.unwrapped(_compat.constvars_as_invars(jaxpr))


def differentiated_names(jaxpr) -> frozenset[Key]:
    """The `checkpoint_name`s of `jaxpr` that JAX's differentiation went
    through (a `jax.grad` or `jax.jvp` inside the handled function): the
    name's equation, one around it, or one reading its value (a loop's
    invariant part JAX moved out) was made by a JVP, as its name stack says
    (`jvp(...)`). A tag carries its derivative; a name does not."""
    found = set()
    for s in walk(jaxpr).sites:
        if s.key[1] != CHECKPOINT_NAME or s.key in found:
            continue
        holder = s.path[-1].jaxpr if s.path else jaxpr
        out = s.eqn.outvars[0]
        readers = (e for e in holder.eqns if any(v is out for v in e.invars))
        if any(
            "jvp(" in str(_compat.name_stack(e))
            for e in (*(r.eqn for r in s.path), s.eqn, *readers)
        ):
            found.add(s.key)
    return frozenset(found)
