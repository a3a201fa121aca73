"""Handlers: small immutable objects that say what happens at a site. They know
nothing of control flow; the rewriter threads what they emit through it."""

from __future__ import annotations

import dataclasses
import fnmatch
import operator
import re
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeAlias, dataclass_transform

import equinox as eqx
import jax
import jax.numpy as jnp

from . import _compat
from ._site import Site

Names: TypeAlias = None | str | list[str] | tuple[str, ...] | Callable[[str], bool]
"""Which names a handler acts on: the type of the `names=` argument of
[`Tag`][effects.Tag], [`Perturb`][effects.Perturb] and [`Stats`][effects.Stats].

- `None`: every name in the handler's collection.
- A string: a glob, matched against the whole name with `fnmatch`'s rules,
  case-sensitively: `*` matches any characters (dots and slashes included),
  `?` one character, `[ab]` one of a set (`"layers.*"`, `"block?"`).
- A list or tuple of such strings: the names any of them matches.
- A predicate `fn(name) -> bool`.

A string without glob characters (`*`, `?`, `[`), alone or in a list, names a
site that must exist: a typo is a `ValueError` from [`handle`][effects.handle]
listing the known names. A glob or a predicate may match nothing (the
handler's entry in `found` is then empty).

**Raises:**

- `TypeError`, from the handler's constructor, for anything else (a number, a
  set, a list holding something other than strings).

**Example:**

```python
fx.Tag(names="layers.*")  # every name that starts with "layers."
fx.Tag(names=["attn*", "mlp"])  # "mlp" must be the name of a tag
fx.Tag(names=lambda name: name.endswith(".0"))
```
"""

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


