import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests"]


@nox.session(python=["3.11", "3.12", "3.13"])
def tests(session: nox.Session) -> None:
    """Run the test suite."""
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


# Not among the default sessions: run it with `nox -s bench` (`-- --quick` for a
# smoke run with fewer repeats).
@nox.session
def bench(session: nox.Session) -> None:
    """Run the benchmarks; write benchmarks/results.md and docs/performance.md."""
    session.install("-e", ".", "flax>=0.12")
    session.run(
        "python",
        "benchmarks/run_all.py",
        "--output",
        "benchmarks/results.md",
        "--docs",
        "docs/performance.md",
        *session.posargs,
    )
