"""`handle`: traces a function to a jaxpr, rewrites the jaxpr with the handlers,
and puts the result on the caller's trace as one call, the same under `jax.jit`,
`jax.grad`, `jax.vmap` and eagerly. Traces and rewritten programs are cached per
function, argument signature and handler configuration."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import threading
import types
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

import equinox as eqx
import jax
import jax.export

from . import _checks, _compat, _jaxpr
from ._custom import per_state
from ._handlers import (
    Handler,
    check_static,
    found_key,
)
from ._jaxpr import aval
from ._primitives import batched_sites, handling, probing
from ._rewrite import trace_rewrite
from ._scope import Handlers, Rewrite, Scope, Unbatched
from ._site import CHECKPOINT_NAME, Site
from ._walk import differentiated_names, sites_in

_NOT_CALLABLE = "handle: the first argument must be a callable, got {fn!r}."
_NOT_HANDLER = (
    "handle: {h!r} is not a handler; pass instances such as fx.Tag(), fx.Perturb(), "
    "fx.Substitute(...) or fx.Intervene(...)."
)
_CANNOT_BATCH = (
    '{} The function cannot be traced with it batched: JAX says "{}". A '
    "`jax.jacfwd` or `jax.hessian` inside the handled function vmaps over "
    "tangents only, with the value shared: differentiate the handled function "
    "instead, `jax.jacfwd(lambda x: fx.handle(f, ...)(x)[0])`."
)
_LEFTOVER = (
    "{handler} got more entries for {where} than it has executions ({n} left "
    "over). Give one entry per execution, in the layout Tag() reports."
)

#
# Adapters: objects `handle` does not trace as they are
#

# Each knows one kind of object among a function and its arguments (Flax NNX
# modules: `_nnx`, which the package registers here) and has
# `functional(fn, args, kwargs) -> (pure, pure_args, finish) | None` (the call
# as a pure function, and what writes its state back), `is_node(fn)` and
# `explain(error) -> Exception | None`.
adapters: list[Any] = []


def functional(fn, args, kwargs):
    """What the first adapter that knows `fn` or its arguments makes of them
    (see `adapters`), or None."""
    for adapter in adapters:
        made = adapter.functional(fn, args, kwargs)
        if made is not None:
            return made
    return None


def _explained(e: Exception) -> Exception | None:
    return next(filter(None, (a.explain(e) for a in adapters)), None)


#
# Splitting arguments into arrays (inputs) and the rest (static)
#

# Per leaf type: whether `eqx.is_array` holds (it depends on the type alone; an
# `isinstance` check against `jax.Array` costs more than this look-up).
_is_array_type: dict[type, bool] = {}


def _split(tree):
    leaves, treedef = jax.tree.flatten(tree)
    dynamic, static = [], []
    for x in leaves:
        array = _is_array_type.get(type(x))
        if array is None:
            array = _is_array_type[type(x)] = eqx.is_array(x)
        if array:
            dynamic.append(x)
            static.append(None)
        else:
            static.append(x)
    return dynamic, tuple(static), treedef


def _merge(dynamic, static, treedef):
    it = iter(dynamic)
    return jax.tree.unflatten(treedef, [next(it) if s is None else s for s in static])


def _static_key(x):
    # A static value with its type, as `jax.jit` keys its static arguments (2
    # and 2.0 are equal, and trace apart), and a float with its sign (-0.0 and
    # 0.0 are equal, and divide apart).
    if type(x) is float:
        return float, x, math.copysign(1.0, x)
    return type(x), x


def _signature(static, treedef, dynamic):
    """A hashable key for the arguments' structure, static values and types, or
    None when a static value is unhashable."""
    return _hashable(
        (
            treedef,
            tuple(map(_static_key, static)),
            tuple((a.shape, a.dtype, a.weak_type) for a in map(aval, dynamic)),
            # (a trace under `jax.enable_x64` differs, as `jax.jit`'s caches know)
            _compat.trace_context(),
        )
    )


def _hashable(key):
    """`key`, or None when it is unhashable."""
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _call_module(module, *args, **kwargs):
    return module(*args, **kwargs)


#
# Caches, bounded: one object per function, least recently used entries dropped
#


class _LRU:
    """A bounded dict in order of use, safe across threads."""

    def __init__(self, size: int):
        self.size = size
        self.items: dict[Any, Any] = {}
        self.lock = threading.Lock()

    def get(self, key):
        with self.lock:
            value = self.items.pop(key, None)
            if value is not None:
                self.items[key] = value
            return value

    def put(self, key, value) -> None:
        with self.lock:
            self.items.pop(key, None)
            self.items[key] = value
            while len(self.items) > self.size:
                del self.items[next(iter(self.items))]


_SIZE = 256  # entries per function (traces, programs, wrappers, ... together)


class _Cache(_LRU):
    """What is cached for one function, by kind and key: `("trace",
    signature)` -> `_Traced`; `("program", (signature, handler configuration,
    handlers' array types, handling state))` -> `_Program`; `("wrapper",
    handler configuration)` -> the `_Handled` for those handlers; `("eager",
    (signature, handler configuration))` -> the `Jitted` call used outside any
    transformation; `(tool, signature)` -> what a tool made (`eager_cached`)."""

    def __init__(self, owner=None):
        super().__init__(_SIZE)
        self.owner = id(owner)  # (see `_cache_for`)


# Functions whose trace may be cached: their arrays are read when traced, as
# `jax.jit` reads them. Other callables (a Flax NNX module, an object with
# `__call__`) may hold state that changes between calls, and are traced again
# at every `handle(obj, ...)`; the handled function, kept, caches in a cache of
# its own, as `jax.jit(obj)` does.
_CACHEABLE = (types.FunctionType, functools.partial, type(jax.jit(lambda: None)))
_CACHE = "_effects_cache"  # a function's `__dict__` entry holding its `_Cache`

# The caches of bound methods (a new object per attribute access), by
# `("method", (function, object))`, and of Equinox modules, by `("module",
# structure)` (see `_cache_for`).
_shared = _LRU(_SIZE)


def _cache_for(fn) -> _Cache | None:
    """`fn`'s cache, None when it has none. A function keeps it in its own
    `__dict__`: it lives exactly as long as the function (a cycle the garbage
    collector frees). A bound method of an object hashed by value (a Flax
    linen module, a frozen dataclass) shares it with every equal object, as
    `jax.jit`'s static arguments do; one hashed by identity may change between
    calls. Every Equinox module of one structure (its treedef and leaves that
    are not arrays) shares one, as `eqx.filter_jit` compiles once per
    structure: its arrays are inputs (see `_call_module`), and the keys hold
    none of them."""
    if isinstance(fn, types.MethodType):
        if type(fn.__self__).__hash__ is object.__hash__:
            return None
        key = "method", (fn.__func__, fn.__self__)
    elif isinstance(fn, eqx.Module):
        key = "module", _split(fn)[1:]
    elif isinstance(fn, _CACHEABLE):
        # Not a `weakref.WeakKeyDictionary` keyed by `fn`: the cache holds the
        # wrapper `handle` returns, which holds `fn` (`jax.jit` caches per
        # function object, so `jax.jit(fx.handle(f, ...))` written inline
        # traces once only if the wrapper is the same), and a weak dictionary's
        # value that holds its key keeps it alive for good, where a `__dict__`
        # entry is a cycle freed with `fn`: tests/test_jax_facts.py::
        # test_jit_cache_is_per_function_object.
        cache = vars(fn).get(_CACHE)
        # `functools.wraps` copies `__dict__` entries, so a wrapper of `fn` (say
        # `jax.vmap(fn)`) can hold `fn`'s cache: it needs its own.
        if cache is None or cache.owner != id(fn):
            cache = vars(fn)[_CACHE] = _Cache(fn)
        return cache
    else:
        return None
    # (hashed first: an empty table's `get` would not hash `key`)
    if _hashable(key) is None:  # unhashable after all (a field holding a list)
        return None
    cache = _shared.get(key)
    if cache is None:
        cache = _Cache()
        _shared.put(key, cache)
    return cache


#
# Tracing and rewriting
#


@dataclasses.dataclass(frozen=True)
class _Traced:
    """`fn` traced with sites carrying their effect: its jaxpr takes the
    constants it closes over, then the arrays among the arguments."""

    jaxpr: Any
    consts: list[Any]
    out_tree: Any
    out_static: tuple  # the non-array outputs, by position
    sites: frozenset
    # Sites in a cond branch a vmap inside `fn` ran for every example, marked
    # where bound; those that may sit in one unmarked, and once a handler
    # matches one of those, the sites marked in `fn` traced again (see
    # `_every_branch`). (See `_checks`, the cond branches a vmap ran.)
    marked: frozenset
    suspects: frozenset
    retraced: list = dataclasses.field(default_factory=list, compare=False)
    batched: frozenset = frozenset()  # traced with these sites batched


def _flat(fn, static, treedef, out_info: dict):
    def flat_fn(*dyn):
        args, kwargs = _merge(dyn, static, treedef)
        out_dyn, out_info["static"], out_info["tree"] = _split(fn(*args, **kwargs))
        return out_dyn

    return flat_fn


def _named_after(fn, static, treedef, dynamic):
    """What JAX's errors while tracing `fn` name."""
    if fn is _call_module:
        return type(_merge(dynamic, static, treedef)[0][0]).__call__
    return fn


