"""Shared test utilities."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def plain(tree):
    """`tree` with every `fx.Found` (a dict with a pytree structure of its own,
    which keeps program order) made a plain dict, to compare with one."""
    if isinstance(tree, dict):
        return {k: plain(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)) and type(tree) in (tuple, list):
        return type(tree)(plain(v) for v in tree)
    return tree


def assert_trees_close(actual, expected, *, rtol=1e-5, atol=1e-6):
    """Same structure (an `fx.Found` compares as a plain dict), and every leaf
    equal up to float tolerance."""
    a_leaves, a_tree = jax.tree.flatten(plain(actual))
    e_leaves, e_tree = jax.tree.flatten(plain(expected))
    assert a_tree == e_tree, f"structure differs:\n{a_tree}\n!=\n{e_tree}"
    for a, e in zip(a_leaves, e_leaves):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, f"shape {a.shape} != {e.shape}"
        assert a.dtype == e.dtype, f"dtype {a.dtype} != {e.dtype}"
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)


_LOCATION_TABLES = r"^(\d+ [{\"]|FileNames|FunctionNames|FileLocations|StackFrames)"


def optimized_hlo(fn, *args) -> str:
    """The optimized HLO of `jax.jit(fn)(*args)`, without metadata and names, so
    two programs that compute the same thing the same way compare equal."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"^HloModule \S+", "HloModule m", text, flags=re.M)
    # GPU programs carry a fingerprint (a 128-bit hash) of the program before
    # layout assignment, which hashes its names.
    text = re.sub(r'\w+="[0-9a-f]{32}"', "", text)
    # Canonicalise instruction and computation names (they embed source names).
    names: dict[str, str] = {}

    def rename(m):
        return names.setdefault(m.group(0), f"%v{len(names)}")

    text = re.sub(r"%[\w.\-]+", rename, text)
    # Parameter names in a computation's signature carry no `%` but embed an
    # instruction id (`Arg_0.25`), which differs with the unoptimized program's
    # size (jax 0.6).
    text = re.sub(r"\b(\w+)\.\d+(?=: )", r"\1", text)
    # Drop the source-location tables (FileNames, FunctionNames, FileLocations,
    # StackFrames) that newer XLA prints after the module header.
    lines = [
        line.rstrip()
        for line in text.splitlines()
        if line.strip() and not re.match(_LOCATION_TABLES, line)
    ]
    return "\n".join(lines)


def devices(n: int) -> list:
    """`n` devices for a multi-device test: the default backend's when it has
    that many, else the CPU's (conftest forces 8 host devices), so the suite
    also runs on a machine with a single GPU."""
    found = jax.devices()
    if len(found) < n:
        found = jax.devices("cpu")
    assert len(found) >= n, f"the test needs {n} devices, found {found}"
    return found[:n]


def mlp_params(key, widths):
    keys = jax.random.split(key, len(widths) - 1)
    return [
        jax.random.normal(k, (m, n)) / jnp.sqrt(m)
        for k, m, n in zip(keys, widths[:-1], widths[1:])
    ]


@contextlib.contextmanager
def leak_checks(on: bool = True):
    """Tracer-leak checking on (or off) within the block, as it was after."""
    before = jax.config.jax_check_tracer_leaks
    jax.config.update("jax_check_tracer_leaks", on)
    try:
        yield
    finally:
        jax.config.update("jax_check_tracer_leaks", before)


def no_leak_checks():
    """Tracer-leak checking off, for a test that meets a false report (each use
    names the JAX-only reproduction)."""
    return leak_checks(False)


class CountCompiles:
    """Counts JAX traces-to-jaxpr and backend compilations while active."""

    def __init__(self):
        self.traces = 0
        self.compiles = 0

    def __call__(self, event, duration, **kwargs):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            self.traces += 1
        elif event == "/jax/core/compile/backend_compile_duration":
            self.compiles += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def run_fresh(script: str) -> subprocess.CompletedProcess:
    """Run `script` in a new Python process on 8 host CPU devices (the
    suite's), importing the `effects` this process imports; its output is
    captured as text."""
    import effects

    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    root = str(Path(effects.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [root, env.get("PYTHONPATH")] if p)
    return subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
