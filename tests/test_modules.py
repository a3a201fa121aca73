"""`tag_modules`: every selected submodule call tagged, on Equinox, Flax linen
and Flax NNX models nobody edited, checked against the layers called by hand
and against Flax's own `capture_intermediates`."""

from __future__ import annotations

import threading
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import assert_trees_close, no_leak_checks, optimized_hlo

import effects as fx

X = jnp.linspace(-1.0, 1.0, 3)


def found_of(**names):
    return {"intermediates": names}


#
# Equinox
#


def mlp():
    return eqx.nn.MLP(3, 2, 4, 2, key=jax.random.key(0))


def mlp_by_hand(model, x):
    """Each layer's output, calling the layers by hand."""
    h0 = model.layers[0](x)
    h1 = model.layers[1](model.activation(h0))
    h2 = model.layers[2](model.activation(h1))
    return {"layers.0": (h0,), "layers.1": (h1,), "layers.2": (h2,)}


def test_equinox_every_layer_named_by_its_path():
    model = mlp()
    out, found = fx.handle(fx.tag_modules(model), fx.Tag())(X)
    assert_trees_close(out, model(X))
    assert_trees_close(found, found_of(**mlp_by_hand(model, X)))
    assert list(found["intermediates"]) == ["layers.0", "layers.1", "layers.2"]


def test_equinox_filters():
    model = mlp()
    want = mlp_by_hand(model, X)
    by_type = fx.handle(fx.tag_modules(model, filter=eqx.nn.Linear), fx.Tag())(X)
    assert_trees_close(by_type[1], found_of(**want))
    by_tuple = fx.tag_modules(model, filter=(eqx.nn.Conv1d, eqx.nn.Linear))
    assert_trees_close(fx.handle(by_tuple, fx.Tag())(X)[1], found_of(**want))
    seen = []

    def last_two(path, module):
        seen.append((path, type(module).__name__))
        return path != "layers.0"

    chosen = fx.handle(fx.tag_modules(model, filter=last_two), fx.Tag())(X)[1]
    assert_trees_close(
        chosen, found_of(**{k: v for k, v in want.items() if k != "layers.0"})
    )
    assert seen == [(f"layers.{i}", "Linear") for i in range(3)]
    none = fx.handle(fx.tag_modules(model, filter=eqx.nn.Conv1d), fx.Tag())(X)[1]
    assert none == {"intermediates": {}}


class Attention(eqx.Module):
    proj: eqx.nn.Linear
    out: eqx.nn.Linear

    def project(self, x):
        return jnp.tanh(self.proj(x))

    def __call__(self, x):
        return self.out(self.project(x))


class Encoder(eqx.Module):
    blocks: list
    norm: eqx.nn.LayerNorm

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.blocks = [
            Attention(
                eqx.nn.Linear(3, 3, key=k[2 * i]), eqx.nn.Linear(3, 3, key=k[2 * i + 1])
            )
            for i in range(2)
        ]
        self.norm = eqx.nn.LayerNorm(3)

    def __call__(self, x):
        for block in self.blocks:
            x = x + block(x)
        x = self.norm(x)
        return self.blocks[0](x)  # called twice: two entries


def test_equinox_nested_methods_and_repeated_calls():
    model = Encoder(jax.random.key(1))
    tagged = fx.tag_modules(model, methods=("__call__", "project"))
    out, found = fx.handle(tagged, fx.Tag())(X)
    b0, b1 = model.blocks
    h = X + b0(X)
    h = h + b1(h)
    n = model.norm(h)
    want = {
        "blocks.0.proj": (b0.proj(X), b0.proj(n)),
        "blocks.0.project": (b0.project(X), b0.project(n)),
        "blocks.0.out": (b0(X), b0(n)),
        "blocks.0": (b0(X), b0(n)),
        "blocks.1.proj": (b1.proj(X + b0(X)),),
        "blocks.1.project": (b1.project(X + b0(X)),),
        "blocks.1.out": (b1(X + b0(X)),),
        "blocks.1": (b1(X + b0(X)),),
        "norm": (n,),
    }
    assert_trees_close(out, model(X))
    assert_trees_close(found, found_of(**want))
    # In the order the program first ran them: inner calls finish first.
    assert list(found["intermediates"])[:4] == [
        "blocks.0.proj",
        "blocks.0.project",
        "blocks.0.out",
        "blocks.0",
    ]