def _trace(fn, static, treedef, dynamic, batched=frozenset()) -> _Traced:
    """`fn` traced with its sites carrying their effect, and those named in
    `batched` batched by any vmap (see `batched_sites`)."""
    out_info = {}
    avals = [aval(x) for x in dynamic]
    with handling(True), batched_sites(batched):
        jaxpr, consts = _jaxpr.trace(
            _flat(fn, static, treedef, out_info),
            avals,
            _named_after(fn, static, treedef, dynamic),
        )
        # Rewritten programs run outside `handle` too: the custom rules in it
        # must not trace there for `handle` (see `_custom.per_state`).
        jaxpr = per_state(jaxpr)
    # (the branches a vmap ran are found in the program as traced: a `jit`
    # call's body is a jaxpr JAX caches, unwrapped or not)
    marked = _checks.branch_marked(jaxpr)
    # (a key marked anywhere is known)
    suspects = _checks.branch_suspects(jaxpr) - marked
    return _Traced(
        _jaxpr.unwrapped(jaxpr),
        consts,
        out_info["tree"],
        out_info["static"],
        sites_in(jaxpr),
        marked,
        suspects,
        batched=batched,
    )


def _every_branch(traced: _Traced, handlers, fn, static, treedef, dynamic):
    """The sites a vmap inside `fn` ran for every branch of a cond, those
    marked in the first trace too: found by tracing `fn` again in a trace
    context of its own (see `_checks.branch_suspects`), once, where a handler
    matches a site that may sit in one unmarked."""
    suspects = map(_checks.branch_probe, traced.suspects)
    if not any(h.matches(p) for p in suspects for h in handlers):
        return frozenset()
    if not traced.retraced:
        avals = [aval(x) for x in dynamic]
        named_after = _named_after(fn, static, treedef, dynamic)
        with handling(True), probing(object()), batched_sites(traced.batched):
            jaxpr, _ = _jaxpr.trace(_flat(fn, static, treedef, {}), avals, named_after)
        traced.retraced.append(_checks.branch_marked(jaxpr))
    return traced.retraced[0]


