"""Sessions: `nox -l` lists them, `nox` runs the default (`tests`).

Every session installs the package from this checkout (`-e .`) into its own
environment, with uv when it is available.
"""

import shutil
import subprocess

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests"]

# The Pythons the default `tests` session runs on: the oldest supported, which
# resolves to jax 0.10, and the newest, which resolves to the newest JAX (0.12).
# Python 3.12 is in the matrix below.
PYTHONS = ["3.11", "3.13"]

# Every JAX minor release from the floor in pyproject.toml to the newest, with
# the Python it runs on here (jax 0.11 and later need Python 3.12). Flax is not
# pinned: the resolver picks the newest Flax that supports the pinned JAX
# (0.12.6 for 0.8 and 0.9, 0.12.8 for 0.10).
JAX_MINORS = {
    "0.8": "3.11",
    "0.9": "3.11",
    "0.10": "3.11",
    "0.11": "3.12",
    "0.12": "3.12",
}

# The minors CI runs besides `tests` (0.10 on Python 3.11, 0.12 on 3.13) and
# `minimums` (which resolves jax 0.8.2, the floor, with an older Equinox and
# Flax: 0.8's branches of `effects/_compat.py`, `get_bind_params`' pair among
# them): those whose internals `_compat` branches on and no other CI session
# runs. 0.11 has scan's params as flat trees, without 0.12's `jax.Inline`. 0.9
# takes 0.8's branches (hijax and `newly_manual_axes` are 0.10+). Every other
# minor is one `nox -s "tests_jax(0.9)"` away.
_IN_CI = ("0.11",)

# .ci/run runs `nox -s tests`, then every session tagged `ci` (`nox -t ci`), one
# after the other, then those tagged `ci-one-core` two at a time: each runs one
# process, and CI has two cores.
CI = ["ci"]
CI_ONE_CORE = ["ci-one-core"]


_VERSIONS = """
import importlib.metadata as m, sys
names = ["jax", "jaxlib", "equinox", "jaxtyping", "flax", "pytest"]
print("python", sys.version.split()[0], *(f"{n} {m.version(n)}" for n in names))
"""

# JAX's tracer-leak checking turns JAX's tracing caches off and doubles the
# suite's time: `tests` on the oldest Python has it on (and one property test
# turns it on wherever it runs). The sessions that repeat the suite on other
# versions run without it, with fewer generated programs per property test.
_REPEAT = {"EFFECTS_LEAK_CHECKS": "0", "EFFECTS_FUZZ_EXAMPLES": "6"}

# What every session but `tests` on the newest Python (the newest JAX) leaves
# to it: the docs' pages and notebooks, the repro scripts of real code, the
# two-process run, and the tests marked `slow` (end-to-end runs of real models
# and solvers, the generators' coverage). They call the public API the
# library's tests check on every version; run everywhere, they took half of
# each repeat's time and a third of the leak-checked session's (unchecked even
# there), and CI's 40 minutes were past. (The `docs` session runs the
# notebooks, and `examples` the examples, on Python 3.11.)
_ENDS_ONLY = [
    *(
        f"--ignore=tests/{name}"
        for name in (
            "test_docs.py",
            "test_notebooks.py",
            "test_repros.py",
            "test_multiprocess.py",
        )
    ),
    "-m",
    "not slow",
]


def _pytest(
    session: nox.Session, *args: str, workers: str = "auto", **env: str
) -> None:
    """Print the versions under test, then run pytest on `workers` processes
    (pytest-xdist; `nox -s tests -- -n 0` runs in this one)."""
    session.run("python", "-c", _VERSIONS, silent=False)
    session.run("pytest", "-n", workers, *args, *session.posargs, env=env)


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """The test suite on the newest JAX each Python resolves to (CPU): whole
    on the newest Python; on the oldest, the library's tests (`_ENDS_ONLY`)
    with JAX's tracer-leak checking on."""
    session.install("-e", ".[test]")
    if session.python == PYTHONS[0]:
        # (the generated programs in full on the newest JAX; here, as where the
        # suite repeats, the first of them)
        _pytest(
            session, *_ENDS_ONLY, EFFECTS_LEAK_CHECKS="1", EFFECTS_FUZZ_EXAMPLES="6"
        )
    else:
        _pytest(session, EFFECTS_LEAK_CHECKS="0")


@nox.session
@nox.parametrize(
    ("python", "jax"),
    [
        nox.param(python, jax, id=jax, tags=CI if jax in _IN_CI else [])
        for jax, python in JAX_MINORS.items()
    ],
)
def tests_jax(session: nox.Session, jax: str) -> None:
    """The library's tests on each JAX minor release, pinned (`jax==0.X.*`), on
    CPU: the suite but what only `tests` on the newest Python runs
    (`_ENDS_ONLY`)."""
    session.install("-e", ".[test]", f"jax=={jax}.*", f"jaxlib=={jax}.*")
    _pytest(session, *_ENDS_ONLY, **_REPEAT)