class Block(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


class Stacked(eqx.Module):
    """Equinox's stacked layers: one Block whose arrays carry a depth axis."""

    blocks: Block

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.blocks = eqx.filter_vmap(lambda k: Block(eqx.nn.Linear(3, 3, key=k)))(keys)

    def __call__(self, x):
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)

        def body(x, d):
            y = eqx.combine(d, static)(x)
            return y, y

        return jax.lax.scan(body, x, dynamic)


def test_equinox_stacked_layers_in_a_scan_are_stacked():
    model = Stacked(jax.random.key(2))
    (out, ys), found = fx.handle(fx.tag_modules(model), fx.Tag())(X)
    assert_trees_close((out, ys), model(X))
    inputs = jnp.concatenate([X[None], ys[:-1]])
    lin = jax.vmap(lambda w, b, x: w @ x + b)(
        model.blocks.lin.weight, model.blocks.lin.bias, inputs
    )
    assert_trees_close(found, found_of(**{"blocks.lin": (lin,), "blocks": (ys,)}))


def test_equinox_sequential_with_batch_norm_keeps_isinstance():
    # eqx.nn.Sequential asks `isinstance(layer, StatefulLayer)` to thread the
    # state: the tagged layers are instances of subclasses of their classes.
    model, state = eqx.nn.make_with_state(eqx.nn.Sequential)(
        [
            eqx.nn.Linear(3, 3, key=jax.random.key(3)),
            eqx.nn.BatchNorm(3, "batch", mode="batch"),
        ]
    )
    tagged = fx.tag_modules(model)
    assert isinstance(tagged.layers[1], eqx.nn.BatchNorm)
    xs = jnp.stack([X, 2 * X, -X])

    def run(m, state):
        return jax.vmap(m, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
            xs, state
        )

    want = run(model, state)
    got, found = fx.handle(run, fx.Tag())(tagged, state)
    assert_trees_close(got, want)
    lin = jax.vmap(model.layers[0])(xs)
    assert_trees_close(found["intermediates"]["layers.0"], (lin,))
    # BatchNorm returns (output, state): both are its output, tagged.
    (bn_out,) = found["intermediates"]["layers.1"]
    assert_trees_close(bn_out[0], want[0])


def test_equinox_shared_layers_report_outputs_not_the_tied_modules():
    # `eqx.nn.Shared` gives its tied modules back when called: parameters,
    # not a computed value (they were reported as the tag "shared").
    class Tied(eqx.Module):
        shared: eqx.nn.Shared

        def __init__(self, key):
            a, b = jax.random.split(key)
            embed = eqx.nn.Linear(3, 4, key=a)
            head = eqx.nn.Linear(4, 3, key=b)
            self.shared = eqx.nn.Shared(
                (embed, head), lambda p: p[1].weight, lambda p: p[0].weight.T
            )

        def __call__(self, x):
            embed, head = self.shared()
            return head(jnp.tanh(embed(x)))

    model = Tied(jax.random.key(0))
    x = jnp.linspace(-1.0, 1.0, 3)
    out, found = fx.handle(fx.tag_modules(model), fx.Tag())(x)
    assert_trees_close(out, model(x))
    names = found["intermediates"]
    assert list(names) == ["shared.pytree.0", "shared.pytree.1"]
    embed, head = model.shared()
    assert_trees_close(names["shared.pytree.0"], (embed(x),))


def test_equinox_unhandled_compiles_to_the_models_program():
    model = mlp()
    tagged = fx.tag_modules(model)
    assert optimized_hlo(lambda x: tagged(x), X) == optimized_hlo(lambda x: model(x), X)
    assert_trees_close(eqx.filter_jit(tagged)(X), model(X))


def test_equinox_handled_compiles_to_the_hand_tagged_program():
    model = mlp()

    def hand_tagged(x):
        for i, layer in enumerate(model.layers):
            x = fx.tag(layer(x), f"layers.{i}")
            if i < len(model.layers) - 1:
                x = model.activation(x)
        return model.final_activation(x)

    tagged = fx.tag_modules(model)
    assert optimized_hlo(fx.handle(tagged, fx.Tag()), X) == optimized_hlo(
        fx.handle(hand_tagged, fx.Tag()), X
    )