@dataclasses.dataclass(frozen=True)
class _Program:
    """A traced function rewritten by handlers: `jaxpr` takes the constants the
    rewrite closes over, the handlers' arrays, the function's constants and the
    arrays among its arguments, and returns the function's arrays and what the
    handlers found, flat."""

    jaxpr: Any  # ClosedJaxpr
    consts: list[Any]  # the constants the rewrite closes over
    traced: _Traced
    found_tree: Any  # a `Found` tree: names in program order
    name: str

    @property
    def n_out(self) -> int:
        return sum(s is None for s in self.traced.out_static)


def _scope(handlers, rewrite: Rewrite, sites) -> Scope:
    """The scope of the whole program, with each handler's per-execution
    inputs under the key of the site of that name it acts at (see `Key`)."""
    inputs, by_name = {}, None
    for i, h in enumerate(handlers):
        for name, entries in h.per_call_inputs().items():
            if by_name is None:
                by_name = {}
                for k in sites:
                    by_name.setdefault(k[2], []).append(k)
            keys = by_name.get(name, ())
            named = sorted({k[:3] for k in keys if h.matches(Site.probe(*k))})
            if len(named) > 1:
                where = [Site.probe(k, c, n).where() for k, c, n in named[:2]]
                raise ValueError(
                    _INPUTS_TWICE.format(
                        handler=type(h).__name__, name=name, where=where
                    )
                )
            inputs[i, named[0] if named else ("tag", "", name)] = list(entries)
    return Scope(handlers, inputs=inputs, rewrite=rewrite)


_INPUTS_TWICE = (
    "{handler} gives per-execution inputs for {name!r}, and acts at the "
    "{where[0]} and the {where[1]}: which one the entries are for is not known. "
    "Give the two different names, or have `matches` take one of them."
)


class Found(dict):
    """What handlers found: a `dict` from collection to a `dict` from name to
    value, names in the order the program first executed them.

    A `dict` in every respect but one: as a pytree it keeps its keys in that
    order (JAX sorts the keys of a plain `dict` when it flattens one), so
    `found` returned through an outer `jax.jit`, `jax.vmap` or
    `jax.grad(..., has_aux=True)` keeps program order too. Its tree structure
    is its own: to `jax.tree.map` it together with plain dicts, convert one
    to the other's type first, such as
    `{c: dict(names) for c, names in found.items()}`.

    **Example:**

    ```python
    def f(x):
        z = fx.tag(x + 1, "zeta")
        return fx.tag(z * 2, "alpha")

    _, found = jax.jit(fx.handle(f, fx.Tag()))(1.0)
    print(list(found["intermediates"]))
    ```

    ```text
    ['zeta', 'alpha']
    ```
    """

    def __repr__(self) -> str:
        return dict.__repr__(self)


