"""`jax.ad_checkpoint.checkpoint_name` sites: every handler sees them as tags in
the collection "checkpoint_name", and the name stays in the program for remat
policies."""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import no_leak_checks
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

import effects as fx

CN = "checkpoint_name"


def f(x):
    h = checkpoint_name(jnp.sin(x), "h")

    def body(c, xi):
        y = checkpoint_name(jnp.tanh(c * xi), "y")
        return c + y, None

    c, _ = jax.lax.scan(body, h, jnp.array([0.5, 1.0, 1.5]))
    c = jax.lax.cond(
        c[0] > 0, lambda c: checkpoint_name(c * 2, "pos"), lambda c: c - 1, c
    )
    return jax.jit(lambda c: jnp.sum(checkpoint_name(jnp.exp(c), "e")))(c)


def f_reference(x):
    """`f` by hand in NumPy: its output and every named value, in order."""
    x = np.asarray(x, np.float64)
    h = np.sin(x)
    c, ys = h, []
    for xi in (0.5, 1.0, 1.5):
        ys.append(np.tanh(c * xi))
        c = c + ys[-1]
    named = {"h": (h,), "y": (np.stack(ys),)}
    if c[0] > 0:
        c = c * 2
        named["pos"] = (c,)
    else:  # a name the branch that ran did not tag is reported as zeros
        c = c - 1
        named["pos"] = (np.zeros_like(c),)
    named["e"] = (np.exp(c),)
    return np.sum(np.exp(c)), named