def test_equinox_gradients_through_tagged_modules():
    model = mlp()

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    tagged = fx.tag_modules(model)
    grads = eqx.filter_grad(loss)(tagged, X)
    want = eqx.filter_grad(loss)(model, X)
    # The same gradients, in a tree of the tagged classes.
    assert_trees_close(jax.tree.leaves(grads), jax.tree.leaves(want))


def test_equinox_training_step_tagging_inside_the_loss_gives_plain_gradients():
    # (repros: err_tagged_grads_type_mismatch.py)
    # Gradients with respect to a tagged copy have the copy's classes, which an
    # optimizer state made from the plain model refuses: JAX's message then
    # names the copy. Tagging inside the loss differentiates the plain model.
    optax = pytest.importorskip("optax")
    model = mlp()
    opt = optax.adam(1e-2)
    state = opt.init(eqx.filter(model, eqx.is_array))

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    tagged = fx.tag_modules(model)
    grads, _ = fx.handle(eqx.filter_grad(loss), fx.Tag(of="cotangent"))(tagged, X)
    assert "tag_modules(Linear)" in repr(type(grads.layers[0]))
    with pytest.raises(ValueError, match=r"tag_modules\(Linear\)"):
        opt.update(grads, state, eqx.filter(model, eqx.is_array))

    def tagged_loss(m, x):
        return loss(fx.tag_modules(m), x)

    grads, found = fx.handle(eqx.filter_grad(tagged_loss), fx.Tag(of="cotangent"))(
        model, X
    )
    want = eqx.filter_grad(loss)(model, X)
    assert jax.tree.structure(grads) == jax.tree.structure(want)
    assert_trees_close(grads, want)
    # The cotangents of the layers' outputs, by hand: dL/dh2 = 2 out, then back.
    h = mlp_by_hand(model, X)
    _, pull = jax.vjp(lambda h2: jnp.sum(h2**2), h["layers.2"][0])
    assert_trees_close(found["intermediates:cotangent"]["layers.2"], pull(1.0))
    updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
    stepped = eqx.apply_updates(model, updates)
    want_updates, _ = opt.update(want, opt.init(eqx.filter(model, eqx.is_array)))
    want_stepped = eqx.apply_updates(model, want_updates)
    assert_trees_close(
        eqx.filter(stepped, eqx.is_array), eqx.filter(want_stepped, eqx.is_array)
    )


def _class_dicts(classes):
    return {c: dict(vars(c)) for c in classes}


def test_no_class_changed_and_threads_see_their_own_names():
    classes = [eqx.nn.MLP, eqx.nn.Linear, eqx.nn.LayerNorm, Attention, Encoder]
    before = _class_dicts(classes)
    models = [mlp(), Encoder(jax.random.key(4))]
    filters = [None, eqx.nn.Linear, lambda p, m: p.endswith("0")]
    results, errors = {}, []

    def work(i):
        try:
            model, flt = models[i % 2], filters[i % 3]
            for _ in range(2):
                tagged = fx.tag_modules(model, filter=flt)
                _, found = fx.handle(tagged, fx.Tag())(X)
                results.setdefault(i, []).append(sorted(found["intermediates"]))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, names in results.items():
        model, flt = models[i % 2], filters[i % 3]
        want = sorted(
            fx.handle(fx.tag_modules(model, filter=flt), fx.Tag())(X)[1][
                "intermediates"
            ]
        )
        assert names == [want] * 2
    assert _class_dicts(classes) == before
    # The model itself is left as it was: calling it tags nothing.
    assert fx.handle(models[0], fx.Tag())(X)[1] == {"intermediates": {}}


def test_bad_arguments_say_what_to_pass():
    with pytest.raises(TypeError, match="expected an Equinox module"):
        fx.tag_modules(lambda x: x)
    with pytest.raises(TypeError, match="`filter` must be"):
        fx.tag_modules(mlp(), filter="Linear")
    with pytest.raises(TypeError, match="`methods` must be a sequence"):
        fx.tag_modules(mlp(), methods="__call__")


