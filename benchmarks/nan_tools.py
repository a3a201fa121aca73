"""The NaN-hunting tools side by side on three programs, in one run: what each
says, and the time to its answer (first call, compile included). Prints the
table `docs/comparison.md` shows.

- A: `log` of a negative value at iteration 2 of a `lax.scan` (forward);
- B: the gradient of `sum(sqrt(x - x))`: a finite forward pass, a NaN gradient;
- C: a 5-block Equinox MLP whose block 3 takes `sqrt` of 0, under
  `jax.jit(jax.grad(loss))`.

Tools: `jax_debug_nans`; `checkify` with `nan_checks` (`err.get()`);
`eqx.debug.backward_nan` (for B and C, which need it placed in the code:
placed after the `sqrt`); jax-tap's `watch_nan` (if `jaxtap` is installed,
`pip install jax-tap`; watching `log`, `sqrt`, `div`, `mul`, `add`,
`add_any` and `dot_general`); and `fx.find_nonfinite`, with no tag.

Run with `python benchmarks/nan_tools.py`.
"""

from __future__ import annotations

import contextlib
import io
import time

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.experimental import checkify

import effects as fx


def a(x):
    def step(c, xi):
        return c + jnp.log(xi), c

    return jax.lax.scan(step, 0.0, x)[0]


def b(x, probe=False):
    h = jnp.sqrt(x - x)
    if probe:
        h = eqx.debug.backward_nan(h)
    return jnp.sum(h)


class Block(eqx.Module):
    lin: eqx.nn.Linear
    k: int = eqx.field(static=True)
    probe: bool = eqx.field(static=True, default=False)

    def __call__(self, x):
        h = self.lin(x)
        if self.k == 3:
            h = jnp.sqrt(h - h)
            if self.probe:
                h = eqx.debug.backward_nan(h)
        return jnp.tanh(h)


class MLP(eqx.Module):
    blocks: list

    def __call__(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


def mlp(probe=False):
    keys = jax.random.split(jax.random.key(0), 5)
    return MLP(
        [Block(eqx.nn.Linear(4, 4, key=k), i, probe) for i, k in enumerate(keys)]
    )


def c_loss(model, x):
    return jnp.sum(model(x) ** 2)


XA = jnp.array([1.0, 2.0, -3.0, 4.0])
XB = jnp.ones(3)
XC = jnp.ones(4)

# Per program: the function the plain tools run (the forward function for A,
# the gradient for B and C), its arguments, and find_nonfinite's call.
PROGRAMS = {
    "A": (a, (XA,), lambda: fx.find_nonfinite(a, XA)),
    "B": (jax.grad(b), (XB,), lambda: fx.find_nonfinite(b, XB, backward=True)),
    "C": (
        jax.grad(c_loss),
        (mlp(), XC),
        lambda: fx.find_nonfinite(c_loss, mlp(), XC, backward=True),
    ),
}


def first_line(text) -> str:
    text = str(text).strip()
    line = text.splitlines()[0] if text else "nothing found"
    return line if len(line) <= 150 else line[:147] + "..."


def fresh(fn):
    """`fn` as a new function: compiled anew, as at a first call."""
    return lambda *args: fn(*args)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def debug_nans(fn, args):
    def run():
        with jax.debug_nans(True):
            try:
                jax.block_until_ready(jax.jit(fresh(fn))(*args))
            except FloatingPointError as e:
                return str(e)
        return "nothing found"

    return timed(run)


def nan_checks(fn, args):
    def run():
        err, _ = jax.jit(checkify.checkify(fresh(fn), errors=checkify.nan_checks))(
            *args
        )
        return err.get() or "nothing found"

    return timed(run)


def backward_nan(name, args):
    if name == "A":
        return "— (forward: not its use)", None
    fn = (lambda x: jax.grad(b)(x, True)) if name == "B" else jax.grad(c_loss)
    args = args if name == "B" else (mlp(probe=True), XC)

    def run():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            jax.block_until_ready(jax.jit(fresh(fn))(*args))
            jax.effects_barrier()
        return out.getvalue() or "nothing printed"

    return timed(run)


def jax_tap(name, fn, args):
    try:
        import jaxtap as tap  # pyright: ignore
    except ImportError:
        return "not installed (`pip install jax-tap`)", None
    watched = ("log", "sqrt", "div", "mul", "add", "add_any", "dot_general")

    def run():
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
            with tap.record(taps=[tap.watch_nan(p, once=True) for p in watched]):
                jax.block_until_ready(jax.jit(fresh(fn))(*args))
            jax.effects_barrier()
        return err.getvalue() or "nothing found"

    return timed(run)


def main():
    rows = []
    for name, (fn, args, ours) in PROGRAMS.items():
        found = {
            "jax_debug_nans": debug_nans(fn, args),
            "checkify(nan_checks)": nan_checks(fn, args),
            "eqx.debug.backward_nan": backward_nan(name, args),
            "jax-tap watch_nan": jax_tap(name, fn, args),
            "effects find_nonfinite": timed(lambda: str(ours())),
        }
        for tool, (said, seconds) in found.items():
            took = "—" if seconds is None else f"{seconds:.2f} s"
            rows.append((name, tool, took, first_line(said).replace("|", "\\|")))
    print("| program | tool | time to answer | what it says (first line) |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
