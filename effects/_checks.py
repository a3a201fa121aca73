"""The checks `handle` makes before it rewrites: that each handler's names
exist and are not consumed before it, that it asks for derivatives the program
has, that no two handlers report one site, and that no handler acts where the
rewrite cannot (a transposed function, a loop JAX moved a site out of, a
recomputation alone, a branch a vmap evaluated for every example), each a
`ValueError` that names the site. They read the analysis of the traced
program (`_walk`)."""

from __future__ import annotations

import fnmatch
import warnings

import jax

from . import _compat
from ._handlers import PARTS, SUM, Select, acts_on, found_key, mode_of
from ._primitives import site_p
from ._site import CHECKPOINT_NAME, Site
from ._walk import recomputed_only, walk


def check(jaxpr, sites, handlers) -> None:
    """Every check but the branches' (`check_branches`), on the traced program
    `jaxpr` holding `sites`."""
    for one in (
        _check_names,
        _check_transposed,
        _check_derivatives,
        _check_reporters,
        _check_loop_invariant,
        _check_recomputed_only,
        _check_keys,
    ):
        one(jaxpr, sites, handlers)


_UNKNOWN_NAME = (
    "{handler}: no {kind} {named} {name} in collection {collection!r}. Known "
    "names: {known}. (A tag "
    "inside a callback's Python function, or one a primitive keeps to trace "
    "later (a lineax iterative solve's operator), is never seen: tag its "
    "result instead.)"
)
_NO_DERIVATIVE = (
    " A {part} site exists where a `jax.{transform}` inside the handled function "
    "differentiates the tag: handle `jax.{transform}(f)`, not `f`. A tag inside a "
    "`custom_jvp`/`custom_vjp` function has none (its rule gives the derivative): "
    "move the tag out of it."
)
_NOT_REACHED = (
    " The `jax.{transform}` inside the handled function differentiates other "
    "tags, not this one: where its value does not depend on what is "
    "differentiated (a constant), JAX computes no {part} for it, nor inside "
    "a `custom_jvp`/`custom_vjp` function (its rule gives the derivative), nor "
    "for an unused value in a checkpoint or cond inside a `jax.checkpoint` "
    "(docs/sharp-bits.md). "
    "For the gradient with respect to it, use "
    "`fx.intermediate_grads(f, kind='tag')`."
)
_TRANSPOSED = (
    "{handler} acts on {where}, which is inside a function that "
    "`jax.linear_transpose` transposes: the transposed program never computes "
    "its value, nor takes its cotangent apart. Tag outside the transposed "
    "function, or differentiate it instead (`fx.handle(jax.grad(f), "
    "fx.Tag(of='cotangent'))` reports the tag's cotangent)."
)
_NOT_DIFFERENTIATED = (
    "{handler}(of={part!r}) matches the {kind} {names}, but the handled "
    "function differentiates none of them: a {part} exists where a "
    "`jax.{transform}` inside the handled function differentiates the tag. "
    "Handle `jax.{transform}(f)`, not `f` (`jax.{transform}(fx.handle(f, ...))` "
    "differentiates outside the handler, which then sees values only)."
)
_INTEGER_VALUES = (
    "{handler}(of={part!r}) matches the {kind} {names}, whose values hold "
    "integers, booleans or keys only: JAX differentiates no such value, so "
    "{it} no {part}. Leave {them} out of `names` (a list of the others, or a "
    "predicate)."
)
_IN_CUSTOM_RULE = (
    "{handler}(of={part!r}) matches the {kind} {names}, which {sit} inside a "
    "`custom_jvp`/`custom_vjp` function whose rule gives the derivative "
    "without differentiating the tag: {it} no {part}. Move the tag out of "
    "the function, or leave {them} out of `names` (a list of the others, or a "
    "predicate)."
)
# (what to do, where a handler consumes the sites a later one names)
_BOTH_ACT = (
    " Narrow the earlier handler's `names`. To have both act there, put a "
    "handler that reports nothing (`Substitute`, `Intervene`) first, and the "
    "other reports the value it gives; or nest them, "
    "`fx.handle(fx.handle(f, {before}(...)), {handler}(...))`, with a "
    "mode of {before} that passes the site on (`consumes=False`: "
    "`fx.Append(consumes=False)`, `fx.Reduce(..., consumes=False)`)."
)
_CONSUMED_BEFORE = (
    "{handler}: the {kind} {name!r} (collection {collection!r}) is consumed by "
    "{before} (handler {j}), which comes before it in the same `fx.handle`: "
    "handlers act in order and the first that matches a site consumes it." + _BOTH_ACT
)
_ALL_CONSUMED_BEFORE = (
    "{handler} matches no site left: every one it matches (the {kind} {name!r} "
    "of collection {collection!r} among them) is consumed by {before} (handler "
    "{j}), which comes before it in the same `fx.handle`, so it reports "
    "nothing: handlers act in order and the first that matches a site consumes "
    "it." + _BOTH_ACT
)
_CONSUMED_INSIDE = (
    "{handler}: {where} is reported by a handler of the `fx.handle` inside "
    "this one, which consumes it: the first handler that matches a site "
    "consumes it. Narrow the inner handler's `names`, move {handler} into "
    "that `fx.handle`, before it, or give the inner handler a mode that passes "
    "the site on (`consumes=False`: `fx.Append(consumes=False)`, "
    "`fx.Reduce(..., consumes=False)`)."
)
_TWO_REPORTERS = (
    "{first} and {second} both report the {where} into found[{collection!r}]: "
    "{why}, so both see it, and one report would overwrite the other. Narrow "
    "one's `names`, or handle in two steps, "
    "`fx.handle(fx.handle(f, {first}(...)), {second}(...))`, to have both."
)
_PASSED_ON = "{first}'s mode passes {name!r} on (`consumes=False`)"
_EVERY_BRANCH = (
    "{handler}: the {kind} {names} (collection {collection!r}) sits in a "
    "`lax.cond` or `lax.switch` whose predicate a `jax.vmap` inside the handled "
    "function batches. That vmap runs every branch for every example and keeps "
    "each example's own outputs, so a handler outside it would report branches "
    "that did not run (a `lax.map` with a `batch_size` runs its chunks under "
    "such a vmap). Put the handler inside the vmap instead: "
    "`jax.vmap(fx.handle(f, ...))`, or `lax.map(fx.handle(g, ...), xs, "
    "batch_size=...)`, reports each example's own branch."
)


