"""`tag_modules`: the output of every selected submodule call tagged, named by
the submodule's path in the model, without editing the model's code and
without patching any class.

- Flax linen: the model's own `apply` and `init`, run inside
  `flax.linen.intercept_methods` (Flax's thread-local hook for exactly this),
  which tags the outputs of the selected modules' methods. Names are scope paths
  joined by "/", as `capture_intermediates` gives them.
- Equinox and Flax NNX: a copy of the model in which each selected submodule is
  an instance of a subclass of its own class (so `isinstance` and attribute
  access behave as before) whose methods tag their outputs. The subclass is
  made once per class and set of methods; the submodule's name and collection
  are a static field of the copy. Names are attribute paths joined by ".",
  sequence indices as numbers (`"layers.0"`), from JAX's key paths (Equinox) or
  NNX's graph attributes. An NNX copy shares the model's Variables, so updates
  made through either reach both; a Variable a call adds (`sow`) is the
  copy's, as attributes set on its module objects are.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax

from ._primitives import tag

_SITE = "_effects_site"  # (name, collection) on a tagged copy of a submodule

_BAD_MODEL = (
    "tag_modules: expected an Equinox module, a Flax linen module or a Flax NNX "
    "module, got {model!r}."
)
_BAD_FILTER = (
    "tag_modules: `filter` must be None, a module type, a tuple of types, or a "
    "function `filter(path, module) -> bool`; got {filter!r}."
)
_BAD_METHODS = (
    "tag_modules: `methods` must be a sequence of method names, got {methods!r}."
)


def tag_modules(
    model,
    *,
    filter: type | tuple[type, ...] | Callable[[str, Any], bool] | None = None,
    methods: Sequence[str] = ("__call__",),
    collection: str = "intermediates",
):
    """Returns `model` with the output of every selected submodule call
    tagged, named by the submodule's path: every layer's output, without
    editing the model's code.

    Nothing in `model` changes and no class is patched. For Equinox and Flax
    NNX, the result is a copy in which each selected submodule is an instance
    of a subclass of its own class (so `isinstance` and attribute access behave
    as before) whose methods tag their outputs. For Flax linen, the result's
    `apply` and `init` run `model`'s inside `flax.linen.intercept_methods`.
    Collect with [`fx.Tag`][effects.Tag] or [`fx.Stats`][effects.Stats], look
    with [`fx.sites`][effects.sites], check with
    [`fx.find_nonfinite`][effects.find_nonfinite], patch with
    [`fx.Substitute`][effects.Substitute], differentiate with
    [`fx.intermediate_grads(..., kind="tag")`][effects.intermediate_grads].
    Only the array leaves of an output are tagged, not those of a module in
    it (`eqx.nn.Shared` returns its tied modules); an output without them is
    left alone.

    Only submodules are tagged: a function applied between them is not.
    `eqx.nn.MLP` holds its activation as a function in a field (`activation`),
    so its `"layers.0"` is the first `Linear`'s output, before the activation.
    To collect the activations, put a tagging function in that field:
    `eqx.tree_at(lambda m: m.activation, model, lambda x:
    fx.tag(jax.nn.relu(x), "activation"))` reports one `"activation"` entry per
    hidden layer ([Capture every
    layer](../guides/capture-every-layer.md#activations-applied-as-functions)).

    **Arguments:**

    - `model`: an Equinox module, a Flax linen module or a Flax NNX module.
    - `filter`: which submodules: None for every one (the model itself
      excluded), a module type or tuple of types, or `filter(path, module) ->
      bool` with `path` the submodule's name.
    - `methods`: the methods whose outputs are tagged. `__call__`'s output is
      named by the submodule's path; another method's by the path, a dot and
      the method's name (`"attn.project"`).
    - `collection`: the tags' collection.

    **Returns:**

    For Equinox and NNX, a module of the same system that runs like `model`
    (`eqx.filter_jit`, `nnx.jit`, `nnx.split` work on it); an NNX one shares
    `model`'s Variables, so updates through either reach both. For linen, an
    object with `apply` and `init` taking what `model`'s take (pass
    `tagged.apply` to [`handle`][effects.handle]). Names: Equinox and NNX,
    attribute paths joined by "." with sequence indices as numbers
    (`"layers.0"`); linen, scope paths joined by "/" (`"Encoder_0/Dense_1"`),
    as `capture_intermediates` names them. A submodule called several times
    reports one entry per call; one called in a scan reports its entries
    stacked, as a tag there would.

    **Raises:**

    - `TypeError`: `model` is none of the three kinds; `filter` is none of the
      above; `methods` is a string or holds something other than strings.

    **Example:**

    ```python
    import equinox as eqx

    model = eqx.nn.MLP(2, 2, width_size=8, depth=2, key=jax.random.key(0))
    tagged = fx.tag_modules(model, filter=eqx.nn.Linear)
    out, found = fx.handle(tagged, fx.Tag())(jnp.ones(2))
    print(jax.tree.map(jnp.shape, found))
    ```

    ```text
    {'intermediates': {'layers.0': ((8,),), 'layers.1': ((8,),), 'layers.2': ((2,),)}}
    ```
    """
    select = _selector(filter)
    if isinstance(methods, str) or not all(isinstance(m, str) for m in methods):
        raise TypeError(_BAD_METHODS.format(methods=methods))
    methods = tuple(methods)

    # `(name, collection)` for a submodule (not the model, named "") that
    # defines one of `methods` and is selected, else None.
    def site(name: str, module) -> tuple[str, str] | None:
        if name and _defines(type(module), methods) and select(name, module):
            return name, collection
        return None

    if isinstance(model, eqx.Module):
        return _equinox(model, site, methods)
    linen = sys.modules.get("flax.linen")
    if linen is not None and isinstance(model, linen.Module):
        return TaggedLinen(model, filter, methods, collection)
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(model, nnx.Module):
        return _nnx(nnx, model, site, methods)
    raise TypeError(_BAD_MODEL.format(model=model))


def _selector(filter) -> Callable[[str, Any], bool]:
    if filter is None:
        return lambda path, module: True
    if isinstance(filter, type) or (
        isinstance(filter, tuple) and all(isinstance(t, type) for t in filter)
    ):
        return lambda path, module: isinstance(module, filter)
    if callable(filter):
        return lambda path, module: bool(filter(path, module))
    raise TypeError(_BAD_FILTER.format(filter=filter))


def _tagged_call(path: str, method: str, collection: str, fn, /, *args, **kwargs):
    """`fn(*args, **kwargs)`, a call of the submodule at `path`, with the arrays
    of its output tagged: not those of a module in it, parameters rather than a
    computed value (`eqx.nn.Shared` gives its tied modules back)."""
    # Under the module's path as JAX's name scope: the operations inside
    # carry it (taps are named by it; profilers show it).
    with jax.named_scope(path):
        out = fn(*args, **kwargs)
    arrays, rest = eqx.partition(out, eqx.is_array, is_leaf=_is_module)
    if not jax.tree.leaves(arrays):
        return out
    name = path if method == "__call__" else f"{path}.{method}"
    return eqx.combine(tag(arrays, name, collection=collection), rest)


def _is_module(x) -> bool:
    return isinstance(x, eqx.Module)


def _defines(cls: type, methods) -> bool:
    """Whether `cls` defines one of `methods` (a class's own `__call__`, not
    that of its metaclass)."""
    own = [vars(c) for c in cls.__mro__ if c is not object]
    return any(callable(d.get(m)) for m in methods for d in own)


#
# Equinox and NNX: subclasses whose methods tag
#

# Per class and methods: its tagging subclass. Both Equinox and NNX register
# every class with JAX's pytree registry, which keeps it for the life of the
# process; making the subclass once bounds what that registry holds.
_subclasses: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_subclasses_lock = threading.Lock()


def _tagging_method(cls: type, method: str):
    original = getattr(cls, method)

    @functools.wraps(original)
    def tagged(self, *args, **kwargs):
        site = getattr(self, _SITE, None)
        if site is None:
            return original(self, *args, **kwargs)
        name, collection = site
        return _tagged_call(name, method, collection, original, self, *args, **kwargs)

    return tagged


def _subclass(cls: type, methods: tuple[str, ...]) -> type:
    with _subclasses_lock:
        per_class = _subclasses.setdefault(cls, {})
        sub = per_class.get(methods)
        if sub is None:
            # Printed as the class it copies (`__name__`), but named as a copy
            # where JAX names a type (`__qualname__`): gradients with respect to
            # a tagged copy have its classes, and a tree mismatch against the
            # plain model then says which side is the copy.
            namespace: dict[str, Any] = {
                "__module__": cls.__module__,
                "__qualname__": f"tag_modules({cls.__qualname__})",
                "__doc__": cls.__doc__,
                **{m: _tagging_method(cls, m) for m in methods if _defines(cls, (m,))},
            }
            if issubclass(cls, eqx.Module):
                namespace["__annotations__"] = {_SITE: Any}
                namespace[_SITE] = eqx.field(static=True, default=None)
            sub = per_class[methods] = type(cls.__name__, (cls,), namespace)
        return sub


def _equinox(model, site, methods):
    def rebuild(node, path: tuple):
        node = jax.tree_util.tree_map_with_path(
            lambda key, x: rebuild(x, path + key) if _is_module(x) else x,
            node,
            is_leaf=lambda x: x is not node and _is_module(x),
        )
        where = site(jax.tree_util.keystr(path, simple=True, separator="."), node)
        if where is None:
            return node
        new = object.__new__(_subclass(type(node), methods))
        for f in dataclasses.fields(node):
            object.__setattr__(new, f.name, getattr(node, f.name))
        object.__setattr__(new, _SITE, where)
        return new

    return rebuild(model, ())


def _nnx(nnx, model, site, methods):
    copies: dict[int, Any] = {}  # a submodule shared in the model stays shared

    def value(x, path: tuple):
        if isinstance(x, nnx.Variable):
            return x  # shared with the model
        if isinstance(x, nnx.Pytree):
            return node(x, path)
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return type(x)(value(v, (*path, str(i))) for i, v in enumerate(x))
        if type(x) is dict:
            return {k: value(v, (*path, str(k))) for k, v in x.items()}
        return x

    def node(x, path: tuple):
        if id(x) in copies:
            return copies[id(x)]
        where = site(".".join(path), x) if isinstance(x, nnx.Module) else None
        cls = type(x) if where is None else _subclass(type(x), methods)
        new = copies[id(x)] = object.__new__(cls)
        for k, v in vars(x).items():
            # `nnx.List` and `nnx.Dict` keep their items as attributes named by
            # index or key, so the path names an item as NNX's own paths do.
            internal = str(k).startswith("_pytree__")  # NNX's own bookkeeping
            vars(new)[k] = v if internal else value(v, (*path, str(k)))
        if where is not None:
            setattr(new, _SITE, where)
        return new

    return node(model, ())


#
# Flax linen: Flax's method interceptor
#


@dataclasses.dataclass(frozen=True)
class TaggedLinen:
    """A linen model whose `apply` and `init` tag the outputs of the selected
    submodules' methods (see `tag_modules`). Equal to another made from equal
    arguments, as linen modules are, so `handle(tagged.apply, ...)` and
    `jax.jit` cache their traces."""

    model: Any
    filter: Any
    methods: tuple[str, ...]
    collection: str

    @functools.cached_property
    def _select(self):
        return _selector(self.filter)

    def _intercept(self, next_fun, args, kwargs, context):
        module, method = context.module, context.method_name
        path = "" if module.scope is None else "/".join(module.scope.path)
        if method not in self.methods or not path or not self._select(path, module):
            return next_fun(*args, **kwargs)
        return _tagged_call(path, method, self.collection, next_fun, *args, **kwargs)

    def apply(self, variables, *args, **kwargs):
        import flax.linen as nn

        with nn.intercept_methods(self._intercept):
            return self.model.apply(variables, *args, **kwargs)

    def init(self, rngs, *args, **kwargs):
        import flax.linen as nn

        with nn.intercept_methods(self._intercept):
            return self.model.init(rngs, *args, **kwargs)