#
# Flax linen
#

nn = pytest.importorskip("flax.linen")


def _features(x):
    """The CNN's convolution, called inside a compact method (which owns it)."""
    x = nn.relu(nn.Conv(features=4, kernel_size=(3, 3))(x))
    return x.reshape((x.shape[0], -1))


class CNN(nn.Module):
    """The seed guide's CNN, smaller: one Dense called twice."""

    @nn.compact
    def __call__(self, x):
        x = _features(x)
        dense = nn.Dense(8)
        x = dense(nn.Dense(8)(x))
        x = dense(nn.relu(x))
        return nn.log_softmax(nn.Dense(2)(x))


def _captured(tree, prefix=()):
    """Flax's `intermediates` collection as {"A/B": values}."""
    out = {}
    for k, v in tree.items():
        if k == "__call__":
            out["/".join(prefix)] = v
        elif isinstance(v, dict):
            out.update(_captured(v, (*prefix, k)))
    return out


@pytest.mark.slow
def test_linen_names_and_values_match_capture_intermediates():
    model = CNN()
    x = jnp.linspace(0.0, 1.0, 2 * 5 * 5).reshape(2, 5, 5, 1)
    variables = model.init(jax.random.key(0), x)
    tagged = fx.tag_modules(model, filter=nn.Dense)
    out, found = fx.handle(tagged.apply, fx.Tag())(variables, x)
    want_out, state = model.apply(
        variables,
        x,
        capture_intermediates=lambda mdl, name: isinstance(mdl, nn.Dense),
        mutable=["intermediates"],
    )
    assert_trees_close(out, want_out)
    want = _captured(state["intermediates"])
    assert set(want) == {"Dense_0", "Dense_1", "Dense_2"}
    assert_trees_close(found, found_of(**want))
    # Every module but the root, as capture_intermediates' default does.
    _, everything = fx.handle(fx.tag_modules(model).apply, fx.Tag())(variables, x)
    assert list(everything["intermediates"]) == [
        "Conv_0",
        "Dense_1",
        "Dense_0",
        "Dense_2",
    ] or set(everything["intermediates"]) == {"Conv_0", "Dense_0", "Dense_1", "Dense_2"}
    # Unhandled, the same program as the model.
    assert optimized_hlo(
        lambda v, x: tagged.apply(v, x), variables, x
    ) == optimized_hlo(lambda v, x: model.apply(v, x), variables, x)
    assert tagged == fx.tag_modules(model, filter=nn.Dense)
    assert jax.tree.structure(tagged.init(jax.random.key(0), x)) == jax.tree.structure(
        variables
    )


class ScanCell(nn.Module):
    @nn.compact
    def __call__(self, carry, x):
        h = nn.tanh(nn.Dense(3)(carry) + x)
        return h, h


class ScanModel(nn.Module):
    cell: Any = ScanCell

    @nn.compact
    def __call__(self, xs):
        scan = nn.scan(
            self.cell, variable_broadcast="params", split_rngs={"params": False}
        )
        return scan()(jnp.zeros(3), xs)


class _EffectCell(nn.Module):
    @nn.compact
    def __call__(self, carry, x):
        h = nn.tanh(nn.Dense(3)(carry) + x)
        jax.debug.callback(lambda h: None, h)
        return h, h


def _flax_scan_refuses_effects() -> bool:
    """Whether this Flax's `nn.scan` refuses any effect in a body with
    broadcast variables, with Flax and JAX alone (a `jax.debug.callback`
    here): Flax 0.12.12 checks that broadcast variables do not depend on the
    body by dead-code elimination, which keeps every effectful equation, so
    it counts the callback's operand as a dependency. Flax 0.12.8 does not."""
    try:
        # Flax 0.12.8's check meets JAX's leak checker false report (see
        # `jax_leak_check_false_report` in conftest.py).
        with no_leak_checks():
            ScanModel(_EffectCell).init(jax.random.key(0), jnp.ones((2, 3)))
    except ValueError as e:
        return "data dependency on the scan body" in str(e)
    return False


