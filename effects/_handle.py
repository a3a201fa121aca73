"""`handle`: runs a function with its sites handled, in one pass on a trace
that builds a jaxpr (`_direct.py`), else by tracing it (sites carrying their
effect) and evaluating its rewritten jaxpr on the caller's trace; and caches
what can be cached."""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from . import _compat, _direct
from ._handlers import Handler, Perturb
from ._primitives import handling
from ._rewrite import run, sites_in
from ._scope import Scope
from ._site import aval

_NOT_CALLABLE = "handle: the first argument must be a callable, got {fn!r}."
_NOT_HANDLER = (
    "handle: {h!r} is not a handler; pass instances such as fx.Tag(), fx.Perturb(), "
    "fx.Substitute(...) or fx.Intervene(...)."
)
_UNKNOWN_NAME = (
    "{handler}: no {kind} named {name!r} in collection {collection!r}. Known names: "
    "{known}."
)
_LEFTOVER = (
    "{handler} got more entries for {where} than it has executions ({n} left "
    "over). Give one entry per execution, in the layout Tag() reports."
)

#
# Tracing, cached per function and argument signature
#


class _Traced:
    """A traced function: its jaxpr (constants as leading inputs), the constants,
    and how to rebuild the outputs."""

    def __init__(self, jaxpr, consts, out_tree, out_static, sites):
        self.jaxpr = jaxpr
        self.consts = consts
        self.out_tree = out_tree
        self.out_static = out_static  # non-array outputs, by position
        self.sites = sites


_trace_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _call_module(module, *args, **kwargs):
    return module(*args, **kwargs)


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


