"""Many processes: a handled, data-parallel training step over two processes of 4
CPU devices each, joined by `jax.distributed` on the loopback address with gloo
collectives. Each runs `tests/multiprocess_worker.py`, which checks `Tag`,
`Stats`, `Substitute(per_call=True)`, `find_nonfinite` and `fx.summary` against
NumPy and the unhandled step; this test starts them, bounds their time, and
compares what they must agree on."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

import effects as fx

WORKER = Path(__file__).resolve().parent / "multiprocess_worker.py"
TIMEOUT_S = 240  # both processes together; they take about 30 s on 2 busy cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment() -> dict[str, str]:
    # Not pytest's (or pytest-xdist's) state, nor this process's 8 devices.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_", "XLA_", "JAX_", "TPU_", "CUDA_VISIBLE"))
    }
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    # The workers import the `effects` this process imports.
    root = str(Path(fx.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [root, env.get("PYTHONPATH")] if p)
    return env


def test_two_processes(tmp_path):
    port, env = _free_port(), _environment()
    outputs = [tmp_path / f"process{i}.npz" for i in range(2)]
    logs = [(tmp_path / f"process{i}.log").open("w+") for i in range(2)]
    workers = []
    try:
        for i in range(2):
            command = [sys.executable, str(WORKER), str(i), str(port), outputs[i]]
            workers.append(
                subprocess.Popen(
                    command, env=env, stdout=logs[i], stderr=subprocess.STDOUT
                )
            )
        codes = [w.wait(timeout=TIMEOUT_S) for w in workers]
    except subprocess.TimeoutExpired:
        codes = None
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait(timeout=30)
    text = []
    for i, log in enumerate(logs):
        log.seek(0)
        text.append(f"--- process {i} ---\n{log.read()[-6000:]}")
        log.close()
    assert codes == [0, 0], f"exit codes {codes} (None: timed out)\n" + "\n".join(text)

    # Both processes computed the same: the loss, the same summaries (bar the
    # line saying which process printed), per-example statistics and sites.
    first, second = (np.load(path) for path in outputs)
    assert sorted(first.files) == sorted(second.files)
    for key in first.files:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    assert first["summary"].item().count("\n") == 4  # header, rule, 3 layers
    assert first["layers.0/mean"].shape == (16,)