@pytest.mark.xfail(
    condition=_flax_scan_refuses_effects(),
    strict=True,
    reason="this Flax's nn.scan refuses any effect in a body with broadcast "
    "variables (jax.debug.callback too); a handled tag carries one",
)
def test_linen_scan_entries_are_stacked_as_a_tag_in_the_scan_would_be(
    jax_leak_check_false_report,
):
    # (repros: flax_linen_scan_over_layers.py, flax01212_scan_no_broadcast.py)
    model = ScanModel()
    xs = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    variables = model.init(jax.random.key(0), xs)
    out, found = fx.handle(fx.tag_modules(model).apply, fx.Tag())(variables, xs)
    want_out, state = model.apply(
        variables, xs, capture_intermediates=True, mutable=["intermediates"]
    )
    assert_trees_close(out, want_out)
    # capture_intermediates collects nothing inside nn.scan (its intermediates
    # do not leave the scan), so the reference is the scan done by hand.
    assert _captured(state["intermediates"]).keys() <= {""}
    dense = variables["params"]["ScanScanCell_0"]["Dense_0"]
    carry, lin, hs = jnp.zeros(3), [], []
    for x in xs:
        lin.append(carry @ dense["kernel"] + dense["bias"])
        carry = jnp.tanh(lin[-1] + x)
        hs.append(carry)
    want = {
        "ScanScanCell_0/Dense_0": (jnp.stack(lin),),
        "ScanScanCell_0": ((jnp.stack(hs), jnp.stack(hs)),),
    }
    assert_trees_close(found, found_of(**want))


#
# Flax NNX
#

nnx = pytest.importorskip("flax.nnx")


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(3, 3, rngs=rngs) for _ in range(2)])
        self.bn = nnx.BatchNorm(3, momentum=0.9, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return self.bn(x)


def test_nnx_every_layer_named_by_its_path_and_state_shared():
    xs = jnp.stack([X, 2 * X])
    model, plain = NnxNet(nnx.Rngs(0)), NnxNet(nnx.Rngs(0))
    model.train()
    plain.train()
    tagged = fx.tag_modules(model)
    assert isinstance(tagged.layers[0], nnx.Linear)
    out, found = fx.handle(tagged, fx.Tag())(xs)
    l0 = plain.layers[0](xs)
    l1 = plain.layers[1](jnp.tanh(l0))
    assert_trees_close(out, plain(xs))
    assert_trees_close(
        found, found_of(**{"layers.0": (l0,), "layers.1": (l1,), "bn": (out,)})
    )
    # The BatchNorm statistics the tagged copy updated are the model's own.
    assert tagged.bn.mean is model.bn.mean
    assert_trees_close(model.bn.mean[...], plain.bn.mean[...])
    # nnx.jit and nnx.split work on the tagged copy.
    assert_trees_close(nnx.jit(lambda m, x: m(x))(tagged, xs), plain(xs))
    graphdef, _ = nnx.split(tagged)
    assert graphdef is not None


def test_nnx_filter_matches_nnx_capture():
    if not hasattr(nnx, "capture"):
        pytest.skip("nnx.capture is newer than this Flax: nothing to compare with")
    xs = jnp.stack([X, 2 * X])
    model = NnxNet(nnx.Rngs(0))
    model.eval()
    tagged = fx.tag_modules(model, filter=nnx.Linear)
    _, found = fx.handle(tagged, fx.Tag())(xs)

    @nnx.jit
    def captured(m, x):
        return nnx.capture(m, nnx.Intermediate, method_outputs=nnx.Intermediate)(x)

    _, state = captured(model, xs)
    want = {f"layers.{i}": state["layers"][i]["__call__"].get_value() for i in range(2)}
    assert list(found["intermediates"]) == ["layers.0", "layers.1"]
    assert_trees_close(found["intermediates"], want)


class Lifted(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.remat(nn.Dense)(3)(x)
        per_row = nn.vmap(
            nn.Dense,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=0,
        )
        return per_row(3)(x)


def test_linen_remat_and_vmap():
    model = Lifted()
    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    variables = model.init(jax.random.key(0), x)
    out, found = fx.handle(fx.tag_modules(model).apply, fx.Tag())(variables, x)
    p = variables["params"]
    h = x @ p["CheckpointDense_0"]["kernel"] + p["CheckpointDense_0"]["bias"]
    v = p["VmapDense_0"]
    rows = jnp.einsum("bi,bio->bo", h, v["kernel"]) + v["bias"]
    assert_trees_close(out, model.apply(variables, x))
    assert_trees_close(
        found, found_of(CheckpointDense_0=(h,), VmapDense_0=(rows,)), atol=1e-5
    )


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.lin(x))


class NnxStack(nnx.Module):
    def __init__(self, key):
        make = nnx.vmap(lambda k: NnxBlock(nnx.Rngs(k)), in_axes=0, out_axes=0)
        self.blocks = make(jax.random.split(key, 5))

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return body(x, self.blocks)


def test_nnx_scan_entries_are_stacked():
    model = NnxStack(jax.random.key(5))
    out, found = fx.handle(fx.tag_modules(model), fx.Tag())(X)
    kernel, bias = model.blocks.lin.kernel[...], model.blocks.lin.bias[...]
    h, lin, hs = X, [], []
    for i in range(5):
        lin.append(h @ kernel[i] + bias[i])
        h = jnp.tanh(lin[-1])
        hs.append(h)
    assert_trees_close(out, h)
    want = {"blocks.lin": (jnp.stack(lin),), "blocks": (jnp.stack(hs),)}
    assert_trees_close(found, found_of(**want))


class PerturbedLinen(nn.Module):
    """The same layer twice: once with linen's perturb, once with fx.perturb."""

    use_fx: bool

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4)(x)
        h = fx.perturb(h, "h") if self.use_fx else self.perturb("h", h)
        return jnp.sum(nn.Dense(1)(jnp.tanh(h)) ** 2)


