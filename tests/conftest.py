import os

# Must run before jax is imported anywhere.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_check_tracer_leaks", True)

if os.environ["JAX_PLATFORMS"].split(",")[0] == "cuda":
    # The cuda session must not pass by quietly running on the CPU.
    assert jax.default_backend() == "gpu", jax.devices()
