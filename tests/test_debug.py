"""The debugging tools: `Stats` and `summary` against statistics computed with
NumPy from the values `Tag` collects, `sites` against the program, and
`find_nonfinite` forward and backward against NaNs and Infs placed by hand."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, devices

import effects as fx

STATS = ("mean", "std", "min", "max", "mean_abs", "nan_count", "inf_count")


def numpy_stats(x) -> dict:
    x = np.asarray(x, np.float64)
    finite = x[np.isfinite(x)]
    some = finite.size > 0
    return {
        "mean": finite.mean() if some else np.nan,
        "std": finite.std() if some else np.nan,
        "min": finite.min() if some else np.nan,
        "max": finite.max() if some else np.nan,
        "mean_abs": np.abs(finite).mean() if some else np.nan,
        "nan_count": np.isnan(x).sum(),
        "inf_count": np.isinf(x).sum(),
    }


def assert_stats(got: dict, x):
    want = numpy_stats(x)
    for k in STATS:
        np.testing.assert_allclose(
            np.asarray(got[k], np.float64), want[k], rtol=1e-5, atol=1e-6, err_msg=k
        )


def f(x):
    h = fx.tag(jnp.sin(x), "h")

    def body(c, r):
        return fx.tag(c * r, "c"), None

    c, _ = jax.lax.scan(body, jnp.ones(2), x.reshape(-1, 2))
    fx.tag(jnp.log(x), "log")  # a NaN for each negative entry
    fx.tag(1.0 / (x - x[0]), "inv")  # an Inf, and a NaN (0/0) at index 0
    fx.tag(jnp.full(3, jnp.nan), "nothing_finite")
    return jnp.sum(h) + jnp.sum(c)


X = jnp.array([0.5, -1.0, 2.0, 3.0, -0.25, 4.0])


@pytest.mark.parametrize("jit", [False, True])
def test_stats_match_numpy_on_the_values_tag_collects(jit):
    run = fx.handle(f, fx.Stats())
    out, found = (jax.jit(run) if jit else run)(X)
    plain, values = fx.handle(f, fx.Tag())(X)
    assert_trees_close(out, plain)
    stats, values = found["intermediates"], values["intermediates"]
    names = ["h", "c", "log", "inv", "nothing_finite"]
    assert list(values) == names
    assert list(stats) == names  # in program order, under an outer jit too
    for name in ("h", "log", "inv", "nothing_finite"):
        (entry,) = stats[name]
        assert_stats(entry, values[name][0])
    # Inside the scan: one statistic per iteration, stacked along it.
    (entry,) = stats["c"]
    assert entry["mean"].shape == (3,)
    for i in range(3):
        assert_stats({k: v[i] for k, v in entry.items()}, values["c"][0][i])
    assert int(stats["log"][0]["nan_count"]) == 2


def test_stats_per_example_under_vmap_in_either_order():
    xs = jnp.stack([X, -X, 2 * X])
    inside = fx.handle(jax.vmap(f), fx.Stats())(xs)[1]
    outside = jax.vmap(fx.handle(f, fx.Stats()))(xs)[1]
    # The same statistics; each entry knows whether its examples are the
    # batch of a vmap inside `handle` (`fx.summary` combines them) or not.
    assert_trees_close(jax.tree.leaves(inside), jax.tree.leaves(outside))
    batch = [e.batch for (e,) in inside["intermediates"].values()]
    assert batch == [1] * 5
    assert [e.batch for (e,) in outside["intermediates"].values()] == [0] * 5
    values = fx.handle(jax.vmap(f), fx.Tag())(xs)[1]["intermediates"]
    for b in range(3):
        entry = {k: v[b] for k, v in inside["intermediates"]["h"][0].items()}
        assert_stats(entry, values["h"][0][b])


@pytest.mark.slow
def test_stats_over_the_whole_batch():
    # Per token (two vmaps, as an Equinox model's over tokens) and in a scan:
    # per_example=False summarises each execution over all examples at once.
    def g(x):  # x: (batch, tokens, 6)
        per_token = jax.vmap(jax.vmap(f))
        fx.tag(jnp.sum(x), "total")  # a value no vmap batches
        return per_token(x)

    xs = jnp.stack([jnp.stack([X, -X, 2 * X]), jnp.stack([X + 1, X * X, -2 * X])])
    out, found = fx.handle(g, fx.Stats(per_example=False))(xs)
    plain, values = fx.handle(g, fx.Tag())(xs)
    assert_trees_close(out, plain)
    stats, values = found["intermediates"], values["intermediates"]
    for name in ("total", "h", "log", "inv", "nothing_finite"):
        (entry,) = stats[name]
        assert entry["mean"].shape == ()
        assert_stats(entry, values[name][0])
    (entry,) = stats["c"]  # one per iteration of the scan, over the batch
    assert entry["mean"].shape == (3,)
    for i in range(3):
        assert_stats({k: v[i] for k, v in entry.items()}, values["c"][0][:, :, i])
    # summary: one row per execution (and scan iteration), not per example
    assert len(fx.summary(found).rows) == 5 + 3
    per_example = fx.handle(g, fx.Stats())(xs)[1]
    assert len(fx.summary(per_example, per_example=True).rows) == 6 * (4 + 3) + 1
    # ... unless asked: by default the table combines the examples, exactly
    whole, combined = fx.summary(found), fx.summary(per_example)
    assert [r["examples"] for r in combined.rows] == [None] + [6] * 7
    assert [r["examples"] for r in whole.rows] == [None] * 8
    for a, b in zip(whole.rows, combined.rows):
        assert (a["name"], a["index"], a["finite"]) == (
            b["name"],
            b["index"],
            b["finite"],
        )
        for k in STATS:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # under jit, and a vmap outside handle is invisible to it (per example)
    assert_trees_close(
        jax.jit(fx.handle(g, fx.Stats(per_example=False)))(xs), (out, found)
    )
    outside = jax.vmap(fx.handle(jax.vmap(f), fx.Stats(per_example=False)))(xs)[1]
    for b in range(2):
        assert_stats(
            {k: v[b] for k, v in outside["intermediates"]["h"][0].items()},
            values["h"][0][b],
        )


@pytest.mark.slow
def test_summary_combines_the_examples_of_stats_exactly():
    # Per example under two vmaps and a scan, with NaNs and Infs in some
    # examples only, and an example with no finite value at all: the combined
    # rows are NumPy's statistics of the batch's values (what Tag collects).
    def one(v):
        fx.tag(jnp.where(v > 2.5, jnp.nan, v), "some_nan")
        fx.tag(jnp.where(v[0] < 0, jnp.inf, v), "all_or_none")
        return f(v)

    g = jax.vmap(jax.vmap(one))  # x: (2, 3, 6)

    xs = jnp.stack([jnp.stack([X, -X, 2 * X]), jnp.stack([X + 1, X * X, -2 * X])])
    _, stats = fx.handle(g, fx.Stats())(xs)
    _, values = jax.jit(fx.handle(g, fx.Tag()))(xs)
    table = fx.summary(stats)
    assert table.columns[5] == "examples"
    rows = {(r["name"], r["index"]): r for r in table.rows}
    assert len(rows) == len(table.rows) == 6 + 3
    for name, (value,) in values["intermediates"].items():
        value = np.asarray(value)
        for i in range(3) if name == "c" else [None]:
            row = rows[name, None if i is None else (i,)]
            whole = value if i is None else value[:, :, i]  # a scan's iteration
            assert row["examples"] == 6
            assert row["shape"] == whole.shape[2:] and row["dtype"] == "float32"
            for k, want in numpy_stats(whole).items():
                np.testing.assert_allclose(row[k], want, rtol=1e-5, atol=1e-6)
    # A vmap outside handle stacks an axis handle did not make: a row per
    # index along it (`outer`), over that index's examples of the vmap inside.
    outside = jax.vmap(fx.handle(jax.vmap(one), fx.Stats()))(xs)[1]
    again = fx.summary(outside)
    assert again.columns[2] == "outer" and len(again.rows) == 2 * len(table.rows)
    for r in again.rows:
        (o,) = r["outer"]
        value = np.asarray(values["intermediates"][r["name"]][0])[o]
        whole = value if r["index"] is None else value[:, r["index"][0]]
        assert r["examples"] == 3
        for k, want in numpy_stats(whole).items():
            np.testing.assert_allclose(r[k], want, rtol=1e-5, atol=1e-6, err_msg=k)
    # Shown per example: the same statistics as Stats computed, per index.
    each = fx.summary(stats, per_example=True).rows
    h = [r for r in each if r["name"] == "h"]
    assert [r["index"] for r in h] == [(b, t) for b in range(2) for t in range(3)]
    for r in h:
        assert r["examples"] == 1 and r["shape"] == (6,)
        assert_stats(r, values["intermediates"]["h"][0][r["index"]])


def test_summary_of_stats_per_training_step_keeps_the_steps_apart():
    # What Stats found at each step of a training loop written as a scan: the
    # steps are not examples (handle did not make that axis), so each gets its
    # rows, `outer` its index; the NaN of step 2 is that step's alone. The
    # reference: each step's values, as Tag collects them, in NumPy.
    def step(w, x):  # (w: (3,), x: (4, 3): a batch of 4)
        def loss(w, x):
            h = jax.vmap(lambda v: fx.tag(jnp.log(v * w), "h"))(x)
            return jnp.sum(jnp.where(jnp.isfinite(h), h, 0.0))

        (_, found), g = jax.value_and_grad(fx.handle(loss, fx.Stats()), has_aux=True)(
            w, x
        )
        return w - 0.01 * g, (found, fx.handle(loss, fx.Tag())(w, x)[1])

    xs = jnp.arange(1.0, 49.0).reshape(4, 4, 3) / 10
    xs = xs.at[2, 1, 0].set(-1.0)  # log of a negative: step 2's NaN
    _, (stats, values) = jax.jit(lambda w: jax.lax.scan(step, w, xs))(jnp.ones(3))
    (entry,) = stats["intermediates"]["h"]
    assert entry.batch == 1 and entry.stacked == () and entry["mean"].shape == (4, 4)
    table = fx.summary(stats)
    assert [r["outer"] for r in table.rows] == [(i,) for i in range(4)]
    assert [r["examples"] for r in table.rows] == [4] * 4
    assert [r["nan_count"] for r in table.nonfinite] == [1]
    assert table.nonfinite[0]["outer"] == (2,)
    (value,) = values["intermediates"]["h"]
    for r in table.rows:
        assert_stats(r, np.asarray(value)[r["outer"]])


def test_summary_of_stats_in_shard_maps_and_scans():
    # Per example, per shard and per iteration: the table combines the
    # examples and the shards (the whole value, as for Tag), keeping a row per
    # iteration; against NumPy on Tag's values.
    mesh = jax.sharding.Mesh(np.array(devices(2)), ("s",))
    spec = jax.sharding.PartitionSpec("s")

    def g(x):  # (4, 2, 3)
        def body(c, _):
            return fx.tag(jnp.sin(c) + c, "c"), None

        def shard(v):  # (2, 2, 3): one shard, two examples
            return jax.vmap(lambda u: jax.lax.scan(body, u, None, length=3)[0])(v)

        return jax.shard_map(shard, mesh=mesh, in_specs=spec, out_specs=spec)(x)

    xs = jnp.arange(24.0).reshape(4, 2, 3) / 7 - 1
    _, stats = fx.handle(g, fx.Stats())(xs)
    _, values = fx.handle(g, fx.Tag())(xs)
    ((entry,),) = stats["intermediates"].values()
    assert entry.stacked == ("shard", "scan") and entry["mean"].shape == (2, 2, 3)
    # Tag's layout: (examples, shards, iterations, 2, 3)
    value = np.asarray(values["intermediates"]["c"][0])
    rows = fx.summary(stats).rows
    assert [r["index"] for r in rows] == [(i,) for i in range(3)]
    for r in rows:
        assert r["examples"] == 4 and r["shape"] == (2, 3)
        want = numpy_stats(value[:, :, r["index"][0]])
        for k in STATS:
            np.testing.assert_allclose(r[k], want[k], rtol=1e-5, atol=1e-6)
    each = fx.summary(stats, per_example=True).rows
    assert [r["index"] for r in each] == list(np.ndindex(2, 2, 3))
    for r in each:
        assert r["examples"] == 1
        assert_stats(r, value[r["index"]])


def test_stats_entries_know_their_leaf_and_are_pytrees():
    def g(x):
        fx.tag({"a": x.astype(jnp.bfloat16), "b": jnp.arange(3)}, "t")
        return x

    run = fx.handle(jax.vmap(g), fx.Stats())
    _, found = jax.jit(run)(jnp.ones((4, 2)))
    (entry,) = found["intermediates"]["t"]
    a, b = entry["a"], entry["b"]
    assert (a.shape, a.dtype, a.stacked) == ((2,), "bfloat16", ())
    assert (b.shape, b.dtype, b.stacked) == ((3,), "int32", ())
    assert dict(a).keys() == set(STATS) and a["mean"].shape == (4,)
    # A pytree: through jit, vmap outside handle, and tree functions.
    assert_trees_close(found, run(jnp.ones((4, 2)))[1])
    leaves, tree = jax.tree.flatten(a)
    assert len(leaves) == len(STATS)
    back = jax.tree.unflatten(tree, [2 * v for v in leaves])
    assert (back.shape, back.stacked) == ((2,), ())
    np.testing.assert_array_equal(back["nan_count"], 2 * a["nan_count"])
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(a)]
    assert paths == [f"['{k}']" for k in STATS]
    # A summary of Tag values has no `examples` column.
    assert "examples" not in fx.summary(fx.handle(g, fx.Tag())(jnp.ones(2))[1]).columns


def test_a_user_handler_over_the_whole_batch():
    # A mode of `per_example=False`: `apply` gets the batch, batch axes first,
    # and may change it and report reductions of it.
    class Center(fx.Handler):
        """Subtracts the batch mean of every tag, and sums its norms."""

        mode = fx.Reduce(
            lambda total, x: total + x, lambda zeros: jnp.float32(0), per_example=False
        )

        def apply(self, site, value, ctx):
            ctx.emit(jnp.sqrt(jnp.sum(value**2)))
            return value - jnp.mean(value, axis=0)

    def g(x):  # x: (B, 3)
        def one(xi):
            def step(c, _):
                return fx.tag(jnp.tanh(c), "c"), None

            return jax.lax.scan(step, xi, None, length=2)[0]

        return jax.vmap(one)(x)

    x = jnp.array([[0.5, -1.0, 2.0], [1.5, 0.25, -3.0]])
    out, found = fx.handle(g, Center())(x)
    c, norms = x, 0.0
    for _ in range(2):
        c = np.tanh(c)
        norms += np.sqrt(np.sum(c**2))
        c = c - c.mean(axis=0)
    assert_trees_close(out, c)
    assert_trees_close(found["intermediates"]["c"], np.float32(norms))


def test_entries_of_the_whole_batch_in_a_scan_are_stacked_in_front_of_it():
    # As `fx.Append` says: a scan's entries stack in front of what `apply`
    # emits, here the whole batch: (scan, batch, ...), where `Tag()` reports
    # (batch, scan, ...).
    class Whole(fx.Handler):
        mode = fx.Append(per_example=False)

        def apply(self, site, value, ctx):
            ctx.emit(value)
            return value

    def g(xs):  # xs: (B, S, 3)
        def one(x):
            def step(c, xi):
                return c + 1.0, fx.tag(jnp.sin(xi) * c, "h")

            return jax.lax.scan(step, 1.0, x)[1]

        return jax.vmap(one)(xs)

    xs = jnp.arange(30.0).reshape(2, 5, 3) / 10
    reference = np.sin(np.asarray(xs)) * np.arange(1, 6, dtype=np.float32)[:, None]
    (whole,) = fx.handle(g, Whole())(xs)[1]["intermediates"]["h"]
    (tagged,) = fx.handle(g, fx.Tag())(xs)[1]["intermediates"]["h"]
    assert_trees_close(whole, reference.transpose(1, 0, 2))
    assert_trees_close(tagged, reference)


def test_stats_of_integers_low_precision_and_pytrees():
    def g(x):
        fx.tag(jnp.arange(5), "ints")
        fx.tag(x.astype(jnp.bfloat16), "bf16")
        fx.tag({"a": x, "b": (2 * x, x[:2])}, "tree")
        return x

    _, found = fx.handle(g, fx.Stats())(X)
    stats = found["intermediates"]
    assert_stats(stats["ints"][0], np.arange(5))
    assert stats["bf16"][0]["mean"].dtype == jnp.float32
    np.testing.assert_allclose(
        stats["bf16"][0]["mean"],
        np.asarray(X.astype(jnp.bfloat16), np.float64).mean(),
        rtol=1e-6,
    )
    tree = stats["tree"][0]
    assert_stats(tree["a"], X)
    assert_stats(tree["b"][0], 2 * X)
    assert_stats(tree["b"][1], X[:2])


def test_stats_names_and_errors():
    _, found = fx.handle(f, fx.Stats(names="l*"))(X)
    assert list(found["intermediates"]) == ["log"]
    with pytest.raises(TypeError, match="Stats: collection must be a string"):
        fx.Stats(collection=1)  # pyright: ignore[reportArgumentType]
    # An exact name is meant to exist; a glob may match nothing.
    with pytest.raises(ValueError, match="Stats: no tag named 'lgo'.*'log'"):
        fx.handle(f, fx.Stats(names="lgo"))(X)
    with pytest.raises(ValueError, match="Stats: no tag matching 'q\\*'.*'log'"):
        fx.handle(f, fx.Stats(names="q*"))(X)
    with pytest.raises(ValueError, match="Perturb: no perturb site named 'log'"):
        fx.handle(f, fx.Perturb(names="log"))(X)


def test_summary_of_stats_and_of_tag():
    _, stats = fx.handle(f, fx.Stats())(X)
    _, values = fx.handle(f, fx.Tag())(X)
    for found in (stats, values):
        table = fx.summary(found)
        text = str(table)
        assert text.splitlines()[0].split()[:3] == ["name", "call", "index"]
        bad = {r["name"] for r in table.nonfinite}
        assert bad == {"log", "inv", "nothing_finite"}
        assert "<table>" in table._repr_html_() and "#fdd" in table._repr_html_()
        rows = {(r["name"], r["index"]): r for r in table.rows}
        np.testing.assert_allclose(
            rows[("h", None)]["mean"],
            numpy_stats(values["intermediates"]["h"][0])["mean"],
            rtol=1e-5,
        )
    # Stats' stacked entries: one row per scan iteration; Tag's: one per call.
    assert len([r for r in fx.summary(stats).rows if r["name"] == "c"]) == 3
    assert len([r for r in fx.summary(values).rows if r["name"] == "c"]) == 1
    # Several collections: names carry their collection.
    two = {"a": {"x": (jnp.ones(2),)}, "b": {"x": (jnp.zeros(2),)}}
    assert [r["name"] for r in fx.summary(two).rows] == ["a/x", "b/x"]


def program(x):
    h = fx.tag(jnp.sin(x), "h")

    def body(c, r):
        c = jax.lax.cond(r[0] > 0, lambda c: c, lambda c: fx.tag(c * 2, "neg"), c)
        return fx.perturb(c, "c"), None

    c, _ = jax.lax.scan(body, h, x[:, None] * jnp.ones((3, 3)), reverse=True)

    def loop_body(s):
        jax.debug.callback(lambda: CALLS.append(None))  # would show a run
        return s[0] + 1, fx.tag(s[1] * 2, "w")

    w = jax.lax.while_loop(lambda s: fx.tag(s[0], "i") < 3, loop_body, (0, c))

    @jax.jit
    def tree(y):
        return fx.tag({"a": y, "b": y[0]}, "tree")

    return tree(w[1])


CALLS: list = []


def test_sites_lists_every_call_with_its_value_and_control_flow_without_running():
    sds = jax.ShapeDtypeStruct
    f32 = jnp.float32
    found = fx.sites(program)(sds((3,), f32))
    assert CALLS == []
    got = {
        (c, n): [(i.kind, i.value, i.where) for i in infos]
        for c, names in found.items()
        for n, infos in names.items()
    }
    assert got == {
        ("intermediates", "h"): [("tag", sds((3,), f32), "")],
        ("intermediates", "neg"): [
            ("tag", sds((3,), f32), "scan(length=3, reverse) > cond branch 0")
        ],
        ("intermediates", "i"): [("tag", sds((), jnp.int32), "while_loop cond")],
        ("intermediates", "w"): [("tag", sds((3,), f32), "while_loop body")],
        ("intermediates", "tree"): [
            ("tag", {"a": sds((3,), f32), "b": sds((), f32)}, "jit(tree)")
        ],
        ("perturbations", "c"): [
            ("perturb", sds((3,), f32), "scan(length=3, reverse)")
        ],
    }
    text = str(found)
    assert text.splitlines()[0].split() == [
        "collection",
        "name",
        "kind",
        "value",
        "where",
    ]
    assert "scan(length=3, reverse) > cond branch 0" in text


def test_sites_of_a_model_tagged_by_tag_modules_and_under_vmap():
    import equinox as eqx

    model = eqx.nn.MLP(3, 2, 4, 2, key=jax.random.key(0))
    found = fx.sites(jax.vmap(fx.tag_modules(model)))(jnp.ones((5, 3)))
    layers = found["intermediates"]
    assert list(layers) == ["layers.0", "layers.1", "layers.2"]
    assert [i.value.shape for i in layers.values() for i in i] == [
        (5, 4),
        (5, 4),
        (5, 2),
    ]
    # A tag called twice in the program is two entries.
    twice = fx.sites(lambda x: fx.tag(x, "t") + fx.tag(2 * x, "t"))(jnp.ones(2))
    assert len(twice["intermediates"]["t"]) == 2


@pytest.mark.parametrize(
    "policy", [None, jax.checkpoint_policies.everything_saveable], ids=["none", "all"]
)
def test_sites_lists_a_site_the_backward_pass_recomputes_once(policy):
    def f(x):
        return jnp.sum(jnp.sin(fx.tag(jnp.sin(x), "h")))

    listed = fx.sites(jax.grad(jax.checkpoint(f, policy=policy)))(jnp.ones(3))
    # the value once, and its cotangent (the backward pass's) once
    parts = [[i.part for i in v] for v in listed["intermediates"].values()]
    assert parts == [["value", "cotangent"]]


def nan_program(x):
    h = fx.tag(jnp.sin(x), "h")

    def body(c, r):
        c = fx.tag(jnp.sqrt(c - r), "s")
        return fx.tag(c * 1.0, "after"), None  # NaN whenever "s" is

    c, _ = jax.lax.scan(body, h, jnp.arange(4.0) * 0.1)

    def loop_body(s):
        i, v = s
        v = jax.lax.cond(i == 1, lambda v: fx.tag(v + 0.0, "branch"), lambda v: v, v)
        return i + 1, fx.tag(jnp.log(v - 0.5), "w")

    _, w = jax.lax.while_loop(lambda s: s[0] < 3, loop_body, (0, c))
    return jax.jit(lambda w: fx.tag(1.0 / w, "inv"))(w)


def nan_reference(x):
    """`nan_program` step by step in NumPy: the executions in order, as (name,
    call, iteration, finite), and the first non-finite one."""
    x = np.asarray(x, np.float64)
    log = []

    def tag(v, name, call, iteration=None):
        log.append((name, call, iteration, bool(np.all(np.isfinite(v)))))
        return v

    with np.errstate(all="ignore"):
        c = tag(np.sin(x), "h", 0)
        for i, r in enumerate(np.arange(4.0) * 0.1):
            c = tag(np.sqrt(c - r), "s", 0, i)
            c = tag(c * 1.0, "after", 0, i)
        v = c
        for i in range(3):
            if i == 1:
                v = tag(v + 0.0, "branch", 0)
            v = tag(np.log(v - 0.5), "w", i)
        tag(1.0 / v, "inv", 0)
    first = next(((n, c, it) for n, c, it, ok in log if not ok), None)
    return first


@pytest.mark.parametrize(
    "x",
    [
        [1.2, 1.5],  # the while loop's second call: log of a negative
        [-0.5, 1.5],  # the scan's first iteration
        [0.01, 1.5],  # the scan's second iteration ("after" only follows it)
        [0.9, 0.9],  # the while loop's second call, past the cond's branch
        [np.pi, 1.5],  # sin(pi) is -8.7e-8 in float32: the first iteration
    ],
)
def test_find_nonfinite_reports_the_first_bad_execution(x):
    x = jnp.asarray(x, jnp.float32)
    want = nan_reference(x)
    got = fx.find_nonfinite(nan_program, x)
    if want is None:
        assert got is None
    else:
        name, call, iteration = want
        assert got == fx.BadSite(name, "intermediates", call, iteration)
        assert f"'{name}'" in str(got) and "first" in str(got)


def test_find_nonfinite_nested_scans_and_other_collections():
    def g(x):
        def outer(c, i):
            def inner(c, j):
                v = fx.tag(jnp.log(c - 0.1 * (i * 3 + j)), "v", collection="logs")
                return c, v

            return jax.lax.scan(inner, c, jnp.arange(3.0))

        return jax.lax.scan(outer, x, jnp.arange(2.0))

    # log(0.45 - 0.1 k) is first NaN at k = 5: outer 1, inner 2.
    got = fx.find_nonfinite(g, jnp.float32(0.45))
    assert got == fx.BadSite("v", "logs", 0, (1, 2))
    assert fx.find_nonfinite(g, jnp.float32(5.0)) is None
    # No tag, and the argument is the NaN: said, rather than found finite.
    said = fx.find_nonfinite(lambda x: x, jnp.float32(jnp.nan))
    assert said is not None and said.primitive is None
    assert "the arguments hold them, at args[0]" in str(said)


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("bad", [7, 9])
def test_find_nonfinite_in_a_lax_map_whose_batches_differ_in_size(bad, backward):
    # `lax.map(batch_size=3)` over 10 values: a scan of 3 batches of a vmap of 3,
    # then a vmap of the 1 left over. The name executes under vmaps of two
    # sizes; its executions are counted whole, not per example (they were, and
    # `find_nonfinite` failed: "reduced over executions under different vmaps").
    def f(xs):
        ys = jax.lax.map(lambda x: fx.tag(jnp.log(x), "h"), xs, batch_size=3)
        return jnp.sum(ys)

    xs = jnp.arange(1.0, 11.0).at[bad].set(-1.0)
    # Executions: the scan's 3 iterations (values 0-2, 3-5, 6-8), then the rest.
    assert fx.find_nonfinite(f, xs, backward=backward) == fx.BadSite(
        "h", "intermediates", bad // 3, None
    )
    assert fx.find_nonfinite(f, jnp.arange(1.0, 11.0), backward=backward) is None


def backward_program(x, r):
    h = fx.tag(x * x, "h")

    def body(c, ri):
        s = fx.tag(jnp.sqrt(c - ri), "s")
        return fx.tag(s * 2.0, "after"), None

    c, _ = jax.lax.scan(body, h, r)
    return jnp.sum(jax.jit(lambda c: fx.tag(jnp.log(c), "log"))(c))


def backward_reference(x, r):
    """What `find_nonfinite(backward_program, x, r, backward=True)` finds, by
    hand in NumPy: the first non-finite tagged value in execution order if
    there is one (the forward pass is already bad), else the first non-finite
    cotangent in the order the backward pass computes them, as `(name, call,
    iteration, backward)`."""
    x, r = np.asarray(x, np.float64), np.asarray(r, np.float64)
    values, cotangents = [], []

    def value(name, v, iteration=None):
        values.append((name, 0, iteration, False, bool(np.all(np.isfinite(v)))))

    def ct(name, v, iteration=None):
        cotangents.append((name, 0, iteration, True, bool(np.all(np.isfinite(v)))))

    with np.errstate(all="ignore"):
        c = [x * x]
        value("h", c[0])
        for i, ri in enumerate(r):
            value("s", np.sqrt(c[-1] - ri), i)
            c.append(2 * np.sqrt(c[-1] - ri))
            value("after", c[-1], i)
        value("log", np.log(c[-1]))
        ct("log", np.ones_like(x))  # d sum(y) / d y
        ct_c = 1 / c[-1]
        for i in reversed(range(len(r))):
            ct("after", ct_c, i)
            ct_s = 2 * ct_c
            ct("s", ct_s, i)
            ct_c = ct_s * 0.5 / np.sqrt(c[i] - r[i])
        ct("h", ct_c)
    bad = [site for *site, ok in values if not ok]
    bad = bad or [site for *site, ok in cotangents if not ok]
    return tuple(bad[0]) if bad else None


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("fails", [False, True])
def test_find_nonfinite_in_a_function_with_checks_of_its_own(fails, backward):
    # checkify reports one failed check: the function's own, failing too, hid
    # the non-finite tag before it (find_nonfinite said there was none).
    from jax.experimental import checkify

    def f(x):
        h = fx.tag(jnp.log(x), "h")  # log(0) = -inf
        checkify.check(jnp.all(x > 0) | (not fails), "x > 0, got {}", x.min())
        return jnp.sum(fx.tag(h * 2, "y"))

    bad = fx.find_nonfinite(f, jnp.array([1.0, 0.0, 2.0]), backward=backward)
    assert bad is not None and (bad.name, bad.call, bad.backward) == ("h", 0, False)
    assert fx.find_nonfinite(f, jnp.array([1.0, 3.0, 2.0]), backward=backward) is None


@pytest.mark.parametrize(
    "x, r",
    [
        ([0.0, 1.0], [0.0, -1.0, -1.0]),  # sqrt'(0) at the first step: "h"
        ([0.5, 1.0], [0.0, 1.0, -1.0]),  # sqrt'(0) at the second: "after" 0
        ([0.15625, 1.0], [0.0, 0.25, 0.5]),  # log(0) = -inf: the value of "log"
        ([0.0, 1.0], [0.0, 1.0, -1.0]),  # sqrt(-1) = NaN: the value of "s" 1
        ([2.0, 1.0], [0.0, 1.0, -1.0]),  # finite
    ],
)
def test_find_nonfinite_backward_reports_the_first_bad_value_or_cotangent(x, r):
    # The first bad value when the forward pass is already non-finite.
    x, r = jnp.asarray(x, jnp.float32), jnp.asarray(r, jnp.float32)
    want = backward_reference(x, r)
    got = fx.find_nonfinite(backward_program, x, r, backward=True)
    if want is None:
        assert got is None
        assert np.all(np.isfinite(jax.grad(backward_program)(x, r)))
        return
    name, call, iteration, backward = want
    assert got == fx.BadSite(name, "intermediates", call, iteration, backward)
    assert f"'{name}'" in str(got)
    if backward:
        assert "backward pass" in str(got)
    else:  # the site backward=False finds, and a message that says so
        assert got == fx.find_nonfinite(backward_program, x, r)
        assert "forward pass is already non-finite" in str(got)


# (the reference, `Tag(of="cotangent")` in a differentiated shard_map, meets
# JAX's false leak report: see conftest.py)
@pytest.mark.usefixtures("jax_leak_check_false_report")
@pytest.mark.parametrize("x0", [1.0, 0.0, -1.0], ids=["finite", "cotangent", "value"])
def test_find_nonfinite_backward_in_a_shard_map(x0):
    # At x0 = 0, sqrt'(0) makes the cotangent of "h" infinite, that of "s"
    # (the loss's) staying 1; at x0 = -1, sqrt(-1) makes the value of "s" a
    # NaN. Both passes of the shard_map are checked.
    mesh = jax.sharding.Mesh(np.array(devices(4)), ("d",))
    spec = jax.sharding.PartitionSpec("d")

    def body(x):
        h = fx.tag(x * x, "h")
        return fx.tag(jnp.sqrt(jnp.sqrt(h) + x0), "s")

    def loss(x):
        sm = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
        return jnp.sum(sm(x))

    x = jnp.arange(8.0).at[0].set(0.0) + jnp.float32(x0 == 1.0)
    got = fx.find_nonfinite(loss, x, backward=True)
    grad = jax.grad(loss)(x)
    if x0 == 1.0:
        assert got is None and np.all(np.isfinite(grad))
    elif x0 == 0.0:
        assert not np.all(np.isfinite(grad))
        _, found = fx.handle(jax.grad(loss), fx.Tag(of="cotangent"))(x)
        cotangents = found["intermediates:cotangent"]
        assert np.all(np.isfinite(cotangents["s"][0]))
        assert not np.all(np.isfinite(cotangents["h"][0]))
        assert (got.name, got.backward) == ("h", True)
    else:
        assert (got.name, got.backward) == ("s", False)
        assert got == fx.find_nonfinite(loss, x)


# (the reference, `Tag(of="cotangent")` in a differentiated shard_map, and
# the backward counters' program meet JAX's false leak report: see conftest.py)
@pytest.mark.usefixtures("jax_leak_check_false_report")
def test_find_nonfinite_of_tags_in_two_shard_maps():
    # JAX's checkify fails on checks in two shard_maps (tests/test_jax_facts.py::
    # test_checkify_fails_on_checks_in_shard_maps), which a shard_map
    # called twice is: the counters answer there, the first bad tag in
    # program order (in the backward pass, the last), at its first bad
    # execution. The references: what Tag() collects of the values and the
    # cotangents, and the untagged function's gradient.
    mesh = jax.sharding.Mesh(np.array(devices(4)), ("d",))
    spec = jax.sharding.PartitionSpec("d")

    def body(x):
        return jnp.sqrt(fx.tag(jnp.log(x), "h"))

    sm = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)

    def f(x):
        return jnp.sum(sm(jnp.exp(sm(x))))

    # Forward: log(log(x)) of x < 1 is NaN at the second call alone.
    x = jnp.arange(8.0) + 0.5
    (first, second) = fx.handle(f, fx.Tag())(x)[1]["intermediates"]["h"]
    assert np.all(np.isfinite(first)) and not np.all(np.isfinite(second))
    # (x[0] = 0.5 in shard 0: log(x) < 0, whose sqrt is the NaN the second
    # call's log takes)
    want = fx.BadSite("h", "intermediates", 1, None, shard=(0,))
    for backward in (False, True):  # (the forward verdict both ways)
        assert fx.find_nonfinite(f, x, backward=backward) == want
    # Backward: every value finite (log(x) = 0 at x = 1 is sqrt's 0), the
    # cotangent of h infinite at the second call only (the first call's
    # x = e^0 = 1 is not sqrt's 0 there: its log is 0 at x = 1 first).
    x = jnp.arange(8.0) + 1.0
    _, found = fx.handle(f, fx.Tag())(x)
    assert all(np.all(np.isfinite(v)) for v in found["intermediates"]["h"])
    assert not np.all(np.isfinite(jax.grad(f)(x)))
    _, found = fx.handle(jax.grad(f), fx.Tag(of="cotangent"))(x)
    cotangents = [np.isfinite(c).all() for c in found["intermediates:cotangent"]["h"]]
    # Both calls' cotangents are infinite (log(1) = 0 at x = 1, and at the
    # second call's e^0): the backward pass meets the second call's first.
    assert cotangents == [False, False]
    got = fx.find_nonfinite(f, x, backward=True)
    assert got == fx.BadSite("h", "intermediates", 1, None, backward=True)
    assert fx.find_nonfinite(f, x) is None


# (the backward counters' program meets JAX's false leak report in a
# differentiated shard_map: see conftest.py)
@pytest.mark.usefixtures("jax_leak_check_false_report")
@pytest.mark.parametrize("nest", ["scan in shard_map", "shard_map in scan"])
def test_find_nonfinite_of_tags_in_a_loop_and_a_shard_map(nest):
    # JAX's checkify fails on checks in a loop in a shard_map, or around one
    # (tests/test_jax_facts.py::test_checkify_fails_on_checks_in_shard_maps):
    # the counters answer, with the iteration and the shard. The reference:
    # the chain of logs by hand, which `Tag()` collects too.
    mesh = jax.sharding.Mesh(np.array(devices(4)), ("d",))
    spec = jax.sharding.PartitionSpec("d")

    def step(c, _):  # (a perturbation too, whose value its input's check sees)
        return fx.tag(fx.perturb(jnp.log(c), "p"), "h"), None

    def scan(c):
        return jax.lax.scan(step, fx.tag(c, "x"), length=3)[0]

    def shard(body):
        return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)

    def f(x):
        if nest == "scan in shard_map":
            return jnp.sum(shard(scan)(x))
        one = shard(lambda c: step(c, None)[0])
        return jnp.sum(jax.lax.scan(lambda c, _: (one(c), None), x, length=3)[0])

    x = np.full(8, 100.0, np.float32)
    x[5] = 2.0  # (shard 2: log(log(2)) < 0)
    chain, c = [], x
    with np.errstate(invalid="ignore"):
        for _ in range(3):
            c = np.log(c)
            chain.append(c)
    assert np.isfinite(chain[1]).all() and np.isnan(chain[2][5])
    values = np.asarray(fx.handle(f, fx.Tag())(x)[1]["intermediates"]["h"])
    assert_trees_close(np.sort(values, None), np.sort(np.stack(chain), None))
    want = fx.BadSite("h", "intermediates", 0, 2, shard=(2,))
    for backward in (False, True):
        got = fx.find_nonfinite(f, jnp.asarray(x), backward=backward)
        assert got == want
        assert "at its call 0, scan iteration 2, shard 2." in str(got)
        op = got.operation
        assert (op.primitive, op.call, op.iteration, op.shard) == ("log", 0, 2, (2,))
        assert op.inputs == f"log({str(np.float32(chain[1][5]))})[1] = nan"


def test_find_nonfinite_backward_reports_a_value_that_is_already_bad_in_a_scan():
    # The NaN first appears at scan iteration 2, spoils every value after it
    # (the tag after the scan too) and every cotangent: backward=True reports
    # the value, as backward=False does, not a cotangent.
    def f(x):
        h = fx.tag(x + 1.0, "h")

        def body(c, i):
            c = fx.tag(jnp.sqrt(c - i), "c")  # of a negative from i = 2 on
            return c, None

        c, _ = jax.lax.scan(body, h, jnp.arange(4.0))
        return jnp.sum(fx.tag(jnp.exp(c), "after"))

    x = jnp.array([0.5, 7.0])
    # The reference: the values by hand, and the gradient, non-finite too.
    c, values = np.float64(1.5), []
    with np.errstate(invalid="ignore"):
        for i in range(4):
            c = np.sqrt(c - i)
            values.append(c)
    assert np.isfinite(values[:2]).all() and np.isnan(values[2])
    assert not np.all(np.isfinite(jax.grad(f)(x)))

    want = fx.BadSite("c", "intermediates", 0, 2)
    forward = fx.find_nonfinite(f, x)
    backward = fx.find_nonfinite(f, x, backward=True)
    assert forward == backward == want
    assert backward.backward is False and backward.backward_search is True
    assert "forward pass is already non-finite" in str(backward)
    assert "forward pass" not in str(forward)
    # (the first line, the tag's; the second names the operation)
    assert str(backward).startswith(str(forward).splitlines()[0])
    assert forward.operation.primitive == "sqrt" and forward.operation.iteration == 2


def test_find_nonfinite_backward_the_example_of_its_docstring_and_errors():
    def loss(x):
        h = fx.tag(x * 0, "h")
        s = fx.tag(jnp.sqrt(h), "s")
        return jnp.sum(s)

    x = jnp.arange(3.0)
    assert fx.find_nonfinite(loss, x) is None  # the forward pass is finite
    assert fx.find_nonfinite(loss, x, backward=True) == fx.BadSite(
        "h", "intermediates", 0, None, backward=True
    )
    # Every tag is checked, not only those on the path from the arguments.
    assert fx.find_nonfinite(
        lambda x: loss(jnp.float32(0) * x[0]), x, backward=True
    ) == fx.BadSite("h", "intermediates", 0, None, backward=True)
    with pytest.raises(ValueError, match="must return a scalar"):
        fx.find_nonfinite(lambda x: fx.tag(x, "t"), x, backward=True)


@pytest.mark.slow
def test_models_as_arguments_equinox_and_nnx():
    # An Equinox module holds functions among its leaves: they stay static.
    mlp = fx.tag_modules(eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0)))

    def loss(model, x):
        return jnp.sum(jnp.sqrt(model(x) * 0))  # NaN gradient, finite value

    x = jnp.ones(3)
    listed = fx.sites(loss)(mlp, jax.ShapeDtypeStruct((3,), jnp.float32))
    assert list(listed["intermediates"]) == ["layers.0", "layers.1", "layers.2"]
    assert fx.find_nonfinite(loss, mlp, x) is None
    # The cotangent of the last layer is 0 * inf: the layer nearest the loss.
    want = fx.BadSite("layers.2", "intermediates", 0, None, backward=True)
    assert fx.find_nonfinite(loss, mlp, x, backward=True) == want

    # An NNX model whose call writes its state (BatchNorm in training mode):
    # looking at it leaves the state as it was.
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
            self.norm = nnx.BatchNorm(4, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.norm(self.linear(x))

    model = Model()
    before = jax.tree.map(np.asarray, nnx.state(model))
    tagged = fx.tag_modules(model)
    xs = jnp.arange(6.0).reshape(2, 3)
    assert list(fx.sites(tagged)(xs)["intermediates"]) == ["linear", "norm"]
    assert fx.find_nonfinite(tagged, xs) is None
    got = fx.find_nonfinite(lambda m, x: loss(m, x), tagged, xs, backward=True)
    assert got == fx.BadSite("norm", "intermediates", 0, None, backward=True)
    assert_trees_close(nnx.state(model), before)


@jax.custom_jvp
def log_custom(x):
    return fx.tag(jnp.log(x), "inner")


@log_custom.defjvp
def _log_custom_jvp(primals, tangents):
    return log_custom(primals[0]), tangents[0] / primals[0]


@jax.custom_vjp
def sqrt_custom(x):
    return fx.tag(jnp.sqrt(x), "inner_vjp")


sqrt_custom.defvjp(
    lambda x: (sqrt_custom(x), x), lambda x, ct: (ct * 0.5 / jnp.sqrt(x),)
)


def custom_program(x):
    a = fx.tag(x - 1, "a")
    return jnp.sum(sqrt_custom(log_custom(a)))


@pytest.mark.parametrize(
    "x, forward, backward",
    [
        ([2.5, 3.0], None, None),
        ([1.0, 3.0], "inner", "a"),  # log(0) = -inf; its cotangent 1/0 at a
        ([1.5, 3.0], "inner_vjp", "a"),  # sqrt(log(0.5)) is NaN
        ([2.0, 3.0], None, "a"),  # sqrt(log(1)) = 0: an infinite derivative
    ],
)
def test_find_nonfinite_in_functions_with_custom_derivatives(x, forward, backward):
    # Forward, every tag is checked; backward, a tag inside a custom_jvp or
    # custom_vjp function has no cotangent of its own, and the custom rules'
    # cotangent reaches the tag outside (`backward`: the first bad cotangent,
    # by hand). A non-finite value, inside such a function too, comes first:
    # backward=True reports it as backward=False does.
    x = jnp.array(x)
    got = fx.find_nonfinite(custom_program, x)
    assert (got and got.name) == forward
    got_backward = fx.find_nonfinite(custom_program, x, backward=True)
    if forward is not None:
        assert got_backward == got and not got_backward.backward
    else:
        assert (got_backward and got_backward.name) == backward
    grad_finite = bool(jnp.all(jnp.isfinite(jax.grad(custom_program)(x))))
    assert grad_finite == (backward is None)


#
# find_nonfinite called again compiles nothing
#


def test_find_nonfinite_compiles_once_per_signature():
    # (repros: perf_find_nonfinite_recompiles.py)
    from helpers import CountCompiles

    calls = []

    def f(x):
        calls.append(None)
        h = fx.tag(jnp.log(x), "h")
        return jnp.sum(fx.tag(jnp.sqrt(h), "s"))

    ok, log_bad = jnp.array([2.0, 3.0]), jnp.array([2.0, -1.0])
    sqrt_bad = jnp.array([0.5, 3.0])  # log(0.5) < 0: sqrt is NaN
    grad_bad = jnp.array([1.0, 3.0])  # sqrt(log(1)) = 0: an infinite derivative
    for backward in (False, True):
        fx.find_nonfinite(f, ok, backward=backward)
        # (and once on a NaN: reading checkify's error runs an eager `<` of
        # JAX's own, traced once per process; a bad cotangent's execution is
        # found by a second check, of its name alone, and the operands of the
        # operation that made a NaN by a program of that operation's, each
        # compiled once per name)
        for x in (log_bad, sqrt_bad, grad_bad):
            fx.find_nonfinite(f, x, backward=backward)
        n = len(calls)
        with CountCompiles() as counter:
            got = [
                fx.find_nonfinite(f, x, backward=backward)
                for x in (log_bad, ok, sqrt_bad, grad_bad)
            ]
        assert counter.traces == 0 and counter.compiles == 0
        assert len(calls) == n
        names = [b and b.name for b in got]
        if backward:
            # The reference: whether each input's gradient is finite.
            finite = [
                bool(jnp.all(jnp.isfinite(jax.grad(f)(x))))
                for x in (log_bad, ok, sqrt_bad, grad_bad)
            ]
            assert finite == [False, True, False, False]
            # The values first (log_bad, sqrt_bad), then the gradient.
            assert names == ["h", None, "s", "h"]
            assert [b and b.backward for b in got] == [False, None, False, True]
        else:
            assert names == ["h", None, "s", None]


def test_find_nonfinite_of_equinox_models_compiles_once():
    from helpers import CountCompiles

    class Model(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            h = fx.tag(jnp.log(self.w * x), "h")
            return jnp.sum(fx.tag(2.0 * h, "y"))

    x = jnp.array([1.0, 2.0])
    models = [Model(jnp.array(w)) for w in ([1.0, 1.0], [1.0, -1.0], [3.0, 1.0])]
    fx.find_nonfinite(models[0], x)
    # (and one NaN: the program that reads the operands of the operation
    # that made it is compiled at the first)
    fx.find_nonfinite(Model(jnp.array([-2.0, 1.0])), x)
    with CountCompiles() as counter:
        # Models of the same structure with other weights: their own results.
        bad, good = [fx.find_nonfinite(m, x) for m in models[1:]]
    assert counter.traces == 0 and counter.compiles == 0
    assert (bad.name, bad.call) == ("h", 0)
    assert good is None
    assert not bool(jnp.all(jnp.isfinite(models[1](x))))
    assert bool(jnp.all(jnp.isfinite(models[2](x))))


@pytest.mark.slow
def test_find_nonfinite_backward_of_an_equinox_model_argument_compiles_once():
    # `find_nonfinite(loss, model, x, backward=True)` again with a new x, or a
    # new model of the same structure: nothing traced or compiled again.
    from helpers import CountCompiles

    def loss(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    def model(seed, nan=False):
        mlp = eqx.nn.MLP(4, 1, 4, 2, key=jax.random.key(seed))
        if nan:  # a NaN weight in the second layer
            w = mlp.layers[1].weight.at[0, 0].set(jnp.nan)
            mlp = eqx.tree_at(lambda m: m.layers[1].weight, mlp, w)
        return fx.tag_modules(mlp)

    xs = [jax.random.normal(jax.random.key(i), (3, 4)) for i in range(3)]
    models = [model(0), model(1), model(2, nan=True)]
    for backward in (False, True):
        fx.find_nonfinite(loss, models[0], xs[0], backward=backward)
        # (and once on a NaN: reading checkify's error runs an eager `<` of
        # JAX's own, traced once per process)
        fx.find_nonfinite(loss, models[2], xs[1], backward=backward)
        with CountCompiles() as counter:
            got = [
                fx.find_nonfinite(loss, m, x, backward=backward)
                for m, x in zip(models, xs[1:] + xs[:1])
            ]
        assert counter.traces == 0 and counter.compiles == 0
        assert got[:2] == [None, None]
        assert got[2] == fx.BadSite("layers.1", "intermediates", 0, None)
    for m, x in zip(models, xs[1:] + xs[:1]):  # the reference
        finite = bool(jnp.isfinite(loss(m, x)))
        assert finite == (m is not models[2])


def test_find_nonfinite_keeps_no_dead_function_alive():
    # Its compiled checks are cached on the function: they die with it.
    import gc
    import weakref

    def run(backward):
        big = jnp.arange(1000.0)

        def f(x):  # log(-1) is NaN; at 1, sqrt's derivative at 0 is not finite
            return jnp.sum(jnp.sqrt(fx.tag(jnp.log(x) + big[0], "h")))

        x = jnp.array([1.0 if backward else -1.0])
        assert fx.find_nonfinite(f, x, backward=backward).name == "h"
        return weakref.ref(big)

    refs = [run(False), run(True)]
    gc.collect()
    assert [r() for r in refs] == [None, None]


@pytest.mark.parametrize(
    "module, internals",
    [
        # `text_table`: the table layout `_stats` shares with `fx.sites`;
        # `one_cond`: a check's second pass under vmaps, one cond for all the
        # examples (a JAX utility, not the handler machinery).
        ("_stats", {"text_table", "one_cond"}),
        # `eager_cached`: caching on the user's function (see `_nonfinite`);
        # `Tapped`: the taps whose values are their equations' inputs and
        # outputs; `handling`: to trace the function with its tags the
        # identity; `_numpy`: fetching a value, as `summary` does; `one_cond`;
        # `traced_sites`, `holds`: the sites and whether the program holds a
        # `shard_map` (which checkify fails on), of one trace.
        (
            "_nonfinite",
            {
                "eager_cached",
                "Tapped",
                "handling",
                "_numpy",
                "one_cond",
                "traced_sites",
                "holds",
            },
        ),
    ],
)
def test_debugging_tools_use_the_public_api_only(module, internals):
    import ast
    import importlib
    import pathlib

    tool = importlib.import_module(f"effects.{module}")
    tree = ast.parse(pathlib.Path(tool.__file__).read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level > 0
        for alias in node.names
    }
    assert imported - set(dir(fx)) == internals


@pytest.mark.parametrize(
    "values, dtype",
    [
        ([1e20, -2e20, 3e20, 0.5e20], jnp.float32),
        ([3e38, 3e38, -1e38, jnp.inf], jnp.float32),
        ([3e38, 2e38, -1e38], jnp.bfloat16),
        ([1e-30, -2e-30, 0.0], jnp.float32),
    ],
)
def test_stats_of_values_near_the_largest_finite_are_finite(values, dtype):
    # The sums overflowed: std (or mean) inf with inf_count 0, where NumPy and
    # summary(Tag) gave the figures.
    x = jnp.asarray(values, dtype)
    _, found = fx.handle(lambda x: fx.tag(x, "h"), fx.Stats())(x)
    assert_stats(found["intermediates"]["h"][0], np.asarray(x, np.float64))


@pytest.mark.parametrize(
    "values",
    [[1e-30, -2e-30, 0.0], [1e-20, 3e-20, 2e-20], [3e38, 3e38, -1e38, jnp.inf]],
)
def test_stats_of_tiny_and_huge_values_match_numpy_to_their_scale(values):
    # (no absolute tolerance: the squares of tiny values underflowed to a std
    # of 0, and XLA's reciprocal of a divisor near the largest float32 was
    # flushed to zero, a mean of 0)
    x = jnp.asarray(values, jnp.float32)
    _, found = jax.jit(fx.handle(lambda x: fx.tag(x, "h"), fx.Stats()))(x)
    got, want = found["intermediates"]["h"][0], numpy_stats(x)
    for k in STATS:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-5, err_msg=k)


def test_stats_under_a_vmap_test_every_example_once_and_mask_where_one_needs():
    # One cond for all the examples, where JAX makes a cond under a vmap a
    # select, which runs both branches: each example's own figures, whether
    # all are finite or one is not, under one vmap and two.
    rows = np.random.default_rng(0).normal(size=(3, 4, 5)).astype(np.float32)
    bad = rows.copy()
    bad[1, 2, 3], bad[2, 0, 0] = np.nan, -np.inf
    for inner in (False, True):
        g = (
            (lambda x: fx.tag(2 * x, "h"))
            if not inner
            else jax.vmap(lambda x: fx.tag(2 * x, "h"))
        )
        handled = fx.handle(jax.vmap(g), fx.Stats())
        assert "cond" in str(jax.make_jaxpr(handled)(rows))
        for xs in (rows, bad):
            _, found = jax.jit(handled)(xs)
            (got,) = found["intermediates"]["h"]
            for i in range(3):
                for j in range(4) if inner else [None]:
                    at = (i,) if j is None else (i, j)
                    assert_stats({k: got[k][at] for k in STATS}, 2 * xs[at])


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("backward", [False, True])
def test_find_nonfinite_in_a_reversed_scan_gives_the_position(reverse, backward):
    # The iteration is the position, as `Tag()` stacks the values and `ctx.at`
    # numbers them (a reversed scan's was the count of those run before it).
    def f(x):
        def body(c, i):
            h = fx.tag(jnp.sqrt(x * (i - 1.5)) * c, "h")  # NaN at positions 0, 1
            return c + 0.1, h

        return jnp.sum(jax.lax.scan(body, x, jnp.arange(4.0), reverse=reverse)[1])

    _, found = fx.handle(f, fx.Tag())(1.0)
    bad_positions = np.flatnonzero(~np.isfinite(found["intermediates"]["h"][0]))
    # The first to run: position 0 forward, 1 in a reversed scan.
    got = fx.find_nonfinite(f, 1.0, backward=backward)
    assert (got.name, got.call, got.backward) == ("h", 0, False)
    assert got.iteration == bad_positions[-1 if reverse else 0]


@pytest.mark.parametrize("control", ["cond", "while_loop"])
def test_find_nonfinite_of_a_vmap_batching_a_predicate_says_to_check_examples(control):
    # (not `handle`'s refusal, naming an internal handler and advising
    # `jax.vmap(fx.handle(...))`, nor JAX's bare AssertionError of a count over
    # the whole batch in such a while loop)
    def g(x):
        h = fx.tag(jnp.log(x), "h")
        if control == "cond":
            return jax.lax.cond(x > 1, lambda h: fx.tag(h * 2, "b"), lambda h: h, h)
        return jax.lax.while_loop(lambda h: h < 3, lambda h: fx.tag(h + 1, "w"), h)

    xs = jnp.array([0.5, 2.0])
    with pytest.raises(ValueError, match="find_nonfinite: a `jax.vmap` inside"):
        fx.find_nonfinite(jax.vmap(g), xs)
    assert [fx.find_nonfinite(g, x) for x in xs] == [None, None]
