"""`find_nonfinite` with no tags: the first primitive that made a NaN or an Inf
from finite inputs, forward and in the gradient, against programs whose NaN
is placed by hand (the line, the iteration, the operands known). The tests
of its tag search are in test_debug.py."""

from __future__ import annotations

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import devices, no_leak_checks

import effects as fx


def _line(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def scan_log(x):  # A: log of a negative value at iteration 2 of a scan
    def body(c, xi):
        return c + jnp.log(xi), c

    return jax.lax.scan(body, 0.0, x)[0]


def sqrt_of_zero(x):  # B: finite forward, NaN gradient
    return jnp.sum(jnp.sqrt(x - x))


def test_a_log_in_a_scan():
    x = jnp.array([1.0, 2.0, -3.0, 4.0])
    bad = fx.find_nonfinite(scan_log, x)
    assert bad is not None
    assert (bad.primitive, bad.line, bad.iteration, bad.call) == (
        "log",
        _line(scan_log, "jnp.log"),
        2,
        0,
    )
    assert bad.file == __file__ and not bad.backward
    assert bad.inputs == "log(-3.0) = nan"
    assert str(bad).startswith(f"`log` at test_nonfinite.py:{bad.line} is the first")
    assert fx.find_nonfinite(scan_log, jnp.abs(x)) is None
    # backward=True: the forward pass is the cause, and says so
    both = fx.find_nonfinite(scan_log, x, backward=True)
    assert both == bad and "already non-finite" in str(both)


def doubled(x):
    return jnp.sum(x * 2.0)


def test_an_inf_made_by_overflowing_a_product_by_a_constant():
    # XLA folds the check's own arithmetic into such a product (see
    # test_jax_facts.py::test_xla_folds_a_product_by_zero_into_the_product_before_it):
    # the answer was "no primitive made a NaN or an Inf".
    x = jnp.array([1e38, -2.0e38, -3.0e38])
    assert np.isinf(doubled(x))
    bad = fx.find_nonfinite(doubled, x)
    assert bad is not None and (bad.primitive, bad.index) == ("mul", (1,))
    assert bad.line == _line(doubled, "x * 2.0") and bad.inputs.endswith("= -inf")


def where_sqrt(x):  # the output is finite, the gradient is not
    return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0))


def test_a_nan_the_output_drops_is_named_with_how_the_gradient_meets_it():
    x = jnp.array([-1.0, 4.0])
    assert np.isfinite(where_sqrt(x)) and np.isnan(jax.grad(where_sqrt)(x)[0])
    assert fx.find_nonfinite(where_sqrt, x) is None  # (the output is finite)
    bad = fx.find_nonfinite(where_sqrt, x, backward=True)
    assert bad is not None and not bad.backward and bad.output_finite
    assert (bad.primitive, bad.line) == ("sqrt", _line(where_sqrt, "jnp.sqrt"))
    assert bad.inputs == "sqrt(-1.0)[0] = nan"
    said = str(bad)
    assert "output is finite all the same" in said and "already" not in said

    # The fix it says gives a finite gradient.
    def fixed(x):
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(jnp.where(x > 0, x, 1.0)), 0.0))

    assert np.isfinite(jax.grad(fixed)(x)).all()
    assert fx.find_nonfinite(fixed, x, backward=True) is None
    # Where the output holds the NaN, that is said instead.
    both = fx.find_nonfinite(scan_log, jnp.array([1.0, -3.0]), backward=True)
    assert not both.output_finite and "already non-finite" in str(both)


def two_sources(x):  # two operations make a NaN: `sqrt` at iteration 1 first
    def body(c, xi):
        return c + jnp.log(xi[0]) + jnp.sqrt(xi[1]), c

    return jax.lax.scan(body, 0.0, x)[0]


def test_of_two_operations_that_make_a_nan_the_first_executed_is_named():
    # Where one operation alone makes a NaN from finite inputs, the counters
    # name it; where two do, the order of execution decides: the iteration,
    # then the program order (`log` comes first in the body, but goes bad at
    # iteration 2), as in two bodies one after the other.
    x = jnp.array([[1.0, 1.0], [1.0, -1.0], [-3.0, 1.0]])
    bad = fx.find_nonfinite(two_sources, x)
    assert (bad.primitive, bad.iteration, bad.inputs) == ("sqrt", 1, "sqrt(-1.0) = nan")
    bad = fx.find_nonfinite(two_sources, x.at[1, 1].set(1.0))  # `log` alone
    assert (bad.primitive, bad.iteration, bad.inputs) == ("log", 2, "log(-3.0) = nan")
    bad = fx.find_nonfinite(two_sources, x.at[1, 0].set(-2.0))  # both at 1
    assert (bad.primitive, bad.iteration, bad.inputs) == ("log", 1, "log(-2.0) = nan")


