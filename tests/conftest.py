import os

# Must run before jax is imported anywhere.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Tracer-leak checking, on unless EFFECTS_LEAK_CHECKS=0 (as the nox sessions
# that repeat the suite on other JAX versions set it: it turns JAX's tracing
# caches off, which doubles the suite's time). The property tests turn it off
# but for one property (tests/test_properties.py says why), and so do the
# modules in `_LEAKS_CHECKED_ELSEWHERE` (see `_leak_checks_where_they_find`).
jax.config.update(
    "jax_check_tracer_leaks", os.environ.get("EFFECTS_LEAK_CHECKS", "1") != "0"
)

if os.environ["JAX_PLATFORMS"].split(",")[0] == "cuda":
    # The cuda session must not pass by quietly running on the CPU.
    assert jax.default_backend() == "gpu", jax.devices()


import pytest  # noqa: E402
from helpers import no_leak_checks  # noqa: E402

# Modules whose code calls what the library's own tests call, on values no
# cache of ours keeps beyond what those tests check: the docs' pages and the
# repro scripts (the public API, as users call it), JAX's own facts and our
# compat reads (JAX alone: those that need the checker turn it on themselves),
# and the two-process run. Leak-checked, they took 880 of the suite's 2,700
# CPU seconds, against 420 unchecked.
_LEAKS_CHECKED_ELSEWHERE = {
    "test_docs.py",
    "test_repros.py",
    "test_jax_facts.py",
    "test_compat.py",
    "test_multiprocess.py",
}


@pytest.fixture(autouse=True)
def _leak_checks_where_they_find(request):
    # (a `slow` test, an end-to-end run of a model, calls what the library's
    # own tests check, on a larger program: leak-checked, it cost twice as
    # much; one that needs the checker turns it on itself)
    slow = request.node.get_closest_marker("slow") is not None
    if slow or request.path.name in _LEAKS_CHECKED_ELSEWHERE:
        with no_leak_checks():
            yield
    else:
        yield


@pytest.fixture
def jax_leak_check_false_report():
    """Turns tracer-leak checking off for a test that meets JAX's false report:
    an effect kept through partial evaluation (a `partial_eval_kept_effects`
    member, as `jax.debug.print` is) in a scan under `jax.grad` makes
    `jax_check_tracer_leaks` report the partial-evaluation trace as leaked,
    with JAX alone (jax 0.10.2):

        jax.config.update("jax_check_tracer_leaks", True)
        def f(x):
            def body(c, r):
                jax.debug.print("r={r}", r=r)
                return c + jnp.sin(r).sum(), None
            return lax.scan(body, 0.0, x)[0]
        jax.grad(f)(jnp.ones((2, 2)))  # Exception: Leaked trace JaxprTrace

    The same for an effect that depends on a tangent (a cotangent site; with
    JAX alone, a `jax.debug.print` in a custom_jvp rule) in a `shard_map` under
    `jax.grad` (jax 0.10.2, 0.12).

    `tests/test_rewrite.py::test_jax_leak_checker_false_report` and
    `..._in_a_differentiated_shard_map` check that JAX still does this, so the
    marks can go when it no longer does."""
    with no_leak_checks():
        yield