def _found_flatten_with_keys(found: Found):
    return tuple((jax.tree_util.DictKey(k), v) for k, v in found.items()), tuple(found)


def _found_flatten(found: Found):
    return tuple(found.values()), tuple(found)


def _found_unflatten(keys, values) -> Found:
    return Found(zip(keys, values))


jax.tree_util.register_pytree_with_keys(
    Found, _found_flatten_with_keys, _found_unflatten, _found_flatten
)
# So that `jax.export` serializes a handled function, whose output holds one.
jax.export.register_pytree_node_serialization(
    Found,
    serialized_name="effects.Found",
    serialize_auxdata=lambda keys: json.dumps(keys).encode(),
    deserialize_auxdata=lambda data: tuple(json.loads(data)),
)


def _report(scope: Scope, handlers) -> Found:
    """What the handlers found, once the whole function has run, each
    collection's names in the order the program first executed them."""
    for key, left in scope.inputs.items():
        if left and len(key) == 2:
            where = scope.sites[key].where() if key in scope.sites else repr(key[1][2])
            raise ValueError(
                _LEFTOVER.format(
                    handler=type(handlers[key[0]]).__name__, where=where, n=len(left)
                )
            )
    found = Found()
    modes = scope.handlers.modes
    for h, mode in zip(handlers, modes):
        key = None if mode is None else found_key(h)
        if key is not None:
            found.setdefault(key, Found())
    for key, site in scope.sites.items():  # in order of first execution
        i, (_, _, name), *within = key
        if within:  # (a handler of the value, differentiated)
            continue
        mode = modes[i]
        if mode is None:
            continue
        collection = site.collection
        if site.part != "value":
            collection = f"{collection}:{site.part}"
        names = found.setdefault(collection, Found())
        if key in scope.accs:
            names[name] = scope.accs[key].value
        elif key in scope.entries:
            values = tuple(v for v, _ in scope.entries[key])
            if site.part == "cotangent":  # (a backward pass runs last first)
                values = _forward(values, scope.counts[key])
            names[name] = values[0] if mode.single else values
    for collection, names in found.items():
        if collection.endswith(":cotangent"):  # names too, in forward order
            found[collection] = Found(reversed(names.items()))
    return found


def _forward(values: tuple, counts: list[int]) -> tuple:
    """A name's cotangents in the order of the executions they belong to:
    each backward pass's (a run of one count, see `Scope.add_entry`)
    reversed."""
    assert len(values) == len(counts)
    each, out = iter(values), []
    for _, run in itertools.groupby(counts):
        out += reversed(list(itertools.islice(each, len(list(run)))))
    return tuple(out)


def _rewrite(traced: _Traced, config: _Config, h_leaves, name: str) -> _Program:
    """`traced` rewritten by the handlers, as a program taking the handlers'
    arrays, the function's constants and the arrays among its arguments:
    done again, splicing nothing, where a handler changed a value in a
    region that was spliced (see `_rewrite.trace_rewrite`)."""
    differentiated = frozenset()
    if any(k[1] == CHECKPOINT_NAME for k in traced.sites):
        differentiated = differentiated_names(traced.jaxpr)
    for splice in (True, False):
        info, rewrite = {}, Rewrite(splice=splice, differentiated=differentiated)

        def rewritten(front, run_in, rewrite=rewrite, info=info):
            handlers = _merge(front, config.static, config.treedef)
            scope = _scope(handlers, rewrite, traced.sites)
            try:
                outs = run_in(scope)
            except Exception:
                # (after a site found unbatched, what fails may be what follows
                # from it: traced again with it batched first)
                rewrite.check_batched()
                raise
            rewrite.check_batched()
            rewrite.check_orders(scope)
            leaves, info["tree"] = jax.tree.flatten(_report(scope, handlers))
            return [*outs, *leaves]

        jaxpr, consts = trace_rewrite(
            traced.jaxpr,
            (),
            Handlers(config.handlers),
            rewrite,
            list(map(aval, h_leaves)),
            rewritten,
        )
        if not rewrite.changed:
            break
    if rewrite.dropped and not handling.value:
        # What a dropped derivative site needed goes too (a value a forward loop
        # kept for the backward pass): the program of the hand-written function.
        # (Under an enclosing `handle`, whose handlers may see a name no value
        # here needs, that handle's rewrite does it.)
        jaxpr = _compat.dce(jaxpr)
    closed = _compat.ClosedJaxpr(jaxpr, ())
    return _Program(closed, consts, traced, info["tree"], name)