def test_b_the_derivative_of_sqrt_at_zero():
    assert fx.find_nonfinite(sqrt_of_zero, jnp.ones(3)) is None
    bad = fx.find_nonfinite(sqrt_of_zero, jnp.ones(3), backward=True)
    assert bad is not None and bad.backward
    assert bad.forward == ("sqrt",)
    assert bad.line == _line(sqrt_of_zero, "jnp.sqrt")
    # JAX's derivative of sqrt: 0.5 / sqrt(x), infinite at 0
    assert (bad.primitive, bad.inputs, bad.index) == (
        "div",
        "div(0.5, 0.0)[0] = inf",
        (0,),
    )
    assert "derivative of `sqrt`" in str(bad)


def test_the_issue_example_with_its_tag_finite():
    # the tagged value is finite; the log of it is not
    f = lambda x: jnp.sum(jnp.log(fx.tag(x - 100.0, "neg")))  # noqa: E731
    bad = fx.find_nonfinite(f, jnp.arange(4.0))
    assert bad is not None and bad.primitive == "log"
    assert bad.inputs == "log(-100.0)[0] = nan" and bad.index == (0,)


class Block(eqx.Module):
    lin: eqx.nn.Linear
    k: int = eqx.field(static=True)

    def __call__(self, x):
        h = self.lin(x)
        if self.k == 3:
            h = jnp.sqrt(h - h)
        return jnp.tanh(h)


class MLP(eqx.Module):
    blocks: list

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _mlp():
    keys = jax.random.split(jax.random.key(0), 5)
    return MLP([Block(eqx.nn.Linear(4, 4, key=k), i) for i, k in enumerate(keys)])


def _loss(model, x):
    return jnp.sum(model(x) ** 2)


@pytest.mark.slow
def test_c_an_equinox_mlp_whose_block_3_takes_sqrt_of_zero():
    model, x = _mlp(), jnp.ones(4)
    grads = jax.jit(jax.grad(_loss))(model, x)
    assert not np.all(np.isfinite(grads.blocks[0].lin.weight))
    assert fx.find_nonfinite(_loss, model, x) is None
    bad = fx.find_nonfinite(_loss, model, x, backward=True)
    assert bad is not None and bad.backward and bad.forward == ("sqrt",)
    assert bad.line == _line(Block.__call__, "jnp.sqrt")
    # the module path, from the scope `tag_modules` enters: the first layer
    # whose cotangent is bad, then the operation, in block 3
    tagged = fx.find_nonfinite(_loss, fx.tag_modules(model), x, backward=True)
    assert tagged is not None and (tagged.name, tagged.backward) == (
        "blocks.3.lin",
        True,
    )
    operation = tagged.operation
    assert operation is not None and operation.scope == "blocks.3"
    assert (operation.primitive, operation.forward) == ("div", ("sqrt",))
    assert operation.line == bad.line and "in blocks.3" in str(tagged)


def test_example_index_under_a_vmap_outside_the_taps():
    xs = jnp.array([[1.0, 2.0, 3.0], [1.0, 2.0, -3.0]])
    bad = fx.find_nonfinite(jax.vmap(scan_log), xs)
    # the taps see the batched program: the element's index names the example
    assert bad is not None and bad.iteration == 2 and bad.index == (1,)
    assert bad.inputs == "log(-3.0)[1] = nan"


def test_the_example_under_vmaps_inside_the_function():
    def f(x):  # x: (2, 3, 4); the scan per example, over the last axis
        return jnp.sum(jax.vmap(jax.vmap(scan_log))(x))

    x = jnp.ones((2, 3, 4)).at[1, 2, 3].set(-5.0).at[0, 1, 3].set(-2.0)
    bad = fx.find_nonfinite(f, x)
    assert bad is not None and (bad.primitive, bad.iteration) == ("log", 3)
    # JAX batches the scan: the taps see the batched `log`, whose element's
    # index names the example; of two, the first
    assert bad.example is None
    assert (bad.index, bad.inputs) == ((0, 1), "log(-2.0)[0, 1] = nan")
    bad = fx.find_nonfinite(f, x.at[0, 1, 3].set(1.0))
    assert bad is not None and bad.inputs == "log(-5.0)[1, 2] = nan"
    assert fx.find_nonfinite(f, jnp.ones((2, 3, 4))) is None


