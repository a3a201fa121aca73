"""Group 12: a GPT-2-small-shaped Equinox model (124M parameters: 12 blocks,
width 768, 12 heads, MLP 3072, vocabulary 50257, 128 tokens; random weights,
built here), tagged by `fx.tag_modules` (every submodule's output, 111 tags),
against HAND-WRITTEN code doing the same thing: a variant of the model that
returns its intermediate values itself, computes their statistics itself, adds
explicit zero deltas at each module's output and differentiates with respect to
them, checks them for NaN and Inf itself, or patches them itself.

The model comes in two forms with the same weights: a Python list of blocks
(`list`), and one block with stacked weights run by `lax.scan` (`scan`; built
as `eqx.filter_vmap` builds it; its tags are inside the scan, reported
stacked).
Measured, for each form, A (effects) against B (hand-written):

- the first call (trace, lower, compile, run, with a model of a new structure
  every round, so no cache helps) and the steady state of
  `fx.handle(model, fx.Tag())`, `fx.Stats()` and
  `fx.intermediate_grads(loss, kind="tag")`, on a batch of 2 sequences through
  `jax.vmap` (the position embedding's tag included: a value the batch does
  not change);
- `fx.find_nonfinite(loss, model, tokens)`, forward and `backward=True`: the
  first call, and the second against a held `jax.jit` of the same check
  written by hand (the second call must not compile: counted). Backward, the
  position embedding is not tagged: `find_nonfinite(backward=True)` refuses a
  tag the loss's `vmap` does not batch;
- one activation patch, one sequence: the middle block's residual stream
  replaced by the clean run's (list: `fx.Substitute`, `fx.Intervene`; scan:
  `fx.Perturb` with deltas stacked over the scan, zero but at that layer, and
  `fx.Intervene` with a function of the value and `at`, whose `at[1]` is the
  layer);
- a grid of 96 patches (12 layers x 8 positions) with `fx.Intervene`, in
  chunks: `jax.lax.map(one_patch, patches, batch_size=8)`.

Then, for the list form, the grid's time and temporary memory (XLA's
`memory_analysis().temp_size_in_bytes`) for several chunk sizes, and a Python
loop of one jitted patch.

Every handled result is first checked against the hand-written one. Targets:
steady state at most 1.03x the hand-written code, first call at most 1.15x,
`find_nonfinite`'s second call at most 1.1x a held jit.

Run with `python benchmarks/bench_gpt.py [--append FILE] [--quick]`; `--quick`
uses a small model (2 blocks, width 64, vocabulary 512, 32 tokens). The full
size takes about 20 minutes on a 2-core CPU. `--smoke` runs a tiny model once
(2 blocks, width 16, 8 tokens), without the first-call rows and with one chunk
size in the grid's table.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _timing import (
    Row,
    arguments,
    blocking,
    compare,
    compare_cold,
    emit,
    heading,
    nbytes,
    plain_dicts,
    ratio_row,
    seconds,
    table,
)

import effects as fx


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 12
    width: int = 768
    heads: int = 12
    vocab: int = 50257
    context: int = 1024  # rows of the position embedding, as GPT-2's
    tokens: int = 128
    batch: int = 2
    positions: int = 8  # patched positions in the grid: the last ones


FULL = Config()
QUICK = Config(layers=2, width=64, heads=4, vocab=512, context=64, tokens=32)
SMOKE = Config(layers=2, width=16, heads=2, vocab=64, context=16, tokens=8, positions=4)
CHUNK = 8  # the grid's chunk size in the side-by-side rows

#
# The model. `hand`, when given, is the hand-written side: it is called on
# every module's output, with the name `tag_modules` gives it, and returns the
# value to go on with (see `Hand`). Left out (as `tag_modules`' copy calls it),
# the model is the plain model.
#


def _keep(hand, name, value):
    return value if hand is None else hand(name, value)


class Linear(eqx.Module):
    weight: jax.Array  # (in, out)
    bias: jax.Array

    def __call__(self, x):
        return x @ self.weight + self.bias


class LayerNorm(eqx.Module):
    weight: jax.Array
    bias: jax.Array

    def __call__(self, x):
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * self.weight + self.bias


class Embedding(eqx.Module):
    weight: jax.Array

    def __call__(self, ids):
        return self.weight[ids]


class Attention(eqx.Module):
    c_attn: Linear
    c_proj: Linear
    heads: int = eqx.field(static=True)

    def __call__(self, x, hand=None, path=""):
        (t, d), h = x.shape, self.heads
        qkv = _keep(hand, f"{path}.c_attn", self.c_attn(x))
        q, k, v = (a.reshape(t, h, d // h) for a in jnp.split(qkv, 3, axis=-1))
        scores = jnp.einsum("thd,shd->hts", q, k) / np.sqrt(d // h)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        y = jnp.einsum("hts,shd->thd", jax.nn.softmax(scores, -1), v)
        return _keep(hand, f"{path}.c_proj", self.c_proj(y.reshape(t, d)))


class MLP(eqx.Module):
    c_fc: Linear
    c_proj: Linear

    def __call__(self, x, hand=None, path=""):
        h = jax.nn.gelu(_keep(hand, f"{path}.c_fc", self.c_fc(x)))
        return _keep(hand, f"{path}.c_proj", self.c_proj(h))


class Block(eqx.Module):
    ln_1: LayerNorm
    attn: Attention
    ln_2: LayerNorm
    mlp: MLP

    def __call__(self, x, hand=None, path=""):
        def keep(name, value):
            return _keep(hand, f"{path}.{name}", value)

        a = self.attn(keep("ln_1", self.ln_1(x)), hand, f"{path}.attn")
        x = x + keep("attn", a)
        m = self.mlp(keep("ln_2", self.ln_2(x)), hand, f"{path}.mlp")
        return x + keep("mlp", m)


class GPT(eqx.Module):
    wte: Embedding
    wpe: Embedding
    blocks: list | Block  # a list of blocks, or one with stacked weights
    ln_f: LayerNorm
    # A new value every round of the first-call rows: a new structure, so
    # neither `eqx.filter_jit` nor `fx.handle` reuses work.
    salt: int = eqx.field(static=True, default=0)

    def __call__(self, tokens, hand=None):  # (T,) -> logits (T, vocab)
        h = _keep(hand, "wte", self.wte(tokens))
        h = h + _keep(hand, "wpe", self.wpe(jnp.arange(tokens.shape[0])))
        if isinstance(self.blocks, list):
            for i, block in enumerate(self.blocks):
                if hand is not None:
                    hand.layer = i
                h = _keep(hand, f"blocks.{i}", block(h, hand, f"blocks.{i}"))
        else:
            dynamic, static = eqx.partition(self.blocks, eqx.is_array)

            def step(h, d, hand):
                return _keep(hand, "blocks", eqx.combine(d, static)(h, hand, "blocks"))

            if hand is None:
                h = jax.lax.scan(lambda h, d: (step(h, d, None), None), h, dynamic)[0]
            else:
                h = hand.scan(step, h, dynamic)
        h = _keep(hand, "ln_f", self.ln_f(h))
        return h @ self.wte.weight.T  # tied, as GPT-2's


def build(cfg: Config) -> tuple[GPT, GPT]:
    """The list and scan forms, with the same weights (GPT-2's initialisation:
    normal weights, zero biases; drawn by NumPy, which is fast at this size)."""
    rng = np.random.default_rng(0)
    n, d, f = cfg.layers, cfg.width, 4 * cfg.width

    def normal(*shape, std=0.02):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * std)

    def linear(n_in, n_out):
        return Linear(normal(n, n_in, n_out), jnp.zeros((n, n_out)))

    def norm(*stack):
        return LayerNorm(jnp.ones((*stack, d)), jnp.zeros((*stack, d)))

    stacked = Block(
        norm(n),
        Attention(linear(d, 3 * d), linear(d, d), cfg.heads),
        norm(n),
        MLP(linear(d, f), linear(f, d)),
    )
    dynamic, static = eqx.partition(stacked, eqx.is_array)
    listed = [
        eqx.combine(jax.tree.map(lambda a: a[i], dynamic), static) for i in range(n)
    ]
    wte = Embedding(normal(cfg.vocab, d))
    wpe = Embedding(normal(cfg.context, d, std=0.01))
    return GPT(wte, wpe, listed, norm()), GPT(wte, wpe, stacked, norm())


_salts = itertools.count(1)


def fresh(model: GPT) -> GPT:
    return dataclasses.replace(model, salt=next(_salts))


#
# The hand-written side
#


class Hand:
    """At each module output, `at(name, value, input, layer)` returns the value
    to go on with and what to keep of it (None: nothing); `input` is
    `inputs.get(name)` (for names inside the scan, that iteration's slice) and
    `layer` the block's index (traced inside the scan). `kept` holds what was
    kept, `order` the names in execution order (the scan's body once)."""

    def __init__(self, at, inputs=None, layer=None):
        self.at, self.inputs, self.layer = at, inputs or {}, layer
        self.kept, self.order = {}, []

    def __call__(self, name, value):
        value, kept = self.at(name, value, self.inputs.get(name), self.layer)
        self.order.append(name)
        if kept is not None:
            self.kept[name] = kept
        return value

    def scan(self, step, h, dynamic):
        inner_inputs = {n: v for n, v in self.inputs.items() if _in_scan(n)}
        layers = jnp.arange(jax.tree.leaves(dynamic)[0].shape[0])
        order = []

        def body(h, xs):
            d, inputs, layer = xs
            inner = Hand(self.at, inputs, layer)
            h = step(h, d, inner)
            order[:] = inner.order
            return h, inner.kept

        h, kept = jax.lax.scan(body, h, (dynamic, inner_inputs, layers))
        self.order.append(tuple(order))  # one entry: the body, per iteration
        self.kept.update(kept)
        return h


def _in_scan(name: str) -> bool:
    return name.split(".")[0] == "blocks"


def hand_run(at, model, tokens, inputs=None):
    """`(logits, kept, order)` of one sequence."""
    hand = Hand(at, inputs)
    return model(tokens, hand), hand.kept, hand.order


def as_found(kept):
    return {"intermediates": {name: (v,) for name, v in kept.items()}}


def _collect(name, value, _, __):
    return value, value


def _stats(name, value, _, __):
    return value, leaf_stats(value)


def leaf_stats(x, axis=None):
    """What `fx.Stats()` keeps of one example's value, written out as a careful
    hand would: over the axes `axis` (None: all), plain reductions where every
    value is finite, and the masked ones, in a cond, where one is not."""
    n = int(np.prod([x.shape[a] for a in (range(x.ndim) if axis is None else axis)]))
    mean = jnp.sum(x, axis) / n
    centred = x - (mean if axis is None else jnp.expand_dims(mean, axis))
    zero = jnp.zeros(mean.shape, jnp.int32)
    plain = {
        "mean": mean,
        "std": jnp.sqrt(jnp.sum(centred**2, axis) / n),
        "min": jnp.min(x, axis),
        "max": jnp.max(x, axis),
        "mean_abs": jnp.sum(jnp.abs(x), axis) / n,
        "nan_count": zero,
        "inf_count": zero,
    }
    clean = jnp.all(jnp.isfinite(jnp.stack([plain[k] for k in list(plain)[:5]])))
    return jax.lax.cond(clean, lambda: plain, lambda: _masked_stats(x, axis))


def _masked_stats(x, axis):
    finite = jnp.isfinite(x)
    count = jnp.sum(finite, axis)
    n = jnp.maximum(count, 1)
    mean = jnp.sum(x, axis, where=finite) / n
    centred = x - (mean if axis is None else jnp.expand_dims(mean, axis))

    def some(v):
        return jnp.where(count > 0, v, jnp.nan)

    return {
        "mean": some(mean),
        "std": some(jnp.sqrt(jnp.sum(centred**2, axis, where=finite) / n)),
        "min": some(jnp.min(x, axis, initial=jnp.inf, where=finite)),
        "max": some(jnp.max(x, axis, initial=-jnp.inf, where=finite)),
        "mean_abs": some(jnp.sum(jnp.abs(x), axis, where=finite) / n),
        "nan_count": jnp.sum(jnp.isnan(x), axis, dtype=jnp.int32),
        "inf_count": jnp.sum(jnp.isinf(x), axis, dtype=jnp.int32),
    }


def _add(name, value, delta, _):
    return (value if delta is None else value + delta), None


def _replace(name, value, new, _):
    return (value if new is None else new), None


def hand_collect(at):
    """By hand: the batch's logits and what `at` keeps, as `fx.handle`
    reports it (batch axes first)."""

    def run(model, tokens):
        logits, kept = jax.vmap(lambda t: hand_run(at, model, t)[:2])(tokens)
        return logits, as_found(kept)

    return run


def loss_of(logits, tokens):
    """Next-token cross-entropy, averaged over the batch and positions."""
    logits, targets = logits[:, :-1], tokens[:, 1:]
    picked = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)


def loss(model, tokens):
    return loss_of(jax.vmap(model)(tokens), tokens)


def batched(model, tokens):
    return jax.vmap(model)(tokens)


def site_shapes(model, tokens):
    """The shape of every module output of one sequence (stacked over the
    scan), and the names in execution order (the scan's body as one tuple)."""
    order = []

    def run():
        _, kept, names = hand_run(_collect, model, tokens[0])
        order.extend(names)
        return kept

    return jax.eval_shape(run), order


def hand_whole_stats(scanned):
    """By hand: the batch's logits and the statistics of every module output
    over the whole batch (per scan iteration inside the scan)."""

    def run(model, tokens):
        logits, found = hand_collect(_collect)(model, tokens)
        stats = {}
        for n, (v,) in found["intermediates"].items():
            # (batch, layers, ...) inside the scan: statistics per layer
            per_layer = scanned and _in_scan(n)
            axis = tuple(a for a in range(v.ndim) if a != 1) if per_layer else None
            stats[n] = leaf_stats(v, axis)
        return logits, as_found(stats)

    return run


def hand_grads(names):
    """By hand: the loss and its gradients with respect to zero deltas added at
    the outputs of `names`."""

    def run(model, tokens):
        shapes, _ = site_shapes(model, tokens)
        deltas = {
            n: jnp.zeros((len(tokens), *s.shape), s.dtype)
            for n, s in shapes.items()
            if n in names
        }

        def loss_at(deltas):
            def one(t, d):
                return hand_run(_add, model, t, d)[0]

            return loss_of(jax.vmap(one)(tokens, deltas), tokens)

        value, grads = jax.value_and_grad(loss_at)(deltas)
        return value, {n: (g,) for n, g in grads.items()}

    return run


def _in_order(good, order):
    """`good` (one flag per name, per scan iteration inside the scan) as one
    flag per execution, in execution order."""
    parts = []
    for entry in order:
        if isinstance(entry, tuple):  # the scan's body: iteration by iteration
            parts.append(jnp.stack([good[n] for n in entry], 1).reshape(-1))
        else:
            parts.append(good[entry].reshape(1))
    return jnp.concatenate(parts)


def executions(order, layers):
    """`(name, scan iteration or None)` for each flag of `_in_order`."""
    out = []
    for entry in order:
        if isinstance(entry, tuple):
            out += [(n, i) for i in range(layers) for n in entry]
        else:
            out.append((entry, None))
    return out


def checked_order(model, tokens, names):
    """The execution order of `site_shapes`, only `names` in it."""
    order = site_shapes(model, tokens)[1]
    return [
        tuple(n for n in e if n in names) if isinstance(e, tuple) else e
        for e in order
        if isinstance(e, tuple) or e in names
    ]


def hand_check(backward: bool, names):
    """By hand, what `fx.find_nonfinite(loss, model, tokens)` checks: the
    index in `executions` of the first execution whose value holds a NaN or an
    Inf; with `backward`, when there is none, the number of executions plus
    the index of the last whose cotangent does (the first the backward pass
    computes); -1 when there is none. Only `names` are checked. Backward, one
    forward pass gives both the values' flags and the gradient."""

    def check(model, tokens):
        order = checked_order(model, tokens, names)
        scanned = any(isinstance(e, tuple) for e in order)

        def flag(name, value, delta, _):
            if name not in names:
                return value, None
            finite = jnp.all(jnp.isfinite(value))
            return (value if delta is None else value + delta), finite

        def run(deltas):
            def one(t, d):
                logits, kept, _ = hand_run(flag, model, t, d)
                return logits, kept

            logits, kept = jax.vmap(one)(tokens, deltas)
            return loss_of(logits, tokens), kept

        if backward:
            shapes, _ = site_shapes(model, tokens)
            deltas = {
                n: jnp.zeros((len(tokens), *s.shape), s.dtype)
                for n, s in shapes.items()
                if n in names
            }
            (_, kept), grads = jax.value_and_grad(run, has_aux=True)(deltas)
        else:
            kept = run({})[1]
        # Over the batch (and, for the gradients, every axis but the scan's).
        values = _in_order({n: jnp.all(f, 0) for n, f in kept.items()}, order)
        first = jnp.where(jnp.all(values), -1, jnp.argmin(values))
        if not backward:
            return first

        def good(n, g):
            keep = 1 if scanned and _in_scan(n) else None
            return jnp.all(jnp.isfinite(g), [a for a in range(g.ndim) if a != keep])

        cotangents = _in_order({n: good(n, g) for n, g in grads.items()}, order)
        last = 2 * len(cotangents) - 1 - jnp.argmin(cotangents[::-1])
        return jnp.where(first >= 0, first, jnp.where(jnp.all(cotangents), -1, last))

    return check


#
# Patching one sequence: `corrupt` differs from `clean` in its first token
#


def metric(logits, tokens):
    """How much the last position prefers the clean first token over the
    corrupted one (their ids: `PAIR`, set in `main`)."""
    return logits[-1, PAIR[0]] - logits[-1, PAIR[1]]


PAIR = [0, 0]  # (clean token, corrupted token), set in `main`


def run_metric(model, tokens):
    return metric(model(tokens), tokens)


def hand_metric(at):
    def run(model, tokens, inputs):
        return metric(hand_run(at, model, tokens, inputs)[0], tokens)

    return run


def _replace_where(layer, positions):
    """At the block outputs given an input: the input where the block is
    `layer` and the position one of `positions`'s true rows."""

    def at(name, value, new, i):
        if new is None:
            return value, None
        return jnp.where((i == layer) & positions[:, None], new, value), None

    return at


def grid_handled(form, cfg, batch_size):
    """The patch grid with effects: `jax.lax.map(one_patch, patches,
    batch_size=...)`, `cache` the clean run's residual streams (the blocks'
    outputs, as `fx.Tag()` reports them). The list form patches with
    `fx.Intervene` functions of the value; the scan form with one function of
    the value and `at`, whose `at[1]` is the scan iteration: the layer."""
    names = [f"blocks.{i}" for i in range(cfg.layers)]

    def grid(model, tokens, cache, layers, positions):
        def one(patch):
            layer, position = patch
            here = (jnp.arange(cfg.tokens) == position)[:, None]
            if form == "list":

                def patch_at(i, name):
                    def fn(value):
                        return jnp.where((i == layer) & here, cache[name], value)

                    return fn

                fns = {n: patch_at(i, n) for i, n in enumerate(names)}
            else:

                def fn(value, at):
                    clean = cache["blocks"][at[1]]
                    return jnp.where((at[1] == layer) & here, clean, value)

                fns = {"blocks": fn}
            return fx.handle(run_metric, fx.Intervene(fns))(model, tokens)[0]

        return jax.lax.map(one, (layers, positions), batch_size=batch_size)

    return grid


def grid_by_hand(cfg, batch_size):
    """The patch grid by hand, either form: the model patching its residual
    streams itself."""

    def grid(model, tokens, cache, layers, positions):
        def one(patch):
            layer, position = patch
            at = _replace_where(layer, jnp.arange(cfg.tokens) == position)
            return hand_metric(at)(model, tokens, cache)

        return jax.lax.map(one, (layers, positions), batch_size=batch_size)

    return grid


def jitted(fn, model, *args):
    """`fn(model, *args)` compiled with the model's arrays as arguments (as
    `eqx.filter_jit` does), and those arguments: `(compiled, arrays)`."""
    params, static = eqx.partition(model, eqx.is_array)
    run = jax.jit(lambda params, *args: fn(eqx.combine(params, static), *args))
    return run.lower(params, *args).compile(), (params, *args)


#
# Measuring
#

_compiles = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _, **__: _compiles.__setitem__(
        0, _compiles[0] + (event == "/jax/core/compile/backend_compile_duration")
    )
)


