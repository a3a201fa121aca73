"""The handlers `Tag`, `Perturb`, `Substitute` and `Intervene` (and
`intermediate_grads`), each checked against a hand-written reference, alone and
under `jax.jit`, `jax.vmap` and `jax.grad` with the handler inside and outside.

With tracer-leak checking on, JAX bypasses its compilation caches, so every
eagerly dispatched operation is compiled anew. To stay fast, constants and simple
references are NumPy, and JAX references run as one compiled program
(`evaluate`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close
from jax import lax

import effects as fx

sg = lax.stop_gradient
f32 = np.float32


def _rng(seed, shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(f32)


def evaluate(fn, *args):
    """`fn(*args)` as one compiled program."""
    return jax.jit(fn)(*args)


X = np.array([0.3, -1.2, 2.0], f32)
XS = np.array([0.5, -1.0, 2.0, 0.25], f32)  # the scan's inputs: 4 iterations
N = XS.shape[0]
B = 2  # batch size under vmap

RUNNING_MAX = fx.Reduce(jnp.maximum, lambda z: jnp.full_like(z, -jnp.inf))
COUNT = fx.Reduce(lambda n, x: n + 1, lambda z: jnp.zeros((), jnp.int32))

#
# The functions under test and their hand-written references
#


def line(x):
    """Straight-line code, "a" tagged twice."""
    a = fx.tag(jnp.sin(x), "a")
    b = fx.tag(a * 3.0, "b")
    a = fx.tag(jnp.cos(b), "a")
    return a + b


def line_ref(x):
    a1 = np.sin(x)
    b = a1 * f32(3.0)
    a2 = np.cos(b)
    return a2 + b, a1, b, a2


def make_model(site):
    """`h` before a scan, `c` in every iteration of it; `site` is `fx.tag` or
    `fx.perturb`."""

    def model(x):
        h = site(jnp.sin(x), "h")

        def body(c, xi):
            c = site(jnp.tanh(c * xi + h), "c")
            return c, None

        c, _ = lax.scan(body, h, XS)
        return c * h

    return model


model = make_model(fx.tag)
pmodel = make_model(fx.perturb)


def model_ref(x, on_h=lambda h: h, on_c=lambda i, c: c):
    """The model written out as a Python loop, with `on_h(h)` and
    `on_c(iteration, c)` applied where the sites are. Returns the output, h and
    the c of every iteration, stacked."""
    h = on_h(jnp.sin(x))
    c, cs = h, []
    for i in range(N):
        c = on_c(i, jnp.tanh(c * XS[i] + h))
        cs.append(c)
    return c * h, h, jnp.stack(cs)


def ploss(x):
    return jnp.sum(pmodel(x) ** 2)


def ploss_ref(x, dh, dc):
    """`ploss` with explicit additive deltas at h and at c in each iteration."""
    out, _, _ = model_ref(x, lambda h: h + dh, lambda i, c: c + dc[i])
    return jnp.sum(out**2)


ZH = np.zeros(3, f32)
ZC = np.zeros((N, 3), f32)

#
# Tag: modes
#


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("append", lambda a1, b, a2: {"a": (a1, a2), "b": (b,)}),
        ("last", lambda a1, b, a2: {"a": a2, "b": b}),
        ("sum", lambda a1, b, a2: {"a": a1 + a2, "b": b}),
        (RUNNING_MAX, lambda a1, b, a2: {"a": np.maximum(a1, a2), "b": b}),
        (COUNT, lambda a1, b, a2: {"a": np.int32(2), "b": np.int32(1)}),
    ],
    ids=["append", "last", "sum", "running_max", "count"],
)
def test_tag_modes_straight_line(mode, expected):
    out, found = fx.handle(line, fx.Tag(mode=mode))(X)
    ref_out, a1, b, a2 = line_ref(X)
    assert_trees_close(out, ref_out)
    assert_trees_close(found, {"intermediates": expected(a1, b, a2)})


def test_tag_strict_single_value():
    out, found = fx.handle(line, fx.Tag(names="b", mode="strict"))(X)
    ref_out, _, b, _ = line_ref(X)
    assert_trees_close(out, ref_out)
    # strict gives the value itself, not a one-entry tuple
    assert_trees_close(found, {"intermediates": {"b": b}})


@pytest.mark.parametrize(
    "fn, name", [(line, "a"), (model, "c")], ids=["repeated", "in_scan"]
)
def test_tag_strict_repeat_raises(fn, name):
    with pytest.raises(ValueError, match=f"'{name}'"):
        fx.handle(fn, fx.Tag(names=name, mode="strict"))(X)
    # a failed call leaves nothing behind
    out, found = fx.handle(line, fx.Tag(names="b", mode="strict"))(X)
    assert_trees_close(found, {"intermediates": {"b": line_ref(X)[2]}})


def test_tag_modes_in_scan():
    _, h, cs = evaluate(model_ref, X)
    found = {
        mode: fx.handle(model, fx.Tag(mode=mode))(X)[1]["intermediates"]
        for mode in ["append", "last", "sum"]
    }
    assert_trees_close(found["append"], {"h": (h,), "c": (cs,)})
    assert_trees_close(found["last"], {"h": h, "c": cs[-1]})
    assert_trees_close(found["sum"], {"h": h, "c": np.sum(cs, 0)})
    _, found = fx.handle(model, fx.Tag(mode=RUNNING_MAX))(X)
    assert_trees_close(found["intermediates"], {"h": h, "c": np.max(cs, 0)})
    _, found = fx.handle(model, fx.Tag(mode=COUNT))(X)
    assert_trees_close(found["intermediates"], {"h": np.int32(1), "c": np.int32(N)})


@pytest.mark.parametrize(
    "reduce",
    [
        fx.Reduce(lambda acc, x: jnp.concatenate([acc, x]), lambda z: z),
        fx.Reduce(lambda acc, x: jnp.sum(acc + x), lambda z: z),
        fx.Reduce(lambda acc, x: (acc + x).astype(jnp.int32), lambda z: z),
    ],
    ids=["grows", "shrinks", "dtype"],
)
def test_reduce_changing_accumulator_raises(reduce):
    with pytest.raises(ValueError, match="'b'"):
        fx.handle(line, fx.Tag(names="b", mode=reduce))(X)


@pytest.mark.parametrize("mode", ["bogus", "max", "first", None])
def test_unknown_mode_raises_at_construction(mode):
    with pytest.raises(ValueError, match="mode"):
        fx.Tag(mode=mode)


#
# Tag: names and collections
#


def named(x):
    h = fx.tag(x + 1.0, "enc/h")
    g = fx.tag(h * 2.0, "enc/g")
    d = fx.tag(g - 3.0, "dec/h")
    return d**2


def named_ref(x):
    h = x + f32(1.0)
    g = h * f32(2.0)
    d = g - f32(3.0)
    return d**2, {"enc/h": h, "enc/g": g, "dec/h": d}


@pytest.mark.parametrize(
    "names, expected",
    [
        (None, {"enc/h", "enc/g", "dec/h"}),
        ("enc/*", {"enc/h", "enc/g"}),
        ("*/h", {"enc/h", "dec/h"}),
        ("enc/g", {"enc/g"}),
        (["dec/*", "enc/g"], {"dec/h", "enc/g"}),
        (("dec/?",), {"dec/h"}),
        (lambda n: n.endswith("g"), {"enc/g"}),
        (lambda n: n.startswith("nothing"), set()),
    ],
    ids=[
        "none",
        "glob",
        "glob_suffix",
        "exact",
        "list",
        "tuple",
        "predicate",
        "none_match",
    ],
)
def test_tag_names_filter(names, expected):
    out, found = fx.handle(named, fx.Tag(names=names))(X)
    ref_out, values = named_ref(X)
    assert_trees_close(out, ref_out)
    assert_trees_close(
        found, {"intermediates": {n: (values[n],) for n in sorted(expected)}}
    )


def test_tag_consumes_only_what_it_collects():
    ref_out, v = named_ref(X)
    # The first Tag consumes enc/*, the second sees only dec/h: the modes show
    # which handler collected what.
    out, found = fx.handle(named, fx.Tag(names="enc/*", mode="last"), fx.Tag())(X)
    assert_trees_close(out, ref_out)
    assert_trees_close(
        found,
        {
            "intermediates": {
                "enc/h": v["enc/h"],
                "enc/g": v["enc/g"],
                "dec/h": (v["dec/h"],),
            }
        },
    )


def test_nested_handle_outer_tag_sees_what_inner_left():
    ref_out, v = named_ref(X)
    inner_handled = fx.handle(named, fx.Tag(names="enc/*"))
    (out, inner), outer = fx.handle(inner_handled, fx.Tag())(X)
    assert_trees_close(out, ref_out)
    assert_trees_close(
        inner, {"intermediates": {"enc/h": (v["enc/h"],), "enc/g": (v["enc/g"],)}}
    )
    assert_trees_close(outer, {"intermediates": {"dec/h": (v["dec/h"],)}})


def two_collections(x):
    s = fx.tag(jnp.sin(x), "s", collection="a")
    t = fx.tag(s * 2.0, "s", collection="b")  # same name, other collection
    u = fx.tag(t + 1.0, "u", collection="b")
    return u * s


def two_collections_ref(x):
    s = np.sin(x)
    t = s * f32(2.0)
    u = t + f32(1.0)
    return u * s, {"a": {"s": (s,)}, "b": {"s": (t,), "u": (u,)}}


@pytest.mark.parametrize(
    "handlers, collections",
    [
        ((fx.Tag("a"),), {"a"}),
        ((fx.Tag("b"),), {"b"}),
        ((fx.Tag("a"), fx.Tag("b")), {"a", "b"}),
        ((fx.Tag("b"), fx.Tag("a")), {"a", "b"}),
    ],
    ids=["a", "b", "a_then_b", "b_then_a"],
)
def test_tag_collections(handlers, collections):
    out, found = fx.handle(two_collections, *handlers)(X)
    ref_out, ref_found = two_collections_ref(X)
    assert_trees_close(out, ref_out)
    assert_trees_close(found, {c: ref_found[c] for c in sorted(collections)})


def test_tag_with_no_matching_collection_reports_empty():
    out, found = fx.handle(two_collections, fx.Tag())(X)
    assert_trees_close(out, two_collections_ref(X)[0])
    assert found == {"intermediates": {}}


def test_nested_handle_other_collection_left_for_outer_handler():
    ref_out, ref_found = two_collections_ref(X)
    inner_handled = fx.handle(two_collections, fx.Tag("a"))
    (out, inner), outer = fx.handle(inner_handled, fx.Tag("b"))(X)
    assert_trees_close(out, ref_out)
    assert_trees_close(inner, {"a": ref_found["a"]})
    assert_trees_close(outer, {"b": ref_found["b"]})


#
# Pytree-valued tags
#


def tree_fn(x):
    p = fx.tag({"w": x * 2.0, "b": (jnp.sum(x), x[:2])}, "p")
    t = fx.tag((x + 1.0, x - 1.0), "t")
    p = fx.tag({"w": p["w"] + t[1], "b": p["b"]}, "p")
    return p["w"] * t[0] + p["b"][0] + jnp.sum(p["b"][1])


def tree_ref(x, on_t=lambda t: t):
    p1 = {"w": x * f32(2.0), "b": (np.sum(x), x[:2])}
    t = on_t((x + f32(1.0), x - f32(1.0)))
    p2 = {"w": p1["w"] + t[1], "b": p1["b"]}
    out = p2["w"] * t[0] + p2["b"][0] + np.sum(p2["b"][1])
    return out, p1, t, p2


def test_tag_pytree_values():
    ref_out, p1, t, p2 = tree_ref(X)
    out, found = fx.handle(tree_fn, fx.Tag())(X)
    assert_trees_close(out, ref_out)
    assert_trees_close(found, {"intermediates": {"p": (p1, p2), "t": (t,)}})
    _, found = fx.handle(tree_fn, fx.Tag(mode="sum"))(X)
    p_sum = jax.tree.map(np.add, p1, p2)
    assert_trees_close(found, {"intermediates": {"p": p_sum, "t": t}})
    _, found = fx.handle(tree_fn, fx.Tag(names="t", mode="strict"))(X)
    assert_trees_close(found, {"intermediates": {"t": t}})


def test_substitute_and_intervene_pytree_values():
    new_t = (np.array([1.0, 2.0, 3.0], f32), np.array([-1.0, 0.5, 4.0], f32))
    out, found = fx.handle(tree_fn, fx.Substitute({"t": new_t}))(X)
    assert_trees_close(out, tree_ref(X, lambda t: new_t)[0])
    assert found == {}

    def swap(t):
        return (t[1], t[0])

    out, found = fx.handle(tree_fn, fx.Intervene({"t": swap}), fx.Tag(names="t"))(X)
    ref_out, _, t, _ = tree_ref(X, swap)
    assert_trees_close(out, ref_out)
    assert_trees_close(found, {"intermediates": {"t": (t,)}})


def test_substitute_pytree_wrong_structure_raises():
    with pytest.raises(ValueError, match="'t'"):
        fx.handle(tree_fn, fx.Substitute({"t": (X, X, X)}))(X)


#
# Perturb
#

DH = _rng(1, (3,))
DC = _rng(2, (N, 3))


def test_perturb_reports_zeros_in_append_layout():
    out, found = fx.handle(ploss, fx.Perturb())(X)
    assert_trees_close(out, evaluate(ploss_ref, X, ZH, ZC))
    assert_trees_close(found, {"perturbations": {"h": (ZH,), "c": (ZC,)}})

    def twice(x):
        p = fx.perturb(x * 2.0, "p")
        return fx.perturb(jnp.sum(p).astype(jnp.float16), "p")

    out, found = fx.handle(twice, fx.Perturb())(X)
    assert_trees_close(out, np.sum(X * f32(2.0)).astype(np.float16), rtol=1e-3)
    assert_trees_close(found, {"perturbations": {"p": (ZH, np.float16(0.0))}})


def test_perturb_ignores_tags_and_tag_ignores_perturbs():
    out, found = fx.handle(ploss, fx.Tag())(X)
    assert_trees_close(out, evaluate(ploss_ref, X, ZH, ZC))
    assert found == {"intermediates": {}}
    out, found = fx.handle(model, fx.Perturb())(X)
    assert_trees_close(out, evaluate(model_ref, X)[0])
    assert found == {"perturbations": {}}


def test_perturb_deltas_are_added():
    out, found = fx.handle(ploss, fx.Perturb({"h": (DH,), "c": (DC,)}))(X)
    assert_trees_close(out, evaluate(ploss_ref, X, DH, DC))
    assert found == {}


def test_perturb_grad_wrt_deltas():
    def handled(d):
        return fx.handle(ploss, fx.Perturb(d))(X)[0]

    grads = evaluate(jax.grad(handled), {"h": (DH,), "c": (DC,)})
    gh, gc = evaluate(jax.grad(ploss_ref, argnums=(1, 2)), X, DH, DC)
    assert_trees_close(grads, {"h": (gh,), "c": (gc,)}, rtol=1e-4, atol=1e-5)


def test_perturb_absent_names_untouched():
    expected = evaluate(ploss_ref, X, DH, ZC)
    out, found = fx.handle(ploss, fx.Perturb({"h": (DH,)}))(X)
    assert_trees_close(out, expected)
    assert found == {}
    # "c" is still a perturb site, visible further out; so is "h", which a
    # Perturb with deltas (reporting nothing) passes on as Substitute does.
    out, found = fx.handle(ploss, fx.Perturb({"h": (DH,)}), fx.Perturb())(X)
    assert_trees_close(out, expected)
    assert_trees_close(found, {"perturbations": {"h": (ZH,), "c": (ZC,)}})


def test_a_handler_without_a_mode_passes_the_value_it_returns_on():
    # One site, one report: a Perturb with deltas reports nothing, so a Tag
    # after it (in one `handle`, or an enclosing one) collects the perturbed
    # value; a Perturb without deltas reports the zeros, and consumes the site.
    def f(x):
        return jnp.cos(fx.tag(jnp.sin(x), "h"))

    h = np.sin(X) + DH
    want = (np.cos(h), {"intermediates": {"h": (h,)}})
    perturb = fx.Perturb({"h": (DH,)}, kind="tag", collection="intermediates")
    assert_trees_close(fx.handle(f, perturb, fx.Tag())(X), want)
    (out, inner), outer = fx.handle(fx.handle(f, perturb), fx.Tag())(X)
    assert_trees_close((out, outer), want)
    assert inner == {}
    zeros = fx.Perturb(kind="tag", collection="intermediates")
    with pytest.warns(UserWarning, match="Tag matches no site left.*Perturb"):
        out, found = fx.handle(f, zeros, fx.Tag())(X)
    want_zeros = {"intermediates": {"h": (np.zeros_like(h),)}}
    assert_trees_close((out, found), (np.cos(np.sin(X)), want_zeros))


@pytest.mark.parametrize(
    "deltas, match",
    [
        ({"zz": (DH,)}, "zz"),
        ({"h": (np.zeros(4, f32),)}, "'h'"),
        ({"h": (np.zeros((), f32),)}, "'h'"),
        ({"h": (np.zeros(3, np.int32),)}, "'h'"),
        ({"c": (np.zeros((N + 1, 3), f32),)}, "'c'"),
        ({"c": (ZH,)}, "'c'"),
        ({"h": (DH, DH)}, "'h'"),
        ({"c": ()}, "'c'"),
    ],
    ids=[
        "unknown_name",
        "wrong_shape",
        "scalar",
        "wrong_dtype",
        "wrong_scan_length",
        "not_stacked",
        "too_many",
        "too_few",
    ],
)
def test_perturb_bad_deltas_raise(deltas, match):
    with pytest.raises(ValueError, match=match):
        fx.handle(ploss, fx.Perturb(deltas))(X)


def test_perturb_unknown_name_lists_known():
    with pytest.raises(ValueError, match="zz") as info:
        fx.handle(ploss, fx.Perturb({"zz": (DH,)}))(X)
    assert "'h'" in str(info.value) and "'c'" in str(info.value)


W = _rng(3, (3, 5))


def batch_loss(x):  # x: (n, 3), any n
    h = fx.perturb(jnp.tanh(x @ W), "h")
    return jnp.sum(h**2)


def test_perturb_new_batch_size_just_works():
    handled = fx.handle(batch_loss, fx.Perturb())
    grads_fn = jax.jit(fx.intermediate_grads(batch_loss))
    for n in [2, 5]:
        x = _rng(n, (n, 3))
        h = np.tanh(x @ W)
        out, found = handled(x)
        assert_trees_close(out, np.sum(h**2))
        assert_trees_close(found, {"perturbations": {"h": (np.zeros((n, 5), f32),)}})
        d = _rng(10 + n, (n, 5))
        out, _ = fx.handle(batch_loss, fx.Perturb({"h": (d,)}))(x)
        assert_trees_close(out, np.sum((h + d) ** 2))
        loss, grads = grads_fn(x)
        assert_trees_close(loss, np.sum(h**2))
        assert_trees_close(grads, {"h": (2 * h,)})


def test_intermediate_grads():
    loss, grads = evaluate(fx.intermediate_grads(ploss), X)
    assert_trees_close(loss, evaluate(ploss_ref, X, ZH, ZC))
    gh, gc = evaluate(jax.grad(ploss_ref, argnums=(1, 2)), X, ZH, ZC)
    # c in the scan: one gradient per iteration, stacked.
    assert_trees_close(grads, {"h": (gh,), "c": (gc,)}, rtol=1e-4, atol=1e-5)


def test_intermediate_grads_and_perturb_at_tags():
    def loss(x):  # `ploss` with tags where it has perturb sites
        return jnp.sum(model(x) ** 2)

    loss_value, grads = evaluate(fx.intermediate_grads(loss, kind="tag"), X)
    assert_trees_close(loss_value, evaluate(ploss_ref, X, ZH, ZC))
    gh, gc = evaluate(jax.grad(ploss_ref, argnums=(1, 2)), X, ZH, ZC)
    assert_trees_close(grads, {"h": (gh,), "c": (gc,)}, rtol=1e-4, atol=1e-5)
    # One name (or a glob, a predicate): that gradient alone, the same.
    for names in ("c", ["c"], "[c]", lambda n: n == "c"):
        got = evaluate(fx.intermediate_grads(loss, kind="tag", names=names), X)
        assert_trees_close(got[1], {"c": (gc,)}, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="no tag named 'hh'.*'c', 'h'"):
        fx.intermediate_grads(loss, kind="tag", names="hh")(X)
    # A glob that matches nothing is a typo too (`found` would be empty).
    # A glob that matches nothing is a typo too (`found` would be empty): a
    # filter must select a site, and each name in it exist.
    with pytest.raises(ValueError, match="no tag matching 'hh\\*'.*'c', 'h'"):
        fx.handle(model, fx.Tag(names="hh*"))(X)
    with pytest.raises(ValueError, match="no tag matching 'q\\?' or 'x\\*'"):
        fx.handle(model, fx.Tag(names=("q?", "x*")))(X)
    _, found = fx.handle(model, fx.Tag(names=("c", "q?")))(X)
    assert list(found["intermediates"]) == ["c"]
    with pytest.raises(ValueError, match="no tag named 'q'"):
        fx.handle(model, fx.Tag(names=("h*", "q")))(X)
    # The handler itself: zeros reported for tags, deltas added at them.
    _, found = fx.handle(model, fx.Perturb(kind="tag"))(X)
    assert_trees_close(found, {"intermediates": {"h": (ZH,), "c": (ZC,)}})
    dh = _rng(11, (3,))
    out, _ = fx.handle(model, fx.Perturb({"h": (dh,)}, kind="tag"))(X)
    assert_trees_close(out, model_ref(X, on_h=lambda h: h + dh)[0], rtol=1e-5)
    # Perturb sites are left alone by it, and a kind it does not know is refused.
    _, found = fx.handle(pmodel, fx.Perturb(kind="tag"))(X)
    assert found == {"intermediates": {}}
    with pytest.raises(ValueError, match="kind must be 'perturb' or 'tag'"):
        fx.Perturb(kind="tags")
    # Nothing of the kind asked for: an error that says what to pass instead.
    with pytest.raises(ValueError, match="no perturb site .* pass kind='tag'"):
        fx.intermediate_grads(lambda x: jnp.sum(model(x)))(X)
    with pytest.raises(ValueError, match="no tag in the collection 'other'"):
        fx.intermediate_grads(
            lambda x: jnp.sum(model(x)), kind="tag", collection="other"
        )(X)


@pytest.mark.parametrize("value", [True, 3, 2.5, jnp.array(True)], ids=repr)
def test_a_tag_of_a_constant_reaches_apply_as_an_array(value):
    # The jaxpr holds a constant scalar as a literal of a Python scalar, which
    # `apply` got as it was: `find_nonfinite` failed reading its `dtype`.
    seen = []

    class Look(fx.Handler):
        def apply(self, site, value, ctx):
            seen.append((site.name, jnp.shape(value), jnp.result_type(value)))
            assert isinstance(value, jax.Array), type(value)
            return value

    def f(x):
        fx.tag(jnp.asarray(value), "constant")
        return jnp.sum(fx.tag(jnp.log(x), "log"))

    x = jnp.array([1.0, -2.0])
    out, _ = fx.handle(f, Look())(x)
    assert_trees_close(out, f(x))
    assert seen[0] == ("constant", (), jnp.asarray(value).dtype)
    assert fx.find_nonfinite(f, x).name == "log"


@pytest.mark.parametrize("jit", [False, True])
def test_intermediate_grads_of_values_with_no_gradient(jit):
    # Integers, booleans and PRNG keys among the tags have the float0 zero
    # `jax.grad(..., allow_int=True)` gives (before: JAX's "grad requires
    # real- or complex-valued inputs", naming no tag).
    def loss(x):
        h = fx.tag(jnp.sin(x), "h")
        n = fx.tag(jnp.int32(3), "n")
        fx.tag(x > 0.2, "b")
        fx.tag(jax.random.key(0), "k")
        m = fx.tag((h * 2, n), "mixed")  # a float and an integer leaf
        return jnp.sum(h * m[1]) + jnp.sum(m[0] ** 2)

    g = fx.intermediate_grads(loss, kind="tag")
    value, grads = (jax.jit(g) if jit else g)(X)
    assert_trees_close(value, loss(X))
    assert list(grads) == ["h", "n", "b", "k", "mixed"]
    assert_trees_close(grads["h"], (3.0 + 8 * jnp.sin(X),), rtol=1e-5)
    assert_trees_close(grads["mixed"][0][0], 2 * (2 * jnp.sin(X)))
    float0 = [grads["n"][0], grads["b"][0], grads["k"][0], grads["mixed"][0][1]]
    assert [(np.shape(z), z.dtype) for z in float0] == [
        ((), jax.dtypes.float0),
        (X.shape, jax.dtypes.float0),
        ((), jax.dtypes.float0),
        ((), jax.dtypes.float0),
    ]
    with pytest.raises(ValueError, match="tag 'both' holds a PRNG key and float"):
        fx.intermediate_grads(
            lambda x: jnp.sum(fx.tag((x, jax.random.key(0)), "both")[0]), kind="tag"
        )(X)


def test_intermediate_grads_eager_repeated_site():
    def loss(x):
        a = fx.perturb(jnp.sin(x), "a")
        a = fx.perturb(a * x, "a")
        return jnp.sum(a**2)

    out, grads = fx.intermediate_grads(loss)(X)
    a1 = np.sin(X)
    a2 = a1 * X
    assert_trees_close(out, np.sum(a2**2))
    # d/da2 = 2 a2; d/da1 = 2 a2 x
    assert_trees_close(grads, {"a": (2 * a2 * X, 2 * a2)})


def test_intermediate_grads_vmap_inside_loss():
    # vmap over axis 1 of x: the site's gradient has the batch axis first.
    def loss(x):  # x: (3, B)
        h = jax.vmap(lambda r: fx.perturb(jnp.sin(r) * r, "h"), in_axes=1, out_axes=1)(
            x
        )
        return jnp.sum(jnp.cos(h) * x)

    x = _rng(4, (3, B + 1))
    out, grads = evaluate(fx.intermediate_grads(loss), x)
    h = np.sin(x) * x
    assert_trees_close(out, np.sum(np.cos(h) * x))
    assert_trees_close(grads, {"h": ((-np.sin(h) * x).T,)})


def _mean_of_examples(per_example):
    """A loss averaging `per_example(xi, pos)` over a batch, where `pos`, tagged
    inside the vmap, does not depend on the example (a position embedding)."""

    def loss(x):  # x: (B, 3)
        def one(xi):
            pos = fx.tag(jnp.cos(jnp.arange(3.0)), "pos")
            return per_example(xi, pos)

        return jnp.mean(jax.vmap(one)(x))

    return loss


def _ref_with_pos_deltas(per_example, x, d):
    """The same loss with an explicit per-example delta added at `pos`."""
    pos = np.cos(np.arange(3.0, dtype=f32))
    return jnp.mean(jax.vmap(lambda xi, di: per_example(xi, pos + di))(x, d))


def test_intermediate_grads_at_a_value_the_batch_does_not_change():
    # The loss averages over a batch, so the handler cannot move inside the
    # vmap; each example's copy of `pos` has its own gradient.
    def per_example(xi, pos):
        h = fx.tag(jnp.tanh(xi * pos), "h")
        return jnp.sum(h * pos)

    loss = _mean_of_examples(per_example)
    x = _rng(30, (B + 1, 3))
    value, grads = evaluate(fx.intermediate_grads(loss, kind="tag"), x)
    zeros = np.zeros((B + 1, 3), f32)
    assert_trees_close(value, evaluate(loss, x))
    want = evaluate(jax.grad(lambda d: _ref_with_pos_deltas(per_example, x, d)), zeros)
    assert_trees_close(grads["pos"], (want,), rtol=1e-5)
    # the deltas themselves, each example's own: the output moves as by hand
    d = _rng(31, (B + 1, 3))
    out, _ = fx.handle(loss, fx.Perturb({"pos": (d,)}, kind="tag"))(x)
    assert_trees_close(
        out, evaluate(lambda x: _ref_with_pos_deltas(per_example, x, d), x)
    )
    # and what Tag() reports is unchanged: `pos` broadcast along the batch
    _, found = fx.handle(loss, fx.Tag(names="pos"))(x)
    np.testing.assert_allclose(
        found["intermediates"]["pos"][0],
        np.broadcast_to(np.cos(np.arange(3.0)), (B + 1, 3)),
        rtol=1e-6,
    )


def test_per_example_values_at_an_unbatched_tag_in_a_scan_and_under_jit():
    # Substitute(per_call=True) gives each example its own value, in a scan
    # inside the vmap, through a jit.
    def loss(x):  # x: (B, 3)
        @jax.jit
        def one(xi):
            def step(c, w):
                return c * w + fx.tag(jnp.sin(w), "s"), None

            return jnp.sum(lax.scan(step, xi, jnp.arange(1.0, 4.0))[0])

        return jnp.sum(jax.vmap(one)(x))

    x = _rng(32, (B, 3))
    _, found = fx.handle(loss, fx.Tag())(x)
    (s,) = found["intermediates"]["s"]
    assert s.shape == (B, 3)  # per example, per iteration
    new = s + np.arange(B * 3, dtype=f32).reshape(B, 3)
    out, _ = fx.handle(loss, fx.Substitute({"s": (new,)}, per_call=True))(x)

    def by_hand(xi, si):
        c = xi
        for i, w in enumerate([1.0, 2.0, 3.0]):
            c = c * w + si[i]
        return jnp.sum(c)

    assert_trees_close(out, evaluate(lambda x: jnp.sum(jax.vmap(by_hand)(x, new)), x))


def test_any_handler_may_change_an_unbatched_value_per_example():
    # Substitute with one value per example, a user handler reading its
    # example's index, find_nonfinite's backward checks: the vmap batches the
    # value, as a hand-written program computing it per example would.
    def per_example(xi, pos):
        return jnp.sum(jnp.tanh(xi * pos))

    loss = _mean_of_examples(per_example)
    x = _rng(34, (B, 3))
    values = _rng(35, (B, 3))
    out, _ = fx.handle(loss, fx.Substitute({"pos": values}))(x)
    by_hand = jnp.mean(jax.vmap(per_example)(x, values))
    assert_trees_close(out, by_hand)

    class ByExample(fx.Handler):
        def matches(self, site):
            return site.name == "pos"

        def apply(self, site, value, ctx):
            return value * (1.0 + ctx.batch_index[0])

    out, _ = jax.jit(fx.handle(loss, ByExample()))(x)
    pos = np.cos(np.arange(3.0, dtype=f32))
    scaled = pos * (1.0 + np.arange(B, dtype=f32))[:, None]
    assert_trees_close(
        out, evaluate(lambda x: jnp.mean(jax.vmap(per_example)(x, scaled)), x)
    )

    # handle(vmap(f), H) == vmap(handle(f, H))
    def one(xi):
        return per_example(xi, fx.tag(jnp.cos(jnp.arange(3.0)), "pos"))

    clip = fx.Intervene({"pos": lambda v: jnp.clip(v, -0.5, 0.5)})
    inside = jax.vmap(fx.handle(one, clip))(x)[0]
    outside = fx.handle(jax.vmap(one), clip)(x)[0]
    assert_trees_close(outside, inside)
    # the backward NaN search checks the cotangent of every example's copy
    bad = fx.find_nonfinite(
        _mean_of_examples(lambda xi, pos: jnp.sum(jnp.sqrt(pos - 1.0) * xi)),
        x,
        backward=True,
    )
    assert bad is not None and bad.name == "pos"


def test_every_unbatched_site_a_handler_changes_is_batched_in_one_more_trace():
    # Three values the vmap leaves unbatched, each changed per example: all are
    # found in one rewrite, so the function is traced twice, not once per site.
    calls = []

    def loss(x):  # x: (B, 3)
        calls.append(None)

        def one(xi):
            out = xi
            for i in range(3):
                out = out * fx.tag(jnp.cos(jnp.arange(3.0) + i), f"pos{i}")
            return jnp.sum(out)

        return jnp.mean(jax.vmap(one)(x))

    x = _rng(36, (B, 3))
    values = {f"pos{i}": _rng(37 + i, (B, 3)) for i in range(3)}
    out, _ = fx.handle(loss, fx.Substitute(values))(x)
    assert len(calls) == 2
    by_hand = jnp.mean(
        jax.vmap(lambda xi, a, b, c: jnp.sum(xi * a * b * c))(x, *values.values())
    )
    assert_trees_close(out, by_hand)


def test_values_per_execution_leave_other_programs_alone():
    # Only the names a handler gives values per execution are batched: under
    # Tag(), `pos` stays one value, broadcast where it meets the batch.
    loss = _mean_of_examples(lambda xi, pos: jnp.sum(xi * pos))
    x = _rng(33, (B, 3))
    plain = str(jax.make_jaxpr(fx.handle(loss, fx.Tag()))(x))
    d = (np.zeros((B, 3), f32),)
    perturbed = fx.handle(loss, fx.Perturb({"pos": d}, kind="tag"))
    perturbed = str(jax.make_jaxpr(perturbed)(x))
    assert "f32[1,3] = broadcast_in_dim" in plain
    assert "f32[1,3] = broadcast_in_dim" not in perturbed
    assert f"f32[{B},3] = broadcast_in_dim" in perturbed


#
# Substitute
#

V = _rng(6, (3,))
VC = _rng(7, (N, 3))


def test_substitute_every_execution():
    out, found = fx.handle(model, fx.Substitute({"h": V}))(X)
    assert_trees_close(out, evaluate(lambda x: model_ref(x, on_h=lambda h: V)[0], X))
    assert found == {}
    # inside the scan: the same value in every iteration
    out, _ = fx.handle(model, fx.Substitute({"c": V}))(X)
    assert_trees_close(out, V * np.sin(X))
    # repeated in straight-line code: every execution replaced
    out, _ = fx.handle(line, fx.Substitute({"a": V}))(X)
    assert_trees_close(out, V + V * f32(3.0))


def test_substitute_per_call_round_trip():
    for fn, expected in [
        (line, line_ref(X)[0]),
        (model, evaluate(model_ref, X)[0]),
        (tree_fn, tree_ref(X)[0]),
    ]:
        out, found = fx.handle(fn, fx.Tag())(X)
        assert_trees_close(out, expected)
        substitute = fx.Substitute(found["intermediates"], per_call=True)
        out, none = fx.handle(fn, substitute)(X)
        assert_trees_close(out, expected)
        assert none == {}


def test_substitute_per_call_different_values():
    out, _ = fx.handle(model, fx.Substitute({"c": (VC,)}, per_call=True))(X)
    # a hand-written scan with the values as inputs
    h = np.sin(X)
    assert_trees_close(out, VC[-1] * h)
    _, cs = evaluate(lambda h, vc: lax.scan(lambda c, v: (v, v), h, vc), h, VC)
    assert_trees_close(out, cs[-1] * h)
    # straight-line code: one value per execution, in program order
    v1, v2 = V, _rng(8, (3,))
    out, _ = fx.handle(line, fx.Substitute({"a": (v1, v2)}, per_call=True))(X)
    assert_trees_close(out, v2 + v1 * f32(3.0))


def test_substitute_per_call_in_scan_feeds_the_carry():
    # the substituted c is the carry of the next iteration
    vc = _rng(9, (N, 3))

    def f(x):
        def body(c, xi):
            c = fx.tag(c * xi + 1.0, "c")
            return c, c * 2.0

        return lax.scan(body, x, XS)

    (c, ys), _ = fx.handle(f, fx.Substitute({"c": (vc,)}, per_call=True))(X)
    assert_trees_close(c, vc[-1])
    assert_trees_close(ys, vc * f32(2.0))


def test_substitute_unknown_name_lists_known():
    with pytest.raises(ValueError, match="'nope'") as info:
        fx.handle(model, fx.Substitute({"nope": V}))(X)
    assert "'h'" in str(info.value) and "'c'" in str(info.value)
    with pytest.raises(ValueError, match="'nope'"):
        fx.handle(model, fx.Substitute({"nope": (V,)}, per_call=True))(X)


@pytest.mark.parametrize(
    "handler, match",
    [
        (fx.Substitute({"h": np.zeros(4, f32)}), "'h'"),
        (fx.Substitute({"h": np.zeros((1, 3), f32)}), "'h'"),
        (fx.Substitute({"h": np.zeros(3, np.int32)}), "'h'"),
        (fx.Substitute({"c": np.zeros(3, np.float16)}), "'c'"),
        (fx.Substitute({"c": ZC}), "'c'"),
        (fx.Substitute({"c": (ZH,)}, per_call=True), "'c'"),
        (fx.Substitute({"c": (np.zeros((N, 3), np.int32),)}, per_call=True), "'c'"),
        (fx.Substitute({"h": (ZC,)}, per_call=True), "'h'"),
    ],
    ids=[
        "shape",
        "rank",
        "dtype",
        "dtype_in_scan",
        "stacked_without_per_call",
        "per_call_not_stacked",
        "per_call_dtype",
        "per_call_shape",
    ],
)
def test_substitute_mismatch_raises(handler, match):
    with pytest.raises(ValueError, match=match):
        fx.handle(model, handler)(X)


@pytest.mark.parametrize(
    "fn, values",
    [
        (line, {"a": (V,)}),
        (line, {"a": (V, V, V)}),
        (model, {"c": ()}),
        (model, {"c": (VC, VC)}),
    ],
    ids=["too_few", "too_many", "too_few_scan", "too_many_scan"],
)
def test_substitute_per_call_wrong_count_raises(fn, values):
    with pytest.raises(ValueError):
        fx.handle(fn, fx.Substitute(values, per_call=True))(X)


def test_outer_tag_collects_substituted_value():
    out, found = fx.handle(model, fx.Substitute({"h": V}), fx.Tag())(X)
    ref_out, _, cs = evaluate(lambda x: model_ref(x, on_h=lambda h: V), X)
    assert_trees_close(out, ref_out)
    assert_trees_close(found, {"intermediates": {"h": (V,), "c": (cs,)}})
    substitute = fx.Substitute({"c": (VC,)}, per_call=True)
    out, found = fx.handle(model, substitute, fx.Tag(names="c"))(X)
    assert_trees_close(found, {"intermediates": {"c": (VC,)}})


def test_nested_handle_outer_tag_collects_substituted_value():
    ref_out, _, cs = evaluate(lambda x: model_ref(x, on_h=lambda h: V), X)
    inner_handled = fx.handle(model, fx.Substitute({"h": V}))
    (out, inner), outer = fx.handle(inner_handled, fx.Tag())(X)
    assert_trees_close(out, ref_out)
    assert inner == {}
    assert_trees_close(outer, {"intermediates": {"h": (V,), "c": (cs,)}})


def scalar_fn(x):
    h = fx.tag(jnp.sin(x), "h")
    return jnp.sum(h * x)


def test_substitute_order_grad_outside():
    # grad(handle(f, Substitute)): no gradient flows through the substituted value.
    got = jax.grad(lambda x: fx.handle(scalar_fn, fx.Substitute({"h": V}))(x)[0])(X)
    assert_trees_close(got, evaluate(jax.grad(lambda x: jnp.sum(V * x)), X))
    assert_trees_close(got, V)


def test_substitute_order_grad_inside():
    # handle(grad(f), Substitute) == grad(handle(f, Substitute)): the new value
    # carries no derivative through the old one, in either order.
    got, found = fx.handle(jax.grad(scalar_fn), fx.Substitute({"h": V}))(X)
    assert_trees_close(got, evaluate(jax.grad(lambda x: jnp.sum(V * x)), X))
    assert_trees_close(got, V)
    assert found == {}


#
# Intervene
#


def test_intervene_each_execution():
    def fn(c):
        return 0.5 * c + 1.0

    out, found = fx.handle(model, fx.Intervene({"c": fn}))(X)
    assert_trees_close(
        out, evaluate(lambda x: model_ref(x, on_c=lambda i, c: fn(c))[0], X)
    )
    assert found == {}
    out, _ = fx.handle(model, fx.Intervene({"h": jnp.exp, "c": fn}))(X)
    assert_trees_close(
        out, evaluate(lambda x: model_ref(x, jnp.exp, lambda i, c: fn(c))[0], X)
    )
    out, _ = fx.handle(line, fx.Intervene({"a": jnp.square}))(X)
    a1 = np.sin(X) ** 2
    assert_trees_close(out, np.cos(a1 * f32(3.0)) ** 2 + a1 * f32(3.0))


def test_intervene_outer_tag_sees_new_value():
    out, found = fx.handle(model, fx.Intervene({"h": jnp.exp}), fx.Tag())(X)
    ref_out, h, cs = evaluate(lambda x: model_ref(x, on_h=jnp.exp), X)
    assert_trees_close(out, ref_out)
    assert_trees_close(h, np.exp(np.sin(X)))
    assert_trees_close(found, {"intermediates": {"h": (h,), "c": (cs,)}})


@pytest.mark.parametrize(
    "fn",
    [
        lambda h: h[:2],
        lambda h: h[None],
        lambda h: jnp.sum(h),
        lambda h: h.astype(jnp.int32),
        lambda h: (h, h),
    ],
    ids=["shorter", "extra_axis", "scalar", "dtype", "structure"],
)
@pytest.mark.parametrize("name", ["h", "c"])
def test_intervene_changing_shape_raises(fn, name):
    with pytest.raises(ValueError, match=f"'{name}'"):
        fx.handle(model, fx.Intervene({name: fn}))(X)


def test_intervene_unknown_name_lists_known():
    with pytest.raises(ValueError, match="'nope'") as info:
        fx.handle(model, fx.Intervene({"nope": jnp.exp}))(X)
    assert "'h'" in str(info.value) and "'c'" in str(info.value)


#
# Intervene with the execution's place: fn(value, at)
#

# A stack of layers as a scan over stacked weights, the way large models are
# written; `stack_ref` unrolls it by hand, with `on(i, h)` at layer i.
L, D = 4, 3
WS = _rng(7, (L, D, D)) / np.sqrt(D).astype(f32)


def stack(x):
    def layer(h, w):
        return fx.tag(h + jnp.tanh(w @ h), "blocks"), None

    return lax.scan(layer, x, WS)[0]


def stack_ref(x, on=lambda i, h: h):
    h = x
    for i in range(L):
        h = on(i, h + jnp.tanh(WS[i] @ h))
    return h


def _patch_layer(k, clean):
    def patch(v, at):
        return jnp.where(at[1] == k, clean[k], v)

    return patch


def test_intervene_at_patches_one_layer_of_a_scanned_stack():
    clean_x, x = X, -X
    _, found = fx.handle(stack, fx.Tag())(clean_x)
    clean = found["intermediates"]["blocks"][0]  # (L, D): one row per layer
    for k in range(L):
        got = jax.jit(
            fx.handle(stack, fx.Intervene({"blocks": _patch_layer(k, clean)}))
        )(x)[0]
        expected = evaluate(
            lambda x: stack_ref(x, lambda i, h: clean[k] if i == k else h), x
        )
        assert_trees_close(got, expected)


def test_intervene_at_grid_over_layers_is_one_vmapped_program():
    clean_x, x = X, -X
    clean = fx.handle(stack, fx.Tag())(clean_x)[1]["intermediates"]["blocks"][0]

    def patched(k):  # k traced: every layer's patch in one program
        return fx.handle(stack, fx.Intervene({"blocks": _patch_layer(k, clean)}))(x)[0]

    got = jax.jit(jax.vmap(patched))(jnp.arange(L))
    expected = jnp.stack(
        [
            evaluate(lambda x: stack_ref(x, lambda i, h: clean[k] if i == k else h), x)
            for k in range(L)
        ]
    )
    assert_trees_close(got, expected)


def test_intervene_at_under_grad_and_vmap_inside():
    k = 2

    def scale_layer(v, at):
        return jnp.where(at[1] == k, 3.0 * v, v)

    def loss(x):
        out, _ = fx.handle(stack, fx.Intervene({"blocks": scale_layer}))(x)
        return jnp.sum(out**2)

    def loss_ref(x):
        return jnp.sum(stack_ref(x, lambda i, h: 3.0 * h if i == k else h) ** 2)

    assert_trees_close(jax.grad(loss)(X), evaluate(jax.grad(loss_ref), X), rtol=1e-5)
    # a vmap inside the handled function: `at` is the same for every example
    xs = np.stack([X, -X, 2 * X])
    got, _ = fx.handle(jax.vmap(stack), fx.Intervene({"blocks": scale_layer}))(xs)
    expected = evaluate(
        jax.vmap(lambda x: stack_ref(x, lambda i, h: 3.0 * h if i == k else h)), xs
    )
    assert_trees_close(got, expected)


def test_intervene_at_counts_calls_and_nested_loops():
    # `at` is (call, *iterations): where Tag() reports the value.
    def f(x):
        x = fx.tag(x, "h")  # call 0

        def outer(c, _):
            def inner(c, _):
                return fx.tag(c + 1.0, "h"), None  # call 1, at (1, i, j)

            return lax.scan(inner, c, None, length=3)[0], None

        c = lax.scan(outer, x, None, length=2)[0]

        def body(carry):
            i, c = carry
            return i + 1, fx.tag(c * 2.0, "h")  # call 2, at (2, iteration)

        return lax.while_loop(lambda carry: carry[0] < 4, body, (0, c))[1]

    def code(v, at):  # records `at` in the value: 1000 call + 100 i + 10 j
        weights = jnp.array([1000, 100, 10][: len(at)], jnp.int32)
        return v + jnp.sum(jnp.stack(at) * weights).astype(v.dtype)

    out, found = fx.handle(f, fx.Intervene({"h": code}), fx.Tag(mode="sum"))(0.0)
    # by hand
    h = 0.0  # call 0: at (0,)
    for i in range(2):
        for j in range(3):
            h = h + 1.0 + 1000 + 100 * i + 10 * j
    for i in range(4):
        h = 2.0 * h + 2000 + 100 * i
    assert_trees_close(out, np.float32(h))


def test_handler_reading_at_reports_where_tag_does():
    # A user-written handler: `ctx.at` in a reported value lines up with Tag().
    class Where(fx.Handler):
        mode = "append"

        def apply(self, site, value, ctx):
            ctx.emit(jnp.stack(ctx.at))
            return value

    def f(x):
        x = fx.tag(x, "h")
        return lax.scan(lambda c, _: (fx.tag(c * 2.0, "h"), None), x, None, length=3)[0]

    _, found = jax.jit(fx.handle(f, Where()))(1.0)
    first, scanned = found["intermediates"]["h"]
    np.testing.assert_array_equal(first, [0])
    np.testing.assert_array_equal(scanned, [[1, 0], [1, 1], [1, 2]])


def test_a_loop_threads_its_iteration_only_when_at_is_read():
    def scan_inputs(handler):
        jaxpr = jax.make_jaxpr(fx.handle(stack, handler))(X)
        (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
        return [str(v.aval) for v in eqn.invars]

    unhandled = scan_inputs(fx.Tag(names=lambda n: n.startswith("nothing")))
    assert scan_inputs(fx.Intervene({"blocks": lambda v: v * 2.0})) == unhandled
    with_at = scan_inputs(fx.Intervene({"blocks": lambda v, at: v * at[1]}))
    assert with_at == [*unhandled, f"int32[{L}]"]  # the iteration, as an input


def test_intervene_at_in_a_recomputed_checkpoint(jax_leak_check_false_report):
    # The backward pass recomputes the tagged value (tanh's derivative needs
    # it): the recomputation gets the call and iteration of the execution it
    # recomputes, as the cotangent does (they share the value's `pair`).
    def layer(h, w):
        return h + jnp.tanh(w @ fx.tag(jnp.sin(h), "blocks")), None

    def loss(x):
        return jnp.sum(lax.scan(jax.checkpoint(layer), x, WS)[0])

    def double_layer_1(v, at):
        return jnp.where(at[1] == 1, 2.0 * v, v)

    def loss_ref(x):
        h = x
        for i in range(L):
            s = jnp.sin(h) * (2.0 if i == 1 else 1.0)
            h = h + jnp.tanh(WS[i] @ s)
        return jnp.sum(h)

    handled = fx.handle(loss, fx.Intervene({"blocks": double_layer_1}))
    got = jax.grad(lambda x: handled(x)[0])(X)
    assert_trees_close(got, evaluate(jax.grad(loss_ref), X), rtol=1e-5)
    # differentiated inside handle: the same
    got, _ = fx.handle(jax.grad(loss), fx.Intervene({"blocks": double_layer_1}))(X)
    assert_trees_close(got, evaluate(jax.grad(loss_ref), X), rtol=1e-5)


#
# Every handler under jit, vmap and grad, outside and inside
#


def _found(collection, **values):
    return {collection: values}


# Each case: the site kind, the per-example parameters (with a leading shape
# `lead`, the batch under vmap), the handler built from them, and the
# reference `(x, params) -> (out, found)`.
CASES = {
    "tag_append": (
        fx.tag,
        lambda lead: {},
        lambda p: fx.Tag(),
        lambda x, p: (lambda o, h, cs: (o, _found("intermediates", h=(h,), c=(cs,))))(
            *model_ref(x)
        ),
    ),
    "tag_running_max": (
        fx.tag,
        lambda lead: {},
        lambda p: fx.Tag(mode=RUNNING_MAX),
        lambda x, p: (lambda o, h, cs: (o, _found("intermediates", h=h, c=cs.max(0))))(
            *model_ref(x)
        ),
    ),
    "perturb_report": (
        fx.perturb,
        lambda lead: {},
        lambda p: fx.Perturb(),
        lambda x, p: (
            model_ref(x)[0],
            _found("perturbations", h=(jnp.zeros(3),), c=(jnp.zeros((N, 3)),)),
        ),
    ),
    "perturb_deltas": (
        fx.perturb,
        lambda lead: {"h": _rng(11, lead + (3,)), "c": _rng(12, lead + (N, 3))},
        lambda p: fx.Perturb({"h": (p["h"],), "c": (p["c"],)}),
        lambda x, p: (
            model_ref(
                x,
                lambda h: h + p["h"],
                lambda i, c: c + p["c"][i],
            )[0],
            {},
        ),
    ),
    "substitute": (
        fx.tag,
        lambda lead: {"h": _rng(13, lead + (3,))},
        lambda p: fx.Substitute({"h": p["h"]}),
        lambda x, p: (model_ref(x, lambda h: p["h"])[0], {}),
    ),
    "substitute_per_call": (
        fx.tag,
        lambda lead: {"c": _rng(14, lead + (N, 3))},
        lambda p: fx.Substitute({"c": (p["c"],)}, per_call=True),
        lambda x, p: (
            model_ref(x, on_c=lambda i, c: p["c"][i])[0],
            {},
        ),
    ),
    "intervene": (
        fx.tag,
        lambda lead: {},
        lambda p: fx.Intervene({"h": lambda h: h**2 + 1.0, "c": lambda c: 0.5 * c}),
        lambda x, p: (
            model_ref(
                x,
                lambda h: h**2 + 1.0,
                lambda i, c: 0.5 * c,
            )[0],
            {},
        ),
    ),
}


def _sum_out(fn):
    # A scalar loss with `found` as auxiliary output.
    def loss(*args):
        out, found = fn(*args)
        return jnp.sum(out), found

    return loss


TRANSFORMS = ["jit_outside", "jit_inside", "vmap_outside", "vmap_inside"]
TRANSFORMS += ["grad_outside", "grad_inside"]


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("case", list(CASES))
def test_handler_under_transformations(case, transform, request):
    if transform == "grad_inside":
        # The model's scan, partially evaluated under `grad`, keeps its unused
        # tags through their effect: JAX's leak checker reports it falsely
        # (see the fixture).
        request.getfixturevalue("jax_leak_check_false_report")
    site, params, handler, ref = CASES[case]
    f = make_model(site)
    p = params(())
    xb = _rng(20, (B, 3))
    pb = params((B,))

    # vmap and grad outside `handle` run inside one jit here, to compile once;
    # other tests run `handle` under eager vmap and grad.
    if transform == "jit_outside":
        got = jax.jit(fx.handle(f, handler(p)))(X)
        expected = evaluate(lambda x: ref(x, p), X)
    elif transform == "jit_inside":
        got = fx.handle(jax.jit(f), handler(p))(X)
        expected = evaluate(lambda x: ref(x, p), X)
    elif transform == "vmap_outside":
        # the handler's values are batched tracers here
        got = evaluate(jax.vmap(lambda x, p: fx.handle(f, handler(p))(x)), xb, pb)
        expected = evaluate(jax.vmap(lambda x, p: ref(x, p)), xb, pb)
    elif transform == "vmap_inside":
        # values and found in the layout seen from the handler: batch axis first
        got = fx.handle(jax.vmap(f), handler(pb))(xb)
        expected = evaluate(jax.vmap(lambda x, p: ref(x, p)), xb, pb)
    elif transform == "grad_outside":
        loss = _sum_out(lambda x: fx.handle(f, handler(p))(x))
        got = evaluate(jax.grad(loss, has_aux=True), X)
        loss = _sum_out(lambda x: ref(x, p))
        expected = evaluate(jax.grad(loss, has_aux=True), X)
    else:
        assert transform == "grad_inside"
        got = fx.handle(jax.grad(lambda x: jnp.sum(f(x))), handler(p))(X)
        expected = evaluate(
            lambda x: (
                jax.grad(lambda x: jnp.sum(ref(x, p)[0]))(x),
                ref(x, p)[1],
            ),
            X,
        )
    assert_trees_close(got, expected, rtol=1e-4, atol=1e-5)


def test_tag_under_eager_vmap_and_grad():
    xb = _rng(23, (B, 3))
    out, found = jax.vmap(fx.handle(line, fx.Tag()))(xb)
    ref_out, a1, b, a2 = line_ref(xb)
    assert_trees_close(out, ref_out)
    assert_trees_close(found, {"intermediates": {"a": (a1, a2), "b": (b,)}})

    loss = _sum_out(fx.handle(line, fx.Tag(mode="last")))
    grad, found = jax.grad(loss, has_aux=True)(X)
    # d/dx sum(cos(3 sin x) + 3 sin x)
    _, a1, b, a2 = line_ref(X)
    assert_trees_close(grad, (1 - np.sin(b)) * f32(3.0) * np.cos(X))
    assert_trees_close(found, {"intermediates": {"a": a2, "b": b}})


def test_vmap_inside_batch_axis_first_for_any_in_axes():
    # vmap over axis 1: found and substituted values still have the batch first.
    xt = _rng(21, (3, B + 1))
    vmapped = jax.vmap(model, in_axes=1, out_axes=1)
    out, found = fx.handle(vmapped, fx.Tag())(xt)
    ref_out, h, cs = evaluate(jax.vmap(model_ref, in_axes=1, out_axes=(1, 0, 0)), xt)
    assert cs.shape == (B + 1, N, 3)
    assert_trees_close(out, ref_out)
    assert_trees_close(found, {"intermediates": {"h": (h,), "c": (cs,)}})

    def ref_with_h(x, v):
        return model_ref(x, on_h=lambda h: v)[0]

    vb = _rng(22, (B + 1, 3))
    out, _ = fx.handle(vmapped, fx.Substitute({"h": vb}))(xt)
    expected = evaluate(jax.vmap(ref_with_h, in_axes=(1, 0), out_axes=1), xt, vb)
    assert_trees_close(out, expected)

    # Intervene sees one example, as under a vmap outside `handle`: centre
    # each example's h over its own elements.
    centre = fx.Intervene({"h": lambda h: h - h.mean()})
    out, _ = fx.handle(vmapped, centre)(xt)
    hb = np.sin(xt.T)
    hb = hb - hb.mean(1, keepdims=True)
    expected = evaluate(jax.vmap(ref_with_h, in_axes=(1, 0), out_axes=1), xt, hb)
    assert_trees_close(out, expected, rtol=1e-4, atol=1e-5)
    outside, _ = jax.vmap(fx.handle(model, centre), in_axes=1, out_axes=1)(xt)
    assert_trees_close(out, outside, rtol=1e-6, atol=1e-6)


#
# Values and functions that close over traced values
#


def test_intervene_closing_over_grad_tracer():
    def handled(s):
        intervene = fx.Intervene({"h": lambda h: h * s})
        return fx.handle(scalar_fn, intervene)(X)[0]

    # sum(sin(x) * s * x): the derivative in s is sum(sin(x) * x)
    assert_trees_close(jax.grad(handled)(2.0), np.sum(np.sin(X) * X))
    assert_trees_close(handled(2.0), np.sum(np.sin(X) * f32(2.0) * X))
    # the same through the scan model
    got = evaluate(
        jax.grad(
            lambda s: jnp.sum(
                fx.handle(model, fx.Intervene({"h": lambda h: h * s}))(X)[0]
            )
        ),
        2.0,
    )
    expected = evaluate(
        jax.grad(lambda s: jnp.sum(model_ref(X, on_h=lambda h: h * s)[0])), 2.0
    )
    assert_trees_close(got, expected, rtol=1e-4)


def test_intervene_closing_over_jit_and_vmap_tracers():
    def handled(x, s):
        return fx.handle(scalar_fn, fx.Intervene({"h": lambda h: h * s}))(x)[0]

    s = np.float32(0.7)
    assert_trees_close(jax.jit(handled)(X, s), np.sum(np.sin(X) * s * X))
    ss = np.array([0.7, -1.3], f32)
    assert_trees_close(
        jax.vmap(handled, in_axes=(None, 0))(X, ss),
        np.sum(np.sin(X) * X) * ss,
    )


def test_substitute_closing_over_grad_tracer():
    def handled(v):
        return fx.handle(scalar_fn, fx.Substitute({"h": v}))(X)[0]

    # sum(v * x): the derivative in v is x
    assert_trees_close(jax.grad(handled)(V), X)

    def handled_per_call(vc):
        out, _ = fx.handle(model, fx.Substitute({"c": (vc,)}, per_call=True))(X)
        return jnp.sum(out**2)

    def reference_per_call(vc):
        return jnp.sum(model_ref(X, on_c=lambda i, c: vc[i])[0] ** 2)

    assert_trees_close(
        evaluate(jax.grad(handled_per_call), VC),
        evaluate(jax.grad(reference_per_call), VC),
        rtol=1e-4,
    )


def test_substitute_closing_over_tracer_inside_jit_of_grad():
    def handled(x, v):
        return jax.grad(
            lambda x: jnp.sum(fx.handle(model, fx.Substitute({"c": v}))(x)[0])
        )(x)

    def reference(x, v):
        return jax.grad(lambda x: jnp.sum(model_ref(x, on_c=lambda i, c: v)[0]))(x)

    assert_trees_close(jax.jit(handled)(X, V), evaluate(reference, X, V), rtol=1e-4)


#
# Handlers as objects: immutable, compared by value, pytrees of their arrays
#


def test_handlers_are_immutable_and_compare_by_value():
    tag = fx.Tag(names=["a*"], mode="sum")
    with pytest.raises(dataclasses.FrozenInstanceError):
        tag.mode = "last"  # type: ignore[misc]
    assert tag == fx.Tag(names=("a*",), mode="sum")
    assert hash(tag) == hash(fx.Tag(names=("a*",), mode="sum"))
    assert tag != fx.Tag(names=["a*"], mode="last")
    assert fx.Tag() != fx.Perturb() and fx.Reduce(max, min) == fx.Reduce(max, min)
    assert hash(fx.Intervene({"h": jnp.exp})) == hash(fx.Intervene({"h": jnp.exp}))
    with pytest.raises(TypeError, match="unhashable"):
        hash(fx.Perturb({"h": (ZH,)}))


@pytest.mark.parametrize(
    "handler, leaves",
    [
        (fx.Tag(names="a*", mode=RUNNING_MAX), []),
        (fx.Intervene({"h": jnp.exp}), []),
        (fx.Perturb(), []),
        (fx.Perturb({"h": (ZH,), "c": (ZC,)}, names="?"), [ZC, ZH]),
        (fx.Substitute({"h": {"u": X, "v": ZH}}), [X, ZH]),
        (fx.Substitute({"c": (X, ZH)}, per_call=True), [X, ZH]),
    ],
    ids=["Tag", "Intervene", "Perturb", "Perturb-values", "Substitute", "per_call"],
)
def test_handlers_are_pytrees_of_their_arrays(handler, leaves):
    flat, treedef = jax.tree.flatten(handler)
    assert len(flat) == len(leaves)
    for leaf, expected in zip(flat, leaves):
        np.testing.assert_array_equal(leaf, expected)
    # Rebuilt with leaves no constructor would accept: no validation runs again.
    marked = jax.tree.unflatten(treedef, ["leaf"] * len(flat))
    assert type(marked) is type(handler)
    assert jax.tree.leaves(marked) == ["leaf"] * len(flat)
    assert jax.tree.structure(jax.tree.unflatten(treedef, flat)) == treedef
    paths = jax.tree_util.tree_leaves_with_path(handler)
    assert all(
        jax.tree_util.keystr(p).startswith((".deltas", ".values")) for p, _ in paths
    )


class Scale(fx.Handler):
    """A user's handler: multiplies the tagged value `name` by `scale`."""

    scale: jax.Array
    name: str = dataclasses.field(metadata={"static": True})
    collection: str = dataclasses.field(
        default="intermediates", metadata={"static": True}
    )

    def matches(self, site):
        return super().matches(site) and site.name == self.name

    def apply(self, site, value, ctx):
        return jax.tree.map(lambda x: x * self.scale, value)