def test_a_nonfinite_constant_is_not_a_finding():
    def f(x):
        direction = jnp.sign(x)
        big = direction * jnp.inf  # a constant's Inf, as diffrax's own
        return jnp.minimum(big, 10.0) + jnp.log(x)

    x = jnp.array([1.0, 2.0])
    assert fx.find_nonfinite(f, x) is None
    bad = fx.find_nonfinite(f, -x)
    assert bad is not None and bad.primitive == "log"


def test_never_none_while_the_output_is_nonfinite():
    bad = fx.find_nonfinite(lambda x: x * jnp.inf, jnp.ones(2))
    assert bad is not None and bad.primitive is None and "constant" in str(bad)
    bad = fx.find_nonfinite(lambda x, y: x * y, jnp.ones(2), y=jnp.array([np.nan, 1]))
    assert bad is not None and "kwargs['y']" in str(bad)


def test_a_nan_the_output_masks_away_is_found_only_where_it_spoils_the_gradient():
    def f(x):  # (the "double where" trap: log of 0, then masked)
        return jnp.sum(jnp.where(x > 0, jnp.log(x), 0.0))

    x = jnp.array([1.0, 0.0, 3.0])
    assert np.isfinite(f(x)) and not np.isfinite(jax.grad(f)(x)).all()
    # finite output and no tag: nothing to explain, and the operations are not
    # searched (one compiled run of `f` tells)
    assert fx.find_nonfinite(f, x) is None
    # the gradient's NaN comes from the forward `log`, masked in the output
    bad = fx.find_nonfinite(f, x, backward=True)
    assert bad is not None and not bad.backward
    assert (bad.primitive, bad.line) == ("log", _line(f, "jnp.log"))
    assert (bad.inputs, bad.index) == ("log(0.0)[1] = -inf", (1,))
    # and a finite function, forward and backward: None, no search
    assert fx.find_nonfinite(lambda x: jnp.sum(jnp.exp(x)), x, backward=True) is None


def test_a_second_call_compiles_nothing_new():
    x = jnp.array([1.0, 2.0, -3.0, 4.0])
    fx.find_nonfinite(scan_log, x, backward=True)
    with jax.log_compiles():
        pass
    traced = []

    def f(x):
        traced.append(1)
        return scan_log(x)

    fx.find_nonfinite(f, x)
    n = len(traced)
    fx.find_nonfinite(f, x * 2)
    assert len(traced) == n


def test_after_a_search_its_own_run_answers_and_a_masked_nan_stays_unreported():
    def f(x, y):
        return jnp.sum(jnp.where(x > 0, jnp.log(x), 0.0)) + jnp.sqrt(y)

    x = jnp.array([1.0, 0.0])
    # two operations made a NaN or an Inf: `log(0)` (masked), `sqrt(-1)`
    bad = fx.find_nonfinite(f, x, -1.0)
    assert bad is not None and bad.primitive == "log"
    assert bad.inputs == "log(0.0)[1] = -inf"
    # From now on the search's program runs first, and says whether the
    # output is finite: a finite one is None, as before any search.
    assert fx.find_nonfinite(f, x, 1.0) is None
    bad = fx.find_nonfinite(f, jnp.ones(2), -4.0)
    assert bad is not None and bad.primitive == "sqrt"
    assert bad.inputs == "sqrt(-4.0) = nan"


def test_an_element_made_nan_from_finite_elements_is_found_beside_a_passed_nan():
    def f(x):
        h = 2 * x  # element 0: the argument's NaN, passed on
        return jnp.sum(jnp.log(h - 3.0))  # element 1: log(-1), made here

    bad = fx.find_nonfinite(f, jnp.array([np.nan, 1.0]))
    assert bad is not None and (bad.primitive, bad.line) == ("log", _line(f, "log"))
    assert (bad.inputs, bad.index) == ("log(-1.0)[1] = nan", (1,))


def test_a_gather_filling_out_of_bounds_indices_with_nan_is_found():
    def f(x, i):
        return jnp.sum(jnp.take(x, i, mode="fill"))

    x = jnp.array([1.0, 2.0, 3.0])
    assert fx.find_nonfinite(f, x, jnp.array([0, 2])) is None
    bad = fx.find_nonfinite(f, x, jnp.array([0, 5]))
    assert bad is not None and (bad.primitive, bad.line) == ("gather", _line(f, "take"))
    assert bad.index == (1,) and bad.inputs.endswith("[1] = nan")


