"""Handlers: small immutable objects that say what happens at a site. They know
nothing of control flow; the rewriter threads what they emit through it."""

from __future__ import annotations

import dataclasses
import fnmatch
import operator
import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, dataclass_transform

import equinox as eqx
import jax
import jax.numpy as jnp

from . import _compat
from ._site import Site

Names = None | str | list[str] | tuple[str, ...] | Callable[[str], bool]

#
# Name filters and modes
#


def _check_names(names, owner: str):
    if names is None or callable(names) or isinstance(names, str):
        return names
    if isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names):
        return tuple(names)
    raise TypeError(
        f"{owner}: `names` must be None, a glob string, a list of globs or a "
        f"predicate on the name, got {names!r}."
    )


_GLOB = re.compile(r"[*?\[]")


def _name_matches(names, name: str) -> bool:
    if names is None:
        return True
    if isinstance(names, str):
        return fnmatch.fnmatchcase(name, names)
    if isinstance(names, tuple):
        return any(fnmatch.fnmatchcase(name, n) for n in names)
    return bool(names(name))


@dataclasses.dataclass(frozen=True)
class Reduce:
    """A custom collection mode for `Tag`: folds every execution of a tag into an
    accumulator, carried through loops in constant memory.

    **Arguments:**

    - `fn`: `fn(acc, x) -> acc`, with `x` the tagged value.
    - `init`: `init(zeros_like_site) -> acc`, the accumulator before the first
      execution (also what is reported if the tag never executes).

    ```python
    running_max = fx.Reduce(jnp.maximum, lambda z: jnp.full_like(z, -jnp.inf))
    out, found = fx.handle(f, fx.Tag(mode=running_max))(x)
    ```
    """

    fn: Callable
    init: Callable

    # The mode protocol the rewriter reads (see `Append`).
    reduces: ClassVar[bool] = True
    single: ClassVar[bool] = False

    @property
    def label(self) -> str:
        return "the fx.Reduce's `fn(acc, x)`"

    def __repr__(self):
        return eqx.tree_pformat(self)


# A pytree with no leaves: `fn` and `init` are part of its structure.
jax.tree_util.register_dataclass(Reduce, data_fields=[], meta_fields=["fn", "init"])


@dataclasses.dataclass(frozen=True)
class _BuiltinReduce(Reduce):
    name: str = ""

    @property
    def label(self) -> str:
        return f"Tag(mode={self.name!r})"


@dataclasses.dataclass(frozen=True)
class Append:
    """The output mode of a handler that reports one entry per execution (a
    tuple, stacked over scan iterations), as `Tag(mode="append")` does; with
    `single=True`, exactly one execution, as `Tag(mode="strict")`.

    **Arguments:**

    - `single`: whether more than one execution is an error.
    - `label`: how error messages name the mode.
    """

    single: bool = False  # exactly one execution allowed
    label: str = "Tag(mode='append')"
    reduces: ClassVar[bool] = False


def _last(acc, x):
    del acc
    return x


def _zeros(z):
    return z


def _add(acc, x):
    return jax.tree.map(jnp.add, acc, x)


_MODES = {
    "append": Append(),
    "strict": Append(single=True, label="Tag(mode='strict')"),
    "last": _BuiltinReduce(_last, _zeros, "last"),
    "sum": _BuiltinReduce(_add, _zeros, "sum"),
}
_BAD_MODE = (
    "Tag: unknown mode {mode!r}; use 'append', 'last', 'strict', 'sum' or "
    "fx.Reduce(fn, init)."
)

#
# Handlers as frozen dataclasses and pytrees
#


def _static() -> Any:
    # A field that is part of a handler's tree structure rather than a leaf (the
    # convention `eqx.field(static=True)` and `jax.tree_util.register_dataclass`
    # share).
    return dataclasses.field(metadata={"static": True})


def _set_fields(handler, **fields):
    # A frozen dataclass refuses `self.x = ...`, in its `__init__` too.
    handler.__dict__.update(fields)


def _register(cls) -> None:
    # `jax.tree_util.register_dataclass` would rebuild a handler by calling its
    # class, which re-runs the constructor's validation on whatever leaves a
    # transformation put in (`None`, tracers, placeholders): unflattening here
    # sets the fields directly instead, as `eqx.Module` does.
    fields = dataclasses.fields(cls)
    data = tuple(f.name for f in fields if not f.metadata.get("static", False))
    meta = tuple(f.name for f in fields if f.metadata.get("static", False))
    _FIELD_VALUES[cls] = _getter(tuple(f.name for f in fields))
    get_data, get_meta = _getter(data), _getter(meta)
    keys = tuple(jax.tree_util.GetAttrKey(n) for n in data)

    def flatten(handler):
        return get_data(handler), get_meta(handler)

    def flatten_with_keys(handler):
        return tuple(zip(keys, get_data(handler))), get_meta(handler)

    def unflatten(aux, children):
        handler = object.__new__(cls)
        handler.__dict__.update(zip(data, children))
        handler.__dict__.update(zip(meta, aux))
        return handler

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)