class Doubler(fx.Handler):
    """A user's handler that reports every tag, and so consumes it as `Tag`
    does, but doubles the value of `name`."""

    mode = "append"
    name: str = dataclasses.field(metadata={"static": True})
    collection: str = dataclasses.field(
        default="intermediates", metadata={"static": True}
    )

    def apply(self, site, value, ctx):
        ctx.emit(value)
        return value * 2.0 if site.name == self.name else value


@pytest.mark.parametrize("name", ["a", "b", "none"])
def test_a_reporting_handler_that_changes_one_value_changes_what_follows(name):
    # Straight-line code whose sites a reporting, consuming handler keeps but
    # one: everything after that site sees the new value, and what it reports
    # is what each site saw.
    a1 = np.sin(X) * (2.0 if name == "a" else 1.0)
    b = a1 * f32(3.0) * (2.0 if name == "b" else 1.0)
    a2 = np.cos(b) * (2.0 if name == "a" else 1.0)
    want_found = {"intermediates": {"a": (np.sin(X), np.cos(b)), "b": (a1 * f32(3.0),)}}
    for g in (fx.handle(line, Doubler(name)), jax.jit(fx.handle(line, Doubler(name)))):
        out, found = g(X)
        assert_trees_close(out, a2 + b)
        assert_trees_close(found, want_found)