def test_a_nan_in_one_shard_of_a_shard_map():
    mesh = jax.sharding.Mesh(np.array(devices(4)), ("i",))
    spec = jax.sharding.PartitionSpec("i")

    def body(x):
        return jnp.log(x)

    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
    x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, -7.0, 8.0])
    bad = fx.find_nonfinite(lambda x: f(x).sum(), x)
    assert bad is not None and bad.primitive == "log"
    assert bad.line == _line(body, "jnp.log")
    assert bad.inputs == "log(-7.0)[0] = nan" and bad.shard == (3,)
    assert "shard 3" in str(bad)


@pytest.mark.parametrize("bad", [0, 5])
def test_an_input_sharded_over_devices_is_searched_as_one_on_one_device(bad):
    # A NaN in one shard of an array sharded over four devices (no shard_map:
    # XLA partitions the program): the search names the operation and the
    # element as for the array on one device. (A maximum over shards drops a
    # NaN: test_jax_facts.py::test_the_max_of_a_sharded_array_drops_a_nan.)
    mesh = jax.sharding.Mesh(np.array(devices(4)), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))

    def f(x):
        return jnp.sum(jnp.log(x))

    x = (jnp.arange(8.0) + 1.0).at[bad].set(-2.0)
    want = fx.find_nonfinite(f, x)
    assert want is not None and want.primitive == "log"
    assert want.index == (bad,) and want.line == _line(f, "jnp.log")
    sharded = jax.device_put(x, sharding)
    got = fx.find_nonfinite(f, sharded)
    assert got == want and got.inputs == want.inputs == f"log(-2.0)[{bad}] = nan"
    # (with a tag: its checks, and the operation behind it, alike)
    tagged = fx.find_nonfinite(lambda x: jnp.sum(fx.tag(jnp.log(x), "h")), sharded)
    assert tagged == fx.BadSite("h", "intermediates", 0, None)
    assert tagged.operation is not None and tagged.operation.index == (bad,)


def test_values_sharded_over_an_explicit_axis_mesh_are_searched():
    # Under an Explicit-axis mesh, whose types carry their shardings: a NaN
    # made forward and an Inf made in the gradient, in a 2-d array sharded
    # over both axes, found as for the array on one device.
    mesh = jax.make_mesh(
        (2, 2),
        ("a", "b"),
        axis_types=(jax.sharding.AxisType.Explicit,) * 2,
        devices=devices(4),
    )

    def f(x):
        return jnp.sum(jnp.sqrt(x) * 2.0)

    x = jnp.arange(16.0).reshape(4, 4) + 1.0
    for value, backward, said in [
        (x.at[1, 2].set(-4.0), False, "sqrt(-4.0)[1, 2] = nan"),
        (x.at[2, 3].set(0.0), True, "div(0.5, 0.0)[2, 3] = inf"),
    ]:
        want = fx.find_nonfinite(f, value, backward=backward)
        assert want is not None and want.inputs == said
        with jax.set_mesh(mesh):
            spec = jax.sharding.PartitionSpec("a", "b")
            sharded = jax.device_put(value, jax.sharding.NamedSharding(mesh, spec))
            got = fx.find_nonfinite(f, sharded, backward=backward)
        assert got == want and got.inputs == said


def test_the_backward_pass_of_a_checkpoint_region_is_searched():
    # The gradient's recomputation of a `jax.checkpoint` region holds the
    # derivative of `sqrt`, whose Inf at 0 is the finding: taps there are
    # operations of their own (they were refused as copies of the forward
    # pass's sites).
    def f(x):
        h = jax.checkpoint(
            lambda v: jnp.sqrt(v) * 2.0, policy=jax.checkpoint_policies.nothing_saveable
        )(x)
        return jnp.sum(h)

    x = jnp.array([1.0, 0.0, 2.0])
    assert np.isfinite(f(x)) and not np.isfinite(jax.grad(f)(x)).all()
    bad = fx.find_nonfinite(f, x, backward=True)
    assert bad is not None and bad.backward and bad.forward == ("sqrt",)
    assert (bad.primitive, bad.index) == ("div", (1,))
    assert bad.line == _line(f, "jnp.sqrt")
    assert fx.find_nonfinite(f, x + 1.0, backward=True) is None