@dataclasses.dataclass(frozen=True, eq=False)
class _Config:
    """Handlers split as arguments are (`_split`): their arrays, inputs of the
    rewritten program, and the rest, which with the arrays' types is their
    configuration."""

    handlers: tuple
    static: tuple  # their leaves, None in place of an array
    treedef: Any
    # The configuration, hashable, or None where a leaf that is not an array is
    # unhashable (see `cache_key`).
    key: Any
    # The names the handlers give values per execution (see `batched_sites`).
    batched: frozenset = frozenset()

    @classmethod
    def of(cls, handlers) -> tuple[_Config, list[Any]]:
        for h in handlers:
            check_static(h)
        leaves, static, treedef = _split(handlers)
        batched = frozenset(n for h in handlers for n in h.per_call_inputs())
        key = _hashable((treedef, tuple(map(_static_key, static))))
        return cls(handlers, static, treedef, key, batched), leaves

    @property
    def cache_key(self):
        # Where the configuration is unhashable, this object: a handled function
        # kept and called again still finds what it cached.
        return self if self.key is None else self.key


def _program(
    cache: _Cache, fn, config: _Config, h_leaves, static, treedef, dynamic
) -> _Program:
    """`fn` traced and rewritten by the handlers for these arguments, from
    `cache` where it can be. Nothing holding a tracer is
    cached: it belongs to one trace."""
    # A check for branches a vmap evaluated traces with sites marked: never cache.
    sig = _signature(static, treedef, dynamic) if probing.value is None else None
    key = None
    if sig is not None:
        key = (sig, config.cache_key, tuple(map(aval, h_leaves)), bool(handling.value))
        program = cache.get(("program", key))
        if program is not None:
            return program
    # The sites whose values a vmap inside `fn` batches although they do not
    # depend on the example: those the handlers give values per execution, and
    # those a handler turns out to change per example (all found in one rewrite:
    # one trace more).
    batched, handlers, unbatched = config.batched, config.handlers, None
    while True:
        try:
            traced = _traced(cache, fn, static, treedef, dynamic, sig, batched)
        except ValueError as e:
            if unbatched is None and batched:
                # (the sites given inputs per execution, batched from the
                # start, cannot be: traced as they are, the rewrite names the
                # site that needs it, `Unbatched`)
                batched = frozenset()
                continue
            if unbatched is None:
                raise
            first = str(e).splitlines()[0]
            raise ValueError(_CANNOT_BATCH.format(unbatched, first)) from e
        _checks.check(traced.jaxpr, traced.sites, handlers)
        every_branch = _every_branch(traced, handlers, fn, static, treedef, dynamic)
        _checks.check_branches(traced.marked | every_branch, handlers)
        try:
            program = _rewrite(traced, config, h_leaves, _name(fn))
        except Unbatched as e:
            if e.names <= batched:
                raise
            batched, unbatched = batched | e.names, e
            continue
        break
    if key is not None and not any(
        map(_compat.is_tracer, [*program.consts, *traced.consts])
    ):
        cache.put(("program", key), program)
    return program


def _traced(cache: _Cache, fn, static, treedef, dynamic, sig, batched) -> _Traced:
    """`fn` traced (from `cache` where it can be), with the sites named in
    `batched` batched by any vmap."""
    if sig is not None and batched:
        sig = (sig, batched)
    traced = None if sig is None else cache.get(("trace", sig))
    if traced is None:
        traced = _trace(fn, static, treedef, dynamic, batched)
        if sig is not None and not any(map(_compat.is_tracer, traced.consts)):
            cache.put(("trace", sig), traced)
    return traced


def _name(fn) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return f"handled_{name}"


def _apply(cache: _Cache, fn, config: _Config, static, treedef, h_leaves, dynamic):
    """Runs `fn` with its sites handled on the current trace, the one way a
    handled call reaches it: one call of the rewritten program. Where that
    trace builds a jaxpr (under `jax.jit`), JAX copies the call's equations
    into it; under `jax.grad` and `jax.vmap`, JAX's cached derivative and
    batching of the whole program apply. Outside any transformation (our
    `Jitted` call under `jax.disable_jit`, or re-run by `jax_debug_nans` to
    find the operation that made a NaN), op by op, as JAX runs a function
    there: a call bound there would be compiled, and raise JAX's internal
    NaN error instead of naming the operation."""
    program = _program(cache, fn, config, h_leaves, static, treedef, dynamic)
    traced, n = program.traced, program.n_out
    args = [*program.consts, *h_leaves, *traced.consts, *dynamic]
    if _compat.is_top_level():
        outs = _compat.eval_jaxpr(program.jaxpr.jaxpr, program.jaxpr.consts, *args)
    else:
        outs = _jaxpr.call_jaxpr(program.jaxpr, args, program.name)
    out = _merge(outs[:n], traced.out_static, traced.out_tree)
    return out, jax.tree.unflatten(program.found_tree, outs[n:])