def test_handler_subclass_is_a_frozen_dataclass_and_pytree():
    scale = Scale(jnp.float32(2.0), "b")
    assert jax.tree.leaves(scale) == [scale.scale]
    assert repr(scale) == "Scale(scale=f32[], name='b')"  # the default left out
    with pytest.raises(dataclasses.FrozenInstanceError):
        scale.name = "a"  # type: ignore[misc]

    def reference(s):
        _, a1, b, _ = line_ref(X)
        return np.cos(a1 * f32(3.0) * s) + a1 * f32(3.0) * s

    out, found = fx.handle(line, scale)(X)
    assert_trees_close(out, reference(f32(2.0)))
    assert found == {}

    # The array is a leaf: a handler closing over a tracer, under grad and jit.
    def loss(s):
        return jnp.sum(fx.handle(line, Scale(s, "b"))(X)[0])

    def loss_ref(s):
        b = jnp.sin(X) * 3.0 * s
        return jnp.sum(jnp.cos(b) + b)

    s = np.float32(0.5)
    assert_trees_close(jax.jit(jax.grad(loss))(s), evaluate(jax.grad(loss_ref), s))


#
# `fx.Select`: a handler's `matches`, said declaratively
#


class Double(fx.Handler):
    """A user's handler selecting its sites with an `fx.Select`."""

    matches = fx.Select(names="enc/*")

    def apply(self, site, value, ctx):
        return 2 * value