# Not among the default sessions: `nox -s fuzz` (`-- -x` to stop at the first
# failure). The property tests run on thousands of generated programs each,
# new ones on every run; a failure prints its program as a standalone script.
@nox.session(python="3.11")
def fuzz(session: nox.Session) -> None:
    """The property tests (tests/test_properties.py) on thousands of programs."""
    session.install("-e", ".[test]")
    session.run("python", "-c", _VERSIONS, silent=False)
    session.run(
        "pytest",
        "-n",
        "auto",
        "tests/test_properties.py",
        *session.posargs,
        env={"EFFECTS_FUZZ_EXAMPLES": "2000", "EFFECTS_FUZZ_RANDOM": "1"},
    )


@nox.session(python="3.11", tags=CI)
def minimums(session: nox.Session) -> None:
    """The library's tests on the lowest versions pyproject.toml allows (the
    suite but `_ENDS_ONLY`)."""
    if not _has_uv():
        session.error("the minimums session needs uv (`pip install uv`)")
    session.install("--resolution", "lowest-direct", "-e", ".[test]")
    _pytest(session, *_ENDS_ONLY, **_REPEAT)


@nox.session(python="3.12", tags=CI)
def cuda(session: nox.Session) -> None:
    """The test suite on a GPU with the CUDA build of JAX (skips without a GPU)."""
    gpus = _visible_gpus()
    if not gpus:
        session.skip(
            "no GPU is visible (`nvidia-smi -L` lists none): the cuda session needs "
            "an NVIDIA GPU and driver; run `nox -s tests` for the CPU suite"
        )
    session.log(f"GPUs: {gpus}")
    session.install("-e", ".[test]", "jax[cuda12]")
    # The GPU is the default backend; the CPU backend is there for the tests
    # that need 8 devices when fewer GPUs are visible (tests/helpers.py).
    # One process: every pytest-xdist worker would claim the GPU's memory.
    _pytest(session, workers="0", JAX_PLATFORMS="cuda,cpu", **_REPEAT)


# The sessions CI runs two at a time, longest first: .ci/run starts them in
# the order they are defined here.


@nox.session(python="3.11", tags=CI_ONE_CORE)
def bench_smoke(session: nox.Session) -> None:
    """Every benchmark's smallest case once, its values checked (no timing)."""
    session.install("-e", ".[flax]")
    session.run("python", "benchmarks/run_all.py", "--smoke")


@nox.session(python="3.11", tags=CI_ONE_CORE)
def examples(session: nox.Session) -> None:
    """Run every script in examples/."""
    session.install("-e", ".[test,plot]")
    scripts = sorted(p for p in _glob("examples/*.py"))
    if not scripts:
        session.error("no scripts in examples/")
    for script in scripts:
        session.run("python", script)


@nox.session(python="3.11", tags=CI_ONE_CORE)
def docs(session: nox.Session) -> None:
    """Build the docs strictly and run every notebook."""
    session.install("-e", ".[docs,test,notebooks]")
    site = f"{session.create_tmp()}/site"
    # NO_MKDOCS_2_WARNING: mkdocs-material's banner about a future mkdocs 2.
    session.run(
        "mkdocs",
        "build",
        "--strict",
        "--site-dir",
        site,
        env={"NO_MKDOCS_2_WARNING": "1"},
    )
    # The pages' code blocks run in every `tests` session (tests/test_docs.py);
    # here only what needs the `docs` and `notebooks` extras.
    session.run("pytest", "-n", "auto", "tests/test_notebooks.py", *session.posargs)


@nox.session(python="3.11", tags=CI_ONE_CORE)
def typecheck(session: nox.Session) -> None:
    """pyright on effects/."""
    session.install("-e", ".[lint,flax]")
    session.run("pyright", "--pythonpath", f"{session.virtualenv.location}/bin/python")


@nox.session(python="3.11", tags=CI_ONE_CORE)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("-e", ".[lint,flax]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


# Not among the default sessions: run it with `nox -s bench` (`-- --quick` for a
# smoke run with fewer repeats).
@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Run the benchmarks; write benchmarks/results.md and docs/performance.md."""
    session.install("-e", ".[flax]")
    session.run(
        "python",
        "benchmarks/run_all.py",
        "--output",
        "benchmarks/results.md",
        "--docs",
        "docs/performance.md",
        *session.posargs,
    )


#
# Helpers
#


def _glob(pattern: str) -> list[str]:
    import glob

    return glob.glob(pattern)


def _has_uv() -> bool:
    return shutil.which("uv") is not None


def _visible_gpus() -> list[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line for line in out.stdout.splitlines() if line.startswith("GPU ")]
