"""One of the two processes `tests/test_multiprocess.py` starts: a training step
of an Equinox MLP with optax, data-parallel over the 8 CPU devices of two
processes (4 each, joined by `jax.distributed` on the loopback address, gloo
collectives), handled under `jax.jit`. It checks what it can on its own against
NumPy and writes what the two processes must agree on to an `.npz` file.

Run as `python multiprocess_worker.py PROCESS_ID PORT OUT.npz`, with
`XLA_FLAGS=--xla_force_host_platform_device_count=4` and `JAX_PLATFORMS=cpu`
in the environment (the test sets them). The "many devices" guide
(docs/guides/many-devices.md) points here as its checked multi-process
example."""

import json
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import effects as fx

process_id, port, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(
    f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process_id,
    initialization_timeout=60,
    heartbeat_timeout_seconds=10,  # a dead peer ends this one soon
)
assert jax.process_count() == 2 and jax.device_count() == 8, jax.devices()

mesh = Mesh(np.array(jax.devices()), ("batch",))
batch = NamedSharding(mesh, PartitionSpec("batch"))
replicated = NamedSharding(mesh, PartitionSpec())

# The same data and model on both processes; each passes only its own rows.
rng = np.random.default_rng(0)
x_all = rng.normal(size=(16, 3)).astype(np.float32)
y_all = rng.normal(size=(16, 2)).astype(np.float32)
rows = slice(8 * process_id, 8 * process_id + 8)


def sharded(a: np.ndarray, process_rows: slice = rows) -> jax.Array:
    """A global array of the batch, from this process's rows."""
    return jax.make_array_from_process_local_data(batch, a[process_rows])


def global_copy(a) -> jax.Array:
    """`a` (the same on every process) replicated over all 8 devices."""
    a = np.asarray(a)
    return jax.make_array_from_callback(a.shape, replicated, lambda index: a[index])


model = eqx.nn.MLP(3, 2, width_size=8, depth=2, key=jax.random.key(0))
model = jax.tree.map(lambda a: global_copy(a) if eqx.is_array(a) else a, model)
tagged = fx.tag_modules(model)  # every layer's output, named by its path
optimiser = optax.adam(1e-2)
opt_state = optimiser.init(eqx.filter(tagged, eqx.is_array))  # its structure
plain_opt_state = optimiser.init(eqx.filter(model, eqx.is_array))


def step(model, opt_state, x, y):
    def loss_fn(model):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    params = eqx.filter(model, eqx.is_array)
    updates, opt_state = optimiser.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss


x, y = sharded(x_all), sharded(y_all)
assert not x.is_fully_addressable  # the batch spans both processes

# (e) The handled step's loss is bitwise the unhandled step's.
plain = eqx.filter_jit(step)(model, plain_opt_state, x, y)
handled = eqx.filter_jit(fx.handle(step, fx.Tag()))
(new_model, _, loss), found = handled(tagged, opt_state, x, y)
assert np.asarray(loss) == np.asarray(plain[2]), (loss, plain[2])
new_params, plain_params = (
    multihost_utils.process_allgather(
        jax.tree.leaves(eqx.filter(m, eqx.is_array)), tiled=True
    )
    for m in (new_model, plain[0])
)
assert all(map(np.array_equal, new_params, plain_params))

# (a) What Tag collected: global arrays spanning both processes, equal to a
# NumPy forward pass of the whole batch.
values = found["intermediates"]
names = ["layers.0", "layers.1", "layers.2"]
assert sorted(values) == names, sorted(values)
gathered = {
    name: np.asarray(multihost_utils.process_allgather(entries[0], tiled=True))
    for name, entries in values.items()
}
h = x_all
for i, name in enumerate(names):
    layer = model.layers[i]
    h = h @ np.asarray(layer.weight).T + np.asarray(layer.bias)
    assert values[name][0].shape == h.shape, (values[name][0].shape, h.shape)
    np.testing.assert_allclose(gathered[name], h, rtol=1e-5, atol=1e-6)
    h = np.maximum(h, 0) if i < 2 else h