def test_a_select_is_a_handlers_matches():
    # Double doubles enc/h and enc/g, where the tags are: what follows them
    # sees the doubled values, computed here by hand.
    out, found = fx.handle(named, Double(), fx.Tag())(X)
    h = 2 * (X + f32(1.0))
    g = 2 * (h * f32(2.0))
    d = g - f32(3.0)
    assert_trees_close(out, d**2)
    assert_trees_close(
        found, {"intermediates": {"enc/h": (h,), "enc/g": (g,), "dec/h": (d,)}}
    )
    site = fx.Site.probe("tag", "intermediates", "enc/x")
    assert Double.matches(site) and not Double.matches(site.of("cotangent"))
    assert not Double.matches(fx.Site.probe("perturb", "intermediates", "enc/x"))


class Collect(fx.Handler):
    """A user's reporting handler: its `matches`, a property, is a `Select`
    built from its fields."""

    mode = "append"
    names: object = dataclasses.field(default=None, metadata={"static": True})
    collection: str = dataclasses.field(
        default="intermediates", metadata={"static": True}
    )
    part: str = dataclasses.field(default="value", metadata={"static": True})

    @property
    def matches(self):
        return fx.Select(self.names, collection=self.collection, part=self.part)

    def apply(self, site, value, ctx):
        ctx.emit(value)
        return value