def _check_names(jaxpr, sites, handlers) -> None:
    """Each handler's required names exist among the sites it sees: those no
    handler before it consumes, as in `handle(handle(f, A), B)` (a
    `checkpoint_name` is never consumed), nor a handler of a `handle` inside
    this one (a derivative it reported stays for the handlers of the value).
    A handler that names none, all of whose sites one before it consumes, is a
    warning (nested, `handle(handle(f, A), B)`, `B` sees no site at all)."""
    # (built where a handler requires names: one probe per site, which a
    # `handle` of one `Tag()` at every site does not pay)
    probes, inside = None, frozenset()
    for i, h in enumerate(handlers):
        select = h.matches
        exact, globs = select.required() if isinstance(select, Select) else ((), ())
        if not (exact or globs or any(map(_consumes, handlers[:i]))):
            continue
        if probes is None:
            probes = [Site.probe(*s) for s in sorted(sites)]
            found = walk(jaxpr).sites
            inside = {s.key for s in found if s.eqn.params.get("derivative_consumed")}

        def consumer(site):
            """The handler before `h` that consumes `site`, if any (-1: one
            of a `handle` inside this one)."""
            if site.collection == CHECKPOINT_NAME:
                return None
            if probes_key(site) in inside:
                return -1
            before = enumerate(handlers[:i])
            consumers = ((j, g) for j, g in before if _consumes(g))
            # (one that matches the value at a derivative site is a handler
            # of the value there, differentiated: it consumes the value only)
            return next(
                (j for j, g in consumers if acts_on(g, site) == site.part), None
            )

        # Each name must exist, and a filter of glob patterns alone select a
        # site, so a pattern with a typo is not an empty `found`. (None: the
        # sites of a handler that names none.)
        for name in exact or ((globs,) if globs else (None,)):
            mine = [p for p in probes if _named(p, name) and h.matches(p)]
            if not mine:
                if name is None:
                    break  # (nothing to see: as in a handle of its own)
                raise ValueError(_unknown_name(h, name, probes, consumer))
            j = consumer(mine[0])
            if j is None or any(consumer(p) is None for p in mine):
                continue
            if j < 0:
                template = _CONSUMED_INSIDE
            else:
                template = _CONSUMED_BEFORE if name else _ALL_CONSUMED_BEFORE
            before = type(handlers[j]).__name__  # (unused where j < 0)
            message = _message(template, h, mine[0], before=before, j=j)
            if name is not None:
                raise ValueError(message)
            warnings.warn(message, stacklevel=_compat.outside_level())