def assert_found(found, want):
    assert list(found) == list(want)
    for name in want:
        assert len(found[name]) == len(want[name]), name
        for got, ref in zip(found[name], want[name]):
            np.testing.assert_allclose(got, ref, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("x", [[0.3, -0.2], [-0.8, 0.4]])  # cond: both branches
@pytest.mark.parametrize("jit", [False, True])
def test_tag_collects_checkpoint_names_through_scan_cond_and_jit(x, jit):
    x = jnp.asarray(x, jnp.float32)
    handled = fx.handle(f, fx.Tag(CN))
    out, found = (jax.jit(handled) if jit else handled)(x)
    want_out, want = f_reference(x)
    np.testing.assert_allclose(out, want_out, rtol=1e-5)
    assert list(found) == [CN]
    assert_found(found[CN], want)  # in program order, under an outer jit too


def test_substitute_patches_a_checkpoint_name_and_tag_sees_the_new_value():
    x = jnp.array([0.3, -0.2])
    new = jnp.array([2.0, -3.0])
    out, found = fx.handle(
        f, fx.Substitute({"h": new}, collection=CN), fx.Tag(CN, names="y")
    )(x)

    def patched(x):  # f with h replaced by hand
        del x
        c = new
        for xi in (0.5, 1.0, 1.5):
            c = c + jnp.tanh(c * xi)
        c = c * 2 if c[0] > 0 else c - 1
        return jnp.sum(jnp.exp(c))

    np.testing.assert_allclose(out, patched(x), rtol=1e-5)
    assert found[CN]["y"][0][0] == pytest.approx(np.tanh(new * 0.5), rel=1e-5)


def test_sites_lists_checkpoint_names_with_their_control_flow():
    listed = fx.sites(f)(jnp.zeros(2))
    assert list(listed[CN]) == ["h", "y", "pos", "e"]
    (y,) = listed[CN]["y"]
    assert (y.kind, y.where, y.value.shape) == ("tag", "scan(length=3)", (2,))
    assert listed[CN]["pos"][0].where == "cond branch 1"
    assert listed[CN]["e"][0].where.startswith("jit(")
    under_remat = fx.sites(jax.checkpoint(f))(jnp.zeros(2))[CN]["y"][0].where
    assert under_remat == "checkpoint > scan(length=3)"


def g(x):
    h = checkpoint_name(jnp.sin(x), "h")
    g = checkpoint_name(jnp.cos(h) * 2, "g")
    return jnp.sum(jnp.exp(g) ** 2)


def saved(fn, x) -> list[str]:
    """What `print_saved_residuals` says `fn` keeps for its backward pass,
    without the source lines."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, x)
    return sorted(line.split(" from ")[0] for line in out.getvalue().splitlines())


@pytest.mark.parametrize("keep", [("h",), ("g",), ("h", "g"), ()])
@pytest.mark.parametrize("handler", [fx.Tag(CN), fx.Stats(CN)], ids=["Tag", "Stats"])
def test_handled_names_still_select_what_a_remat_policy_saves(keep, handler):
    x = jnp.array([0.1, 0.7, 1.3])
    policy = jax.checkpoint_policies.save_only_these_names(*keep)
    plain = jax.checkpoint(g, policy=policy)
    handled = fx.handle(plain, handler)
    want = saved(plain, x)
    assert len(want) == 1 + len(keep)  # x, and the values the policy names
    assert saved(lambda x: handled(x)[0], x) == want
    np.testing.assert_allclose(
        jax.grad(lambda x: handled(x)[0])(x), jax.grad(g)(x), rtol=1e-5
    )


def test_a_substituted_value_keeps_the_name():
    x = jnp.array([0.1, 0.7, 1.3])
    handled = fx.handle(g, fx.Substitute({"g": jnp.ones(3)}, collection=CN))
    assert "name[name=g]" in str(jax.make_jaxpr(handled)(x))
    np.testing.assert_allclose(handled(x)[0], jnp.sum(jnp.exp(jnp.ones(3)) ** 2))


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.nothing_saveable])
def test_a_backward_pass_recomputing_a_name_adds_no_execution(policy):
    x = jnp.array([0.1, 0.7, 1.3])
    _, want = fx.handle(g, fx.Tag(CN))(x)
    grad, found = fx.handle(jax.grad(jax.checkpoint(g, policy=policy)), fx.Tag(CN))(x)
    np.testing.assert_allclose(grad, jax.grad(g)(x), rtol=1e-5)
    assert_found(found[CN], want[CN])
    listed = fx.sites(jax.grad(jax.checkpoint(g, policy=policy)))(x)
    assert {n: len(v) for n, v in listed[CN].items()} == {"h": 1, "g": 1}

    def scanned(x):  # the scan's backward pass recomputes each iteration
        def body(c, _):
            return jnp.sin(checkpoint_name(c * 1.5, "z")), None

        return jnp.sum(jax.lax.scan(jax.checkpoint(body, policy=policy), x, None, 4)[0])

    _, want = fx.handle(scanned, fx.Tag(CN))(x)
    _, found = fx.handle(jax.grad(scanned), fx.Tag(CN))(x)
    assert found[CN]["z"][0].shape == (4, 3)
    assert_found(found[CN], want[CN])


def test_nested_handlers_each_see_the_name_it_keeps():
    x = jnp.array([0.1, 0.7, 1.3])
    inner = fx.handle(g, fx.Tag(CN, names="h"))
    (_, found_inner), found_outer = fx.handle(inner, fx.Tag(CN, names="h"))(x)
    np.testing.assert_allclose(found_inner[CN]["h"][0], jnp.sin(x))
    np.testing.assert_allclose(found_outer[CN]["h"][0], jnp.sin(x))


def double(v):
    return 2 * v


@pytest.mark.parametrize(
    "a, b",
    [
        (fx.Tag(CN, names=["h"]), fx.Intervene({"h": double}, collection=CN)),
        (fx.Intervene({"h": double}, collection=CN), fx.Tag(CN, names="h")),
        (fx.Substitute({"g": jnp.ones(3)}, collection=CN), fx.Tag(CN)),
        (fx.Tag(CN, names="h"), fx.Stats(CN, names="g")),
    ],
)
def test_handlers_in_one_handle_see_the_name_as_nested_handles_do(a, b):
    """`handle(f, A, B)` equals `handle(handle(f, A), B)`: a name is never
    consumed, so every handler after one that matched it sees it, with the
    value the handlers before it left."""
    x = jnp.array([0.1, 0.7, 1.3])
    (want_out, found_a), found_b = fx.handle(fx.handle(g, a), b)(x)
    out, found = fx.handle(g, a, b)(x)
    np.testing.assert_allclose(out, want_out, rtol=1e-6)
    want = {CN: {**found_a.get(CN, {}), **found_b.get(CN, {})}}
    assert found.keys() == want.keys()
    assert found[CN].keys() == want[CN].keys()
    for name in want[CN]:
        jax.tree.map(np.testing.assert_allclose, found[CN][name], want[CN][name])


def test_two_handlers_reporting_one_name_in_one_handle_is_an_error():
    x = jnp.array([0.1, 0.7, 1.3])
    with pytest.raises(ValueError, match="Tag and Stats both report .*'h'.*two steps"):
        fx.handle(g, fx.Tag(CN), fx.Stats(CN, names="h"))(x)
    (_, inner), outer = fx.handle(fx.handle(g, fx.Tag(CN)), fx.Tag(CN, mode="sum"))(x)
    np.testing.assert_allclose(inner[CN]["h"][0], jnp.sin(x))
    np.testing.assert_allclose(outer[CN]["h"], jnp.sin(x))


def test_the_two_reporters_error_names_the_first_site_in_program_order():
    # (err_clash_error_names_random_tag: the name came from a set's order,
    # one of three across hash seeds)
    def f(x, tag):
        a = tag(jnp.sin(x), "zz_first")
        b = tag(jnp.cos(a), "mm_second")
        return tag(b * 2, "aa_third").sum()

    class Peek(fx.Handler):
        mode = fx.Reduce(
            jnp.maximum, lambda z: jnp.full_like(z, -jnp.inf), consumes=False
        )

        def apply(self, site, value, ctx):
            ctx.emit(value)
            return value

    x = jnp.array([0.1, 0.7, 1.3])
    for tag, handlers in (
        (checkpoint_name, (fx.Tag(CN), fx.Stats(CN))),
        (fx.tag, (Peek(), fx.Tag())),
    ):
        with pytest.raises(ValueError, match="both report the tag 'zz_first'"):
            fx.handle(lambda x, tag=tag: f(x, tag), *handlers)(x)


def test_a_name_an_earlier_handler_consumes_is_an_error_that_says_so():
    def f(x):
        return fx.tag(jnp.sin(x), "h") + fx.tag(x, "k")

    with pytest.raises(ValueError, match="'h'.*consumed by Tag \\(handler 0\\)"):
        fx.handle(f, fx.Tag(), fx.Substitute({"h": 1.0}))(0.5)
    with pytest.raises(ValueError, match="no tag named 'x'.*Known names: 'k'"):
        fx.handle(f, fx.Tag(names="h"), fx.Substitute({"x": 1.0}))(0.5)


@pytest.mark.parametrize("mark", [fx.tag, fx.perturb])
def test_the_checkpoint_name_collection_is_reserved(mark):
    with pytest.raises(ValueError, match="reserved.*checkpoint_name"):
        mark(jnp.ones(2), "h", collection=CN)


def test_under_vmap_inside_handle_the_value_is_as_the_program_holds_it():
    xs = jnp.arange(6.0).reshape(2, 3)
    _, found = fx.handle(jax.vmap(g), fx.Tag(CN))(xs)
    np.testing.assert_allclose(found[CN]["h"][0], jnp.sin(xs))
    _, found = jax.vmap(fx.handle(g, fx.Tag(CN)))(xs)
    np.testing.assert_allclose(found[CN]["h"][0], jnp.sin(xs))


def test_find_nonfinite_checks_checkpoint_names_forward_and_backward():
    def loss(x):
        h = checkpoint_name(x * 0, "h")
        s = checkpoint_name(jnp.sqrt(h), "s")
        return jnp.sum(jnp.log(s + 1))

    x = jnp.array([1.0, 2.0])
    assert fx.find_nonfinite(loss, x) is None
    assert fx.find_nonfinite(loss, x, backward=True) == fx.BadSite(
        "h", CN, 0, None, backward=True
    )
    assert fx.find_nonfinite(lambda x: loss(jnp.log(x - 1)), x) == fx.BadSite(
        "h", CN, 0, None
    )


# jax 0.12: under the `jax_remat3` flag, `checkpoint_name` is a hijax primitive
# (`CheckpointName`) and `jax.checkpoint` one too (`RematTraced`).
_HAS_REMAT3 = "jax_remat3" in jax.config.values


@contextlib.contextmanager
def _remat3():
    # Without tracer-leak checking: on jax 0.10 JAX alone fails there under the
    # flag, `jax.jit(lambda x: checkpoint_name(jnp.sin(x), "cn"))(x)` raising an
    # IndexError from its leak checker while it lowers the hijax primitive
    # (jax 0.12 runs it).
    before = jax.config.values["jax_remat3"]
    jax.config.update("jax_remat3", True)
    try:
        with no_leak_checks():
            yield
    finally:
        jax.config.update("jax_remat3", before)


def _named(x):
    h = checkpoint_name(jnp.sin(x), "cn")
    return fx.tag(h * 2.0, "t")


@pytest.mark.skipif(not _HAS_REMAT3, reason="no jax_remat3 flag in this JAX")
def test_checkpoint_name_under_remat3_is_a_site():
    """Under the flag, handlers saw no checkpoint_name: `Tag` of the collection
    reported `{}` without a word."""
    x = jnp.array([0.3, -1.2])
    with _remat3():
        assert "CheckpointName" in str(jax.make_jaxpr(_named)(x))
        _, found = jax.jit(fx.handle(_named, fx.Tag(CN)))(x)
        assert list(found[CN]) == ["cn"]
        np.testing.assert_allclose(found[CN]["cn"][0], jnp.sin(x), rtol=1e-6)
        out, _ = fx.handle(_named, fx.Substitute({"cn": -x}, collection=CN))(x)
        np.testing.assert_allclose(out, -2.0 * x, rtol=1e-6)
        # Inside a `jax.checkpoint`, which effects cannot rewrite under the
        # flag: listed by `fx.sites`, and an error names it when matched.
        wrapped = jax.checkpoint(_named)
        listing = str(fx.sites(wrapped)(x))
        assert "cn" in listing and "RematTraced" in listing
        with pytest.raises(ValueError, match=r"'cn'.*`RematTraced`.*jax_remat3"):
            fx.handle(wrapped, fx.Tag(CN))(x)


def _loss_in_a_scan(x):
    def body(c, _):
        h = checkpoint_name(jnp.sin(x), "h")  # (loop-invariant: JAX moves it out)
        return c + jnp.sum(h * h), None

    return jax.lax.scan(body, 0.0, None, length=2)[0]


@pytest.mark.parametrize(
    "differentiate",
    [
        jax.grad,
        lambda f: jax.jit(jax.grad(f)),
        lambda f: jax.grad(jax.jit(f)),
        lambda f: lambda x: jax.jvp(f, (x,), (jnp.ones_like(x),))[1],
    ],
    ids=["grad", "jit-grad", "grad-jit", "jvp"],
)
@pytest.mark.parametrize("loss", ["plain", "scan"])
def test_changing_a_name_a_grad_inside_differentiates_is_refused(differentiate, loss):
    # (the derivative was JAX's before the handler changed the value: it gave
    # the new value times the old derivative, where `jax.grad(handle(f))`
    # gives zero)
    def plain(x):
        h = checkpoint_name(jnp.sin(x), "h")
        return jnp.sum(h * h)

    f = {"plain": plain, "scan": _loss_in_a_scan}[loss]
    x = jnp.array([0.3, 0.7])
    ones = fx.Substitute({"h": jnp.ones(2)}, collection=CN)
    with pytest.raises(ValueError, match="changes the checkpoint_name 'h'.*jax.grad"):
        fx.handle(differentiate(f), ones)(x)
    # what the error points to: differentiating the handled function
    g = differentiate(lambda x: fx.handle(f, ones)(x)[0])(x)
    np.testing.assert_allclose(g, np.zeros(2))
    # a handler that looks is not refused, and the derivative is JAX's
    out, found = fx.handle(differentiate(f), fx.Tag(CN, mode="last"))(x)
    np.testing.assert_allclose(out, differentiate(f)(x), rtol=1e-6)
    np.testing.assert_allclose(found[CN]["h"], np.sin(x), rtol=1e-6)
    # nor is a change where nothing is differentiated
    out, _ = fx.handle(f, ones)(x)
    np.testing.assert_allclose(out, 2.0 * {"plain": 1, "scan": 2}[loss])