def test_a_select_says_where_a_handler_reports_and_which_names_must_exist():
    _, values = named_ref(X)
    _, found = fx.handle(named, Collect("dec/*"))(X)
    assert_trees_close(found, {"intermediates": {"dec/h": (values["dec/h"],)}})
    # Matching nothing: its collection, empty (as `Tag` reports).
    _, found = fx.handle(named, Collect(lambda n: False, collection="other"))(X)
    assert found == {"other": {}}
    # A name without glob characters must exist, and a glob must match one:
    # the error names the handler and lists the names it could have meant.
    for names in ["enc/hh", "dec/x*"]:
        with pytest.raises(ValueError, match=r"Collect: no tag .*'dec/h'"):
            fx.handle(named, Collect(names))(X)


def test_a_select_of_a_derivative_part_reports_beside_the_values():
    def f(x):
        return jnp.sum(jnp.sin(fx.tag(x * x, "h")))

    (_, grad), found = fx.handle(jax.value_and_grad(f), Collect(part="cotangent"))(X)
    assert_trees_close(grad, 2 * X * np.cos(X * X), rtol=1e-6)
    assert_trees_close(
        found, {"intermediates:cotangent": {"h": (np.cos(X * X),)}}, rtol=1e-6
    )


class Count(fx.Handler):
    """A user's reporting handler with a `matches` method: it reports each
    site under the site's own collection, and requires no name."""

    mode = "sum"

    def matches(self, site):
        return site.kind == "tag" and site.name.endswith("h")

    def apply(self, site, value, ctx):
        ctx.emit(jnp.ones_like(value))
        return value


