"""The optimizer chain: clipping by one scalar factor equals optax's clip, its AdamW update
writes no clipped copy of the gradients, weight decay spares the norm scales, the schedule warms up
then follows a cosine, and the first moment may be kept in bfloat16."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import small_config

from gspmd_tp.job.errors import UserError
from gspmd_tp.model.params import path_str
from gspmd_tp.train import optimizer, run_setup
from gspmd_tp.train import state as state_lib

TREE = {"w": jnp.linspace(-1.0, 1.0, 64 * 48).reshape(64, 48), "scale": jnp.arange(48.0) / 48}


@pytest.mark.parametrize("max_norm", [1e-3, 1.0, 1e6])  # clipping hard, a little, not at all
def test_clip_equals_optax(max_norm):
    ours, theirs = optimizer.clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
    assert jax.tree.structure(ours.init(TREE)) == jax.tree.structure(theirs.init(TREE))
    got, _ = ours.update(TREE, ours.init(TREE))
    want, _ = theirs.update(TREE, theirs.init(TREE))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-12)


def _passes_writing(tx, shape) -> int:
    """Fusions of the compiled clip + AdamW update whose output is a whole leaf of `shape`."""
    params = {"w": jnp.ones(shape), "norm": jnp.ones(shape[-1:])}

    def update(p, state, g):
        u, state = tx.update(g, state, p)
        return optax.apply_updates(p, u), state

    text = jax.jit(update).lower(params, tx.init(params), params).compile().as_text()
    out = f"f32[{','.join(map(str, shape))}]"
    return len(re.findall(rf"= {re.escape(out)}\{{[0-9,]*\}} fusion\(", text))


def test_the_update_writes_no_clipped_gradient(monkeypatch):
    """optax's clip writes the clipped gradient whole for the two moment updates to read; the
    scalar factor fuses into them: new first moment, second moment and parameter, three passes."""
    c = small_config().optim
    assert _passes_writing(optimizer.make_optimizer(c, 10)[0], (512, 256)) == 3
    monkeypatch.setattr(optimizer, "clip_by_global_norm", optax.clip_by_global_norm)
    assert _passes_writing(optimizer.make_optimizer(c, 10)[0], (512, 256)) == 4


@pytest.mark.parametrize(
    "saved, now, count, said",
    [
        # A constant rate: a new config.steps changes no step's rate, so nothing is said (it said
        # "step 3 trains at lr 3.000e-03, not 3.000e-03").
        ({"steps": 4, "optim.warmup_steps": 0, "optim.min_lr_ratio": 1.0}, {"steps": 6}, 2, None),
        # The decay stretched: from the next step on.
        ({"steps": 4, "optim.warmup_steps": 1}, {"steps": 6}, 2, 3),
        # Still warming up, the warmup unchanged: the first step whose rate differs is named, the
        # second after the warmup's end (the decay's first is its peak in both).
        ({"steps": 10, "optim.warmup_steps": 5}, {"steps": 20}, 2, 7),
    ],
)
def test_a_schedule_change_is_noted_at_the_first_step_whose_rate_differs(saved, now, count, said):
    before = small_config(**saved)
    config = small_config(**{**saved, **now})
    lines = []
    optimizer.note_schedule_change(before.to_dict(), config, count, count, lines.append)
    if said is None:
        assert lines == []
        return
    old = optimizer.make_schedule(before.optim, before.steps)(said - 1)
    new = optimizer.make_schedule(config.optim, config.steps)(said - 1)
    assert lines == [
        f"note: the learning-rate schedule differs from the one step {count} was trained on "
        f"(config.steps {before.steps} -> {config.steps}): step {said} trains at lr {float(new):.3e}, "
        f"not {float(old):.3e}"
    ]
    assert float(new) != pytest.approx(float(old), rel=1e-6)


def _adam_state(state):
    """The ScaleByAdamState inside make_optimizer's chain (clip, then AdamW's own chain)."""
    (adam,) = [s for s in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")]
    return adam


def test_a_bfloat16_first_moment_keeps_the_second_in_float32_and_updates_alike():
    """With no warmup the updates are lr-sized, not 0. The first uses the new first moment before
    AdamW stores it in bfloat16; the second reads the stored one, and its decayed copy b1 * mu is
    rounded to bfloat16 again: two roundings of 2^-8 relative each, which move an update of about
    lr by at most about 2^-7 * lr. Close to float32's within that, and not equal to it (the moment
    really was rounded)."""
    c = small_config(**{"optim.warmup_steps": 0}).optim
    tx32, _ = optimizer.make_optimizer(c, 10)
    c.mu_dtype = "bfloat16"
    tx16, _ = optimizer.make_optimizer(c, 10)
    state16, state32 = tx16.init(TREE), tx32.init(TREE)
    assert {x.dtype for x in jax.tree.leaves(_adam_state(state16).mu)} == {jnp.dtype("bfloat16")}
    assert {x.dtype for x in jax.tree.leaves(_adam_state(state16).nu)} == {jnp.dtype("float32")}
    params = TREE
    for i in range(2):
        grads = jax.tree.map(lambda x, i=i: jnp.sin(7 * x + i) + 0.1, params)
        got, state16 = tx16.update(grads, state16, params)
        want, state32 = tx32.update(grads, state32, params)
        assert _adam_state(state16).mu["w"].dtype == jnp.bfloat16 and got["w"].dtype == jnp.float32
        assert _adam_state(state16).nu["w"].dtype == jnp.float32
        # Adam moves each weight by up to about lr (m / sqrt(v) is sign(g) at the first step).
        assert np.abs(np.asarray(want["w"])).mean() > 0.5 * c.lr
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=2**-7 * c.lr)
        params = optax.apply_updates(params, want)
    assert not np.array_equal(np.asarray(got["w"]), np.asarray(want["w"]))


def test_a_bfloat16_first_moment_trains_as_float32_does_over_many_steps():
    """40 jit-compiled AdamW steps of least squares (w: 32 x 8) from the same start, the first
    moment in bfloat16 and in float32. One step's update differs by at most about 2^-7 * lr (the
    test above); the runs' gradients then drift apart a little too, so the weights may differ by
    n * lr * 2^-6 (0.0125 here, under 2% of the 0.7 they travel). A first moment that bfloat16
    broke (left at 0, mis-scaled) would miss by far more. mu stays bfloat16 and nu float32 after
    every step (no promotion in the update), and both runs cut the loss more than thirtyfold."""
    steps, lr = 40, 0.02
    x = jax.random.normal(jax.random.key(0), (64, 32))
    w_true = 0.3 * jax.random.normal(jax.random.key(1), (32, 8))
    y = x @ w_true
    loss = lambda p: jnp.mean((x @ p["w"] - y) ** 2)
    params0 = {"w": jnp.zeros((32, 8))}

    def train(mu_dtype):
        c = small_config(**{"optim.warmup_steps": 0, "optim.lr": lr, "optim.min_lr_ratio": 1.0}).optim
        c.weight_decay, c.mu_dtype = 0.0, mu_dtype
        tx, _ = optimizer.make_optimizer(c, steps)

        @jax.jit
        def step(p, s):
            value, g = jax.value_and_grad(loss)(p)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s, value

        p, s, losses = params0, tx.init(params0), []
        for _ in range(steps):
            p, s, value = step(p, s)
            losses.append(float(value))
            adam = _adam_state(s)
            assert adam.mu["w"].dtype == jnp.dtype(mu_dtype) and adam.nu["w"].dtype == jnp.float32
        return p, losses

    p16, losses16 = train("bfloat16")
    p32, losses32 = train("float32")
    assert losses32[-1] < losses32[0] / 30 and losses16[-1] < losses16[0] / 30
    assert np.abs(np.asarray(p32["w"])).max() > 0.5  # the weights travelled
    np.testing.assert_allclose(np.asarray(p16["w"]), np.asarray(p32["w"]), rtol=0, atol=steps * lr * 2**-6)
    np.testing.assert_allclose(losses16, losses32, rtol=0.02)


def _numpy_adamw(c, total_steps: int, params: dict, grad_of, steps: int) -> list[dict]:
    """The parameters after each of `steps` updates of AdamW as its paper writes it, in float64
    numpy, for config.optim `c`: the gradient scaled to a global norm of at most clip_norm; the
    moments m = b1 m + (1 - b1) g and v = b2 v + (1 - b2) g^2, bias-corrected; the update
    -lr_t (m_hat / (sqrt(v_hat) + eps) + weight_decay p), with no decay for leaves under a "norm";
    lr_t rising linearly from 0 over warmup_steps, then down a half cosine to lr * min_lr_ratio at
    total_steps. `grad_of(params)` gives each step's gradient."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    out = []
    for t in range(steps):
        g = {k: np.asarray(x, np.float64) for k, x in grad_of(p).items()}
        norm = math.sqrt(sum((x**2).sum() for x in g.values()))
        g = {k: x * min(1.0, c.clip_norm / norm) for k, x in g.items()}
        if t < c.warmup_steps:
            lr = c.lr * t / c.warmup_steps
        else:
            progress = (t - c.warmup_steps) / (total_steps - c.warmup_steps)
            end = c.lr * c.min_lr_ratio
            lr = end + (c.lr - end) * 0.5 * (1 + math.cos(math.pi * progress))
        for k in p:
            m[k] = c.b1 * m[k] + (1 - c.b1) * g[k]
            v2[k] = c.b2 * v2[k] + (1 - c.b2) * g[k] ** 2
            adam = (m[k] / (1 - c.b1 ** (t + 1))) / (np.sqrt(v2[k] / (1 - c.b2 ** (t + 1))) + c.eps)
            decay = 0.0 if "norm" in k else c.weight_decay
            p[k] = p[k] - lr * (adam + decay * p[k])
        out.append(dict(p))
    return out


