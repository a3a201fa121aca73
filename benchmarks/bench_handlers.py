"""Group 10: what building a handler costs, `fx.Tag` (A) against the two ways
the pytree could have been made by a library (B).

Users build handlers inline at every call (`fx.handle(f, fx.Tag())(x)`), and
`handle` rebuilds them from their leaves a few times per call (splitting their
arrays from their configuration). `fx.Handler` subclasses are frozen
dataclasses whose pytree registration sets the fields directly when
unflattening, as `eqx.Module` does, without running the constructor's
validation again. The two alternatives, with the same fields and the same
validating constructor as `fx.Tag`:

- an `eqx.Module` (custom `__init__`);
- a frozen dataclass registered with `jax.tree_util.register_dataclass`, its
  validation in `__post_init__`: that registration rebuilds by calling the
  class, so the validation runs at every unflattening, on whatever leaves a
  transformation put there (`None` from `eqx.partition`, the placeholders
  `jax.vmap` puts in an `in_axes` tree), and a constructor that converts or
  checks its leaves (as `Substitute` and `Perturb` do) cannot be written so.

The last row puts the `eqx.Module` construction next to a whole eager handled
call of a 4-layer function, the call group 4 measures.

Run with `python benchmarks/bench_handlers.py [--append FILE]`.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from _timing import arguments, compare, emit, mlp_params, ratio_row, table

import effects as fx

MODES = ("append", "last", "strict", "sum")


def _validate(collection, mode):
    if not isinstance(collection, str):
        raise TypeError(f"Tag: collection must be a string, got {collection!r}.")
    if not (isinstance(mode, fx.Reduce) or mode in MODES):
        raise ValueError(f"Tag: unknown mode {mode!r}.")


class ModuleTag(eqx.Module):
    collection: str = eqx.field(static=True)
    names: object = eqx.field(static=True)
    mode: object = eqx.field(static=True)

    def __init__(self, collection="intermediates", *, names=None, mode="append"):
        _validate(collection, mode)
        self.collection = collection
        self.names = tuple(names) if isinstance(names, list) else names
        self.mode = mode


@dataclasses.dataclass(frozen=True)
class DataclassTag:
    collection: str = dataclasses.field(
        default="intermediates", metadata={"static": True}
    )
    names: object = dataclasses.field(default=None, metadata={"static": True})
    mode: object = dataclasses.field(default="append", metadata={"static": True})

    def __post_init__(self):
        _validate(self.collection, self.mode)
        if isinstance(self.names, list):
            object.__setattr__(self, "names", tuple(self.names))


jax.tree_util.register_dataclass(DataclassTag)


def unflattening(handler):
    leaves, treedef = jax.tree.flatten(handler)
    return lambda: jax.tree.unflatten(treedef, leaves)


def main():
    args = arguments(__doc__.splitlines()[0])
    repeats = 5 if args.quick else 11
    number = 2000

    def timed(a, b, n=number):
        return compare(a, b, repeats=repeats, number=n, warmup=50)

    def fx_tag():
        return fx.Tag(names=["layer*"], mode="sum")

    def module_tag():
        return ModuleTag(names=["layer*"], mode="sum")

    def dataclass_tag():
        return DataclassTag(names=["layer*"], mode="sum")

    rows = [
        ratio_row("construct, vs `eqx.Module`", timed(fx_tag, module_tag), None),
        ratio_row(
            "construct, vs `register_dataclass`",
            timed(fx_tag, dataclass_tag),
            None,
        ),
        ratio_row(
            "unflatten, vs `eqx.Module`",
            timed(unflattening(fx_tag()), unflattening(module_tag())),
            None,
        ),
        ratio_row(
            "unflatten, vs `register_dataclass`",
            timed(unflattening(fx_tag()), unflattening(dataclass_tag())),
            None,
        ),
    ]

    params, x = mlp_params(4), jnp.ones((8, 128))

    def f(params, x):
        for i, w in enumerate(params):
            x = fx.tag(jnp.tanh(x @ w), f"layer{i}")
        return x

    def eager_call():
        return jax.block_until_ready(fx.handle(f, fx.Tag())(params, x))

    rows.append(
        ratio_row(
            "`eqx.Module` construction (A) vs an eager `handle(f, Tag())(x)`, "
            "4 layers (B)",
            timed(module_tag, eager_call, n=200),
            None,
        )
    )
    emit(
        table(
            "10. Building a handler: `fx.Tag` (A) vs the same handler as B",
            ("A", "B"),
            rows,
        ),
        args,
    )


if __name__ == "__main__":
    main()