def test_intermediate_grads_match_linen_perturb():
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    flax_model, fx_model = PerturbedLinen(False), PerturbedLinen(True)
    variables = flax_model.init(jax.random.key(0), x)
    params = {"params": variables["params"]}

    # Flax's workflow: perturbations initialised as zeros, then differentiated.
    def loss(params, perturbations, x):
        return flax_model.apply({**params, "perturbations": perturbations}, x)

    want = jax.grad(loss, argnums=1)(params, variables["perturbations"], x)
    value, got = fx.intermediate_grads(fx_model.apply)(params, x)
    assert_trees_close(value, fx_model.apply(params, x))
    assert_trees_close(got["h"], (want["h"],))


def test_linen_and_nnx_from_threads_leave_classes_as_they_were():
    classes = [nn.Dense, nn.Module, NnxNet, nnx.Linear, nnx.BatchNorm, nnx.Module]
    before = _class_dicts(classes)
    batch = jnp.stack([X, 2 * X])
    cnn = CNN()
    images = jnp.linspace(0.0, 1.0, 2 * 5 * 5).reshape(2, 5, 5, 1)
    variables = cnn.init(jax.random.key(0), images)
    want_linen = fx.handle(fx.tag_modules(cnn, filter=nn.Dense).apply, fx.Tag())(
        variables, images
    )[1]
    errors = []

    def work(i):
        try:
            for _ in range(2):
                if i % 2:
                    tagged = fx.tag_modules(cnn, filter=nn.Dense)
                    got = fx.handle(tagged.apply, fx.Tag())(variables, images)[1]
                    assert_trees_close(got, want_linen)
                else:
                    model = NnxNet(nnx.Rngs(i))
                    model.eval()
                    flt = nnx.Linear if i % 4 else None
                    _, found = fx.handle(fx.tag_modules(model, filter=flt), fx.Tag())(
                        batch
                    )
                    names = ["layers.0", "layers.1"] + ([] if i % 4 else ["bn"])
                    assert list(found["intermediates"]) == names
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    # Without JAX's leak checker: it is process-wide, and once (1 run in 4, a
    # loaded machine) it reported a tracer of one thread's NNX trace held by
    # Flax's `graphlib._get_sorted_leaves._flatten`, a self-referencing
    # closure that only the garbage collector frees, while 7 other threads
    # traced. What this test checks is the classes and the values.
    with no_leak_checks():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    assert _class_dicts(classes) == before