class Jitted:
    """`jax.jit(body)` for a `body` whose output may hold leaves that are not
    arrays: those are taken from its trace."""

    def __init__(self, body):
        self.body = body
        self.out = None  # (out_static, out_tree), once traced
        self.compiled = jax.jit(self._call)

    def _call(self, *args):
        out_dyn, *self.out = _split(self.body(*args))
        return out_dyn

    def __call__(self, *args):
        outs = self.compiled(*args)
        assert self.out is not None  # (set when traced)
        return _merge(outs, *self.out)


class _Handled:
    """The function `handle` returns."""

    def __init__(self, fn, handlers, cache: _Cache, split=None):
        self.fn = fn
        self.handlers = handlers
        self.cache = cache
        self._config, self._h_leaves = split or _Config.of(handlers)
        # `updated=()`: copying `fn.__dict__` would copy a nested wrapper's state.
        # A module's `__call__` bound to it: the handled module's signature is
        # the call's, without `self` (`eqx.filter_jit` binds arguments to it).
        functools.update_wrapper(
            self,
            fn.__call__ if isinstance(fn, eqx.Module) else fn,  # pyright: ignore
            updated=(),
        )

    def with_arrays(self, handlers, leaves) -> _Handled:
        """A copy for `handlers`, which differ from this wrapper's only in the
        values of their arrays (`leaves`)."""
        new = object.__new__(_Handled)
        new.__dict__.update(self.__dict__)
        new.handlers, new._h_leaves = handlers, leaves
        return new

    def __call__(self, *args, **kwargs):
        try:
            nnx_call = functional(self.fn, args, kwargs)
            if nnx_call is not None:
                return self._call_nnx(*nnx_call)
            return self._call(args, kwargs)
        except Exception as e:
            better = _explained(e)
            if better is None:
                raise
            raise better from e

    def _call_nnx(self, pure, pure_args, finish):
        """With Flax NNX objects among the function and its arguments: their
        state in and out (see `_nnx`)."""
        if isinstance(self.fn, _CACHEABLE) or any(a.is_node(self.fn) for a in adapters):
            handled = _memoized(pure, self.handlers)
        else:  # a callable that may hold state: traced at every call
            handled = _Handled(
                functools.wraps(pure)(lambda *a: pure(*a)), self.handlers, _Cache()
            )
        (out, state), found = handled(*pure_args)
        finish(state)
        return out, found

    def _call(self, args, kwargs):
        fn = self.fn
        if isinstance(fn, eqx.Module):  # its arrays are inputs, not constants
            fn, args = _call_module, (fn, *args)
        dynamic, static, treedef = _split((args, kwargs))
        apply = functools.partial(_apply, self.cache, fn, self._config, static, treedef)
        if not _compat.is_top_level():
            return apply(self._h_leaves, dynamic)
        # Outside any transformation: through a jit of the same call, cached
        # per argument signature, so that repeated calls neither trace nor
        # dispatch op by op (compiled anew when a static argument is unhashable).
        sig = _signature(static, treedef, dynamic)
        key = None if sig is None else (sig, self._config.cache_key)
        jitted = None if key is None else self.cache.get(("eager", key))
        if jitted is None:
            jitted = Jitted(apply)
            if key is not None:
                self.cache.put(("eager", key), jitted)
        return jitted(self._h_leaves, dynamic)


#
# One wrapper per function and handlers, so that `jax.jit(fx.handle(f, ...))`
# written inline hits jit's cache
#


def _memoized(fn, handlers) -> _Handled:
    cache = _cache_for(fn)
    if cache is None:  # (the wrapper, kept, still caches)
        return _Handled(fn, handlers, _Cache())
    # Inside a transformation, handlers may close over its tracers, which a
    # kept wrapper would keep alive; a module's wrapper holds its arrays.
    if not _compat.is_top_level() or isinstance(fn, eqx.Module):
        return _Handled(fn, handlers, cache)
    config, arrays = _Config.of(handlers)
    if config.key is None:  # an unhashable leaf that is not an array
        return _Handled(fn, handlers, cache, (config, arrays))
    wrapper = cache.get(("wrapper", config.key))
    if wrapper is None:
        wrapper = _Handled(fn, handlers, cache, (config, arrays))
        cache.put(("wrapper", config.key), wrapper)
    # Handlers holding arrays (`Perturb(deltas)`, `Substitute(values)`): a new
    # wrapper each call, since the arrays differ, sharing what is cached for
    # handlers that differ only in their arrays' values.
    return wrapper.with_arrays(handlers, arrays) if arrays else wrapper


#
# Tools that compile a function (`intermediate_grads`, `find_nonfinite`): what
# they build for it, cached as `handle` caches its jitted calls
#


