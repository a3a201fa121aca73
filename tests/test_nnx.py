"""Flax NNX modules through `handle`: every state update a plain call makes
(BatchNorm's running statistics, RNG counters) reaches the caller's module,
eagerly, under `nnx.jit`, under `jax.jit` of a function of the module's state
and inside `nnx.grad`; compared with the same calls without effects
(`../shared/repros/bug_nnx_state_dropped.py`, `bug_nnx_grad_state_dropped.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_trees_close

import effects as fx

nnx = pytest.importorskip("flax.nnx")


class Net(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        h = fx.tag(self.bn(self.lin(x)), "bn")
        return self.drop(fx.perturb(h, "h"))

    def features(self, x):
        return fx.tag(self.lin(x), "lin")


X = jnp.linspace(-1.0, 2.0, 12).reshape(4, 3)


def new_model():
    model = Net(nnx.Rngs(0))
    model.train()
    return model


def fwd(model, x):
    return model(x)


def loss_fn(model, x):
    return jnp.sum(model(x) ** 2)


def bn_of(model, x):
    """What the tag "bn" sees in a plain call, without changing `model`."""
    clone = nnx.clone(model)
    return clone.bn(clone.lin(x))


def _comparable(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(x)
    return x


def assert_same_state(a, b, **tolerance):
    """Every Variable of `a` equals `b`'s: parameters, statistics, RNG keys and
    counters."""
    assert_trees_close(
        jax.tree.map(_comparable, nnx.state(a)),
        jax.tree.map(_comparable, nnx.state(b)),
        **tolerance,
    )


def twice(call, model):
    """Two calls in a row: the second sees the first's updates (the running
    statistics, a new dropout mask)."""
    return call(model, X), call(model, X)


HANDLED_CALLS = {
    "handle(fwd)(model, x)": lambda m, x: fx.handle(fwd, fx.Tag())(m, x),
    "handle(model)(x)": lambda m, x: fx.handle(m, fx.Tag())(x),
    "handle(model.__call__)(x)": lambda m, x: fx.handle(m.__call__, fx.Tag())(x),
    "nnx.jit(handle(fwd))": lambda m, x: nnx.jit(fx.handle(fwd, fx.Tag()))(m, x),
    "handle(nnx.jit(fwd))": lambda m, x: fx.handle(nnx.jit(fwd), fx.Tag())(m, x),
    "handle(fwd) under nnx.jit": nnx.jit(lambda m, x: fx.handle(fwd, fx.Tag())(m, x)),
}


@pytest.mark.parametrize("label", HANDLED_CALLS)
def test_state_updates_reach_the_callers_module(label):
    call = HANDLED_CALLS[label]
    plain, handled = new_model(), new_model()
    want_bn = bn_of(handled, X)
    want = twice(fwd, plain)
    (out1, found1), (out2, _) = twice(call, handled)
    assert_trees_close((out1, out2), want)
    assert_same_state(handled, plain)
    assert int(handled.drop.rngs.count[...]) == 2
    assert_trees_close(found1, {"intermediates": {"bn": (want_bn,)}})


def test_under_jax_jit_of_a_function_of_the_state():
    plain, handled = new_model(), new_model()
    graphdef, state = nnx.split(handled)

    @jax.jit
    def step(state, x):
        model = nnx.merge(graphdef, state)
        out, found = fx.handle(fwd, fx.Tag())(model, x)
        return out, found, nnx.state(model)

    out, found, state = step(state, X)
    out2, _, state = step(state, X)
    assert_trees_close((out, out2), twice(fwd, plain))
    nnx.update(handled, state)
    assert_same_state(handled, plain)


def test_a_module_shared_between_arguments_stays_shared():
    # Two arguments holding the same module: one update, seen by both.
    def f(a, b, x):
        return a(x) + b(x)

    plain, handled = new_model(), new_model()
    want = f(plain, plain, X)
    out, _ = fx.handle(f, fx.Tag())(handled, handled, X)
    assert_trees_close(out, want)
    assert_same_state(handled, plain)


def test_a_method_bound_to_a_module():
    plain, handled = new_model(), new_model()
    out, found = fx.handle(handled.features, fx.Tag())(X)
    assert_trees_close(out, plain.features(X))
    assert_trees_close(found, {"intermediates": {"lin": (plain.features(X),)}})


@pytest.mark.slow
@pytest.mark.parametrize("jit", [False, True])
def test_inside_nnx_grad_a_training_loop_matches_the_plain_one(jit):
    # The pattern the docs show: handle inside nnx.value_and_grad. Two steps
    # of SGD, against the same loop without effects.
    def loss_fx(model, x):
        return fx.handle(loss_fn, fx.Tag(names="bn"))(model, x)

    def plain_step(model, x):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x)
        nnx.update(
            model,
            jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param), grads),
        )
        return loss

    def handled_step(model, x):
        (loss, found), grads = nnx.value_and_grad(loss_fx, has_aux=True)(model, x)
        nnx.update(
            model,
            jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param), grads),
        )
        return loss, found

    if jit:
        plain_step, handled_step = nnx.jit(plain_step), nnx.jit(handled_step)
    plain, handled = new_model(), new_model()
    for _ in range(2):
        want_bn = bn_of(handled, X)
        want = plain_step(plain, X)
        loss, found = handled_step(handled, X)
        assert_trees_close(loss, want)
        assert_trees_close(found, {"intermediates": {"bn": (want_bn,)}})
        # Parameters after SGD steps, rounded differently: near zero, to 1e-5.
        assert_same_state(handled, plain, atol=1e-5)


@pytest.mark.parametrize("jit", [False, True])
def test_intermediate_grads_carries_the_state(jit):
    class Explicit(Net):
        # The same model with the perturbation written out: a reference.
        def __call__(self, x, delta):
            return self.drop(self.bn(self.lin(x)) + delta)

    def reference(model, x):
        return nnx.value_and_grad(
            lambda delta, m: jnp.sum(Explicit.__call__(m, x, delta) ** 2)
        )(jnp.zeros((4, 3)), model)

    grads_of = fx.intermediate_grads(loss_fn)
    if jit:
        grads_of, reference = nnx.jit(grads_of), nnx.jit(reference)
    plain, handled = new_model(), new_model()
    for _ in range(2):
        want_loss, want_grad = reference(plain, X)
        loss, grads = grads_of(handled, X)
        assert_trees_close((loss, grads), (want_loss, {"h": (want_grad,)}))
        assert_same_state(handled, plain)


def test_substitute_and_intervene_carry_the_state():
    ones = jnp.ones((4, 3))
    for handler, replace in [
        (fx.Substitute({"bn": ones}), lambda v: ones),
        (fx.Intervene({"bn": lambda v: 2.0 * v}), lambda v: 2.0 * v),
    ]:
        # The reference does by hand what the handler does at the tag.
        plain, handled = new_model(), new_model()
        want = plain.drop(replace(plain.bn(plain.lin(X))))
        out, _ = fx.handle(fwd, handler)(handled, X)
        assert_trees_close(out, want)
        assert_same_state(handled, plain)


def test_a_module_closed_over_and_written_says_to_pass_it():
    model = new_model()
    with pytest.raises(ValueError, match="pass the module as an argument"):
        fx.handle(lambda x: model(x), fx.Tag())(X)
    # Only read, a closed-over module is fine.
    model.eval()
    out, _ = fx.handle(lambda x: model(x), fx.Tag())(X)
    assert_trees_close(out, model(X))


def test_a_module_made_outside_jax_grad_and_not_written_is_fine():
    # Under a plain jax.grad or jax.jit around `handle`, a module made outside
    # them can be read, as in a plain call; only a write is Flax's error.
    model = new_model()
    model.eval()  # BatchNorm reads its statistics; Dropout does nothing

    def loss(v):
        out, _ = fx.handle(fwd, fx.Tag())(model, X)
        return jnp.sum(out) * v

    assert_trees_close(jax.grad(loss)(1.0), jnp.sum(fwd(model, X)))
    assert_trees_close(jax.jit(loss)(2.0), 2.0 * jnp.sum(fwd(model, X)))
    model.train()  # now the call writes the statistics: refused, with advice
    with pytest.raises(ValueError, match="use `nnx.grad` and `nnx.jit`"):
        jax.grad(loss)(1.0)


class Perturbed(nnx.Module):
    """NNX's perturb, or fx.perturb, at the same place."""

    def __init__(self, use_fx, rngs):
        self.use_fx = use_fx
        self.l1 = nnx.Linear(3, 4, rngs=rngs)
        self.l2 = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        h = self.l1(x)
        h = fx.perturb(h, "h") if self.use_fx else self.perturb("h", h)
        return jnp.sum(self.l2(jnp.tanh(h)) ** 2)