def test_a_handler_whose_matches_is_a_method_reports_under_each_sites_collection():
    def f(x):
        return fx.tag(fx.tag(x, "h", collection="a"), "gh", collection="b") + 1

    out, found = fx.handle(f, Count())(X)
    assert_trees_close(out, X + 1)
    assert_trees_close(
        found, {"a": {"h": np.ones(3, f32)}, "b": {"gh": np.ones(3, f32)}}
    )
    # (Count consumed both: the Tag after it finds nothing of its own, and
    # says so)
    with pytest.warns(UserWarning, match="Tag matches no site left.*'gh'"):
        _, again = fx.handle(f, Count(), fx.Tag(collection="b"))(X)
    assert_trees_close(again, found)


def test_a_set_of_names_selects_exactly_those_and_each_must_exist():
    def f(x):
        return fx.tag(x, "a[0]") + fx.tag(2 * x, "a0")

    _, found = fx.handle(f, fx.Tag(names={"a[0]"}))(X)
    assert_trees_close(found, {"intermediates": {"a[0]": (X,)}})
    _, found = fx.handle(f, fx.Tag(names="a[0]"))(X)  # a glob: "a0"
    assert_trees_close(found, {"intermediates": {"a0": (2 * X,)}})
    with pytest.raises(
        ValueError, match=r"no tag named 'b'.*Known names: 'a0', 'a\[0\]'"
    ):
        fx.handle(f, fx.Tag(names={"a[0]", "b"}))(X)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(names=3), TypeError, "Select: `names` must be"),
        (dict(names={"a", 1}), TypeError, "Select: `names` must be"),
        (dict(collection=None), TypeError, "Select: collection must be a string"),
        (dict(kind="site"), ValueError, "Select: kind='site'"),
        (dict(part="primal"), ValueError, "Select: part='primal'"),
    ],
)
def test_a_bad_select_is_refused_when_made(kwargs, error, match):
    with pytest.raises(error, match=match):
        fx.Select(**kwargs)