def test_the_optimizer_is_adamw_as_its_paper_writes_it_over_a_warmup_and_the_cosine():
    """Six updates of the trainer's optimizer against _numpy_adamw: two warmup steps (the first at
    a rate of 0), then the cosine; clipping that bites on the early steps and not on the later
    ones; decay on the weights and not on the norm scale. A missing bias correction, a decayed
    norm scale, clipping per leaf or a schedule off by one step each miss by far more than 1e-5."""
    c = small_config().optim
    c.lr, c.warmup_steps, c.min_lr_ratio, c.weight_decay, c.clip_norm = 0.05, 2, 0.1, 0.1, 2.0
    total = 6
    tx, _ = optimizer.make_optimizer(c, total)
    params = {"w": jnp.linspace(-1.0, 1.0, 24).reshape(4, 6), "mlp_norm/scale": jnp.linspace(0.5, 1.5, 6)}
    # Least squares towards the start plus 0.2: the gradient shrinks as the weights approach it.
    target = {k: np.asarray(x, np.float64) + 0.2 for k, x in params.items()}
    grad_of = lambda p: {k: 4 * (np.asarray(x, np.float64) - target[k]) for k, x in p.items()}  # noqa: E731
    start, norms = params, []
    state, got = tx.init(params), []
    for _ in range(total):
        grads = {k: jnp.asarray(x, jnp.float32) for k, x in grad_of(params).items()}
        norms.append(float(optax.global_norm(grads)))
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        got.append(params)
    assert norms[0] > c.clip_norm > norms[-1]  # clipped at first, not at the end
    for k in start:  # the first update, at a rate of 0, moves nothing
        assert np.array_equal(np.asarray(got[0][k]), np.asarray(start[k])), k
    want = _numpy_adamw(c, total, start, grad_of, total)
    for step, (g, w) in enumerate(zip(got, want, strict=True), 1):
        for k in w:
            np.testing.assert_allclose(
                np.asarray(g[k]), w[k], rtol=1e-5, atol=1e-6, err_msg=f"{k}, step {step}"
            )
    assert not np.allclose(np.asarray(got[-1]["w"]), np.asarray(start["w"]), atol=0.05)  # it moved