def _check_derivatives(jaxpr, sites, handlers) -> None:
    """A handler of tangents or cotangents that matches tags none of which the
    function differentiates, or tags inside a custom_jvp/custom_vjp function
    that have no derivative, says so rather than find nothing. (A tag whose
    value does not depend on what is differentiated has none either: it is
    left out, as JAX leaves out its zero derivative.)"""
    probes = [Site.probe(*k) for k in sorted(sites) if k[3] == "value"]
    for h in handlers:
        # Per derivative part the handler takes (by `matches`, where it does
        # not take the value): the tags it matches there, and those of them
        # the function does not differentiate.
        others = [p for p in probes if not h.matches(p)]
        checked = []
        for part in ("tangent", "cotangent"):
            values = [probes_key(p) for p in others if h.matches(p.of(part))]
            have = {k[:3] for k in sites if k[3] == part}
            if values:
                checked.append((part, values, [k for k in values if k[:3] not in have]))
        if not checked:
            continue
        if all(len(missing) == len(values) for _, values, missing in checked):
            part, _, names = checked[0]
            inexact = _inexact_values(jaxpr, names)
            message = _NOT_DIFFERENTIATED if inexact else _INTEGER_VALUES
        else:
            # (the first part some of whose tags are differentiated: those
            # that are not, if inside a custom rule)
            part, _, missing = next(c for c in checked if len(c[2]) < len(c[1]))
            custom = {
                s.key[:3]
                for s in walk(jaxpr).sites
                if any(r.name in _CUSTOM for r in s.path)
            }
            names = [k for k in missing if k[:3] in custom]
            if not names:
                continue
            message = _IN_CUSTOM_RULE
        one = len(names) == 1
        raise ValueError(
            message.format(
                handler=type(h).__name__,
                part=part,
                kind=_kind(names[0][0]) + ("" if one else "s"),
                names=", ".join(repr(k[2]) for k in names),
                transform="grad" if part == "cotangent" else "jvp",
                it="it has" if one else "they have",
                sit="sits" if one else "sit",
                them="it" if one else "them",
            )
        )


_CUSTOM = ("custom_jvp_call", "custom_vjp_call")


def _inexact_values(jaxpr, keys) -> bool:
    """Whether a site of one of `keys`, value sites, holds a floating or
    complex leaf."""
    return any(
        jax.numpy.issubdtype(v.aval.dtype, jax.numpy.inexact)
        for s in walk(jaxpr).sites
        if s.key in keys
        for v in s.eqn.invars
    )


def probes_key(site: Site) -> tuple[str, str, str, str]:
    return site.kind, site.collection, site.name, site.part


def _kind(kind: str) -> str:
    return "tag" if kind == "tag" else "perturb site"


def _message(template: str, h, site: Site, **more) -> str:
    # `template` filled in for handler `h` at `site`: with the site's fields
    # and `more`, of which `str.format` takes those the template names.
    return template.format(
        handler=type(h).__name__,
        where=site.where(),
        kind=_kind(site.kind),
        name=site.name,
        collection=site.collection,
        **more,
    )