def test_perturb_refuses_deltas_its_names_do_not_select():
    deltas = {"enc/h": (jnp.zeros(3),)}
    with pytest.raises(ValueError, match="Perturb: deltas for 'enc/h'"):
        fx.Perturb(deltas, names="dec/*", kind="tag")
    perturb = fx.Perturb(deltas, names="enc/*", kind="tag")
    out, _ = fx.handle(named, perturb)(X)
    assert_trees_close(out, named_ref(X)[0])


#
# A mode that passes the site on (`consumes=False`)
#


class ClipCount(fx.Handler):
    """The guide's `Clip`, passing the clipped value on: it reports how many
    elements it clipped, and a handler further out sees the clipped value."""

    mode = fx.Reduce(
        lambda n, k: n + k, lambda value: jnp.zeros((), jnp.int32), consumes=False
    )

    def apply(self, site, value, ctx):
        clipped = jnp.clip(value, -0.5, 0.5)
        ctx.emit(jnp.sum(clipped != value, dtype=jnp.int32))
        return clipped


def _scanned(x):
    step = lambda h, _: (fx.tag(2.0 * h, "h"), None)  # noqa: E731
    return lax.scan(step, x, None, length=3)[0]


def _scanned_ref(x):
    rows, h = [], x
    for _ in range(3):
        h = np.clip(2.0 * h, -0.5, 0.5)
        rows.append(h)
    counts = sum(
        int(np.sum(np.clip(2.0 * r, -0.5, 0.5) != 2.0 * r)) for r in [x, *rows[:2]]
    )
    return h, np.stack(rows), counts


def test_a_mode_that_passes_the_site_on_lets_a_handler_further_out_report_it():
    x = np.array([0.05, 0.3, -0.2], f32)
    out_want, rows, count = _scanned_ref(x)
    (out, inner), outer = fx.handle(fx.handle(_scanned, ClipCount()), fx.Tag())(x)
    assert_trees_close(out, out_want)
    assert int(inner["intermediates"]["h"]) == count == 5
    assert_trees_close(outer, {"intermediates": {"h": (rows,)}})
    # Consuming (the default), the outer Tag sees nothing.
    consuming = fx.Tag(mode=fx.Append())
    (_, inner), outer = fx.handle(fx.handle(_scanned, consuming), fx.Tag())(x)
    assert outer == {"intermediates": {}}
    passing = fx.Tag(mode=fx.Append(consumes=False))
    (_, inner), outer = fx.handle(fx.handle(_scanned, passing), fx.Tag())(x)
    assert_trees_close(inner, outer)