def _signature(static, treedef, dynamic):
    avals = [aval(x) for x in dynamic]
    key = (
        treedef,
        static,
        tuple((a.shape, a.dtype, getattr(a, "weak_type", False)) for a in avals),
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _trace(fn, static, treedef, dynamic, keep_jit: bool) -> _Traced:
    out_info = {}

    def flat_fn(*dyn):
        args, kwargs = _merge(dyn, static, treedef)
        out = fn(*args, **kwargs)
        out_dyn, out_static, out_tree = _split(out)
        out_info.update(tree=out_tree, static=out_static)
        return out_dyn

    avals = [jax.typeof(x) for x in dynamic]
    with handling(True):
        jaxpr, consts = _compat.trace(flat_fn, avals, keep_jit=keep_jit)
    return _Traced(jaxpr, consts, out_info["tree"], out_info["static"], sites_in(jaxpr))


def _traced(fn, static, treedef, dynamic, key, *, staged: bool) -> _Traced:
    """`staged`: whether the traced function will be evaluated straight into a
    jaxpr being built (under `jax.jit`, or eagerly through our own jit). If not
    (under `grad`, `vmap`, ...), calls of `jit(inline=True)` functions (most of
    `jax.numpy`) are kept as calls, so that evaluating the trace transforms each
    with JAX's cached transformation of it, as the untransformed function would;
    if so, they are inlined, which is cheaper to copy."""
    if key is not None:
        key = (key, staged)
    try:
        per_fn = _trace_cache.setdefault(fn, {}) if key is not None else None
    except TypeError:  # not weak-referenceable or not hashable
        per_fn = None
    if per_fn is not None and key in per_fn:
        return per_fn[key]
    traced = _trace(fn, static, treedef, dynamic, keep_jit=not staged)
    if per_fn is not None and not any(
        isinstance(c, _compat.Tracer) for c in traced.consts
    ):
        per_fn[key] = traced
    return traced


#
# Evaluation
#


def _check_names(sites, handlers) -> None:
    for h in handlers:
        names = h.required_names()
        if not names:
            continue
        known = sorted(n for k, c, n in sites if k == h.kind and c == h.collection)
        for name in names:
            if name not in known:
                raise ValueError(
                    _UNKNOWN_NAME.format(
                        handler=type(h).__name__,
                        kind="tag" if h.kind == "tag" else "perturb site",
                        name=name,
                        collection=h.collection,
                        known=", ".join(map(repr, known)) or "none",
                    )
                )


def _scope(handlers) -> Scope:
    inputs = {
        (i, name): list(entries)
        for i, h in enumerate(handlers)
        for name, entries in h.per_call_inputs().items()
    }
    return Scope(handlers, inputs=inputs)


def _report(scope: Scope, handlers) -> dict[str, dict[str, Any]]:
    """What the handlers found, once the whole function has run."""
    for key, left in scope.inputs.items():
        if left:
            name = key[1]
            where = scope.sites[key].where() if key in scope.sites else repr(name)
            raise ValueError(
                _LEFTOVER.format(
                    handler=type(handlers[key[0]]).__name__, where=where, n=len(left)
                )
            )
    found: dict[str, dict[str, Any]] = {}
    for i, h in enumerate(handlers):
        if not h.reports:
            continue
        mine = found.setdefault(h.collection, {})
        strict = h.output_mode() == "strict"
        for (j, name), entries in scope.entries.items():
            if j == i:
                values = [v for v, _ in entries]
                mine[name] = values[0] if strict else tuple(values)
        for (j, name), acc in scope.accs.items():
            if j == i:
                mine[name] = acc
    return found


def _evaluate(traced: _Traced, handlers, consts, dynamic):
    """Two passes: evaluates the traced function's jaxpr, rewritten."""
    _check_names(traced.sites, handlers)
    scope = _scope(handlers)
    outs = run(traced.jaxpr, (), [*consts, *dynamic], scope)
    return outs, _report(scope, handlers)


def _call_direct(fn, handlers, args, kwargs):
    """One pass (see `_direct.py`), on a trace that builds a jaxpr; two when the
    function stages a region the one pass cannot rewrite."""
    scope = _scope(handlers)
    try:
        out, seen = _direct.call(fn, args, kwargs, scope)
    except _direct.Fallback as e:
        if e.frame.scope is not scope:
            raise
        dynamic, static, treedef = _split((args, kwargs))
        traced = _traced(fn, static, treedef, dynamic, None, staged=True)
        outs, found = _evaluate(traced, handlers, traced.consts, dynamic)
        return _merge(outs, traced.out_static, traced.out_tree), found
    _check_names(seen, handlers)
    return out, _report(scope, handlers)


class _Handled:
    """The function `handle` returns."""

    def __init__(self, fn, handlers):
        self.fn = fn
        self.handlers = handlers
        self._module = isinstance(fn, eqx.Module)
        h_dyn, self._h_static = eqx.partition(handlers, eqx.is_array)
        # The handlers' arrays go into the jitted evaluation as a flat list: jit
        # flattens its arguments at every call, and flattening an `eqx.Module`
        # runs Python.
        self._h_leaves, self._h_def = jax.tree.flatten(h_dyn)
        # Per argument signature: the traced function and its jitted evaluation.
        self._eager: dict[Any, _Eager] = {}
        # `updated=()`: copying `fn.__dict__` would copy a nested wrapper's state.
        functools.update_wrapper(
            self,
            fn if not isinstance(fn, eqx.Module) else type(fn).__call__,
            updated=(),
        )

    def with_arrays(self, handlers, leaves) -> _Handled:
        """A copy for `handlers`, which differ from this wrapper's only in the
        values of their arrays (`leaves`): it shares this wrapper's caches."""
        new = object.__new__(_Handled)
        new.__dict__.update(self.__dict__)
        new.handlers, new._h_leaves = handlers, leaves
        return new

    def __call__(self, *args, **kwargs):
        fn = self.fn
        if self._module:  # its arrays are inputs, not constants
            fn, args = _call_module, (self.fn, *args)
        if _compat.staging_trace() is not None:
            return _call_direct(fn, self.handlers, args, kwargs)
        dynamic, static, treedef = _split((args, kwargs))
        key = _signature(static, treedef, dynamic)
        if key is not None and _compat.is_top_level():
            # Outside any transformation: evaluate through a cached jit, so
            # repeated eager calls neither re-trace nor dispatch op by op.
            hit = self._eager.get(key)
            if hit is None:
                hit = self._eager[key] = _Eager(
                    fn, self._h_static, self._h_def, static, treedef
                )
            return hit(self._h_leaves, dynamic)
        traced = _traced(fn, static, treedef, dynamic, key, staged=False)
        outs, found = _evaluate(traced, self.handlers, traced.consts, dynamic)
        return _merge(outs, traced.out_static, traced.out_tree), found


class _Eager:
    """The jitted evaluation of a handled function for one argument signature,
    taking the handlers' arrays as a flat list."""

    def __init__(self, fn, h_static, h_def, static, treedef):
        self.fn, self.h_static, self.h_def = fn, h_static, h_def
        self.static, self.treedef = static, treedef
        self.out = None  # (out_static, out_tree, all arrays), once traced
        self.compiled = jax.jit(self._evaluate)

    def _evaluate(self, h_leaves, dynamic):
        handlers = eqx.combine(jax.tree.unflatten(self.h_def, h_leaves), self.h_static)
        args, kwargs = _merge(dynamic, self.static, self.treedef)
        out, found = _call_direct(self.fn, handlers, args, kwargs)
        out_dyn, out_static, out_tree = _split(out)
        arrays = all(s is None for s in out_static)
        self.out = (out_static, out_tree, arrays)
        # jit can return the output as it is when it is all arrays: one less step
        return (out if arrays else out_dyn), found

    def __call__(self, h_leaves, dynamic):
        outs, found = self.compiled(h_leaves, dynamic)
        out_static, out_tree, arrays = self.out  # pyright: ignore[reportGeneralTypeIssues]
        if arrays:
            return outs, found
        return _merge(outs, out_static, out_tree), found


class _Memo:
    """The wrappers made for one function, kept in the function's own `__dict__`:
    they live exactly as long as the function (a cycle the garbage collector
    frees), so `jax.jit(fx.handle(f, fx.Tag()))` written inline reuses one
    wrapper and its caches, and nothing keeps a closure over tracers alive."""

    size = 32  # least recently used wrappers beyond this are dropped

    def __init__(self, owner):
        self.owner = id(owner)
        # A plain dict, in order of use: `OrderedDict.pop` compares keys thrice.
        self.wrappers: dict[_HandlersKey, _Handled] = {}

    def get(self, fn, key: _HandlersKey, handlers) -> _Handled:
        wrapper = self.wrappers.pop(key, None)
        if wrapper is None:
            wrapper = _Handled(fn, handlers)
        self.wrappers[key] = wrapper
        while len(self.wrappers) > self.size:
            del self.wrappers[next(iter(self.wrappers))]
        return wrapper

    def get_with_arrays(self, fn, handlers) -> _Handled:
        """A wrapper for handlers holding arrays (`Perturb(deltas)`,
        `Substitute(values)`): a new one each call, since the arrays differ, but
        sharing the eager caches of every wrapper whose handlers differ only in
        their arrays' values, which its jitted evaluation takes as arguments."""
        leaves, treedef = jax.tree.flatten(handlers)
        is_array = [eqx.is_array(x) for x in leaves]
        arrays = [x for x, a in zip(leaves, is_array) if a]
        try:
            static = tuple(_ARRAY if a else x for x, a in zip(leaves, is_array))
            key = _HandlersKey((treedef, static))
        except TypeError:  # an unhashable leaf that is not an array
            return _Handled(fn, handlers)
        return self.get(fn, key, handlers).with_arrays(handlers, arrays)


class _HandlersKey:
    """Handlers as a memo key, hashed once: a handler's hash reads its fields."""

    __slots__ = ("handlers", "hash")

    def __init__(self, handlers):
        self.handlers = handlers
        self.hash = hash(handlers)

    def __hash__(self):
        return self.hash

    def __eq__(self, other):
        return isinstance(other, _HandlersKey) and self.handlers == other.handlers


_MEMO = "_effects_handled"
_ARRAY = object()  # an array's place in a memo key of handlers holding arrays


# Callables whose `__dict__` holds nothing but attributes set on them, so the
# memo may live there: functions, partials and jitted functions. Any other
# object (a Flax NNX or linen module, a class with `__call__`) may treat its
# `__dict__` as its state, and gets a new wrapper per call.
_MEMOIZABLE = (types.FunctionType, functools.partial, type(jax.jit(lambda: None)))


# Memos of bound methods (`model.apply`: a new object at every attribute access),
# keyed on the method's function and its object, least recently used last.
_method_memos: dict[tuple[Any, Any], _Memo] = {}
_METHOD_MEMOS = 64


def _method_memo(method) -> _Memo | None:
    """The memo for a method bound to an object that is hashed by value (a Flax
    linen module, a frozen dataclass): equal objects are the same object to it,
    as they are to `jax.jit`'s static arguments. An object hashed by identity
    may change between calls (its attributes are read when traced), so it gets
    none, and neither does an unhashable one."""
    owner = method.__self__
    if type(owner).__hash__ is object.__hash__:
        return None
    key = (method.__func__, owner)
    try:
        memo = _method_memos.pop(key, None)
    except TypeError:  # unhashable after all (a field holding an array, say)
        return None
    if memo is None:
        memo = _Memo(method)
    _method_memos[key] = memo
    if len(_method_memos) > _METHOD_MEMOS:
        del _method_memos[next(iter(_method_memos))]
    return memo


def _memoized(fn, handlers) -> _Handled:
    if not _compat.is_top_level():
        # Inside a transformation, handlers may close over its tracers, which a
        # memo would keep alive; and a traced function is traced once anyway.
        return _Handled(fn, handlers)
    if isinstance(fn, types.MethodType):
        memo = _method_memo(fn)
        if memo is None:
            return _Handled(fn, handlers)
    elif isinstance(fn, _MEMOIZABLE):
        namespace = vars(fn)
        memo = namespace.get(_MEMO)
        # `functools.wraps` copies `__dict__` entries, so a wrapper of `fn` (say
        # `jax.vmap(fn)`) can hold `fn`'s memo: it needs its own.
        if not isinstance(memo, _Memo) or memo.owner != id(fn):
            memo = namespace[_MEMO] = _Memo(fn)
    else:
        return _Handled(fn, handlers)
    try:
        key = _HandlersKey(handlers)
    except TypeError:  # handlers holding arrays are unhashable
        return memo.get_with_arrays(fn, handlers)
    return memo.get(fn, key, handlers)


def handle(fn: Callable, *handlers: Handler) -> Callable:
    """Returns `fn` with its tags handled: `wrapped(*args, **kwargs) -> (out, found)`.

    `fn`'s jaxpr is rewritten by the handlers (through jit, scan, cond,
    while_loop, checkpoint, custom_jvp/vjp, shard_map): under `jax.jit`, in one
    pass as `fn` is traced; the result composes with `jax.jit`, `jax.vmap` and
    `jax.grad` in any order. Handlers act in order: the
    first is closest to the sites, as in `handle(handle(fn, A), B)`. A collecting
    handler consumes the sites it collects; the others stay visible further out.

    **Arguments:**

    - `fn`: any callable on pytrees (arrays are inputs; other leaves are static,
      as with `eqx.filter_jit`). An Equinox module's arrays are inputs too.
    - `*handlers`: `fx.Tag`, `fx.Perturb`, `fx.Substitute`, `fx.Intervene`.

    **Returns:**

    A function returning `(out, found)`, with `found` a dict from each reporting
    handler's collection to a dict from name to value.

    ```python
    out, found = fx.handle(f, fx.Tag())(x)
    ```
    """
    if not callable(fn):
        raise TypeError(_NOT_CALLABLE.format(fn=fn))
    for h in handlers:
        if not isinstance(h, Handler):
            raise TypeError(_NOT_HANDLER.format(h=h))
    return _memoized(fn, handlers)


def intermediate_grads(fn: Callable, *, collection: str = "perturbations") -> Callable:
    """Gradients of a scalar function with respect to its `perturb` sites.

    **Arguments:**

    - `fn`: a function returning a scalar, with `fx.perturb` sites.
    - `collection`: the collection of the sites.

    **Returns:**

    `g(*args, **kwargs) -> (fn(*args, **kwargs), grads)`, with `grads` a dict
    from site name to a tuple with one gradient per execution (stacked over scan
    iterations), the layout `Perturb()` reports.

    ```python
    loss, grads = fx.intermediate_grads(loss_fn)(params, x)
    ```
    """

    def g(*args, **kwargs):
        _, shapes = eqx.filter_eval_shape(
            handle(fn, Perturb(collection=collection)), *args, **kwargs
        )
        zeros = jax.tree.map(
            lambda s: jax.numpy.zeros(s.shape, s.dtype), shapes[collection]
        )

        def loss(deltas):
            out, _ = handle(fn, Perturb(deltas, collection=collection))(*args, **kwargs)
            return out

        return jax.value_and_grad(loss)(zeros)

    functools.update_wrapper(g, fn)
    return g