# (f) summary of the values that span processes: every process computes the
# same table, equal to NumPy's summary of the gathered values.
table = fx.summary(found)
reference = fx.summary({"intermediates": {k: (v,) for k, v in gathered.items()}})
assert [r["name"] for r in table.rows] == [r["name"] for r in reference.rows]
for row, ref in zip(table.rows, reference.rows):
    for key, value in ref.items():
        if isinstance(value, float):
            np.testing.assert_allclose(row[key], value, rtol=1e-5, atol=1e-6)
        else:
            assert row[key] == value, (key, row, ref)
text = str(table)
note = f"process {process_id} of 2; statistics over the global values"
assert text.splitlines()[0] == note, text
assert note in table._repr_html_()

# (c) Substituting what Tag collected, per call, gives the same step.
# The values are an argument of the jitted function: a handler's arrays are
# read when it traces, as constants, and a global array cannot be one.


@eqx.filter_jit
def substituted(values, *args):
    return fx.handle(step, fx.Substitute(values, per_call=True))(*args)


(sub_model, _, sub_loss), _ = substituted(values, tagged, opt_state, x, y)
assert np.asarray(sub_loss) == np.asarray(loss), (sub_loss, loss)

# (b) Stats, per example: sharded along the batch; the parent compares the two
# processes' (gathered) results, here compared with NumPy's.
stats = eqx.filter_jit(fx.handle(step, fx.Stats()))(tagged, opt_state, x, y)[1]
stats_table = fx.summary(stats, per_example=True)
per_example = {
    f"{name}/{key}": np.asarray(multihost_utils.process_allgather(v, tiled=True))
    for name, entries in stats["intermediates"].items()
    for key, v in entries[0].items()
}
for name in names:
    for key in ("mean", "std", "min", "max", "mean_abs", "nan_count"):
        got = per_example[f"{name}/{key}"]
        want = np.array([r[key] for r in stats_table.rows if r["name"] == name])
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert got.shape == (16,), got.shape
    np.testing.assert_allclose(
        per_example[f"{name}/mean"], gathered[name].mean(axis=1), rtol=1e-5, atol=1e-6
    )
# ... and combined over the batch by the summary: the statistics of the
# gathered values, as NumPy computes them.
combined = fx.summary(stats)
for row, ref in zip(combined.rows, reference.rows):
    assert row["name"] == ref["name"] and row["examples"] == 16, row
    for key in ("mean", "std", "min", "max", "mean_abs", "nan_count"):
        np.testing.assert_allclose(row[key], ref[key], rtol=1e-5, atol=1e-6)

# (d) find_nonfinite names the first layer when a NaN is planted in process
# 1's rows (process 0's are finite), forward and backward.
x_nan = x_all.copy()
x_nan[12, 1] = np.nan
bad_args = (tagged, opt_state, sharded(x_nan), y)
# (`fx.sites`, so `find_nonfinite`, takes a function returning arrays alone.)
bad = fx.find_nonfinite(lambda *a: eqx.filter(step(*a), eqx.is_array), *bad_args)
assert (bad.name, bad.call) == ("layers.0", 0), bad


def loss_of(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


bad_backward = fx.find_nonfinite(loss_of, tagged, bad_args[2], y, backward=True)
assert (bad_backward.name, bad_backward.backward) == ("layers.0", False), bad_backward
# A gradient that goes bad on the way back: sqrt's derivative at 0.
zero_model = eqx.tree_at(
    lambda m: m.layers[2].weight, tagged, global_copy(np.zeros((2, 8), np.float32))
)
zero_model = eqx.tree_at(lambda m: m.layers[2].bias, zero_model, global_copy([0, 0.0]))


def sqrt_loss(model, x):
    return jnp.sum(jnp.sqrt(jax.vmap(model)(x) ** 2))


bad_cotangent = fx.find_nonfinite(sqrt_loss, zero_model, x, backward=True)
assert (bad_cotangent.name, bad_cotangent.backward) == ("layers.2", True), bad_cotangent

np.savez(
    out_path,
    loss=np.asarray(loss),
    summary=np.array(text.split("\n", 1)[1]),
    stats_summary=np.array(str(stats_table).split("\n", 1)[1]),
    bad=np.array(json.dumps([str(bad), str(bad_backward), str(bad_cotangent)])),
    **per_example,
)
jax.distributed.shutdown()