@pytest.mark.parametrize(
    "fn, x, said",
    [
        # (a bfloat16 output of a float32 input: XLA refuses one reduction
        # of both, test_jax_facts.py::
        # test_xla_refuses_a_reduction_of_floats_of_two_precisions)
        (
            lambda x: jnp.exp(x.astype(jnp.bfloat16) * 100),
            [1.0, 2.0],
            "exp(100)[0] = inf",
        ),
        (
            lambda x: jnp.log(x.astype(jnp.complex64) * 0),
            [1.0, 2.0],
            "log(0j)[0] = (-inf+0j)",
        ),
        (
            lambda x: jnp.log(x.astype(jnp.float16) - 2),
            [3.0, 1.0],
            "log(-1.0)[1] = nan",
        ),
    ],
    ids=["bfloat16", "complex", "float16"],
)
def test_outputs_of_another_precision_than_their_inputs(fn, x, said):
    bad = fx.find_nonfinite(lambda x: jnp.abs(jnp.sum(fn(x))), jnp.array(x))
    assert bad is not None and bad.inputs == said


def test_operations_in_a_second_shard_map_are_searched():
    # One operation made the NaN, in the second shard_map: the counters name
    # it. Two made one, in two shard_maps, where JAX's checkify cannot order
    # them (test_jax_facts.py::test_checkify_fails_on_checks_in_shard_maps):
    # the first in program order, the first here too.
    mesh = jax.sharding.Mesh(np.array(devices(4)), ("i",))
    spec = jax.sharding.PartitionSpec("i")

    def grow(x):
        return jnp.exp(x) - 1.0

    def shrink(x):
        return jnp.log(x)

    first = jax.shard_map(grow, mesh=mesh, in_specs=spec, out_specs=spec)
    second = jax.shard_map(shrink, mesh=mesh, in_specs=spec, out_specs=spec)

    def f(x):
        return second(first(x)).sum()

    x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, -7.0, 8.0])
    bad = fx.find_nonfinite(f, x)
    assert (bad.primitive, bad.line, bad.shard) == ("log", _line(shrink, "log"), (3,))
    assert bad.inputs.startswith("log(-0.99") and bad.inputs.endswith("= nan")
    bad = fx.find_nonfinite(f, x.at[0].set(1000.0))
    assert (bad.primitive, bad.line, bad.shard) == ("exp", _line(grow, "exp"), (0,))
    assert bad.inputs == "exp(1000.0)[0] = inf"


@pytest.mark.parametrize("around", ["loop", "cond"])
def test_operations_beside_a_shard_map_are_searched(around):
    # A loop around a shard_map that holds no check (a negation, which cannot
    # make a NaN), or a cond with it in one branch: JAX's checkify fails on
    # checks beside it there (test_jax_facts.py::
    # test_checkify_fails_on_checks_in_shard_maps). Two operations made a NaN:
    # the first in program order, which without a loop between them is the
    # first to run.
    mesh = jax.sharding.Mesh(np.array(devices(4)), ("i",))
    spec = jax.sharding.PartitionSpec("i")
    flip = jax.shard_map(jnp.negative, mesh=mesh, in_specs=spec, out_specs=spec)

    def both(c):
        return jnp.log(c) + jnp.sqrt(c) + c

    def f(x):
        if around == "loop":
            return jnp.sum(jax.lax.fori_loop(0, 2, lambda i, c: both(flip(c)), x))
        return jnp.sum(both(jax.lax.cond(jnp.sum(x) > 0, flip, both, x)))

    x = jnp.array([1.0, 2.0, 3.0, 4.0])
    with np.errstate(invalid="ignore"):
        assert np.isnan(np.log(-1.0)) and np.isnan(np.sqrt(-1.0))
    assert np.isnan(f(x))
    bad = fx.find_nonfinite(f, x)
    iteration = 0 if around == "loop" else None
    assert (bad.primitive, bad.iteration) == ("log", iteration)
    assert bad.line == _line(both, "log")
    assert bad.inputs == "log(-1.0)[0] = nan"


def _field(t, y, args):
    return -args * jnp.sqrt(y)


@pytest.mark.slow
def test_diffrax_backward_nan_and_a_finite_solve():
    diffrax = pytest.importorskip("diffrax")

    def solve(y0, rate):
        term = diffrax.ODETerm(_field)
        sol = diffrax.diffeqsolve(term, diffrax.Euler(), 0.0, 1.0, 0.1, y0, args=rate)
        return jnp.sum(sol.ys)

    # (diffrax's solve meets JAX's leak checker, which then fails on its own
    # report (IndexError in `_why_alive`), with JAX and diffrax alone)
    with no_leak_checks():
        _diffrax_cases(solve)