def test_two_reports_of_one_site_in_one_handle_are_an_error_that_says_to_nest():
    x = np.array([0.05, 0.3, -0.2], f32)
    with pytest.raises(
        ValueError,
        match=r"ClipCount and Tag both report the tag 'h'.*ClipCount's mode passes "
        r"'h' on \(`consumes=False`\).*two steps",
    ):
        fx.handle(_scanned, ClipCount(), fx.Tag())(x)
    # A handler after it that reports other names, or none, is no clash.
    out, found = fx.handle(_scanned, ClipCount(), fx.Tag(names=lambda n: False))(x)
    assert int(found["intermediates"]["h"]) == 5
    out, _ = fx.handle(_scanned, ClipCount(), fx.Intervene({"h": jnp.negative}))(x)
    want = x
    for _ in range(3):  # clipped, then negated
        want = -np.clip(2.0 * want, -0.5, 0.5)
    assert_trees_close(out, want)


@pytest.mark.parametrize(
    "make, owner",
    [
        (lambda: fx.Tag(3), "Tag"),
        (lambda: fx.Perturb(collection=3), "Perturb"),
        (lambda: fx.Substitute({}, collection=3), "Substitute"),
        (lambda: fx.Intervene({}, collection=3), "Intervene"),
        (lambda: fx.Perturb(names=3), "Perturb"),
    ],
)
def test_a_handler_names_itself_when_its_selection_is_refused(make, owner):
    with pytest.raises(TypeError, match=f"^{owner}: "):
        make()


def test_a_delta_at_a_prng_key_is_refused_by_name():
    def f(x):
        return jax.random.normal(fx.tag(jax.random.key(0), "k")) + x

    zero_key = jnp.zeros((), jax.random.key(0).dtype)
    with pytest.raises(ValueError, match="tag 'k'.*holds a PRNG key"):
        fx.handle(f, fx.Perturb({"k": (zero_key,)}, kind="tag"))(X)


def test_at_in_a_reversed_scan_is_the_iterations_position():
    # As its stacked entries are: position i, though it runs (n - 1 - i)-th.
    xs = jnp.arange(1.0, 5.0)

    def f(xs):
        def body(c, x):
            h = fx.tag(x * 2, "h")
            return c * 0.5 + h, h

        return lax.scan(body, 0.0, xs, reverse=True)

    def by_hand(xs):
        def body(c, ix):
            i, x = ix
            h = x * 2 * i
            return c * 0.5 + h, h

        return lax.scan(body, 0.0, (jnp.arange(4.0), xs), reverse=True)

    scale = fx.Intervene({"h": lambda v, at: v * at[1]})
    assert_trees_close(fx.handle(f, scale)(xs)[0], by_hand(xs))
    _, found = fx.handle(f, fx.Tag())(xs)
    assert_trees_close(found["intermediates"]["h"], (xs * 2,))


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_handler_using_the_accumulator_where_it_runs_again_is_refused(checkpoint):
    # Under a `jax.grad` inside `handle` (or a checkpoint's recomputation),
    # `apply` runs again reporting nothing, and `emit` gives None: a handler
    # that used it failed with a message blaming its value, or a bare
    # TypeError naming nothing.
    class UsesAccumulator(fx.Handler):
        mode = "sum"

        def apply(self, site, value, ctx):
            return ctx.emit(value) * 1.0

    def f(x):
        inner = lambda x: fx.tag(jnp.sin(x), "h") ** 2  # noqa: E731
        return jnp.sum((jax.checkpoint(inner) if checkpoint else inner)(x))

    with pytest.raises(ValueError, match="UsesAccumulator uses what `ctx.emit`"):
        fx.handle(jax.grad(f), UsesAccumulator())(X)
    # Outside, where `emit` knows the accumulator: the value it returns.
    got = jax.grad(lambda x: fx.handle(f, UsesAccumulator())(x)[0])(X)
    assert_trees_close(got, jax.grad(f)(X))


def test_mismatches_at_a_prng_key_tag_name_the_tag_and_handler():
    # (building the message failed on the key's dtype: "Cannot interpret
    # 'key<fry>' as a data type")
    def f(x):
        return jax.random.normal(fx.tag(jax.random.key(0), "k")) + x

    with pytest.raises(ValueError, match="Substitute gives uint32\\[\\] for tag 'k'"):
        fx.handle(f, fx.Substitute({"k": jnp.zeros((), jnp.uint32)}))(X)


def test_ctx_example_checks_the_shape_with_or_without_a_vmap():
    # Without a vmap inside `handle`, a value of another shape came back as
    # it was: `emit(value * ctx.example(w))` reported (2, 3) for a (3,) tag.
    class Weighted(fx.Handler):
        mode = "append"
        w: Any

        def apply(self, site, value, ctx):
            ctx.emit(value * ctx.example(self.w))
            return value

    def f(x):
        return fx.tag(jnp.sin(x), "h")

    _, found = fx.handle(f, Weighted(2 * jnp.ones(3)))(X)
    assert_trees_close(found["intermediates"]["h"], (2 * jnp.sin(X),))
    for w in (jnp.ones((2, 3)), jnp.ones((7, 3)), (jnp.ones(3),)):
        with pytest.raises(ValueError, match="tag 'h'"):
            fx.handle(f, Weighted(w))(X)


def test_mode_errors_name_the_handler_that_has_the_mode():
    class Recorder(fx.Handler):
        mode = "append"

        def apply(self, site, value, ctx):
            ctx.emit(value)
            return value

    class Concat(fx.Handler):
        mode = fx.Reduce(lambda a, v: jnp.concatenate([a, v]), lambda z: z)

        def apply(self, site, value, ctx):
            ctx.emit(value)
            return value

    def loop(x):
        return lax.while_loop(lambda h: h.sum() < 9, lambda h: fx.tag(2 * h, "h"), x)

    with pytest.raises(ValueError, match="Recorder\\(mode='append'\\) cannot append"):
        fx.handle(loop, Recorder())(X)
    with pytest.raises(ValueError, match="Concat's fx.Reduce `fn\\(acc, x\\)` turned"):
        fx.handle(lambda x: fx.tag(x, "h"), Concat())(X)
    with pytest.raises(ValueError, match="Tag\\(mode='append'\\) cannot append"):
        fx.handle(loop, fx.Tag())(X)


def test_an_error_in_a_handlers_apply_says_which_handler_and_tag():
    class Boom(fx.Handler):
        def apply(self, site, value, ctx):
            if site.name == "second":
                raise RuntimeError("boom")
            return value

    def f(x):
        return fx.tag(fx.tag(x, "first") * 2, "second")

    with pytest.raises(RuntimeError, match="boom") as caught:
        fx.handle(f, Boom())(X)
    # (JAX adds a note of its own after ours)
    assert caught.value.__notes__[0] == (
        "(raised in Boom.apply at tag 'second' (collection 'intermediates'))"
    )


class _EveryTag(fx.Handler):
    """A handler whose `matches` is a method: tags of every collection."""

    mode = "append"
    shift: dict = dataclasses.field(default_factory=dict)

    def matches(self, site):
        return site.kind == "tag" and site.part == "value"

    def per_call_inputs(self):
        return self.shift

    def apply(self, site, value, ctx):
        if site.name in self.shift:
            value = value + ctx.next_input()
        ctx.emit(value)
        return value


def _one_name_two_collections(x):
    a = fx.tag(x, "big")
    b = fx.tag(2 * x, "big", collection="other")
    c = fx.tag(3 * x, "solo", collection="other")
    return lax.scan(
        lambda c, _: (fx.tag(c + 1, "big", collection="other"), None),
        a + b + c,
        None,
        length=2,
    )[0]


def test_a_method_handler_reports_one_name_of_two_collections_apart():
    # Its entries were keyed by name alone: the second collection's `big`
    # went into the first's, silently.
    x = jnp.float32(1.0)
    for fn in [
        fx.handle(_one_name_two_collections, _EveryTag()),
        jax.jit(fx.handle(_one_name_two_collections, _EveryTag())),
    ]:
        _, found = fn(x)
        f32 = np.float32
        want = {
            "intermediates": {"big": (f32(1.0),)},
            "other": {
                "big": (f32(2.0), np.array([7.0, 8.0], f32)),
                "solo": (f32(3.0),),
            },
        }
        assert_trees_close(found, want)
    _, tags = fx.handle(_one_name_two_collections, fx.Tag(), fx.Tag("other"))(x)
    assert_trees_close(found, tags)


def test_inputs_for_a_name_a_handler_sees_in_two_collections_are_refused():
    with pytest.raises(
        ValueError,
        match="_EveryTag.*'big'.*collection 'intermediates'.*collection 'other'",
    ):
        fx.handle(_one_name_two_collections, _EveryTag({"big": (1.0,)}))(1.0)
    shifted = _EveryTag({"solo": (jnp.float32(0.5),)})
    _, found = fx.handle(_one_name_two_collections, shifted)(jnp.float32(1.0))
    assert_trees_close(found["other"]["solo"], (np.float32(3.5),))


class _Scaled(fx.Handler):
    w: Any = dataclasses.field(default=None, metadata={"static": True})

    def apply(self, site, value, ctx):
        return value * self.w


@pytest.mark.parametrize("w", [jnp.float32(7.0), np.ones(3)])
def test_an_array_in_a_static_field_is_refused_naming_the_field(w):
    # It worked once, then failed inside JAX's comparison of tree structures,
    # naming neither the handler nor the field.
    f = lambda x: fx.tag(x, "h")  # noqa: E731
    for _ in range(2):
        with pytest.raises(
            TypeError, match=r"_Scaled\.w is a static field holding an array"
        ):
            fx.handle(f, _Scaled(w))(jnp.ones(3))
    assert_trees_close(
        fx.handle(f, _Scaled(2.0))(jnp.ones(3))[0], np.full(3, 2.0, np.float32)
    )


def test_reports_of_different_shapes_in_two_branches_name_the_handler():
    sizes = iter([4, 3])

    class Grows(fx.Handler):
        mode = "append"

        def apply(self, site, value, ctx):
            ctx.emit(jnp.zeros(next(sizes)))  # one size per branch traced
            return value

    def f(x, p):
        return lax.cond(p, lambda x: fx.tag(x, "h"), lambda x: fx.tag(x + 1, "h"), x)

    with pytest.raises(
        ValueError,
        match="Grows reports float32\\[4\\] at tag 'h'.* float32\\[3\\] in another",
    ):
        fx.handle(f, Grows())(jnp.ones(3), jnp.array(True))