def test_weight_decay_shrinks_every_weight_but_the_norm_scales():
    """The trainer's own optimizer (run_setup's) on the model's parameters, with zero gradients:
    Adam's part of the update is 0, so each weight moves by -lr * weight_decay * itself, and the
    norm scales (the only leaves optimizer.decay_mask exempts) do not move. With the mask dropped,
    the scales (all ones) would move by lr * weight_decay = 1e-3 and this would fail."""
    c = small_config(rules="dp", mesh="dp=8,mp=1")
    c.optim.lr, c.optim.weight_decay, c.optim.warmup_steps = 0.01, 0.1, 0  # first step at the peak
    s = run_setup.setup(c)
    state = state_lib.init_state(s.model_cfg, s.tx, s.mesh, s.rules, c.seq_len, c.seed)
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    updates, _ = jax.jit(s.tx.update)(zeros, state.opt_state, state.params)
    moved, kept = set(), set()
    for (path, param), update in zip(
        jax.tree_util.tree_leaves_with_path(state.params), jax.tree.leaves(updates), strict=True
    ):
        name, param, update = path_str(path), np.asarray(param), np.asarray(update)
        assert np.abs(param).max() > 0, name  # a leaf of zeros would hide a decay
        if np.any(update):
            np.testing.assert_allclose(update, -0.01 * 0.1 * param, rtol=1e-5, atol=0, err_msg=name)
            moved.add(name)
        else:
            kept.add(name)
    assert kept == {"final_norm/scale", "layers/attn_norm/scale", "layers/mlp_norm/scale"}
    assert {"embedding", "lm_head", "layers/attn/qkv", "layers/mlp/down"} <= moved