def _getter(names: tuple[str, ...]) -> Callable[[Any], tuple]:
    # `operator.attrgetter`, the fastest way to read several attributes, returns
    # a bare value for a single name.
    if len(names) == 1:
        get = operator.attrgetter(names[0])
        return lambda obj: (get(obj),)
    return operator.attrgetter(*names) if names else lambda obj: ()


# Per handler class: its fields' values, as a tuple.
_FIELD_VALUES: dict[type, Callable[[Any], tuple]] = {}


def _field_values(handler) -> tuple:
    return _FIELD_VALUES[type(handler)](handler)


#
# Handlers
#


# Handlers are frozen dataclasses rather than `eqx.Module`s: users build them
# inline at every call (`fx.handle(f, fx.Tag())(x)`), and an `eqx.Module` costs
# several microseconds to construct, a frozen dataclass a fraction of one.
@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, _static))
class Handler:
    """Base class of handlers: say what happens at one execution of a site, and
    the rewriter threads it through every control-flow construct.

    A subclass is made a frozen dataclass and a pytree: its fields are leaves,
    except those declared `dataclasses.field(metadata={"static": True})`, which
    are part of its configuration (and of the key the rewritten program is
    cached under).

    **The protocol** (see [Writing a handler](../guides/writing-a-handler.md)):

    - `matches(site) -> bool`: whether to act at a site (`site.kind`,
      `site.collection`, `site.name`). Default: sites of the class attribute
      `kind` (`"tag"` or `"perturb"`) in `self.collection`.
    - `apply(call, leaves) -> (new_leaves, consumed)`: one execution. `leaves`
      are the value's arrays in program layout; `call.site.to_front(leaves)` and
      `call.site.from_front(value, what)` convert to and from the layout
      `found` uses; `call.emit(value)` reports a value (under a `Reduce` mode it
      returns the accumulator so far); `call.next_input()` takes the next
      per-execution input. A consumed site is no longer visible
      to handlers further out.
    - `output_mode()`: `fx.Append()`, `fx.Append(single=True)`,
      `fx.Reduce(fn, init)`, or None if it emits nothing. Reported under
      `found[self.collection]` when the class attribute `reports` is true.
    - `per_call_inputs()`: `{name: (entry, ...)}`, one entry per execution, in
      the layout `Tag()` reports.
    - `required_names()`: names that must exist (a typo is an error).
    - `calls_user_code()`: whether `apply` may call user code (default True).
    - The class attribute `consumes`: whether `apply` consumes every site it
      matches (`Tag` and `Perturb` do), so that handlers further out, which do
      not see those sites, cannot require their names.

    ```python
    class Scale(fx.Handler):
        factor: float = dataclasses.field(metadata={"static": True})
        collection: str = dataclasses.field(
            default="intermediates", metadata={"static": True}
        )

        def apply(self, call, leaves):
            return [x * self.factor for x in leaves], False
    ```
    """

    kind: ClassVar[str] = "tag"
    reports: ClassVar[bool] = False
    # Whether `apply` consumes every site it matches (then handlers further out
    # never see those sites, and cannot require their names).
    consumes: ClassVar[bool] = False
    collection: str
    # Whether the class or a base defines its own `__init__` (as `Tag` does, to
    # validate its arguments): it is then kept, and no dataclass one generated.
    _custom_init: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._custom_init = "__init__" in vars(cls) or cls._custom_init
        dataclasses.dataclass(
            cls, frozen=True, eq=False, repr=False, init=not cls._custom_init
        )
        _register(cls)

    # Handlers are compared and hashed by their fields' values, cheaply: `handle`
    # looks them up in its cache at every call. (Handlers holding arrays are not
    # hashable, and are not cached.)
    def __hash__(self):
        return hash((type(self), _field_values(self)))

    def __eq__(self, other):
        return type(self) is type(other) and _field_values(self) == _field_values(other)

    def __repr__(self):
        return eqx.tree_pformat(self)

    def matches(self, site: Site) -> bool:
        return site.kind == self.kind and site.collection == self.collection

    def apply(self, call, leaves) -> tuple[list[Any], bool]:
        raise NotImplementedError

    def required_names(self) -> tuple[str, ...]:
        """Names that must exist among the program's sites."""
        return ()

    def per_call_inputs(self) -> Mapping[str, tuple]:
        """Values consumed one per execution, in the layout `Tag()` reports."""
        return {}

    def output_mode(self) -> Append | Reduce | None:
        """How the values this handler emits are reported: one entry per
        execution (`Append`), folded (`Reduce`), or None if it emits none."""
        return None

    def report(self, entries: tuple) -> Any:
        """What `found` holds for a name this handler appended `entries` for
        (one per execution)."""
        return entries

    def calls_user_code(self) -> bool:
        """Whether `apply` may call user code, which then runs as it would
        where `handle` was called (user code may hold tags, or call functions
        JAX caches per trace context). True unless a handler says otherwise."""
        return True