def eager_cached(what, fn, args, kwargs, make) -> tuple[Any, list[Any]]:
    """`(made, dynamic)`: `dynamic` the arrays among `fn` (an Equinox module's)
    and its arguments, every other leaf held static as `eqx.filter_jit` holds
    it, and `made = make(call, dynamic)` with `call(dynamic)` calling `fn` on
    them. Flax NNX objects among `fn` and its arguments go in as their state,
    and the state they end with is dropped: `call` looks at them, leaving them
    as they were. Outside any transformation, `made` is cached per `what`
    (hashable), `fn` and the arguments' signature, for the functions `handle`
    caches (an Equinox module per structure, as `handle(model, ...)`): it may
    hold `call`, which holds no array but what `fn` closes over."""
    nnx_call = functional(fn, args, kwargs)
    nnx = nnx_call is not None  # (`call` must not hold `nnx_call`'s Variables)
    if nnx_call is not None:
        fn, args, kwargs, what = nnx_call[0], nnx_call[1], {}, (what, "nnx")
    cache = _cache_for(fn) if _compat.is_top_level() else None
    if isinstance(fn, eqx.Module):
        fn, args = _call_module, (fn, *args)
    dynamic, static, treedef = _split((args, kwargs))

    def call(dynamic):
        args, kwargs = _merge(dynamic, static, treedef)
        out = fn(*args, **kwargs)
        return out[0] if nnx else out

    sig = None if cache is None else _signature(static, treedef, dynamic)
    made = None if sig is None else cache.get((what, sig))  # pyright: ignore
    if made is None:
        made = make(call, dynamic)
        if sig is not None:
            cache.put((what, sig), made)  # pyright: ignore
    return made, dynamic


P = ParamSpec("P")  # (named as users read them in `handle`'s signature)
R = TypeVar("R")