def _refuse(template: str, site: Site, acting, **more) -> None:
    """Raise `template` for the first of the handlers `acting` at `site`, if
    there is one."""
    h = next(iter(acting), None)
    if h is not None:
        raise ValueError(_message(template, h, site, **more))


def _named(site: Site, name: str | tuple[str, ...] | None) -> bool:
    """Whether `site` is named `name`, or matches one of the glob patterns
    (any name, for None)."""
    if name is None:
        return True
    if isinstance(name, tuple):
        return any(fnmatch.fnmatchcase(site.name, g) for g in name)
    return site.name == name


def _unknown_name(h, name: str | tuple[str, ...], probes, consumer) -> str:
    # The names the handler could have meant: those of its selection's kind,
    # collection and part that no handler before it consumes.
    select: Select = h.matches
    kind, collection, part = select.kind, select.collection, select.part
    any_name = Select(None, collection, kind, part)
    known = sorted({p.name for p in probes if any_name(p) and consumer(p) is None})
    what = _kind(kind) if part == "value" else f"{part} of a {_kind(kind)}"
    message = _UNKNOWN_NAME.format(
        handler=type(h).__name__,
        kind=what,
        named="matching" if isinstance(name, tuple) else "named",
        name=" or ".join(map(repr, name)) if isinstance(name, tuple) else repr(name),
        collection=collection,
        known=", ".join(map(repr, known)) or "none",
    )
    if part != "value":
        has_value = any(
            p.part == "value" and p.kind == kind and _named(p, name) for p in probes
        )
        reached = has_value and any(p.part == part for p in probes)
        transform = "grad" if part == "cotangent" else "jvp"
        template = _NOT_REACHED if reached else _NO_DERIVATIVE
        message += template.format(part=part, transform=transform)
    return message


def _check_reporters(jaxpr, sites, handlers) -> None:
    """No two handlers report one site into `found`, one report over the
    other. The first handler that reports a site consumes it, unless its mode
    passes it on (`consumes=False`) or the site is a `checkpoint_name`, which
    is never consumed: then the next that reports it would report it too. The
    error names the first such site in program order."""
    modes = [mode_of(h) for h in handlers]
    if sum(m is not None for m in modes) < 2:
        return
    passes_on = any(m is not None and not m.consumes for m in modes)

    def clash(key):
        k, c, n, part = key
        if c != CHECKPOINT_NAME and not passes_on:
            return None
        probe, first = Site.probe(k, c, n, part), None
        for h, mode in zip(handlers, modes):
            if mode is None or acts_on(h, probe) != part:
                continue
            if first is not None:
                return probe, first, h
            if mode.consumes and c != CHECKPOINT_NAME:
                return None
            first = h
        return None

    # (at every call: the sites as a set, in program order only on error)
    if not any(map(clash, sites)):
        return
    in_order = dict.fromkeys(s.key for s in walk(jaxpr).sites)
    probe, first, second = next(filter(None, map(clash, in_order)))
    why = _PASSED_ON.format(first=type(first).__name__, name=probe.name)
    if probe.collection == CHECKPOINT_NAME:
        why = f"a `checkpoint_name` ({probe.name!r}) is never consumed"
    raise ValueError(
        _TWO_REPORTERS.format(
            first=type(first).__name__,
            second=type(second).__name__,
            where=probe.where(),
            collection=found_key(first) or probe.collection,
            why=why,
        )
    )


def _consumes(h) -> bool:
    mode = mode_of(h)
    return mode is not None and mode.consumes