def matches_tag(handler, site) -> bool:
    """Whether a handler with `collection` and `names` fields acts at `site`, a
    tag. (Handler.matches, and the name filter, spelt out: this runs at every
    site.)"""
    return (
        site.kind == "tag"
        and site.collection == handler.collection
        and (handler.names is None or _name_matches(handler.names, site.name))
    )


class Tag(Handler):
    """Collects tagged values.

    **Arguments:**

    - `collection`: the collection whose tags are collected.
    - `names`: which names: None for all, a glob, a list of globs or a predicate.
    - `mode`: `"append"` (a tuple with one entry per execution, stacked over
      scan iterations), `"last"`, `"strict"` (exactly one execution), `"sum"`,
      or `fx.Reduce(fn, init)`.

    **Returns:** in `found[collection]`, a dict from name to value.

    ```python
    out, found = fx.handle(f, fx.Tag(names="layer*", mode="sum"))(x)
    ```
    """

    reports: ClassVar[bool] = True
    consumes: ClassVar[bool] = True
    collection: str = _static()
    names: Any = _static()
    mode: Any = _static()

    def __init__(
        self,
        collection: str = "intermediates",
        *,
        names: Names = None,
        mode: str | Reduce = "append",
    ):
        if not isinstance(collection, str):
            raise TypeError(f"Tag: collection must be a string, got {collection!r}.")
        if not (isinstance(mode, Reduce) or mode in _MODES):
            raise ValueError(_BAD_MODE.format(mode=mode))
        _set_fields(
            self, collection=collection, names=_check_names(names, "Tag"), mode=mode
        )

    def matches(self, site):
        return matches_tag(self, site)

    def output_mode(self):
        return _MODES[self.mode] if isinstance(self.mode, str) else self.mode

    def required_names(self):
        # A name without glob characters is meant to exist: a typo is an error.
        # (A glob or a predicate may match nothing.)
        names = (self.names,) if isinstance(self.names, str) else self.names
        if not isinstance(names, tuple):
            return ()
        return tuple(n for n in names if not _GLOB.search(n))

    def apply(self, call, leaves):
        call.emit(call.site.to_front(leaves))
        return leaves, True

    def report(self, entries):
        return entries[0] if self.output_mode().single else entries

    def calls_user_code(self):
        return isinstance(self.mode, Reduce)


class Perturb(Handler):
    """Handles `perturb` sites. With no `deltas`, reports zeros shaped like each
    site (in `Tag()`'s append layout) and leaves values unchanged; with `deltas`,
    adds `deltas[name]` at each execution, so that `jax.grad` with respect to the
    deltas is the gradient with respect to the intermediate values.

    **Arguments:**

    - `deltas`: None, or a dict from name to a tuple with one delta per execution
      (stacked over scan iterations), as `Perturb()` reports. Names absent from
      `deltas` are left alone.
    - `collection`: the collection of the sites; by default `"perturbations"`
      (`"intermediates"` with `kind="tag"`).
    - `names`: which names (None, glob, list of globs, predicate).
    - `kind`: `"perturb"`, or `"tag"` to add the deltas at tags instead: the
      gradient with respect to a tagged value, e.g. every layer tagged by
      `fx.tag_modules`.

    ```python
    _, found = fx.handle(loss, fx.Perturb())(x)
    grads = jax.grad(lambda d: fx.handle(loss, fx.Perturb(d))(x)[0])(
        found["perturbations"])
    ```
    """

    kind: str = _static()  # type: ignore[misc]
    consumes: ClassVar[bool] = True
    collection: str = _static()
    deltas: Any
    names: Any = _static()

    def __init__(
        self,
        deltas: Mapping[str, Any] | None = None,
        *,
        collection: str | None = None,
        names: Names = None,
        kind: str = "perturb",
    ):
        if deltas is not None and not isinstance(deltas, Mapping):
            raise TypeError(
                f"Perturb: deltas must be a dict from name to a tuple of deltas, got "
                f"{type(deltas).__name__}."
            )
        if kind not in ("perturb", "tag"):
            raise ValueError(f"Perturb: kind must be 'perturb' or 'tag', got {kind!r}.")
        if collection is None:
            collection = "perturbations" if kind == "perturb" else "intermediates"
        _set_fields(
            self,
            kind=kind,
            collection=collection,
            deltas=None if deltas is None else _per_call_dict(deltas, "Perturb"),
            names=_check_names(names, "Perturb"),
        )

    @property
    def reports(self):  # type: ignore[override]
        return self.deltas is None

    def matches(self, site):
        if not (super().matches(site) and _name_matches(self.names, site.name)):
            return False
        return self.deltas is None or site.name in self.deltas

    def required_names(self):
        return () if self.deltas is None else tuple(self.deltas)

    def per_call_inputs(self):
        return {} if self.deltas is None else self.deltas

    def output_mode(self):
        return None if self.deltas is not None else _MODES["append"]

    def apply(self, call, leaves):
        if self.deltas is None:
            call.emit(jax.tree.map(jnp.zeros_like, call.site.to_front(leaves)))
            return leaves, True
        delta = call.site.from_front(call.next_input(), "Perturb delta")
        return [x + d for x, d in zip(leaves, delta)], True

    def calls_user_code(self):
        return False