def test_nnx_unhandled_compiles_to_the_models_program():
    model = NnxNet(nnx.Rngs(0))
    model.eval()
    tagged = fx.tag_modules(model)
    batch = jnp.stack([X, 2 * X])
    assert optimized_hlo(lambda x: tagged(x), batch) == optimized_hlo(
        lambda x: model(x), batch
    )


class HandTaggedCNN(nn.Module):
    """`CNN` with the `fx.tag` calls `tag_modules(filter=nn.Dense)` makes."""

    @nn.compact
    def __call__(self, x):
        x = _features(x)
        # Linen names modules as they are made: `dense` first.
        dense = nn.Dense(8, name="Dense_0")
        x = dense(fx.tag(nn.Dense(8, name="Dense_1")(x), "Dense_1"))
        x = fx.tag(x, "Dense_0")
        x = fx.tag(dense(nn.relu(x)), "Dense_0")
        return nn.log_softmax(fx.tag(nn.Dense(2, name="Dense_2")(x), "Dense_2"))


def test_linen_handled_compiles_to_the_hand_tagged_program():
    x = jnp.linspace(0.0, 1.0, 2 * 5 * 5).reshape(2, 5, 5, 1)
    variables = CNN().init(jax.random.key(0), x)
    tagged = fx.tag_modules(CNN(), filter=nn.Dense)
    by_hand = HandTaggedCNN()
    assert jax.tree.structure(by_hand.init(jax.random.key(0), x)) == jax.tree.structure(
        variables
    )
    got = fx.handle(tagged.apply, fx.Tag())
    want = fx.handle(by_hand.apply, fx.Tag())
    assert_trees_close(got(variables, x), want(variables, x))
    assert optimized_hlo(got, variables, x) == optimized_hlo(want, variables, x)


class HandTaggedNnxNet(NnxNet):
    """`NnxNet` with the `fx.tag` calls `tag_modules` makes."""

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = jnp.tanh(fx.tag(layer(x), f"layers.{i}"))
        return fx.tag(self.bn(x), "bn")


def test_nnx_handled_compiles_to_the_hand_tagged_program():
    batch = jnp.stack([X, 2 * X])
    model, by_hand = NnxNet(nnx.Rngs(0)), HandTaggedNnxNet(nnx.Rngs(0))
    model.eval()
    by_hand.eval()
    tagged = fx.tag_modules(model)
    got = fx.handle(lambda m, x: m(x), fx.Tag())
    assert_trees_close(got(tagged, batch), got(by_hand, batch))
    assert optimized_hlo(lambda x: got(tagged, x), batch) == optimized_hlo(
        lambda x: got(by_hand, x), batch
    )


class Raises(eqx.Module):
    lin: eqx.nn.Linear

    def __call__(self, x):
        y = self.lin(x)
        if y.shape[0] == 3:  # static: raises while traced
            raise RuntimeError("model failed")
        return y


def test_a_model_that_raises_leaves_nothing_behind():
    classes = [Raises, eqx.nn.Linear, nn.Dense, CNN, NnxNet, nnx.Linear]
    before = _class_dicts(classes)
    tagged = fx.tag_modules(Raises(eqx.nn.Linear(3, 3, key=jax.random.key(0))))
    with pytest.raises(RuntimeError, match="model failed"):
        fx.handle(tagged, fx.Tag())(X)
    images = jnp.linspace(0.0, 1.0, 2 * 5 * 5).reshape(2, 5, 5, 1)
    variables = CNN().init(jax.random.key(0), images)
    with pytest.raises(TypeError):  # a wrong argument, inside linen's apply
        fx.handle(fx.tag_modules(CNN()).apply, fx.Tag())(variables, images, 1, 2)
    assert _class_dicts(classes) == before
    # Nothing of the failed calls is left: linen's interceptor stack is empty
    # again, so the plain model tags nothing, and the tagged one works.
    _, found = fx.handle(CNN().apply, fx.Tag())(variables, images)
    assert found == {"intermediates": {}}
    _, found = fx.handle(fx.tag_modules(CNN()).apply, fx.Tag())(variables, images)
    assert set(found["intermediates"]) == {"Conv_0", "Dense_0", "Dense_1", "Dense_2"}
