"""`fx.taps`: sites after primitives' outputs and at loop carries, checked
against the values the program computes written out by hand, against the
untapped program (same result, same HLO), and under every handler and
transformation as tags are."""

from __future__ import annotations

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, optimized_hlo

import effects as fx


def _line(fn, text: str) -> int:
    """The line of `fn`'s source holding `text`."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def f(x):
    y = jnp.sin(x)
    z = jnp.log(y + 2.0)
    return jnp.sum(z * y)


X = jnp.array([0.5, 1.0, 2.0])


def test_tag_at_taps_collects_every_output_of_the_program():
    out, found = fx.handle(fx.taps(f), fx.Tag("taps"))(X)
    taps = found["taps"]
    y = jnp.sin(X)
    want = {
        "sin": y,
        "add": y + 2.0,
        "log": jnp.log(y + 2.0),
        "mul": jnp.log(y + 2.0) * y,
        "reduce_sum": jnp.sum(jnp.log(y + 2.0) * y),
    }
    file = "test_taps.py"
    lines = {
        "sin": _line(f, "jnp.sin"),
        "add": _line(f, "jnp.log"),
        "log": _line(f, "jnp.log"),
        "mul": _line(f, "jnp.sum"),
        "reduce_sum": _line(f, "jnp.sum"),
    }
    assert list(taps) == [f"{p} @ {file}:{lines[p]}" for p in want]
    for (name, (value,)), expected in zip(taps.items(), want.values()):
        assert_trees_close(value, expected)
    assert_trees_close(out, f(X))


def test_unhandled_taps_are_the_plain_program():
    assert_trees_close(fx.taps(f)(X), f(X))
    assert optimized_hlo(fx.taps(f), X) == optimized_hlo(f, X)
    grad = jax.grad(f)
    assert optimized_hlo(fx.taps(grad), X) == optimized_hlo(grad, X)
    # and a handler of another collection leaves them unhandled
    out, found = fx.handle(fx.taps(f), fx.Tag())(X)
    assert found == {"intermediates": {}} and np.allclose(out, f(X))


def test_selection_by_primitive_and_by_predicate():
    _, found = fx.handle(fx.taps(f, "log"), fx.Tag("taps"))(X)
    assert [n.split(" @ ")[0] for n in found["taps"]] == ["log"]
    _, found = fx.handle(fx.taps(f, ("sin", "mul")), fx.Tag("taps"))(X)
    assert [n.split(" @ ")[0] for n in found["taps"]] == ["sin", "mul"]
    line = _line(f, "jnp.log")
    _, found = fx.handle(fx.taps(f, where=lambda t: t.line == line), fx.Tag("taps"))(X)
    assert [n.split(" @ ")[0] for n in found["taps"]] == ["add", "log"]
    with pytest.raises(TypeError, match="primitives"):
        fx.taps(f, 3)  # pyright: ignore[reportArgumentType]


def test_names_tell_shapes_apart_and_carry_scopes():
    def g(x):
        with jax.named_scope("head"):
            a = jnp.exp(x), jnp.exp(x[:2])
        return a

    _, found = fx.handle(fx.taps(g), fx.Tag("taps"))(X)
    line = _line(g, "jnp.exp")
    names = list(found["taps"])
    assert names[0] == f"head/exp @ test_taps.py:{line}"
    assert names[-1] == f"head/exp @ test_taps.py:{line} #1"
    assert_trees_close(found["taps"][names[-1]], (jnp.exp(X[:2]),))
    # the same names on a second trace
    again = fx.handle(fx.taps(lambda x: g(x)), fx.Tag("taps"))(X)[1]
    assert list(again["taps"]) == names


def test_loop_carries_per_iteration():
    def loop(x):
        def body(c, xi):
            return c * 2.0 + xi, None

        c, _ = jax.lax.scan(body, x[0], x)
        return jax.lax.while_loop(lambda c: c < 100.0, lambda c: c * 3.0, c)

    tapped = fx.taps(loop, (), carries=True)
    names = list(fx.sites(tapped)(X)["taps"])
    scan_name, while_name = names
    _, found = fx.handle(tapped, fx.Tag("taps", names=scan_name))(X)
    c, carries = X[0], []
    for xi in X:
        c = c * 2.0 + xi
        carries.append(c)
    assert_trees_close(found["taps"][scan_name][0], jnp.stack(carries))
    # a while loop's carries, every iteration: their sum (append needs a scan)
    _, found = fx.handle(tapped, fx.Tag("taps", names=while_name, mode="sum"))(X)
    whiles = []
    while c < 100.0:
        c = c * 3.0
        whiles.append(c)
    assert_trees_close(found["taps"][while_name], sum(whiles))
    assert names[0].startswith("scan carry @") and names[1].startswith("while carry")
    # a predicate on the loop selects carries
    only = fx.taps(loop, (), carries=lambda t: t.primitive == "while carry")
    found = fx.handle(only, fx.Tag("taps", mode="last"))(X)[1]
    assert list(found["taps"]) == names[1:]
    assert_trees_close(found["taps"][while_name], whiles[-1])


def test_through_higher_order_primitives():
    @jax.custom_jvp
    def softplus(x):
        return jnp.log1p(jnp.exp(x))

    softplus.defjvp(lambda p, t: (softplus(p[0]), t[0] * jax.nn.sigmoid(p[0])))

    def g(x):
        x = jax.jit(jnp.tanh)(x)
        x = jax.checkpoint(lambda v: jnp.cos(v))(x)
        x = jax.lax.cond(x.sum() > 0, jnp.exp, jnp.negative, x)
        return softplus(x)

    # JAX caches a branch's jaxpr by its function, with the frames of its first
    # trace (jax 0.7-0.9 keep those around the `cond` call): another caller's
    # line must not name the taps
    other = lambda x: jax.lax.cond(x.sum() > 0, jnp.exp, jnp.negative, x)  # noqa: E731
    fx.handle(other, fx.Tag("taps"))(X)
    _, found = fx.handle(
        fx.taps(g, ("tanh", "cos", "exp", "neg", "log1p")), fx.Tag("taps")
    )(X)
    got = {
        (n.split(" @ ")[0], int(n.rsplit(":", 1)[1])): v
        for n, v in found["taps"].items()
    }
    line = _line(g, "lax.cond")
    inner = _line(softplus.fun, "log1p")
    assert set(got) == {
        ("tanh", line - 2),
        ("cos", line - 1),
        ("exp", line),
        ("neg", line),
        ("exp", inner),
        ("log1p", inner),
    }
    t = jnp.tanh(X)
    c = jnp.cos(t)
    e = jnp.exp(c)
    assert_trees_close(got["tanh", line - 2][0], t)
    assert_trees_close(got["cos", line - 1][0], c)
    assert_trees_close(got["exp", line][0], e)
    assert_trees_close(got["exp", inner][0], jnp.exp(e))
    assert_trees_close(got["log1p", inner][0], jnp.log1p(jnp.exp(e)))

    # the branch not taken: as for a tag there
    def untaken(x):
        return jax.lax.cond(x.sum() > 0, jnp.exp, lambda v: fx.tag(-v, "n"), x)

    tagged = fx.handle(untaken, fx.Tag())(c)[1]["intermediates"]["n"]
    assert_trees_close(got["neg", line], tagged)


def test_taps_inside_jits_are_collected_and_changed_as_outside_them():
    # A `jax.jit` that holds nothing but its program (JAX's own `jnp.where`
    # and `jnp.tril` are ones, in a gradient) has its equations, taps
    # included, put in its caller's place; one with shardings is kept.
    helper = jax.jit(lambda v: jnp.log(v + 2.0))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    pinned = jax.jit(lambda v: jnp.exp(-v), out_shardings=device)

    def g(x):
        a = helper(x)  # called twice: the same jaxpr, its own executions
        b = helper(jnp.sin(x))
        return jnp.sum(pinned(a * b))

    tapped = fx.taps(g, ("log", "exp", "sin"))
    out, found = fx.handle(tapped, fx.Tag("taps"))(X)
    assert_trees_close(out, g(X))
    values = {
        p: [v for n, vs in found["taps"].items() if f"{p} @" in n for v in vs]
        for p in ("log", "exp", "sin")
    }
    a, b = jnp.log(X + 2.0), jnp.log(jnp.sin(X) + 2.0)
    assert_trees_close(values["log"], [a, b])
    assert_trees_close(values["sin"], [jnp.sin(X)])
    assert_trees_close(values["exp"], [jnp.exp(-a * b)])
    # The gradient through the handled taps, and a change at every `log`.
    handled = fx.handle(tapped, fx.Tag("taps"))
    assert_trees_close(jax.grad(lambda x: handled(x)[0])(X), jax.grad(g)(X), rtol=1e-5)
    logs = [n for n in found["taps"] if "log @" in n]
    halve = fx.Intervene({n: lambda v: v / 2 for n in logs}, collection="taps")
    out, _ = fx.handle(tapped, halve)(X)
    assert_trees_close(out, jnp.sum(jnp.exp(-a * b / 4)), rtol=1e-5)


def test_vmap_either_side_and_jit():
    xs = jnp.stack([X, 2 * X])
    handled = fx.handle(fx.taps(f), fx.Tag("taps"))
    out_in, found_in = fx.handle(jax.vmap(fx.taps(f)), fx.Tag("taps"))(xs)
    out_out, found_out = jax.vmap(handled)(xs)
    assert_trees_close(out_in, out_out)
    assert list(found_in["taps"]) == list(found_out["taps"])
    assert_trees_close(found_in, found_out)
    assert_trees_close(jax.jit(handled)(X), handled(X))


def test_grad_through_handled_taps_and_cotangents_at_taps():
    def loss(x):
        return fx.handle(fx.taps(f), fx.Tag("taps"))(x)[0]

    assert_trees_close(jax.grad(loss)(X), jax.grad(f)(X))
    # d(sum(log(sin x + 2) * sin x)) / d(log output) = sin x
    _, found = fx.handle(jax.grad(fx.taps(f, "log")), fx.Tag("taps", of="cotangent"))(X)
    (ct,) = found["taps:cotangent"].values()
    assert_trees_close(ct[0], jnp.sin(X))


def test_taps_of_a_gradient_see_the_backward_pass():
    _, found = fx.handle(fx.taps(jax.grad(f)), fx.Tag("taps"))(X)
    backward = [n for n in found["taps"] if n.startswith("transpose(")]
    assert backward, list(found["taps"])
    # the cotangent of log's input: 1/(sin x + 2) * sin x
    name = next(n for n in backward if "/div @" in n)
    y = jnp.sin(X)
    assert_trees_close(found["taps"][name][0], y / (y + 2.0))


def test_intervene_at_the_input_of_a_log_recovers_the_loss():
    def loss(x):
        return jnp.sum(jnp.log(x - 1.0))

    x = jnp.array([0.5, 2.0, 3.0])
    assert not np.isfinite(loss(x))
    (name,) = fx.sites(fx.taps(loss, "sub"))(x)["taps"]
    clamp = fx.Intervene({name: lambda v: jnp.maximum(v, 1e-3)}, collection="taps")
    out, _ = fx.handle(fx.taps(loss, "sub"), clamp)(x)
    assert_trees_close(out, jnp.sum(jnp.log(jnp.maximum(x - 1.0, 1e-3))))
    # Substitute by name, as Tag found it
    fixed = jnp.array([1.0, 1.0, 2.0])
    out, _ = fx.handle(
        fx.taps(loss, "sub"), fx.Substitute({name: fixed}, collection="taps")
    )(x)
    assert_trees_close(out, jnp.sum(jnp.log(fixed)))


@pytest.mark.slow
def test_stats_of_every_matmul_of_an_unedited_model():
    model = eqx.nn.MLP(3, 2, width_size=5, depth=2, key=jax.random.key(0))
    x = jnp.array([0.1, -0.2, 0.3])
    _, found = fx.handle(fx.taps(model, "dot_general"), fx.Stats("taps"))(x)
    rows = fx.summary(found).rows
    assert len(rows) == 3
    h = x
    for layer, row in zip(model.layers, rows):
        pre = layer.weight @ h
        np.testing.assert_allclose(row["mean"], np.mean(pre), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(row["max"], np.max(pre), rtol=1e-5)
        h = jax.nn.relu(pre + layer.bias)
    assert "eqx.nn.Linear/dot_general" in rows[0]["name"]


def test_module_paths_from_tag_modules():
    class Block(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x):
            return jnp.tanh(self.lin(x))

    class Net(eqx.Module):
        blocks: list

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    keys = jax.random.split(jax.random.key(1), 3)
    net = fx.tag_modules(Net([Block(eqx.nn.Linear(2, 2, key=k)) for k in keys]))
    listed = fx.sites(fx.taps(net, "tanh"))(jnp.ones(2))["taps"]
    assert [n.split(" @ ")[0] for n in listed] == [f"blocks.{i}/tanh" for i in range(3)]
    info = listed["blocks.1/tanh @ test_taps.py:" + str(_line(Block.__call__, "tanh"))][
        0
    ]
    assert info.tap.primitive == "tanh" and info.tap.scope == "blocks.1"
    assert info.value == jax.ShapeDtypeStruct((2,), jnp.float32)


def test_a_second_call_does_not_trace_again():
    traced = []

    def g(x):
        traced.append(1)
        return jnp.sin(x)

    handled = fx.handle(fx.taps(g), fx.Tag("taps"))
    handled(X)
    handled(X + 1)
    fx.handle(fx.taps(g), fx.Tag("taps"))(X)  # (written inline again)
    assert len(traced) == 1


def test_the_library_frame_is_kept_beside_the_user_line():
    lin = eqx.nn.Linear(2, 2, key=jax.random.key(0))

    def g(x):
        return lin(x)

    (infos,) = fx.sites(fx.taps(g, "dot_general"))(jnp.ones(2))["taps"].values()
    tap = infos[0].tap
    assert tap.location == f"test_taps.py:{_line(g, 'lin(x)')}"
    assert tap.library is not None and tap.library.startswith("_linear.py:")


def test_at_reads_the_iteration_of_a_carry():
    def loop(x):
        return jax.lax.scan(lambda c, _: (c * 2.0 + 1.0, None), x, None, length=4)[0]

    tapped = fx.taps(loop, (), carries=True)
    (name,) = fx.sites(tapped)(X)["taps"]
    # the carry after iteration 1 zeroed: the loop goes on from there
    reset = fx.Intervene(
        {name: lambda v, at: jnp.where(at[1] == 1, 0.0, v)}, collection="taps"
    )
    out, _ = fx.handle(tapped, reset)(X)
    c = X
    for i in range(4):
        c = c * 2.0 + 1.0
        c = jnp.zeros_like(c) if i == 1 else c
    assert_trees_close(out, c)


def test_an_nnx_layer_tapped_whole_is_named_by_its_library_line():
    nnx = pytest.importorskip("flax.nnx")
    layer = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    x = jnp.array([1.0, -2.0, 0.5])
    _, found = fx.handle(fx.taps(layer, "dot_general"), fx.Tag("taps"))(x)
    ((name, (value,)),) = found["taps"].items()
    # (Flax 0.12.0 calls it so that JAX keeps the caller's frame: this test's)
    assert name.startswith(("dot_general @ linear.py:", "dot_general @ test_taps"))
    assert_trees_close(value, x @ layer.kernel[...])
    # as an argument of the user's function: the user's line
    _, found = fx.handle(fx.taps(lambda m, x: m(x), "dot_general"), fx.Tag("taps"))(
        layer, x
    )
    (name,) = found["taps"]
    assert name.startswith("dot_general @ test_taps.py:")


class _CountAbove(fx.Handler):
    """A user's handler: counts the elements above 1 of every execution."""

    mode = fx.Reduce(lambda n, k: n + k, lambda _: jnp.zeros((), jnp.int32))
    matches = fx.Select(collection="taps")

    def apply(self, site, value, ctx):
        ctx.emit(jnp.sum(value > 1.0, dtype=jnp.int32))
        return value


def test_a_user_handler_at_taps():
    def g(x):
        return jnp.exp(x) * 2.0

    _, found = fx.handle(fx.taps(g), _CountAbove())(X)
    counts = {n.split(" @ ")[0]: int(v) for n, v in found["taps"].items()}
    assert counts == {
        "exp": int(jnp.sum(jnp.exp(X) > 1.0)),
        "mul": int(jnp.sum(jnp.exp(X) * 2.0 > 1.0)),
    }