def test_the_schedule_warms_up_linearly_then_decays_along_a_cosine():
    """lr 1e-2, warmup 4 of 20 steps, down to a tenth: values worked out by hand from the
    formula lr * (min + (1 - min) * (1 + cos(pi * (t - 4) / 16)) / 2) after the warmup."""
    c = small_config(**{"optim.lr": 1e-2, "optim.warmup_steps": 4, "optim.min_lr_ratio": 0.1}).optim
    schedule = optimizer.make_schedule(c, 20)
    want = {
        0: 0.0,
        1: 2.5e-3,
        3: 7.5e-3,
        4: 1e-2,  # the peak
        8: 1e-3 + 9e-3 * (1 + math.cos(math.pi / 4)) / 2,  # a quarter of the way down the cosine
        12: 5.5e-3,  # half-way: the mean of peak and end
        20: 1e-3,  # the end, and beyond it
        30: 1e-3,
    }
    for step, lr in want.items():
        assert float(schedule(step)) == pytest.approx(lr, rel=1e-5, abs=1e-12), step


def test_a_warmup_as_long_as_the_run_still_reaches_the_peak():
    """make_schedule ends the warmup one step before the run's end, so the last step trains at the
    peak rather than the run never leaving the warmup."""
    c = small_config(**{"optim.lr": 1e-2, "optim.warmup_steps": 50}).optim
    schedule = optimizer.make_schedule(c, 5)
    assert [float(schedule(i)) for i in range(5)] == pytest.approx([0, 2.5e-3, 5e-3, 7.5e-3, 1e-2])


@pytest.mark.parametrize("key", ["mu_dtype", "grad_reduce_dtype"])
@pytest.mark.parametrize("value", ["bf16", "float16", ""])
def test_a_first_moment_or_reduction_dtype_it_does_not_take_is_one_line(key, value):
    c = small_config(**{f"optim.{key}": value}).optim
    with pytest.raises(
        UserError, match=rf"^config.optim.{key} must be one of float32, bfloat16, got '{value}'$"
    ):
        optimizer.check(c)