def _check_loop_invariant(jaxpr, sites, handlers) -> None:
    """No handler of a value sees a site that JAX took out of a loop. Under a
    `jax.grad` inside the handled function, JAX's partial evaluation of a
    `lax.scan` computes a value that its body computes from what the loop
    closes over only once, before the loop, and its site with it (it does so
    with `jax.debug.print` too); the site's derivative stays in the loop's
    backward pass, under the same `pair` number. A handler of the value would
    see one execution where the loop runs many. (One pair may have several
    value sites: JAX differentiates a `jax.jit` function once for all its
    calls, inside a loop and out. It was moved if its derivative sites sit
    in more scans than any of them.)"""
    paired = [
        (s, s.eqn.params["pair"], _scans(s))
        for s in walk(jaxpr).sites
        if s.eqn.primitive is site_p and s.eqn.params.get("pair") is not None
    ]
    loops = {}  # (pair, value or not) -> the most scans around one of its sites
    for s, pair, n in paired:
        key = (pair, s.key[3] == "value")
        loops[key] = max(loops.get(key, 0), n)
    for s, pair, _ in paired:
        if s.key[3] == "value" and loops.get((pair, False), 0) > loops[pair, True]:
            probe = Site.probe(*s.key)
            _refuse(_HOISTED, probe, (h for h in handlers if h.matches(probe)))


def _check_recomputed_only(jaxpr, sites, handlers) -> None:
    """No handler that reports a site finds it only where the backward pass
    recomputes (see `_walk.recomputes`): under a `jax.grad` inside the
    handled function, JAX marks the forward pass's copy of a `jax.checkpoint`
    in a loop in another `jax.checkpoint` as it marks the recomputation, and a
    region holding no tag of ours outside a while loop has nothing else to
    tell them apart by. The handler would report none of its executions."""
    for key in recomputed_only(jaxpr):
        probe = Site.probe(*key)
        reporting = (h for h in handlers if mode_of(h) is not None and h.matches(probe))
        _refuse(_RECOMPUTED_ONLY, probe, reporting)


def _check_transposed(jaxpr, sites, handlers) -> None:
    """No handler acts on a site that `jax.linear_transpose` transposed (see
    `_primitives._site_transpose`): the transposed program never computes its
    value, nor its cotangent apart."""
    for s in walk(jaxpr).sites:
        if s.eqn.params.get("transposed"):
            probe = Site.probe(*s.key)
            acting = (h for h in handlers if any(h.matches(probe.of(p)) for p in PARTS))
            _refuse(_TRANSPOSED, probe, acting)


def _check_keys(jaxpr, sites, handlers) -> None:
    """No handler sums a PRNG key: a key has no sum."""
    for s in walk(jaxpr).sites:
        keys = [v.aval for v in s.eqn.invars if _compat.is_key(v.aval)]
        if keys:
            probe = Site.probe(*s.key)
            summing = (
                h
                for h in handlers
                if acts_on(h, probe) == probe.part and mode_of(h) is SUM
            )
            _refuse(_REDUCED_KEY, probe, summing, key=keys[0])


_REDUCED_KEY = (
    "{handler} sums {where}, whose value holds a PRNG key ({key}), which has "
    "no sum. Leave it out of `names`, collect it with mode='append' or "
    "'last', or tag `jax.random.key_data(key)`."
)


def _scans(located) -> int:
    # (JAX hoists out of a `lax.scan` only: a `lax.while_loop` it differentiates
    # forward only, whole, and a derivative site in one more of those than its
    # value is a linearized function applied in a loop, as optimistix's Chord
    # applies a Jacobian it took once)
    return sum(r.eqn.primitive is _compat.scan_p for r in located.path)


_RECOMPUTED_ONLY = (
    "{handler} reports {where}, which under the `jax.grad` inside the handled "
    "function is found only in regions JAX marks as the backward pass's "
    "recomputation of a `jax.checkpoint` (JAX marks so the forward pass's copy "
    "of a `jax.checkpoint` in a loop in another `jax.checkpoint` too), so "
    "{handler} would report none of its executions. Handle the function before "
    "differentiating it (`jax.grad(lambda *a: fx.handle(f, ...)(*a)[0])`), or "
    "`fx.tag` a value in the same `jax.checkpoint` function: a tag tells the "
    "forward pass's copy apart. A tag in the backward rule of a `custom_vjp` "
    "function inside a `jax.checkpoint` runs there too, and cannot be told "
    "apart: call the `custom_vjp` function outside the checkpoint."
)
_HOISTED = (
    "{handler} matches {where}, which executes once, outside a `lax.scan` (or "
    "`fori_loop`) that holds its derivative. Either its value is what a loop "
    "body computes from what the loop closes over only, and under the "
    "`jax.grad` inside the handled function JAX computes it once, before the "
    "loop ({handler} would see one execution where `fx.handle(f, ...)` sees "
    "one per iteration), or a function `jax.linearize` or `jax.vjp` made "
    "outside the loop is applied in it: the two look alike in the program. "
    "Handle the function before differentiating it "
    "(`jax.grad(lambda *a: fx.handle(f, ...)(*a)[0])`, or `jax.linearize` of "
    "the handled function), or tag a value the loop computes from its carry."
)