def exact_names(names) -> tuple[str, ...]:
    """The names of a `names=` filter without glob characters: meant to exist,
    so a typo is an error (a glob or a predicate may match nothing)."""
    names = (names,) if isinstance(names, str) else names
    if not isinstance(names, tuple):
        return ()
    return tuple(n for n in names if not _GLOB.search(n))


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
    """A custom mode for [`Tag`][effects.Tag]: folds every execution of a name
    into an accumulator, carried through loops in constant memory.

    `Tag(mode="sum")` and `Tag(mode="last")` are built-in reductions. The
    accumulator starts as `init(zeros)`, with `zeros` shaped like one
    execution's value, and each execution `x` replaces it with `fn(acc, x)`,
    in program order; `found` holds the accumulator after the last execution.
    In a `lax.scan` or a `lax.while_loop` the accumulator is carried through
    the loop, so collecting costs the same memory for any number of
    iterations. A custom [`Handler`][effects.Handler] may return a `Reduce` from
    its `output_mode()` too.

    `Reduce` is compared by its functions: define `fn` and `init` once, not as
    new lambdas at every call, or every call is a new configuration, traced
    and compiled again.

    **Arguments:**

    - `fn`: `fn(acc, x) -> acc`, with `x` the tagged value in the layout
      `Tag()` reports (the batch axes of a `jax.vmap` inside the handled
      function first). It must keep the accumulator's shapes and dtypes.
    - `init`: `init(zeros) -> acc`, the accumulator before the first
      execution, from zeros shaped like the tagged value.

    **Returns:**

    As a mode: in `found[collection][name]`, the accumulator after the last
    execution; `init(zeros)` if the name never executes at run time (a branch
    not taken, a loop of zero iterations).

    **Raises:**

    - `ValueError`, from [`handle`][effects.handle], naming the tag: `fn`
      changes the accumulator's shapes or dtypes, or raises a `TypeError` or
      `ValueError` on it (values of one name of different shapes), or one name
      is reduced under `jax.vmap`s of different sizes.

    **Example:**

    ```python
    def f(x):
        h = fx.tag(jnp.sin(x), "h")
        return fx.tag(jnp.cos(h), "h")

    running_max = fx.Reduce(jnp.maximum, lambda z: jnp.full_like(z, -jnp.inf))
    _, found = fx.handle(f, fx.Tag(mode=running_max))(1.0)
    print(found)  # {'intermediates': {'h': Array(0.84147096, dtype=float32)}}
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
    """The mode of a handler that reports one entry per execution: what a
    custom [`Handler`][effects.Handler]'s `output_mode()` returns to report
    every value it emits, as `Tag(mode="append")` does.

    `found` then holds, per name, a tuple with one entry per execution in
    program order; executions inside a `lax.scan` are one entry, stacked along
    a new leading axis of the scan's length (after the batch axes of a
    `jax.vmap` inside the handled function). With `single=True`, the name must
    execute exactly once, as under `Tag(mode="strict")`.

    **Arguments:**

    - `single`: whether more than one execution is an error.
    - `label`: how error messages name the mode, such as `"MyHandler()"`.

    **Returns:**

    As a mode: in `found[collection][name]`, what the handler's `report`
    makes of the tuple of entries (the tuple itself by default).

    **Raises:**

    - `ValueError`, from [`handle`][effects.handle], naming the tag: a site
      inside a `lax.while_loop` (whose number of iterations is unknown); with
      `single=True`, a second execution, or a site inside a `lax.scan`.

    **Example:**

    ```python
    import dataclasses

    class Magnitudes(fx.Handler):
        # Collects the absolute value of every tagged value.
        reports = True
        collection: str = dataclasses.field(
            default="intermediates", metadata={"static": True}
        )

        def output_mode(self):
            return fx.Append(label="Magnitudes()")

        def apply(self, call, leaves):
            call.emit(jax.tree.map(jnp.abs, call.site.to_front(leaves)))
            return leaves, False

    _, found = fx.handle(lambda x: fx.tag(-x, "h"), Magnitudes())(2.0)
    print(found)  # {'intermediates': {'h': (Array(2., dtype=float32),)}}
    ```
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
    """The base class of handlers: subclass it to say what happens at one
    execution of a site; the rewriter carries what the handler does through
    every control-flow construct.

    [`Tag`][effects.Tag], [`Perturb`][effects.Perturb],
    [`Substitute`][effects.Substitute], [`Intervene`][effects.Intervene] and
    [`Stats`][effects.Stats] are subclasses. A subclass is made a frozen
    dataclass and a pytree: its fields are leaves, except those declared
    `dataclasses.field(metadata={"static": True})`, which are part of its
    configuration (and of the key the rewritten program is cached under).
    Declare a `collection` field: the default `matches` reads it. Handlers are
    equal when their fields are, and hashable when their fields are.
    [Writing a handler](../guides/writing-a-handler.md) builds one step by
    step.

    **The protocol**, the methods and class attributes the rewriter reads:

    - `apply(call, leaves) -> (new_leaves, consumed)`: one execution. `leaves`
      are the value's arrays in program layout; `call.site.to_front(leaves)` and
      `call.site.from_front(value, what)` convert to and from the layout
      `found` uses for one execution (inside a `shard_map`, one shard's value,
      without the shard axis); `call.emit(value)` reports a value in that
      layout (under a `Reduce` mode it returns the accumulator so far);
      `call.next_input()` takes the next per-execution input, in that layout.
      `call.site.from_found(value, what)` takes a value in the layout `found`
      has, shard axes included (each shard takes its own entry), as
      `Substitute` does; `call.site.to_found(leaves)` gives one shard's value
      with shard axes of size 1, and `from_found(value, what, this_shard=True)`
      takes it back, as `Intervene` does. A consumed site is no longer visible
      to handlers further out. The one method a subclass must define.
    - `matches(site) -> bool`: whether to act at a site (`site.kind`,
      `site.collection`, `site.name`). Default: sites of the class attribute
      `kind` (`"tag"` or `"perturb"`) in `self.collection`.
    - `output_mode()`: [`fx.Append()`][effects.Append],
      `fx.Append(single=True)`, [`fx.Reduce(fn, init)`][effects.Reduce], or
      None (the default) if it emits nothing. Reported under
      `found[self.collection]` when the class attribute `reports` is true.
    - `report(entries)`: what `found` holds for a name, from the tuple of
      entries an `Append` mode collected (default: the tuple).
    - `per_call_inputs()`: `{name: (entry, ...)}`, one entry per execution, in
      the layout `Tag()` reports (default: none).
    - `required_names()`: names that must exist (a typo is an error; default:
      none).
    - `calls_user_code()`: whether `apply` may call user code (default True).
    - `changes_values()`: whether `apply` may return other values than it was
      given (default True; `Tag`, `Stats` and `Perturb()` without deltas say
      False). Inside a function with a custom derivative, only a handler that
      changes nothing may act.
    - Class attributes: `kind` (`"tag"`, the default, or `"perturb"`),
      `reports` (default False), and `consumes`: whether `apply` consumes
      every site it matches (`Tag` and `Perturb` do), so that handlers further
      out, which do not see those sites, cannot require their names.

    **Arguments:**

    Those of the subclass: its fields, in order, as for any dataclass.

    **Returns:**

    An instance to pass to [`handle`][effects.handle].

    **Raises:**

    - `NotImplementedError`, from [`handle`][effects.handle], when a subclass
      that does not define `apply` matches a site.
    - `TypeError`, when the subclass is defined, for fields a dataclass cannot
      have (a field without a default after one with a default).

    **Example:**

    ```python
    import dataclasses

    class Scale(fx.Handler):
        # Multiplies tagged values by `factor`.
        factor: float = dataclasses.field(metadata={"static": True})
        collection: str = dataclasses.field(
            default="intermediates", metadata={"static": True}
        )

        def apply(self, call, leaves):
            return [x * self.factor for x in leaves], False

    out, _ = fx.handle(lambda x: 1 + fx.tag(x, "h"), Scale(10.0))(2.0)
    print(out)  # 21.0
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

    def changes_values(self) -> bool:
        """Whether `apply` may return other values than it was given. Inside a
        function with a custom derivative a handler that does is refused: the
        custom rule would not know. True unless a handler says otherwise."""
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
    """Collects the values of tags: the handler behind most uses of
    [`handle`][effects.handle].

    It acts at the [`tag`][effects.tag]s of `collection` whose names `names`
    selects, reports their values in `found[collection]`, and consumes them:
    handlers further out no longer see them. The mode says what `found` holds
    for each name:

    - `"append"` (the default): a tuple with one entry per execution, in
      program order. Executions inside a `lax.scan` are one entry, stacked
      along a new leading axis of the scan's length; in a `lax.cond`, the
      branch that ran (zeros where it did not tag). Not in a
      `lax.while_loop`.
    - `"strict"`: the single value; a second execution, or a tag in a
      `lax.scan` or `lax.while_loop`, is an error.
    - `"last"`: the value of the last execution.
    - `"sum"`: the sum over executions.
    - [`fx.Reduce(fn, init)`][effects.Reduce]: any fold over executions.

    Reductions (`"last"`, `"sum"`, `Reduce`) carry an accumulator through
    loops in constant memory, `lax.while_loop` included, and report zeros (or
    `init(zeros)`) for a name that never executes. Under a `jax.vmap` inside
    the handled function, values have the batch axes first.
    [Semantics](../semantics.md#what-found-holds) gives every case.

    **Arguments:**

    - `collection`: the collection whose tags are collected.
    - `names`: which names; see [`Names`][effects.Names].
    - `mode`: `"append"`, `"strict"`, `"last"`, `"sum"` or a
      [`Reduce`][effects.Reduce], as above.

    **Returns:**

    As a handler: in `found[collection]`, a dict from name to value, names in
    the order the program first executed them; `{}` if no tag matched.

    **Raises:**

    - `TypeError`: `collection` is not a string, or `names` is not a
      [`Names`][effects.Names].
    - `ValueError`: `mode` is none of the above. From
      [`handle`][effects.handle]: a name without glob characters that no tag
      has, or a mode the program cannot honour (`"strict"` executed twice or
      in a loop, `"append"` in a `lax.while_loop`).

    **Example:**

    ```python
    def f(x):
        def step(h, _):
            return fx.tag(2 * h, "h"), None

        h, _ = jax.lax.scan(step, x, None, length=3)
        return fx.tag(h + 1, "out")

    _, found = fx.handle(f, fx.Tag())(1.0)
    print(found)
    # {'intermediates': {'h': (Array([2., 4., 8.], dtype=float32),),
    #                    'out': (Array(9., dtype=float32),)}}
    _, found = fx.handle(f, fx.Tag(names="h", mode="sum"))(1.0)
    print(found)  # {'intermediates': {'h': Array(14., dtype=float32)}}
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
        return exact_names(self.names)

    def apply(self, call, leaves):
        call.emit(call.site.to_front(leaves))
        return leaves, True

    def report(self, entries):
        return entries[0] if self.output_mode().single else entries

    def calls_user_code(self):
        return isinstance(self.mode, Reduce)

    def changes_values(self):
        return False


class Perturb(Handler):
    """Handles [`perturb`][effects.perturb] sites, to take gradients with
    respect to intermediate values.

    Without `deltas`, it reports zeros shaped like each site, in the layout of
    `Tag(mode="append")`, and leaves values unchanged: the deltas to start
    from. With `deltas`, it adds `deltas[name]` at each execution, so that
    `jax.grad` with respect to the deltas is the gradient with respect to the
    intermediate values. [`fx.intermediate_grads`][effects.intermediate_grads]
    does both in one call. Either way it consumes the sites it acts at.

    **Arguments:**

    - `deltas`: None, or a dict from name to a tuple with one delta per
      execution (stacked over scan iterations), as `Perturb()` reports. Names
      absent from `deltas` are left alone.
    - `collection`: the collection of the sites; by default `"perturbations"`
      (`"intermediates"` with `kind="tag"`).
    - `names`: which names; see [`Names`][effects.Names].
    - `kind`: `"perturb"`, or `"tag"` to act at [`tag`][effects.tag]s instead:
      the gradient with respect to a tagged value, such as every layer
      [`fx.tag_modules`][effects.tag_modules] tags.

    **Returns:**

    As a handler without `deltas`: in `found[collection]`, a dict from name to
    a tuple of zeros, one per execution. With `deltas`, nothing in `found`.

    **Raises:**

    - `TypeError`: `deltas` is not a dict, a name's deltas are not a tuple or
      list, or a delta is not a pytree of arrays; `names` is not a
      [`Names`][effects.Names].
    - `ValueError`: `kind` is neither `"perturb"` nor `"tag"`. From
      [`handle`][effects.handle]: a name in `deltas`, or in `names` without
      glob characters, that no site has; deltas
      of another shape or dtype than the value, or more or fewer than its
      executions; a site inside a `lax.while_loop`; deltas at a site inside a
      `custom_jvp` or `custom_vjp` function.

    **Example:**

    ```python
    def loss(x):
        h = fx.perturb(jnp.sin(x), "h")
        return (2 * h) ** 2

    _, found = fx.handle(loss, fx.Perturb())(1.0)
    zeros = found["perturbations"]  # {'h': (Array(0., dtype=float32),)}
    grads = jax.grad(lambda d: fx.handle(loss, fx.Perturb(d))(1.0)[0])(zeros)
    print(grads)  # {'h': (Array(6.7317677, dtype=float32),)}
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
        return exact_names(self.names) if self.deltas is None else tuple(self.deltas)

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

    def changes_values(self):
        return self.deltas is not None


class Substitute(Handler):
    """Replaces the values of tags: activation patching.

    By default `values[name]` replaces every execution of the tag `name` (every
    loop iteration). With `per_call=True`, `values[name]` is a tuple with one
    entry per execution, stacked over scan iterations: exactly what `Tag()`
    reports, so values collected from one run can be substituted into another.
    The new value is passed on as the same tag, so a [`Tag`][effects.Tag]
    further out collects what was substituted. No gradient flows through a
    substituted value to what computed the original.

    **Arguments:**

    - `values`: a dict from name to the new value, a pytree of arrays (or
      numbers) with the tagged value's structure, shapes and dtypes (in the
      layout `Tag()` reports: under a `jax.vmap` inside the handled function,
      batch axes first; inside a `shard_map` or `pmap`, then one axis with an
      entry per shard, each shard taking its own); with `per_call=True`, a
      tuple of such values per name.
    - `collection`: the collection of the tags.
    - `per_call`: whether `values` holds one entry per execution.

    **Returns:**

    As a handler: nothing in `found`; the handled function's output computed
    with the new values.

    **Raises:**

    - `TypeError`: `values` is not a dict, a value is not a pytree of arrays,
      or with `per_call=True` a name's entries are not a tuple or list.
    - `ValueError`, from [`handle`][effects.handle]: a name no tag has; a value
      of another structure, shape or dtype than the tagged value (inside a
      `shard_map`, the message gives the layout); with `per_call=True`, more or
      fewer entries than executions, or a tag inside a `lax.while_loop`; a tag
      inside a `custom_jvp` or `custom_vjp` function; inside a `shard_map`, a
      tag whose value every shard holds alike.

    **Example:**

    ```python
    def f(x):
        h = fx.tag(jnp.sin(x), "h")
        return 2 * h

    out, _ = fx.handle(f, fx.Substitute({"h": jnp.zeros(3)}))(jnp.ones(3))
    print(out)  # [0. 0. 0.]
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
        if self.per_call:
            return call.site.from_front(call.next_input(), "Substitute value"), False
        return call.site.from_found(
            self.values[call.site.name], "Substitute value"
        ), False

    def calls_user_code(self):
        return False


class Intervene(Handler):
    """Transforms the values of tags: `fns[name](value)` replaces the value at
    every execution of the tag `name`.

    The new value is passed on as the same tag, so a [`Tag`][effects.Tag]
    further out collects it. The functions are part of the handler's
    configuration and compared by identity: define them once, not as new
    lambdas at every call, or every call is traced and compiled again.

    **Arguments:**

    - `fns`: a dict from name to a function of the tagged value (in the layout
      `Tag()` reports, once per execution, so once per loop iteration)
      returning a value of the same structure, shapes and dtypes. Inside a
      `shard_map` or `pmap` it runs in each shard on that shard's value, with
      a shard axis of size 1 where `Tag()` has the shard axis.
    - `collection`: the collection of the tags.

    **Returns:**

    As a handler: nothing in `found`; the handled function's output computed
    with the transformed values.

    **Raises:**

    - `TypeError`: `fns` is not a dict from name to a callable.
    - `ValueError`, from [`handle`][effects.handle]: a name no tag has; a
      function returning another structure, shape or dtype; a tag inside a
      `custom_jvp` or `custom_vjp` function.

    **Example:**

    ```python
    def f(x):
        h = fx.tag(jnp.sin(x), "h")
        return 2 * h

    def ablate(h):
        return h.at[0].set(0.0)

    out, _ = fx.handle(f, fx.Intervene({"h": ablate}))(jnp.ones(3))
    print(out)  # [0.        1.6829419 1.6829419]
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
        new = self.fns[call.site.name](call.site.to_found(leaves))
        what = "The Intervene function's result"
        return call.site.from_found(new, what, this_shard=True), False


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