def test_intermediate_grads_match_nnx_perturb_workflow():
    if not hasattr(nnx, "capture"):
        pytest.skip("nnx.capture is newer than this Flax: nothing to compare with")
    flax_model = Perturbed(False, nnx.Rngs(0))
    fx_model = Perturbed(True, nnx.Rngs(0))

    # NNX's four steps: initialise the perturbations, capture, differentiate
    # with respect to them (the fourth, merging with the intermediates, only
    # repackages).
    _, perturbations = nnx.capture(flax_model, nnx.Perturbation)(X[None])

    def loss(model, perturbations, x):
        return nnx.capture(model, nnx.Intermediate, init=perturbations)(x)

    (_, want), _ = nnx.grad(loss, argnums=(0, 1), has_aux=True)(
        flax_model, perturbations, X[None]
    )
    value, got = fx.intermediate_grads(fwd)(fx_model, X[None])
    assert_trees_close(value, fx_model(X[None]))
    assert_trees_close(got["h"], (want["h"].get_value(),))


def test_intervene_inside_nnx_grad_carries_state_and_gradients():
    # A handler that changes the forward pass, inside a training step's
    # nnx.value_and_grad: the loss, the gradients and the state updates are
    # those of the model with the change written in.
    class Doubled(Net):
        def __call__(self, x):
            return self.drop(2.0 * self.bn(self.lin(x)))

    def handled_loss(model, x):
        out, _ = fx.handle(fwd, fx.Intervene({"bn": lambda v: 2.0 * v}))(model, x)
        return jnp.sum(out**2)

    def reference_loss(model, x):
        return jnp.sum(Doubled.__call__(model, x) ** 2)

    handled, reference = new_model(), new_model()
    for _ in range(2):
        got = nnx.value_and_grad(handled_loss)(handled, X)
        want = nnx.value_and_grad(reference_loss)(reference, X)
        # Some gradients are zero up to rounding (BatchNorm removes the mean):
        # compared to 1e-4 absolute.
        assert_trees_close(
            jax.tree.map(_comparable, got), jax.tree.map(_comparable, want), atol=1e-4
        )
        assert_same_state(handled, reference)