class Substitute(Handler):
    """Replaces tagged values (activation patching).

    **Arguments:**

    - `values`: a dict from name to the new value. By default a value has the
      tagged value's structure and replaces every execution of the name (every
      loop iteration). With `per_call=True` it is a tuple with one entry per
      execution, stacked over scan iterations: exactly what `Tag()` reports.
    - `collection`: the collection of the tags.
    - `per_call`: see above.

    The new value is passed on as the same tag, so a `Tag` further out collects
    what was substituted. No gradient flows through a substituted value.

    ```python
    out, _ = fx.handle(f, fx.Substitute({"h": jnp.zeros(3)}))(x)
    ```
    """

    collection: str = _static()
    values: Any
    per_call: bool = _static()

    def __init__(
        self,
        values: Mapping[str, Any],
        *,
        collection: str = "intermediates",
        per_call: bool = False,
    ):
        if not isinstance(values, Mapping):
            raise TypeError(
                f"Substitute: values must be a dict from name to value, got "
                f"{type(values).__name__}."
            )
        per_call = bool(per_call)
        if per_call:
            values = _per_call_dict(values, "Substitute(per_call=True)")
        else:
            values = {k: _as_arrays(v, "Substitute", k) for k, v in values.items()}
        _set_fields(self, collection=collection, values=values, per_call=per_call)

    def matches(self, site):
        return super().matches(site) and site.name in self.values

    def required_names(self):
        return tuple(self.values)

    def per_call_inputs(self):
        return self.values if self.per_call else {}

    def apply(self, call, leaves):
        value = call.next_input() if self.per_call else self.values[call.site.name]
        return call.site.from_front(value, "Substitute value"), False

    def calls_user_code(self):
        return False


class Intervene(Handler):
    """Applies `fns[name](value) -> value` at every execution of a tag.

    **Arguments:**

    - `fns`: a dict from name to a function of the tagged value (in the layout
      `Tag()` reports, per loop iteration) returning a value of the same shape and
      dtype.
    - `collection`: the collection of the tags.

    ```python
    out, _ = fx.handle(f, fx.Intervene({"h": lambda h: h.at[0].set(0.0)}))(x)
    ```
    """

    collection: str = _static()
    fns: Any = _static()

    def __init__(
        self, fns: Mapping[str, Callable], *, collection: str = "intermediates"
    ):
        if not isinstance(fns, Mapping) or not all(callable(f) for f in fns.values()):
            raise TypeError("Intervene: fns must be a dict from name to a function.")
        _set_fields(self, collection=collection, fns=_FrozenDict(fns))

    def matches(self, site):
        return super().matches(site) and site.name in self.fns

    def required_names(self):
        return tuple(self.fns)

    def apply(self, call, leaves):
        new = self.fns[call.site.name](call.site.to_front(leaves))
        return call.site.from_front(new, "The Intervene function's result"), False


#
# Helpers
#


class _FrozenDict(dict):
    # A hashable dict so handlers holding functions stay hashable (for caching).
    def __hash__(self):  # type: ignore[override]
        return hash(tuple(self.items()))


def _as_arrays(value, owner: str, name: str):
    def convert(x):
        if isinstance(x, (jax.Array, _compat.Tracer)) or eqx.is_array_like(x):
            return jnp.asarray(x)
        raise TypeError(
            f"{owner}: the value for {name!r} must be a pytree of arrays, found "
            f"{x!r} of type {type(x).__name__}."
        )

    return jax.tree.map(convert, value)


def _per_call_dict(values, owner: str):
    out = {}
    for name, entries in values.items():
        if not isinstance(entries, (tuple, list)):
            raise TypeError(
                f"{owner}: the value for {name!r} must be a tuple with one entry per "
                f"execution of the tag (the layout `Tag()` reports), got "
                f"{type(entries).__name__}."
            )
        out[name] = tuple(_as_arrays(e, owner, name) for e in entries)
    return out
