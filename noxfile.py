import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests"]


@nox.session(python=["3.11", "3.12", "3.13"])
def tests(session: nox.Session) -> None:
    """Run the test suite."""
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)