class Sowing(nnx.Module):
    """Keeps what it saw: `sow` (which adds a Variable at the first call, and
    appends to its tuple after) and a tuple Variable that grows."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)
        self.seen = nnx.Variable(())

    def __call__(self, x):
        h = fx.tag(self.lin(x), "h")
        self.sow(nnx.Intermediate, "features", h * 2)
        self.seen.value = (*self.seen.value, h)
        return h


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside")
@pytest.mark.filterwarnings("ignore:'.value' .* is now deprecated")
@pytest.mark.parametrize("label", HANDLED_CALLS)
def test_variables_a_call_adds_or_grows_reach_the_callers_module(label):
    # (`../shared/repros`-style: a tuple that grew counted as unwritten, and a
    # Variable `sow` adds at the first call was refused)
    call = HANDLED_CALLS[label]
    plain, handled = Sowing(nnx.Rngs(0)), Sowing(nnx.Rngs(0))
    want = twice(fwd, plain)
    (out1, found1), (out2, found2) = twice(call, handled)
    assert_trees_close((out1, out2), want)
    assert len(plain.features.value) == len(plain.seen.value) == 2
    assert_same_state(handled, plain)
    assert_trees_close(
        (found1, found2), tuple({"intermediates": {"h": (h,)}} for h in want)
    )