def _diffrax_cases(solve):
    y0 = jnp.array([1.0, 4.0])
    assert fx.find_nonfinite(solve, y0, 0.5) is None  # its own `inf`s are none
    bad = fx.find_nonfinite(solve, jnp.array([0.0, 4.0]), 0.5, backward=True)
    assert bad is not None and bad.backward
    assert bad.forward == ("sqrt",) and bad.line == _line(_field, "jnp.sqrt")
    assert "checkpointed-bwd" in bad.name  # (diffrax's backward pass)


@pytest.mark.slow
def test_an_nnx_model_backward():
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(3, 3, rngs=rngs)
            self.b = nnx.Linear(3, 1, rngs=rngs)

        def __call__(self, x):
            h = self.a(x)
            return self.b(jnp.sqrt(h - h))

    def loss(net, x):
        return jnp.sum(net(x) ** 2)

    net, x = Net(nnx.Rngs(0)), jnp.ones((2, 3))
    assert fx.find_nonfinite(loss, net, x) is None
    bad = fx.find_nonfinite(loss, net, x, backward=True)
    assert bad is not None and bad.forward == ("sqrt",)
    assert bad.line == _line(Net.__call__, "jnp.sqrt") and bad.index == (0, 0)
    # with its layers' tags: the first whose cotangent is bad, then the operation
    tagged = fx.find_nonfinite(loss, fx.tag_modules(net), x, backward=True)
    assert tagged is not None and tagged.name == "a" and tagged.backward
    assert tagged.operation == bad


def _in_while(x):
    return jax.lax.while_loop(
        lambda c: c[1] < 3, lambda c: (jnp.log(c[0]), c[1] + 1), (x, 0)
    )[0]


def _in_cond(x):
    return jax.lax.cond(x.sum() > 10, lambda v: v, lambda v: jnp.log(v), x)


def _in_checkpoint(x):
    return jax.checkpoint(lambda v: jnp.log(v) * 2.0)(x)


@jax.custom_jvp
def _custom(v):
    return jnp.log(v)


_custom.defjvp(lambda p, t: (_custom(p[0]), t[0] / p[0]))


def _in_custom_jvp(x):
    return _custom(x) + 1.0


@pytest.mark.parametrize("fn", [_in_while, _in_cond, _in_checkpoint, _in_custom_jvp])
def test_through_higher_order_primitives(fn):
    x = jnp.array([-0.5, 2.0])
    bad = fx.find_nonfinite(fn, x)
    assert bad is not None and bad.primitive == "log"
    assert bad.line == _line(fn if fn is not _in_custom_jvp else _custom.fun, "jnp.log")
    assert bad.inputs == "log(-0.5)[0] = nan"


@jax.custom_vjp
def _scaled(v):
    return jnp.sin(v) * 2.0


def _scaled_bwd(v, g):
    return (g * jnp.log(v - 10.0),)  # NaN in the custom rule alone


_scaled.defvjp(lambda v: (_scaled(v), v), _scaled_bwd)


@jax.custom_jvp
def _rooted(v):
    return jnp.sin(v)


_rooted.defjvp(lambda p, t: (_rooted(p[0]), t[0] * jnp.sqrt(p[0] - 10.0)))


def _calls_scaled(x):
    y = jnp.cos(x)
    return jnp.sum(_scaled(y) * 3.0)


def _calls_rooted(x):
    return jnp.sum(_rooted(jnp.cos(x)))


@pytest.mark.parametrize(
    ("fn", "call", "primitive"),
    [
        (_calls_scaled, "_scaled(y)", "log"),
        (_calls_rooted, "_rooted(jnp.cos(x))", "sqrt"),
    ],
    ids=["custom_vjp", "custom_jvp"],
)
def test_an_operation_of_a_custom_rule_is_named_by_the_call(fn, call, primitive):
    # The operations of a custom rule carry the source of the call: they are
    # not the derivative of the other primitives on its line (the `mul` and
    # `reduce_sum` there), but of the call, named by its text.
    x = jnp.arange(3.0)
    assert np.isfinite(fn(x)) and not np.isfinite(jax.grad(fn)(x)).any()
    bad = fx.find_nonfinite(fn, x, backward=True)
    assert bad is not None and bad.backward and bad.primitive == primitive
    assert bad.line == _line(fn, call) and bad.forward == ()
    assert bad.expression == call and bad.inputs.startswith(f"{primitive}(-9.0)")
    assert f"part of the derivative of `{call}` there" in str(bad)