def check_branches(every_branch, handlers) -> None:
    """No handler sees a site that a vmap inside the function ran for every
    branch of a cond: it would report values of branches that did not run."""
    for h in handlers:
        hit = sorted(s for s in every_branch if h.matches(branch_probe(s)))
        if hit:
            names = ", ".join(dict.fromkeys(f"{s[2]!r}{_branch_where(s)}" for s in hit))
            message = _message(_EVERY_BRANCH, h, branch_probe(hit[0]), names=names)
            raise ValueError(message)


#
# The cond branches a vmap ran
#

# Finding the sites a `vmap` inside `handle` ran for every branch of a `cond`.
#
# Under `jax.vmap`, a `cond` (or `switch`) whose predicate is batched becomes a
# select between the outputs of all its branches, each evaluated for every
# example; no `cond` is left in the program for a rewriter to see, nor anything
# that says which branch each example took. A handler outside that vmap would see
# every branch's tags, so `handle` refuses them (`vmap(handle(f))` sees each
# example's own branch). A site bound in JAX's batching rule of such a `cond` is
# marked there, as a param its equation keeps (see `_primitives`):
#
# - In the trace `handle` makes, where the rule evaluates the branches: the
#   sites directly in them, at any depth of the `cond`s and loops a vmap keeps
#   around it. What the rule traces (what the branches call: a `jax.jit`, a loop
#   body, a `cond` the vmap keeps in them) is a jaxpr JAX caches, and may give
#   to a `cond` it keeps elsewhere, which a mark made there would follow.
# - Where the program may hold a site of a branch unmarked (a select beside a
#   site a vmap batches), `handle` traces the function again in a trace context
#   of its own (`_primitives.probing`), which is part of the key of every cache
#   of traces JAX keeps: the jaxprs of that trace are its own, and a site bound
#   anywhere under the rule is marked (`branch_suspects`, `branch_marked`). A
#   site is known by its name and the call path of its `tag` (which its
#   equation keeps through JAX's transformations), the same in both traces.

# (kind, collection, name, call path of the `tag`, part): a tangent or
# cotangent site a vmap ran for every branch is one too (a `jax.grad` inside
# the vmap: the branches of the forward pass's cond, and of its transpose).
BranchKey = tuple[str, str, str, tuple, str]


def branch_suspects(jaxpr) -> frozenset[BranchKey]:
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
    return frozenset(_branch_key(s) for s in tags if s.path)


def branch_marked(jaxpr) -> frozenset[BranchKey]:
    """The sites bound where a vmap evaluated every branch of a `cond`."""
    return frozenset(
        _branch_key(s) for s in walk(jaxpr).sites if s.eqn.params.get("every_branch")
    )


def _branch_key(located) -> BranchKey:
    kind, collection, name, part = located.key
    path = tuple(_compat.call_frames(located.eqn.source_info.traceback))
    return kind, collection, name, path, part


def branch_probe(key: BranchKey) -> Site:
    """The site a key is, for handlers to match."""
    kind, collection, name, _, part = key
    return Site.probe(kind, collection, name, part)


def _branch_where(key: BranchKey) -> str:
    """Where a site's `tag` was called, for messages."""
    path = key[3]
    return f" at {path[0][0]}:{path[0][1]}" if path else ""