_start = time.perf_counter()


def log(what):
    """Progress, on stderr: the full size runs for many minutes."""
    print(
        f"[{time.perf_counter() - _start:7.1f} s] {what}", file=sys.stderr, flush=True
    )


def close(what, a, b, tol):
    def one(path, x, y):
        np.testing.assert_allclose(
            np.asarray(x, np.float64),
            np.asarray(y, np.float64),
            rtol=tol,
            atol=tol * (1 + float(np.max(np.abs(np.asarray(y, np.float64))))),
            err_msg=f"{what}: {jax.tree_util.keystr(path)}",
        )

    jax.tree_util.tree_map_with_path(one, a, b)


def same_found(what, found, by_hand, tol):
    names = found["intermediates"], by_hand["intermediates"]
    assert set(names[0]) == set(names[1]), (what, set(names[0]) ^ set(names[1]))
    # (`Stats()` keeps an `fx.Statistics` per leaf, the hand-written side a dict)
    close(what, plain_dicts(names[0]), plain_dicts(names[1]), tol)


class Measure:
    """The rows of one form of the model."""

    def __init__(self, form, plain, cfg, tokens, repeats, cold):
        self.form, self.plain, self.cfg, self.tokens = form, plain, cfg, tokens
        self.repeats, self.cold = repeats, cold
        # Rounds for the rows with a backward pass, three times as slow.
        self.heavy = ((repeats + 1) // 2, (cold + 1) // 2)
        self.tagged = fx.tag_modules(plain)
        self.no_wpe = functools.partial(
            fx.tag_modules, filter=lambda path, _: path != "wpe"
        )
        self.rows: list[Row] = []

    def label(self, what):
        return f"{self.form}: {what}"

    def steady(self, what, a, b, limit: float | None = 1.03, repeats=None, warmup=1):
        log(self.label(f"{what}, steady"))
        for _ in range(warmup):
            a(), b()
        before = _compiles[0]  # (after the warm-up, which may compile)
        pair = compare(a, b, repeats=repeats or self.repeats, warmup=0)
        if _compiles[0] != before:  # then it is not the steady state
            what += f" ({_compiles[0] - before} compilations!)"
        target = "—" if limit is None else f"≤ {limit:g}"
        target += "" if limit in (None, 1.03, 1.1) else " †"
        self.rows.append(ratio_row(self.label(f"{what}, steady"), pair, limit, target))

    def first(self, what, make_a, make_b, repeats=None):
        if not self.cold:  # a smoke run
            return
        log(self.label(f"{what}, first call"))
        pair = compare_cold(make_a, make_b, repeats=repeats or self.cold, warmup=0)
        self.rows.append(ratio_row(self.label(f"{what}, first call"), pair, 1.15))

    def collected(self, name, handler, at, tol):
        """`fx.handle(model, handler)` on a batch (`jax.vmap`) against the model
        keeping, by hand, what `at` keeps."""
        run, tagged, tokens = fx.handle(batched, handler), self.tagged, self.tokens
        by_hand = eqx.filter_jit(hand_collect(at))
        (out_a, found_a), (out_b, found_b) = (
            run(tagged, tokens),
            by_hand(self.plain, tokens),
        )
        close(f"{name}: logits", out_a, out_b, 1e-5)
        same_found(name, found_a, found_b, tol)
        self.first(
            name,
            lambda: blocking(
                fx.handle(batched, handler), fx.tag_modules(fresh(self.plain)), tokens
            ),
            lambda: blocking(
                eqx.filter_jit(hand_collect(at)), fresh(self.plain), tokens
            ),
        )
        self.steady(
            name, blocking(run, tagged, tokens), blocking(by_hand, self.plain, tokens)
        )

    def whole_stats(self):
        """`Stats(per_example=False)`: statistics over the whole batch, one
        set per execution (per scan iteration inside the scan), against the
        same by hand and against the plain model; and `Stats()`, per example,
        against the plain model."""
        name = "`Stats(per_example=False)`"
        tagged, tokens, plain = self.tagged, self.tokens, self.plain
        run = fx.handle(batched, fx.Stats(per_example=False))
        scanned = self.form == "scan"
        by_hand = eqx.filter_jit(hand_whole_stats(scanned))
        (out_a, found_a), (out_b, found_b) = run(tagged, tokens), by_hand(plain, tokens)
        close(f"{name}: logits", out_a, out_b, 1e-5)
        same_found(name, found_a, found_b, 1e-4)
        self.steady(
            name, blocking(run, tagged, tokens), blocking(by_hand, plain, tokens)
        )
        model = eqx.filter_jit(batched)
        self.steady(
            f"{name} vs the plain model",
            blocking(run, tagged, tokens),
            blocking(model, plain, tokens),
            limit=1.1,
        )
        per_example = fx.handle(batched, fx.Stats())
        self.steady(
            "`Stats()` (per example) vs the plain model",
            blocking(per_example, tagged, tokens),
            blocking(model, plain, tokens),
            limit=None,
        )

    def grads(self):
        name = '`intermediate_grads(kind="tag")`'
        tagged, tokens = self.tagged, self.tokens
        names = set(site_shapes(self.plain, tokens)[0])  # `wpe` included
        run = fx.intermediate_grads(loss, kind="tag")
        by_hand = eqx.filter_jit(hand_grads(names))
        (va, ga), (vb, gb) = run(tagged, tokens), by_hand(self.plain, tokens)
        close(f"{name}: loss", va, vb, 1e-5)
        same_found(name, {"intermediates": ga}, {"intermediates": gb}, 1e-4)
        self.first(
            name,
            lambda: blocking(
                fx.intermediate_grads(loss, kind="tag"),
                fx.tag_modules(fresh(self.plain)),
                tokens,
            ),
            lambda: blocking(
                eqx.filter_jit(hand_grads(names)), fresh(self.plain), tokens
            ),
            repeats=self.heavy[1],
        )
        self.steady(
            name,
            blocking(run, tagged, tokens),
            blocking(by_hand, self.plain, tokens),
            repeats=self.heavy[0],
        )

    def nonfinite(self, backward):
        """`find_nonfinite`. Backward, without the position embedding's tag:
        `find_nonfinite(backward=True)` refuses a tag the loss's `vmap` does not
        batch."""
        name = f"`find_nonfinite(backward={backward})`"
        tokens, plain = self.tokens, self.plain
        names = set(site_shapes(plain, tokens)[0]) - ({"wpe"} if backward else set())
        tag = self.no_wpe if backward else fx.tag_modules
        where = executions(checked_order(plain, tokens, names), self.cfg.layers)
        check = eqx.filter_jit(hand_check(backward, names))

        def by_hand(model):
            i = int(check(model, tokens))
            return None if i < 0 else (*where[i % len(where)], i >= len(where))

        def handled(model):
            bad = fx.find_nonfinite(loss, tag(model), tokens, backward=backward)
            return None if bad is None else (bad.name, bad.iteration, bad.backward)

        assert handled(plain) is None and by_hand(plain) is None, name
        # A NaN in block 1's MLP weight: both name the same execution.
        if self.form == "list":
            bad = eqx.tree_at(
                lambda m: m.blocks[1].mlp.c_fc.weight,
                plain,
                replace_fn=lambda w: w.at[0, 0].set(jnp.nan),
            )
        else:
            bad = eqx.tree_at(
                lambda m: m.blocks.mlp.c_fc.weight,
                plain,
                replace_fn=lambda w: w.at[1, 0, 0].set(jnp.nan),
            )
        found = handled(bad), by_hand(bad)
        assert found[0] == found[1] is not None, (name, found)

        def first_handled():
            model = tag(fresh(plain))
            return lambda: fx.find_nonfinite(loss, model, tokens, backward=backward)

        def first_by_hand():
            fresh_check, model = (
                eqx.filter_jit(hand_check(backward, names)),
                fresh(plain),
            )
            return lambda: int(fresh_check(model, tokens))

        heavy = self.heavy if backward else (None, None)
        self.first(name, first_handled, first_by_hand, repeats=heavy[1])
        tagged = tag(plain)
        fx.find_nonfinite(loss, tagged, tokens, backward=backward)
        before = _compiles[0]
        fx.find_nonfinite(loss, tagged, tokens, backward=backward)
        compiled = _compiles[0] - before
        self.rows.append(
            Row(
                self.label(f"{name}, second call: compilations"),
                str(compiled),
                "0",
                "—",
                "0",
                compiled == 0,
            )
        )
        self.steady(
            f"{name}, second call vs a held jit",
            lambda: fx.find_nonfinite(loss, tagged, tokens, backward=backward),
            lambda: int(check(plain, tokens)),
            limit=1.1,
            repeats=heavy[0],
        )

    def patches(self, clean, corrupt):
        """One patch, on one sequence: the middle block's residual stream
        replaced by the clean run's at every position."""
        cfg, tagged, plain = self.cfg, self.tagged, self.plain
        k = cfg.layers // 2
        clean_cache = residuals(tagged, clean)
        corrupt_cache = residuals(tagged, corrupt)
        every = jnp.ones(cfg.tokens, bool)
        by_hand = eqx.filter_jit(hand_metric(_replace_where(k, every)))
        if self.form == "list":
            name = f"blocks.{k}"
            value = clean_cache[name]
            inputs = {name: value}
            substitute = lambda: fx.handle(  # noqa: E731
                run_metric, fx.Substitute({name: value})
            )(tagged, corrupt)[0]
            intervene = fx.handle(run_metric, fx.Intervene({name: lambda _: value}))
            handled = {
                f"one patch, `Substitute` ({name})": substitute,
                f"one patch, `Intervene` ({name})": lambda: intervene(tagged, corrupt)[
                    0
                ],
            }
        else:
            stack = clean_cache["blocks"]
            inputs = {"blocks": stack}
            delta = (
                jnp.zeros_like(stack).at[k].set(stack[k] - corrupt_cache["blocks"][k])
            )
            perturb = fx.handle(
                run_metric, fx.Perturb({"blocks": (delta,)}, kind="tag")
            )

            def layer_k(value, at):
                return jnp.where(at[1] == k, stack[k], value)

            intervene = fx.handle(run_metric, fx.Intervene({"blocks": layer_k}))
            handled = {
                f"one patch, `Perturb` deltas (blocks, layer {k})": lambda: perturb(
                    tagged, corrupt
                )[0],
                f"one patch, `Intervene(fn(v, at))` (blocks, layer {k})": lambda: (
                    intervene(tagged, corrupt)[0]
                ),
            }
        want = by_hand(plain, corrupt, inputs)
        if self.unrolled is not None:  # the scan form: the same weights unrolled
            unrolled = hand_metric(_replace)(
                self.unrolled, corrupt, {f"blocks.{k}": clean_cache["blocks"][k]}
            )
            close("one patch, unrolled", want, unrolled, 1e-3)
        for what, run in handled.items():
            close(what, run(), want, 1e-3)
            self.steady(
                what,
                lambda run=run: jax.block_until_ready(run()),
                blocking(by_hand, plain, corrupt, inputs),
            )

    def grid(self, corrupt, clean_cache, repeats):
        """The chunked grid, against the same grid by hand."""
        args = grid_args(self.cfg, clean_cache, corrupt)
        a, a_args = jitted(grid_handled(self.form, self.cfg, CHUNK), self.tagged, *args)
        b, b_args = jitted(grid_by_hand(self.cfg, CHUNK), self.plain, *args)
        got = a(*a_args)
        close("grid", got, b(*b_args), 1e-3)
        # The grid's last patch: the last block at the last patched position.
        layer, position = int(args[-2][-1]), int(args[-1][-1])
        at = _replace_where(layer, jnp.arange(self.cfg.tokens) == position)
        close(
            "grid's last patch", got[-1], hand_metric(at)(self.plain, *args[:2]), 1e-3
        )
        self.steady(
            f"grid of {len(args[-1])} patches, chunks of {CHUNK}",
            blocking(a, *a_args),
            blocking(b, *b_args),
            repeats=repeats,
            warmup=0,
        )
        return got


def residuals(tagged, tokens):
    """Every tagged value of one sequence, one entry per name."""
    found = fx.handle(tagged, fx.Tag())(tokens)[1]["intermediates"]
    return {n: v[0] for n, v in found.items()}


def grid_args(cfg, cache, corrupt):
    """The grid's arguments after the model: the corrupted tokens, the clean
    run's residual streams (the blocks' outputs), and the (layer, position) of
    every patch, layer-major; positions evenly spaced, ending at the last."""
    step = cfg.tokens // cfg.positions
    positions = np.arange(cfg.positions) * step + step - 1
    layers, positions = np.meshgrid(np.arange(cfg.layers), positions, indexing="ij")
    return (
        corrupt,
        {n: v for n, v in cache.items() if re.fullmatch(r"blocks(\.\d+)?", n)},
        jnp.asarray(layers.reshape(-1)),
        jnp.asarray(positions.reshape(-1)),
    )


def chunk_sizes(plain, cfg, clean, corrupt, sizes, reference):
    """The list form's grid for each chunk size: time and temporary memory
    with effects, temporary memory by hand; and a Python loop of one jitted
    patch. `reference`: the grid's values, as measured before."""
    tagged = fx.tag_modules(plain)
    args = grid_args(cfg, residuals(tagged, clean), corrupt)
    n = len(args[-1])
    lines = [
        heading(
            f"12c. Patch grid, {n} patches ({cfg.layers} layers x {cfg.positions} "
            f"positions, one sequence of {cfg.tokens} tokens), list form: "
            "`jax.lax.map(one_patch, patches, batch_size=k)`"
        ),
        "",
        "| chunk size k | time, effects | temp memory, effects "
        "| temp memory, by hand |",
        "|---|---|---|---|",
    ]
    for k in sizes:
        log(f"grid, chunks of {k}")
        compiled, call_args = jitted(grid_handled("list", cfg, k), tagged, *args)
        start = time.perf_counter()
        got = jax.block_until_ready(compiled(*call_args))
        elapsed = time.perf_counter() - start
        close(f"grid, chunks of {k}", got, reference, 1e-3)
        temp = compiled.memory_analysis().temp_size_in_bytes
        del compiled
        by_hand, _ = jitted(grid_by_hand(cfg, k), plain, *args)
        hand_temp = by_hand.memory_analysis().temp_size_in_bytes
        del by_hand
        label = f"{k} (one `vmap`)" if k == n else f"{k}"
        lines.append(
            f"| {label} | {seconds(elapsed)} | {nbytes(temp)} | {nbytes(hand_temp)} |"
        )

    # What one writes first: a Python loop over one jitted patch.
    log("grid, a Python loop of one jitted patch")
    one, one_args = jitted(
        lambda m, t, c, layer, position: grid_handled("list", cfg, 1)(
            m, t, c, layer[None], position[None]
        )[0],
        tagged,
        *args[:2],
        args[2][0],
        args[3][0],
    )
    start = time.perf_counter()
    got = [one(one_args[0], *args[:2], la, po) for la, po in zip(args[2], args[3])]
    got = jax.block_until_ready(jnp.stack(got))
    elapsed = time.perf_counter() - start
    close("grid, Python loop", got, reference, 1e-3)
    temp = one.memory_analysis().temp_size_in_bytes
    lines.append(
        f"| a Python loop of {n} jitted single patches | {seconds(elapsed)} "
        f"| {nbytes(temp)} | — |"
    )
    return "\n".join(lines) + "\n"


def main():
    args = arguments(__doc__.splitlines()[0])
    cfg = SMOKE if args.smoke else QUICK if args.quick else FULL
    # Steady-state rounds, first-call rounds; halved for the backward passes.
    # A smoke run makes no first-call rows: they check no value, and each is
    # two compilations of a model that the other rows compile already.
    repeats, cold = (1, 0) if args.smoke else (3, 1) if args.quick else (5, 3)
    listed, scanned = build(cfg)
    tokens = jax.random.randint(
        jax.random.key(1), (cfg.batch, cfg.tokens), 0, cfg.vocab
    )
    clean = tokens[0]
    corrupt = clean.at[0].set((clean[0] + 1) % cfg.vocab)
    PAIR[:] = [int(clean[0]), int(corrupt[0])]
    log("the two forms")
    close("list vs scan", batched(listed, tokens), batched(scanned, tokens), 1e-4)

    grids = {}
    for form, plain, part in (("list", listed, "a"), ("scan", scanned, "b")):
        m = Measure(form, plain, cfg, tokens, repeats, cold)
        m.unrolled = listed if form == "scan" else None
        m.collected("`Tag()`", fx.Tag(), _collect, 1e-5)
        m.collected("`Stats()`", fx.Stats(), _stats, 1e-4)
        m.whole_stats()
        m.grads()
        m.nonfinite(backward=False)
        m.nonfinite(backward=True)
        m.patches(clean, corrupt)
        grids[form] = m.grid(corrupt, residuals(m.tagged, clean), 1)
        size = {FULL: "124M", QUICK: "small", SMOKE: "tiny"}[cfg]
        emit(
            table(
                f"12{part}. GPT-2-shaped Equinox model ({size}: {cfg.layers} blocks, "
                f"width {cfg.width}, {cfg.tokens} tokens, batch {cfg.batch}), "
                f"{form} form, `tag_modules` (A) vs hand-written (B)",
                ("A", "B"),
                m.rows,
            ),
            args,
        )
    close("grid, list vs scan", grids["list"], grids["scan"], 1e-3)
    n = cfg.layers * cfg.positions
    sizes = [CHUNK] if args.smoke else sorted({1, 4, 8, 16, n})
    emit(chunk_sizes(listed, cfg, clean, corrupt, sizes, grids["list"]), args)


if __name__ == "__main__":
    main()
