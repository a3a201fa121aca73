"""Handlers: small immutable objects that say what happens at a site. They know
nothing of control flow; the rewriter threads what they emit through it."""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import inspect
import operator
import re
from collections.abc import Callable, Mapping, Set
from typing import Any, ClassVar, TypeAlias, dataclass_transform

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import PyTree

from . import _compat
from ._layout import example_part
from ._site import Site, describe, shape_dtype

Names: TypeAlias = (
    None | str | list[str] | tuple[str, ...] | Set[str] | Callable[[str], bool]
)
"""Which names a handler acts on: the type of the `names=` argument of
[`Tag`][effects.Tag], [`Perturb`][effects.Perturb] and [`Stats`][effects.Stats].

- `None`: every name in the handler's collection.
- A string: a glob, matched against the whole name with `fnmatch`'s rules,
  case-sensitively: `*` matches any characters (dots and slashes included),
  `?` one character, `[ab]` one of a set (`"layers.*"`, `"block?"`).
- A list or tuple of such strings: the names any of them matches.
- A set of names: exactly those (glob characters are part of a name there).
- A predicate `fn(name) -> bool`.

A string without glob characters (`*`, `?`, `[`), alone or in a list, and
every name of a set, names a site that must exist: a typo is a `ValueError`
from [`handle`][effects.handle] listing the known names. A glob or a
predicate may match nothing (the handler's entry in `found` is then empty).

**Raises:**

- `TypeError`, from the handler's constructor, for anything else (a number,
  a list holding something other than strings).

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


def _check_names(names, owner: str) -> Any:
    if names is None or callable(names) or isinstance(names, str):
        return names
    if isinstance(names, (set, frozenset)) and all(isinstance(n, str) for n in names):
        return frozenset(names)
    if isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names):
        return tuple(names)
    raise TypeError(
        f"{owner}: `names` must be None, a glob string, a list of globs, a set "
        f"of names or a predicate on the name, got {names!r}."
    )


def _check_collection(collection, owner: str) -> None:
    if not isinstance(collection, str):
        raise TypeError(f"{owner}: collection must be a string, got {collection!r}.")


def _check_part(part, owner: str, argument: str) -> None:
    if part not in PARTS:
        raise ValueError(
            f"{owner}: {argument}={part!r}; use 'value', 'tangent' or 'cotangent'."
        )


_GLOB = re.compile(r"[*?\[]")
PARTS = ("value", "tangent", "cotangent")


@dataclasses.dataclass(frozen=True)
class Select:
    """Which sites a handler acts at, said declaratively: a handler's
    `matches`, as a [`Handler`][effects.Handler] subclass's class attribute
    (`matches = fx.Select(names="layers.*")`) or what a built-in's `matches`
    is. Called on a [`Site`][effects.Site], it says whether it selects it.

    Said this way rather than as a method, the selection tells
    [`handle`][effects.handle] two things a method cannot: the names that
    must exist (a typo is an error listing the known names, as for
    [`Tag`][effects.Tag]) and the collection a handler with a `mode` reports
    into (`found[collection]`, empty when nothing matched; for a derivative
    part, `found[f"{collection}:{part}"]`). A handler whose `matches` is a
    method reports each site under the site's own collection, and requires
    no name.

    **Arguments:**

    - `names`: which names, see [`Names`][effects.Names]: a string without
      glob characters, alone or in a list, and every name of a set, must be
      the name of a site the handler sees; a glob must match one.
    - `collection`: the sites' collection.
    - `kind`: `"tag"` (sites of [`fx.tag`][effects.tag]) or `"perturb"`
      ([`fx.perturb`][effects.perturb]).
    - `part`: `"value"`, or the `"tangent"` or `"cotangent"` a `jax.jvp` or
      `jax.grad` inside the handled function takes of the value (see
      [Gradients and tangents](../guides/derivatives.md)).

    **Raises:**

    - `TypeError`: `names` is not a [`Names`][effects.Names] or
      `collection` is not a string.
    - `ValueError`: `kind` or `part` is none of the above.

    **Example:**

    ```python
    class Double(fx.Handler):
        matches = fx.Select(names="h")

        def apply(self, site, value, ctx):
            return 2 * value

    out, _ = fx.handle(lambda x: fx.tag(x, "h") + 1, Double())(1.0)
    print(out)
    ```

    ```text
    3.0
    ```
    """

    names: Names = None
    collection: str = "intermediates"
    kind: str = "tag"
    part: str = "value"

    def __post_init__(self):
        object.__setattr__(self, "names", _check_names(self.names, "Select"))
        _check_collection(self.collection, "Select")
        if self.kind not in ("tag", "perturb"):
            raise ValueError(f"Select: kind={self.kind!r}; use 'tag' or 'perturb'.")
        _check_part(self.part, "Select", "part")

    def __call__(self, site: Site) -> bool:
        # (spelt out: this runs at every site)
        if site.kind != self.kind or site.collection != self.collection:
            return False
        if site.part != self.part:
            return False
        names = self.names
        if names is None:
            return True
        if isinstance(names, str):
            return fnmatch.fnmatchcase(site.name, names)
        if isinstance(names, frozenset):
            return site.name in names
        if isinstance(names, tuple):
            return any(fnmatch.fnmatchcase(site.name, n) for n in names)
        return bool(names(site.name))  # pyright: ignore[reportCallIssue] (a list is a tuple here)

    def required(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The names that must exist, and the glob patterns one of which must
        match a site (a predicate may match nothing)."""
        names = self.names
        if isinstance(names, frozenset):
            return tuple(sorted(names)), ()
        names = (names,) if isinstance(names, str) else names
        if not isinstance(names, tuple):
            return (), ()
        exact = tuple(n for n in names if not _GLOB.search(n))
        return exact, tuple(n for n in names if _GLOB.search(n))


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
    iterations. A custom [`Handler`][effects.Handler] may have a `Reduce` as
    its `mode` too.

    `Reduce` is compared by its functions: define `fn` and `init` once, not as
    new lambdas at every call, or every call is a new configuration, traced
    and compiled again.

    **Arguments:**

    - `fn`: `fn(acc, x) -> acc`, with `x` one example's tagged value (under a
      `jax.vmap` inside the handled function, `fn` runs under it, and `found`
      holds one accumulator per example, batch axes first). It must keep the
      accumulator's shapes and dtypes.
    - `init`: `init(zeros) -> acc`, the accumulator before the first
      execution, from zeros shaped like one example's tagged value.
    - `per_example`: `True` (the default) as above; `False` for a handler's
      `apply` to run once per execution on the whole batch of the `jax.vmap`s
      inside the handled function (batch axes first; `init` then gets zeros
      shaped like that whole value), as [`Append`][effects.Append] says.
    - `consumes`: `True` (the default) for a handler of this mode to consume
      the sites it acts at; `False` to pass the value it returns on, as the
      same site, to the handlers after it, as [`Append`][effects.Append]
      says.

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
    print(found)  # max(sin(1), cos(sin(1)))
    ```

    ```text
    {'intermediates': {'h': Array(0.84147096, dtype=float32)}}
    ```
    """

    fn: Callable
    init: Callable
    per_example: bool = True
    consumes: bool = True

    # The mode protocol the rewriter reads (see `Append`).
    reduces: ClassVar[bool] = True
    single: ClassVar[bool] = False

    def __repr__(self):
        return eqx.tree_pformat(self)


# A pytree with no leaves: `fn` and `init` are part of its structure.
jax.tree_util.register_dataclass(
    Reduce, data_fields=[], meta_fields=["fn", "init", "per_example", "consumes"]
)


@dataclasses.dataclass(frozen=True)
class Append:
    """The mode of a handler that reports one entry per execution: a custom
    [`Handler`][effects.Handler]'s `mode` to report every value it emits, as
    `Tag(mode="append")` does (`mode = "append"` says the same).

    `found` then holds, per name, a tuple with one entry per execution in
    program order; executions inside a `lax.scan` are one entry, stacked along
    a new leading axis of the scan's length (after the batch axes of a
    `jax.vmap` inside the handled function). With `single=True`, the name must
    execute exactly once, as under `Tag(mode="strict")`.

    **Arguments:**

    - `single`: whether more than one execution is an error.
    - `label`: how error messages name the mode, such as `"MyHandler()"`.
    - `per_example`: `True` (the default) for `apply` to run per example of
      the `jax.vmap`s inside the handled function, reporting each example's
      entry (batch axes first); `False` for it to run once per execution on
      the whole batch, batch axes first as `Tag()` reports them, and report
      one entry per execution (as `Stats(per_example=False)` does). Inside a
      `lax.scan` or a `shard_map`, the entries are stacked in front of what
      it emits, batch axes included: `(scan, batch, ...)` for a value of the
      whole batch, where `Tag()` reports `(batch, scan, ...)`. The law
      `handle(vmap(f), H) == vmap(handle(f, H))` is then not kept, by design:
      a handler of the whole batch sees the vmaps inside `handle` only.
    - `consumes`: `True` (the default) for a handler of this mode to consume
      the sites it acts at: handlers after it, and those of an enclosing
      `handle`, do not see them (one site, one report). `False` for it to
      pass the value it returns on as the same site, so that a handler
      further out reports it too: `fx.handle(fx.handle(f, A), fx.Tag())`
      returns both reports, each in its own `found`. Two handlers reporting
      one site in one `handle` (one `found`) is then an error that says to
      nest them.

    **Returns:**

    As a mode: in `found[collection][name]`, the tuple of entries; with
    `single=True`, the one entry.

    **Raises:**

    - `ValueError`, from [`handle`][effects.handle], naming the tag: a site
      inside a `lax.while_loop` (whose number of iterations is unknown); with
      `single=True`, a second execution, or a site inside a `lax.scan`.

    **Example:**

    ```python
    class Magnitudes(fx.Handler):
        # Collects the absolute value of every tagged value.
        mode = fx.Append(label="Magnitudes()")

        def apply(self, site, value, ctx):
            ctx.emit(jax.tree.map(jnp.abs, value))
            return value

    _, found = fx.handle(lambda x: fx.tag(-x, "h"), Magnitudes())(2.0)
    print(found)
    ```

    ```text
    {'intermediates': {'h': (Array(2., dtype=float32),)}}
    ```
    """

    single: bool = False  # exactly one execution allowed
    label: str = "Tag(mode='append')"
    per_example: bool = True
    consumes: bool = True
    reduces: ClassVar[bool] = False


def _last(acc, x):
    del acc
    return x


def _zeros(z):
    return z


def _sum_dtype(x):
    # As `jnp.sum` sums: bools and narrow integers into the default integer
    # (a bool sum is a count, an int8 one does not wrap); 16-bit floats in
    # float32, where a count of ones goes past 256.
    dtype = jnp.result_type(x)
    if dtype == jnp.bool_ or (
        jnp.issubdtype(dtype, jnp.integer) and dtype.itemsize < 4
    ):
        return jnp.sum(jnp.zeros((), dtype)).dtype
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return jnp.float32
    return dtype


# (`lax` rather than `jnp`: these run at every execution of every summed site,
# and `lax.add` traces in a quarter of the time `+` does.)
def _sum_init(z):
    return jax.tree.map(lambda x: lax.convert_element_type(x, _sum_dtype(x)), z)


def _add(acc, x):
    return jax.tree.map(
        lambda a, b: lax.add(a, lax.convert_element_type(b, a.dtype)), acc, x
    )


_MODES = {
    "append": Append(),
    "strict": Append(single=True, label="Tag(mode='strict')"),
    "last": Reduce(_last, _zeros),
    "sum": Reduce(_add, _sum_init),
}
SUM = _MODES["sum"]
_BAD_MODE = (
    "Tag: unknown mode {mode!r}; use 'append', 'last', 'strict', 'sum', "
    "fx.Reduce(fn, init) or fx.Append(...)."
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
    cls._field_values = staticmethod(_getter(tuple(f.name for f in fields)))
    get_data, get_meta = _getter(data), _getter(meta)
    cls._static_values = staticmethod(lambda h: zip(meta, get_meta(h)))
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


def check_static(handler) -> None:
    """No static field holds an array: a static field is part of the tree
    structure, compared by value at every call, which an array's `==` does not
    give (JAX: "arrays cannot be passed as metadata fields")."""
    for name, value in type(handler)._static_values(handler):
        if isinstance(value, (jax.Array, np.ndarray)):
            raise TypeError(
                f"{type(handler).__name__}.{name} is a static field holding an "
                f"array ({describe(shape_dtype(value))}); a static field is "
                "part of the handler's configuration, compared at every call. "
                "Remove its `static` mark (an array field is an input of the "
                "program), or hold a Python number."
            )


def _getter(names: tuple[str, ...]) -> Callable[[Any], tuple]:
    # `operator.attrgetter`, the fastest way to read several attributes, returns
    # a bare value for a single name.
    if len(names) == 1:
        get = operator.attrgetter(names[0])
        return lambda obj: (get(obj),)
    return operator.attrgetter(*names) if names else lambda obj: ()


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
    every control-flow construct and transformation.

    [`Tag`][effects.Tag], [`Perturb`][effects.Perturb],
    [`Substitute`][effects.Substitute], [`Intervene`][effects.Intervene] and
    [`Stats`][effects.Stats] are subclasses written on this protocol and
    nothing else. A subclass is made a frozen dataclass and a pytree: its
    fields are leaves, except those declared
    `dataclasses.field(metadata={"static": True})`, which are part of its
    configuration (and of the key the rewritten program is cached under).
    Handlers are equal when their fields are, and hashable when their fields
    are. [Writing a handler](../guides/writing-a-handler.md) builds one step
    by step.

    **The protocol** (four members):

    - `matches`: which sites to act at, a [`Select`][effects.Select] (the
      default, `Select()`, takes the value of every tag of the collection
      `"intermediates"`), as a class attribute or a property built from the
      handler's fields, or a method `matches(site) -> bool` on a
      [`Site`][effects.Site] (`site.kind`, `site.collection`, `site.name`,
      `site.part`). A `Select` also says which names must exist and where a
      handler with a mode reports (`found[collection]`, empty when nothing
      matched); with a method, a handler reports each site under its own
      collection.
    - `apply(site, value, ctx) -> value`: one execution, the one method a
      subclass must define. `value` is the tagged value of **one example**:
      under a `jax.vmap` inside the handled function, `apply` runs under that
      vmap too, so a handler computes the same thing whether `vmap` is inside
      or outside [`handle`][effects.handle]. Return the value the program goes
      on with: `value` itself to leave it as it is, or a new pytree of the
      same structure, shapes and dtypes. `ctx` is a
      [`Context`][effects.Context]: `ctx.emit(x)` reports `x` under `mode`,
      `ctx.next_input()` is this execution's entry of `per_call_inputs()`.
    - `mode`: how emitted values are reported, in `found[site.collection]
      [site.name]`: `"append"` or [`fx.Append()`][effects.Append] (one entry
      per execution), `"strict"` (exactly one execution), `"last"`, `"sum"`
      or [`fx.Reduce(fn, init)`][effects.Reduce] (folded), or `None` (the
      default) for a handler that reports nothing. `fx.Append(per_example=
      False)` has `apply` run once on the whole batch of the vmaps inside the
      handled function instead of per example.
    - `per_call_inputs() -> {name: (entry, ...)}`, optional: one entry per
      execution in the layout `Tag()` reports, read by `ctx.next_input()`;
      an entry has the structure, shapes and dtypes of the tag's value there
      (what a handler needs of another kind, such as PRNG keys or a table,
      it holds in a field and picks from by `ctx.at`).

    **One site, one report.** A handler with a mode *consumes* the sites it
    acts at: handlers after it in the same `handle`, and those of an
    enclosing `handle`, do not see them (`Tag`, `Stats`, `Perturb()`). A
    handler without a mode passes the value it returns on as the same site
    (`Substitute`, `Intervene`, `Perturb(deltas)`), so that a `Tag` further
    out collects the value the program goes on with; so does one whose mode
    says `consumes=False` (`fx.Reduce(..., consumes=False)`,
    `fx.Append(consumes=False)`), which reports too. (A `checkpoint_name` is
    never consumed: remat policies select by it.) Two handlers reporting one
    site into one `found` is an error that says to nest them.

    Derivatives: under a `jax.jvp` or `jax.grad` inside
    [`handle`][effects.handle], a site has a tangent or cotangent part besides
    its value (`site.part`). A handler whose `matches` takes only the
    derivative part gets, in `apply`, the derivative of one execution's value
    (`ctx.primal` is the value itself) and returns the derivative the program
    goes on with: a gradient clip at a layer, say. A handler whose `matches`
    takes the value is a handler of the value, differentiated where the
    program is: its JVP acts on the tangent and its VJP on the cotangent, so
    `handle(jax.grad(f), H) == jax.grad(handle(f, H))` (see [Gradients and
    tangents](../guides/derivatives.md)). At an execution where `apply`
    returned the value it got (it only emits, as `Tag` and `Stats` do), its
    derivative is the identity and it is not run again.

    **Arguments:**

    Those of the subclass: its fields, in order, as for any dataclass.

    **Returns:**

    An instance to pass to [`handle`][effects.handle].

    **Raises:**

    - `NotImplementedError`, from [`handle`][effects.handle], when a subclass
      that does not define `apply` matches a site.
    - `ValueError`, from [`handle`][effects.handle], naming the tag and the
      handler: `apply` returns a value of another structure, shape or dtype;
      it changes a value inside a `custom_jvp`/`custom_vjp` function (whose
      rule would not know); or `mode` cannot be honoured where the site is.
      (A value a `vmap` inside the handled function leaves unbatched, which
      `apply` changes per example, is no error: `handle` has the vmap batch
      it.)
    - `TypeError`, when the subclass is defined, for fields a dataclass cannot
      have (a field without a default after one with a default).

    **Example:**

    ```python
    import dataclasses

    class Scale(fx.Handler):
        # Multiplies tagged values by `factor`.
        factor: float = dataclasses.field(metadata={"static": True})

        def apply(self, site, value, ctx):
            return jax.tree.map(lambda x: x * self.factor, value)

    out, _ = fx.handle(lambda x: 1 + fx.tag(x, "h"), Scale(10.0))(2.0)
    print(out)
    ```

    ```text
    21.0
    ```
    """

    # A `Select`, or a method `matches(self, site) -> bool`.
    matches: ClassVar[Callable[[Site], bool]] = Select()
    mode: ClassVar[Any] = None
    # Whether the class or a base defines its own `__init__` (as `Tag` does, to
    # validate its arguments): it is then kept, and no dataclass one generated.
    _custom_init: ClassVar[bool] = False
    # Its fields' values, as a tuple (set per class by `_register`).
    _field_values: ClassVar[Callable[[Any], tuple]]
    _static_values: ClassVar[Callable[[Any], Any]]

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
        return hash((type(self), type(self)._field_values(self)))

    def __eq__(self, other):
        values = type(self)._field_values
        return type(self) is type(other) and values(self) == values(other)

    def __repr__(self):
        return eqx.tree_pformat(self)

    def apply(self, site: Site, value: PyTree, ctx: Context) -> PyTree:
        raise NotImplementedError(
            f"{type(self).__name__} matches {site.where()} but defines no "
            "`apply(site, value, ctx)`."
        )

    def per_call_inputs(self) -> Mapping[str, tuple]:
        return {}


class Context:
    """What [`Handler.apply`][effects.Handler] can do at one execution of a
    site, besides returning a value.

    **Attributes:**

    - `site`: the [`Site`][effects.Site].
    - `stacking`: the axes a value `emit` appends gains on its way to
      `found`, after the batch axes (one per example of each `jax.vmap`
      around the site), as a static tuple: `"shard"` per `shard_map` around
      the site, then `"scan"` per `lax.scan` (or `fori_loop`), outermost
      first.
    - `batch_axes`: how many `jax.vmap`s inside the handled function `apply`
      runs under, static (the length of `batch_index`, without reading it); 0
      for a handler of the whole batch.

    **Example:**

    ```python
    class Count(fx.Handler):
        # Counts the executions of each name. A "sum" adds up values shaped
        # like the site's, from zeros (in the dtype `jnp.sum` would give).
        mode = "sum"

        def apply(self, site, value, ctx):
            ctx.emit(jnp.ones_like(value))
            return value

    _, found = fx.handle(lambda x: fx.tag(fx.tag(x, "h") + 1, "h"), Count())(0.0)
    print(found)
    ```

    ```text
    {'intermediates': {'h': Array(2., dtype=float32)}}
    ```
    """

    __slots__ = ("site", "_emit", "_input", "_axes", "_at", "_primal", "stacking")

    def __init__(
        self, site: Site, emit, entry, axes: tuple[str, ...], at, primal, stacking=()
    ):
        self.site = site
        self._emit, self._input, self._axes, self._at = emit, entry, axes, at
        self._primal = primal
        self.stacking = stacking

    @property
    def primal(self) -> PyTree:
        """At a tangent or cotangent site (`site.part`), the value whose
        derivative `apply` gets, for one example; at a value site, an error."""
        if self._primal is NO_INPUT:
            raise ValueError(
                f"{self.site.where()}: `ctx.primal` is the value at a tangent or "
                "cotangent site; here `apply` gets the value itself."
            )
        return self._primal

    def emit(self, value: PyTree) -> PyTree | None:
        """Reports `value` under the handler's `mode`. Under a reduction
        (`"sum"`, `"last"`, [`Reduce`][effects.Reduce]) returns the
        accumulator with `value` folded in: what the executions so far add up
        to; else None. Where `handle` runs `apply` again only to differentiate
        it (a handler of the value at a tangent or cotangent site) or in the
        backward pass's recomputation of a `jax.checkpoint`, it reports
        nothing and returns None: a handler that uses the accumulator there is
        refused with a message naming it."""
        return self._emit(value)

    def next_input(self) -> PyTree:
        """This execution's entry of the handler's `per_call_inputs()`, in the
        layout of one example (as `value`)."""
        if self._input is NO_INPUT:
            raise ValueError(
                f"{self.site.where()}: `ctx.next_input()` needs an entry per "
                "execution of this name in the handler's `per_call_inputs()`."
            )
        return self._input

    @property
    def at(self) -> tuple[jax.Array, ...]:
        """Which execution of the site this is, as int32 scalars `(call,
        *iterations)`: the index of its entry among the name's executions (in
        `found[collection][name]` under `Tag()`), then its iteration of each
        `lax.scan`, `lax.while_loop` or `fori_loop` around the site in the
        handled function, outermost first: where `Tag()` reports its value
        (in a `lax.scan` with `reverse=True`, the iteration's position, as
        its stacked entries are, not how many ran before it).
        The iterations are traced values; a loop counts them only for a
        handler that reads `at`, so the program is unchanged otherwise. The
        same for every example of a `jax.vmap` (see `batch_index`)."""
        return self._at()

    @property
    def batch_axes(self) -> int:
        return len(self._axes)

    @property
    def batch_index(self) -> tuple[jax.Array, ...]:
        """The index of the example `apply` runs for along each `jax.vmap`
        inside the handled function, outermost first; `()` outside any."""
        return tuple(jax.lax.axis_index(a) for a in self._axes)

    def example(self, value: PyTree) -> PyTree:
        """`value`, shaped like the site's value either for one example or in
        the layout `Tag()` reports (the batch axes of the vmaps inside the
        handled function first, then one axis per `shard_map` around the
        site, each entry one shard's): the part for this example and shard."""
        want, batch, shards = self.site.shape_dtype, self.site.batch, self.site.shards
        if want is None:
            return value
        if jax.tree.structure(value) != jax.tree.structure(want):
            raise Misfit(
                f"{self.site.where()}: a value of structure "
                f"{jax.tree.structure(value)} where the tag's value is "
                f"{describe(want)}; the structure must be the same."
            )

        def part(x, w):
            x = jnp.asarray(x)
            got, found = example_part(x, w.shape, batch, shards, self.batch_index)
            if got is None:
                layout = "" if found == w.shape else _LAYOUT.format(found)
                raise Misfit(
                    f"{self.site.where()}: a value of shape {x.shape} is not "
                    f"one example's ({w.shape}){layout}."
                )
            return got

        return jax.tree.map(part, value, want)


_LAYOUT = (
    " nor in the layout Tag() reports ({}): one entry per example of each vmap "
    "inside the handled function, then per shard of each shard_map around the "
    "tag (`jnp.broadcast_to` gives every shard the same value)"
)
NO_INPUT = object()


class Misfit(ValueError):
    """A value `Context.example` cannot take the example's part of: `act`
    names the handler that gave it."""


def found_key(handler) -> str | None:
    """The key of `found` a handler whose `matches` is a `Select` reports
    under: its collection; for the tangents or cotangents of a collection,
    `"collection:tangent"` and `"collection:cotangent"`, beside the values."""
    select = handler.matches
    if not isinstance(select, Select):
        return None
    collection, part = select.collection, select.part
    return collection if part == "value" else f"{collection}:{part}"


def acts_on(handler, site: Site) -> str | None:
    """The part of `site` a handler acts on, by its `matches`: at a value site,
    "value" where it matches it; at a tangent or cotangent site, "value" where
    it matches the value (a handler of the value, differentiated there), else
    the site's part where it matches that site; None where it does not act."""
    if handler.matches(site if site.part == "value" else site.of("value")):
        return "value"
    if site.part != "value" and handler.matches(site):
        return site.part
    return None


def mode_label(handler: Handler) -> str:
    """How messages name a handler's mode: by its class and the mode it was
    given (`Recorder(mode='append')`), or as an `Append`'s `label` says."""
    mode, name = handler.mode, type(handler).__name__
    if isinstance(mode, str):
        return f"{name}(mode={mode!r})"
    if isinstance(mode, Append):
        return mode.label if mode.label != Append.label else f"{name}(mode=fx.Append())"
    return f"{name}'s fx.Reduce `fn(acc, x)`"


def mode_of(handler: Handler) -> Append | Reduce | None:
    """A handler's `mode`, its built-in names made objects."""
    mode = handler.mode
    if mode is None or isinstance(mode, (Append, Reduce)):
        return mode
    if isinstance(mode, str) and mode in _MODES:
        return _MODES[mode]
    raise ValueError(
        f"{type(handler).__name__}: unknown mode {mode!r}; use None, 'append', "
        "'strict', 'last', 'sum', fx.Append(...) or fx.Reduce(fn, init)."
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
    - `"sum"`: the sum over executions, as `jnp.sum` of them would be:
      bools and integers narrower than 32 bits sum into the default integer
      (a bool tag counts its `True`s), 16-bit floats in float32. What a
      custom handler emits is added in that dtype.
    - [`fx.Reduce(fn, init)`][effects.Reduce]: any fold over executions.

    Reductions (`"last"`, `"sum"`, `Reduce`) carry an accumulator through
    loops in constant memory, `lax.while_loop` included, and report zeros (or
    `init(zeros)`) for a name that never executes. Under a `jax.vmap` inside
    the handled function, values have the batch axes first.
    [Semantics](../semantics.md#what-found-holds) gives every case.

    **Arguments:**

    - `collection`: the collection whose tags are collected.
    - `names`: which names; see [`Names`][effects.Names].
    - `mode`: `"append"`, `"strict"`, `"last"`, `"sum"`, a
      [`Reduce`][effects.Reduce] or an [`Append`][effects.Append], as above.
    - `of`: what to collect: `"value"` (the default), or the derivatives of
      the values that a `jax.jvp` (`"tangent"`) or `jax.grad`/`jax.vjp`
      (`"cotangent"`) inside the handled function takes: with `"cotangent"`,
      the gradient with respect to every tag in one backward pass. See
      [Gradients and tangents](../guides/derivatives.md).

    **Returns:**

    As a handler: in `found[collection]` (for derivatives,
    `found[f"{collection}:{of}"]`), a dict from name to value, names in the
    order the program first executed them; `{}` if no tag matched.
    Cotangents are in the order of the executions whose values they belong to,
    as values are, though the backward pass runs in reverse; a reduction
    folds them in the order the backward pass runs (`"last"` is the
    cotangent of the first execution).

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
    _, found = fx.handle(f, fx.Tag(names="h", mode="sum"))(1.0)
    print(found)
    ```

    ```text
    {'intermediates': {'h': (Array([2., 4., 8.], dtype=float32),),
                       'out': (Array(9., dtype=float32),)}}
    {'intermediates': {'h': Array(14., dtype=float32)}}
    ```
    """

    collection: str = _static()
    names: Any = _static()
    mode: Any = _static()  # pyright: ignore[reportIncompatibleVariableOverride]
    of: str = _static()  # pyright: ignore[reportIncompatibleVariableOverride]

    def __init__(
        self,
        collection: str = "intermediates",
        *,
        names: Names = None,
        mode: str | Reduce | Append = "append",
        of: str = "value",
    ):
        owner = type(self).__name__  # (a subclass's, `Stats`)
        _check_collection(collection, owner)
        if not (isinstance(mode, (Reduce, Append)) or mode in _MODES):
            raise ValueError(_BAD_MODE.format(mode=mode))
        _check_part(of, owner, "of")
        names = _check_names(names, owner)
        _set_fields(self, collection=collection, names=names, mode=mode, of=of)

    @functools.cached_property
    def matches(self):  # pyright: ignore[reportIncompatibleMethodOverride]
        return Select(self.names, collection=self.collection, part=self.of)

    def apply(self, site, value, ctx):
        ctx.emit(value)
        return value


class Perturb(Handler):
    """Handles [`perturb`][effects.perturb] sites, to take gradients with
    respect to intermediate values.

    Without `deltas`, it reports zeros shaped like each site, in the layout of
    `Tag(mode="append")`, and leaves values unchanged: the deltas to start
    from. With `deltas`, it adds `deltas[name]` at each execution, so that
    `jax.grad` with respect to the deltas is the gradient with respect to the
    intermediate values. [`fx.intermediate_grads`][effects.intermediate_grads]
    does both in one call. Without `deltas` it consumes the sites it acts
    at; with them it passes the perturbed value on, as
    [`Substitute`][effects.Substitute] does.

    **Arguments:**

    - `deltas`: None, or a dict from name to a tuple with one delta per
      execution (stacked over scan iterations), as `Perturb()` reports. Names
      absent from `deltas` are left alone. Under a `jax.vmap` inside the
      handled function the deltas are per example, also at a value the vmap
      does not batch (it then batches it, see
      [Semantics](../semantics.md#layout-vmap-shard_map-and-scan-axes)).
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
    zeros = found["perturbations"]
    grads = jax.grad(lambda d: fx.handle(loss, fx.Perturb(d))(1.0)[0])(zeros)
    print(zeros)
    print(grads)  # d(loss)/dh = 8 h = 8 sin(1)
    ```

    ```text
    {'h': (Array(0., dtype=float32),)}
    {'h': (Array(6.7317677, dtype=float32),)}
    ```
    """

    kind: str = _static()
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
        names = _check_names(names, "Perturb")
        _check_collection(collection, "Perturb")
        select = Select(names, collection=collection, kind=kind)
        for name in () if deltas is None or names is None else deltas:
            if not select(Site.probe(kind, collection, name)):
                raise ValueError(
                    f"Perturb: deltas for {name!r}, a name `names` does not "
                    "select: leave it out of the deltas, or out of `names`."
                )
        if deltas is not None:
            deltas = _per_call_dict(deltas, "Perturb")
        _set_fields(self, kind=kind, collection=collection, deltas=deltas, names=names)

    @property
    def mode(self):  # pyright: ignore[reportIncompatibleVariableOverride]
        # Without deltas: the zeros to start from, one entry per execution.
        return "append" if self.deltas is None else None

    @functools.cached_property
    def matches(self):  # pyright: ignore[reportIncompatibleMethodOverride]
        names = self.names if self.deltas is None else frozenset(self.deltas)
        return Select(names, collection=self.collection, kind=self.kind)

    def per_call_inputs(self):
        return {} if self.deltas is None else self.deltas

    def apply(self, site, value, ctx):
        if self.deltas is None:
            ctx.emit(jax.tree.map(jnp.zeros_like, value))
            return value
        if any(map(_compat.is_key, jax.tree.leaves(value))):
            raise ValueError(_KEY_DELTA.format(where=site.where()))
        return jax.tree.map(jnp.add, value, ctx.next_input())


_KEY_DELTA = (
    "Perturb: {where} holds a PRNG key, which takes no delta. Leave the name "
    "out of the deltas."
)


class Substitute(Handler):
    """Replaces the values of tags: activation patching.

    By default `values[name]` replaces every execution of the tag `name` (every
    loop iteration). With `per_call=True`, `values[name]` is a tuple with one
    entry per execution, stacked over scan iterations: exactly what `Tag()`
    reports, so values collected from one run can be substituted into another.
    The new value is passed on as the same tag, so a [`Tag`][effects.Tag]
    further out collects what was substituted. No gradient flows through a
    substituted value to what computed the original, whether `jax.grad` is
    outside [`handle`][effects.handle] or inside it (there the tangent and
    cotangent of the old value are zero too).

    **Arguments:**

    - `values`: a dict from name to the new value, a pytree of arrays (or
      numbers) with the tagged value's structure, shapes and dtypes: one
      example's (every example gets it), or in the layout `Tag()` reports
      (under a `jax.vmap` inside the handled function batch axes first, inside
      a `shard_map` one entry per shard: each gets its own); with
      `per_call=True`, a tuple of values in the layout `Tag()` reports, one
      per execution.
    - `collection`: the collection of the tags.
    - `per_call`: whether `values` holds one entry per execution.

    **Returns:**

    As a handler: nothing in `found`; the handled function's output computed
    with the new values.

    **Raises:**

    - `TypeError`: `values` is not a dict, a value is not a pytree of arrays,
      or with `per_call=True` a name's entries are not a tuple or list.
    - `ValueError`, from [`handle`][effects.handle]: a name no tag has; a value
      of another structure, shape or dtype than the tagged value; with
      `per_call=True`, more or fewer entries than executions, or a tag inside a
      `lax.while_loop`; a tag inside a `custom_jvp` or `custom_vjp` function.

    **Example:**

    ```python
    def f(x):
        h = fx.tag(jnp.sin(x), "h")
        return 2 * h

    out, _ = fx.handle(f, fx.Substitute({"h": jnp.zeros(3)}))(jnp.ones(3))
    print(out)
    ```

    ```text
    [0. 0. 0.]
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
        _check_collection(collection, "Substitute")
        _set_fields(self, collection=collection, values=values, per_call=per_call)

    @functools.cached_property
    def matches(self):  # pyright: ignore[reportIncompatibleMethodOverride]
        return Select(frozenset(self.values), collection=self.collection)

    def per_call_inputs(self):
        return self.values if self.per_call else {}

    def apply(self, site, value, ctx):
        if self.per_call:
            return ctx.next_input()
        return ctx.example(self.values[site.name])


class Intervene(Handler):
    """Transforms the values of tags: `fns[name](value)` (or `fns[name](value,
    at)`) replaces the value at every execution of the tag `name`.

    The new value is passed on as the same tag, so a [`Tag`][effects.Tag]
    further out collects it. The functions are part of the handler's
    configuration and compared by identity: define them once, not as new
    lambdas at every call, or every call is traced and compiled again.

    A function of two arguments also gets `at`, which execution this is: a
    tuple of int32 scalars `(call, *iterations)`, the name's call number (the
    index of its entry in what `Tag()` reports), then its iteration of each
    `lax.scan`, `lax.while_loop` or `fori_loop` around the tag, outermost
    first (see [`Context.at`][effects.Context]). So one layer of a model
    written as a scan over stacked layers can be patched alone:
    `lambda v, at: jnp.where(at[1] == k, clean[k], v)`, with `k` a Python
    int or a traced one (`jax.vmap` over `k` patches every layer in one
    program).

    Differentiated where it acts: under a `jax.jvp` or `jax.grad` inside
    [`handle`][effects.handle], `fn`'s JVP acts on the tag's tangent and its
    VJP on the cotangent, so `handle(jax.grad(f), Intervene(fns)) ==
    jax.grad(handle(f, Intervene(fns)))`; `at` there is the value's
    execution's, though a backward pass runs them last first.

    **Arguments:**

    - `fns`: a dict from name to a function `fn(value)` or `fn(value, at)`
      (a function that needs two positional arguments gets `at`), called
      once per execution (so once per loop iteration) on one example's value
      (under a `jax.vmap` inside the handled function it runs under that
      vmap; inside a `shard_map`, on one shard's value), returning a value of
      the same structure, shapes and dtypes.
    - `collection`: the collection of the tags.

    **Returns:**

    As a handler: nothing in `found`; the handled function's output computed
    with the transformed values.

    **Raises:**

    - `TypeError`: `fns` is not a dict from name to a callable.
    - `ValueError`, from [`handle`][effects.handle]: a name no tag has; a
      function returning another structure, shape or dtype; a tag inside a
      `custom_jvp` or `custom_vjp` function; a function reading `at` in a
      `jax.checkpoint` region the backward pass of a `jax.grad` inside
      `handle` recomputes for a value it does not differentiate.

    **Example:**

    ```python
    def f(x):
        h = fx.tag(jnp.sin(x), "h")
        return 2 * h

    def ablate(h):
        return h.at[0].set(0.0)

    out, _ = fx.handle(f, fx.Intervene({"h": ablate}))(jnp.ones(3))
    print(out)
    ```

    ```text
    [0.        1.6829419 1.6829419]
    ```

    One layer of three, written as a scan, zeroed by its iteration: layer 2
    then adds 1 to the zero.

    ```python
    def layers(x):
        step = lambda h, _: (fx.tag(h + 1.0, "layer"), None)
        return jax.lax.scan(step, x, None, length=3)[0]

    def zero_layer_1(h, at):  # at = (call, iteration)
        return jnp.where(at[1] == 1, 0.0, h)

    out, _ = fx.handle(layers, fx.Intervene({"layer": zero_layer_1}))(0.0)
    print(out)
    ```

    ```text
    1.0
    ```
    """

    collection: str = _static()
    fns: Any = _static()
    takes_at: frozenset = _static()  # the names whose function takes `at`

    def __init__(
        self, fns: Mapping[str, Callable], *, collection: str = "intermediates"
    ):
        if not isinstance(fns, Mapping) or not all(callable(f) for f in fns.values()):
            raise TypeError("Intervene: fns must be a dict from name to a function.")
        fns = _FrozenDict(fns)
        takes_at = frozenset(name for name, fn in fns.items() if _takes_at(fn))
        _check_collection(collection, "Intervene")
        _set_fields(self, collection=collection, fns=fns, takes_at=takes_at)

    @functools.cached_property
    def matches(self):  # pyright: ignore[reportIncompatibleMethodOverride]
        return Select(frozenset(self.fns), collection=self.collection)

    def apply(self, site, value, ctx):
        fn = self.fns[site.name]
        return fn(value, ctx.at) if site.name in self.takes_at else fn(value)


def _takes_at(fn) -> bool:
    """Whether `fn` needs two positional arguments: `fn(value, at)`."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # (no signature: a builtin)
        return False
    for args in [(None,), (None, None)]:
        try:
            signature.bind(*args)
        except TypeError:
            continue
        return len(args) == 2
    return False


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