def handle(fn: Callable[P, R], *handlers: Handler) -> Callable[P, tuple[R, Found]]:
    """Returns `fn` with its sites handled: `wrapped(*args, **kwargs) -> (out,
    found)`.

    `handle` traces `fn` to a jaxpr, lets the handlers rewrite that jaxpr (a
    site becomes what its handlers do there), and runs the rewritten program
    as one call. Sites inside `jax.jit`, `lax.scan`, `lax.cond`/`switch`,
    `lax.while_loop`, `jax.checkpoint`, `custom_jvp`/`custom_vjp` and
    `shard_map` are handled too; [Semantics](../semantics.md#what-found-holds)
    says what `found` holds in each. The handled function composes with
    `jax.jit`, `jax.vmap` and `jax.grad`, inside or outside it.

    Handlers act in order, the first closest to the sites: `handle(fn, A, B)`
    behaves as `handle(handle(fn, A), B)` but returns one merged `found`. One
    site, one report: a handler that reports ([`Tag`][effects.Tag],
    [`Stats`][effects.Stats], `Perturb()`) consumes the sites it matches; one
    that reports nothing ([`Substitute`][effects.Substitute],
    [`Intervene`][effects.Intervene], `Perturb(deltas)`) passes the new value
    on as the same site, and sites no handler consumes stay visible to a
    `handle` further out.

    **Compiled, also outside `jit`.** Called outside any JAX transformation,
    the handled call runs through a cached `jax.jit` of its own (compiled
    again at every call when a static argument cannot be hashed). `fn` must
    therefore be traceable as under `jax.jit`: Python control flow on the
    values of array arguments (`if x > 0:`) fails; use `jnp.where` or
    `lax.cond`. Under `jax.jit`, `jax.grad` or `jax.vmap`, the rewritten
    program runs on that transformation's trace, which differentiates or
    batches it as a whole.

    **Arguments and caching.** Array leaves of the arguments (and of an
    Equinox module passed as `fn`) are inputs; every other leaf, Python numbers
    included, is static, as with `eqx.filter_jit`. The trace of `fn` is cached
    per argument signature (the pytree structure, the static values, the
    arrays' shapes and dtypes) and the rewritten program per handler
    configuration (the handlers' static fields, and the shapes and dtypes of
    their arrays), and so is the jitted call used outside any transformation:
    at most 256 entries per function, all kinds together, the least recently
    used dropped, for as long as the function lives. So:

    - a Python float that changes between calls (a step size) is a new
      signature, traced and compiled again at every call; pass it as an array,
      `jnp.asarray(step)`;
    - a function built anew at every call, such as a lambda given to
      [`Intervene`][effects.Intervene] inside a loop, is a new configuration,
      compiled again at every call; define it once, outside the loop;
    - arrays `fn` closes over are read when it is traced, as with `jax.jit`;
      pass arrays that change as arguments;
    - only functions are cached (a `def`, a lambda, a `functools.partial`, a
      jitted function, or a method of an object hashed by value, such as a
      Flax linen module), and Equinox modules: `handle(model, ...)` called
      outside any transformation shares its compiled calls with every model
      of the same structure (pytree structure and non-array leaves) and
      handlers, as `eqx.filter_jit` does. Other callables (an object with
      `__call__`, a Flax NNX module) may hold state that changes between
      calls, so each `handle(obj, ...)` traces them again; the handled
      function it returns, kept and called again, keeps what its first trace
      read, as `jax.jit(obj)` does (an NNX module's state goes in at every
      call).

    `handle(fn, *handlers)` returns the same function for equal hashable
    handlers, so `jax.jit(fx.handle(f, fx.Tag()))` written inline in a loop
    neither traces nor compiles again. Flax NNX modules among the arguments
    (or as `fn`) go in as their state, and the state they end with is written
    back, as `nnx.jit` does.

    **Arguments:**

    - `fn`: the function to handle: any callable on pytrees, or an Equinox or
      Flax NNX module.
    - `*handlers`: instances of [`Handler`][effects.Handler] subclasses:
      [`Tag`][effects.Tag], [`Stats`][effects.Stats],
      [`Perturb`][effects.Perturb], [`Substitute`][effects.Substitute],
      [`Intervene`][effects.Intervene], or one of your own.

    **Returns:**

    A function `wrapped(*args, **kwargs) -> (out, found)`, with `fn`'s
    signature. `out` is what `fn` returns, with the values handlers changed.
    `found` is a [`Found`][effects.Found] (a dict) from the collection of each
    reporting handler (`Tag`, `Stats`, `Perturb()` without deltas) to a dict
    from name to value, names in the order the program first executed them,
    also when returned through a `jax.jit`, `jax.vmap` or `jax.grad` around
    `handle`; a reporting handler that matched nothing gives an empty dict.
    `Substitute`, `Intervene` and `Perturb(deltas)` report nothing. Each
    value's layout is its handler's mode: see [`Tag`][effects.Tag]. A handled
    function handled again returns nested pairs:
    `fx.handle(fx.handle(f, A), B)(x)` returns
    `((out, inner_found), outer_found)`.

    **Raises:**

    - `TypeError`, from `handle` itself: `fn` is not callable, or a handler is
      not a [`Handler`][effects.Handler] instance (a class, `fx.Tag`, instead
      of an instance, `fx.Tag()`).
    - `ValueError`, from the first call with new arguments or handlers (while
      tracing), naming the tag and its collection, when:
        - a name given without glob characters (`Tag(names="h")`,
          `Substitute({"h": ...})`, `Intervene`, `Perturb(deltas)`) is not the
          name of any site the handler sees; the message lists the known
          names;
        - a value from `Substitute`, `Intervene` or `Perturb(deltas)` has
          another structure, shape or dtype than the tagged value, or
          per-execution entries (`Substitute(per_call=True)`,
          `Perturb(deltas)`) are more or fewer than the executions;
        - a mode cannot be honoured: `"strict"` for a name executed more than
          once or inside a `lax.scan` or `lax.while_loop`; `"append"` or
          per-execution entries inside a `lax.while_loop` (whose number of
          iterations is unknown); a matched tag in a `while_loop`'s
          `cond_fun`; a reduction whose accumulator changes shape or dtype;
        - a tag has different shapes or dtypes in the branches of a `lax.cond`;
        - `Substitute`, `Intervene` or `Perturb(deltas)` would change a value
          inside a `custom_jvp` or `custom_vjp` function;
        - a matched tag sits inside a higher-order primitive no rule knows
          (`custom_linear_solve`, so `jax.scipy.sparse.linalg.cg`); the message
          names the primitive;
        - a handler outside a `jax.vmap` would see tags in `lax.cond` branches
          whose predicate that vmap batches: put the handler inside the vmap,
          `jax.vmap(fx.handle(f, ...))`.
    - What `jax.jit` raises for `fn`, such as `jax.errors.TracerBoolConversionError`
      (a `TypeError`) for Python control flow on the values of arrays.

    **Example:**

    ```python
    def f(x):
        h = fx.tag(jnp.sin(x), "h")
        return 2 * h

    out, found = fx.handle(f, fx.Tag())(1.0)
    print(out)
    print(found)
    ```

    ```text
    1.6829419
    {'intermediates': {'h': (Array(0.84147096, dtype=float32),)}}
    ```

    Handlers act in order, the first closest to the sites: here `Tag`
    collects what `Substitute` put in place of `h`.

    ```python
    out, found = fx.handle(f, fx.Substitute({"h": jnp.float32(0.5)}), fx.Tag())(1.0)
    print(out, found["intermediates"]["h"])
    ```

    ```text
    1.0 (Array(0.5, dtype=float32),)
    ```
    """
    if not callable(fn):
        raise TypeError(_NOT_CALLABLE.format(fn=fn))
    for h in handlers:
        if not isinstance(h, Handler):
            raise TypeError(_NOT_HANDLER.format(h=h))
    return cast(Callable[P, tuple[R, Found]], _memoized(fn, handlers))
