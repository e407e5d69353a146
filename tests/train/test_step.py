"""The train step: it really shards; its loss is the mean over the batch's tokens and its update
AdamW's of that loss's gradient; gradient accumulation equals the full batch and reduces over data
parallelism once per step where parameters are replicated over it. The eval step counts no padding
row."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import loss_and_grads, small_config, token_batches
from shipped_rules import SHIPPED, mesh_for

from gspmd_tp.data import pipeline
from gspmd_tp.model.transformer import Transformer
from gspmd_tp.sharding import hlo
from gspmd_tp.train import run_setup
from gspmd_tp.train import state as state_lib
from gspmd_tp.train import step as step_lib


def test_compiled_step_really_shards():
    """Guards against constraints silently doing nothing: megatron_1d must all-reduce."""
    s = run_setup.setup(small_config(rules="megatron_1d", mesh="dp=2,mp=4"))
    hlo = step_lib.compile_train_step(s).as_text()
    assert "all-reduce" in hlo
    state = state_lib.init_state(s.model_cfg, s.tx, s.mesh, s.rules, 32, 0)
    qkv = state.params["layers"]["attn"]["qkv"]
    assert qkv.sharding.spec == s.rules.spec(("layers", "embed", "kv_heads", None, "head_dim"))
    assert qkv.addressable_shards[0].data.shape[2] == qkv.shape[2] // 4  # kv_heads over mp=4


def test_gradient_accumulation_equals_full_batch():
    """megatron_2d: the microbatches' gradients are summed in the layout of parameters split over
    both axes (test_trainer runs every rule file's full step against one device)."""
    c = small_config(rules="megatron_2d", mesh="dp=2,mp=4", batch_size=32)  # microbatches of 8 rows
    (loss1, grads1), (loss4, grads4) = loss_and_grads(c, [(1, 0), (4, 0)])
    np.testing.assert_allclose(float(loss4), float(loss1), rtol=1e-6)
    for g1, g4 in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads4), strict=True):
        np.testing.assert_allclose(np.asarray(g4), np.asarray(g1), rtol=1e-4, atol=1e-7)


def _plain_mean_loss(s):
    """jit-compiled (mean token loss, gradient) of setup `s`'s model on a batch (step.host_batch's,
    its documents masked apart), by optax's cross entropy on the whole batch's logits: the
    reference the step's own sums must agree with."""
    model = Transformer(s.model_cfg)

    def mean_loss(params, batch):
        tokens = batch["tokens"]
        documents = {"segment_ids_bl": batch["segment_ids"], "positions_bl": batch["positions"]}
        logits = model.apply({"params": params}, tokens[:, :-1], **documents).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return jax.jit(jax.value_and_grad(mean_loss))


@pytest.mark.parametrize("accum", [1, 4])
def test_the_loss_is_the_mean_over_the_batch_tokens_and_the_gradient_its_gradient(accum):
    """Each microbatch's loss sum is divided by the whole batch's tokens: a division by its own
    would make the loss (and gradient) `accum` times too large; a missing one, 16 x 32 times."""
    c = small_config(rules="megatron_1d", mesh="dp=2,mp=4", batch_size=16)
    ((loss, grads),) = loss_and_grads(c, [(accum, 0)])
    s = run_setup.setup(c)
    state = state_lib.init_state(s.model_cfg, s.tx, s.mesh, s.rules, c.seq_len, c.seed)
    with state_lib.sharding_context(s.mesh, s.rules):
        batch = jax.device_put(step_lib.host_batch(s, token_batches(c, 1)[0]), s.batch_sharding)
        want_loss, want_grads = _plain_mean_loss(s)(state.params, batch)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert 4 < float(want_loss) < 7  # about ln(256) = 5.5 at initialization: a per-token mean
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-7)


def test_the_train_step_applies_adamw_to_the_clipped_mean_gradient_at_the_rate_it_reports():
    """Two compiled steps (2 microbatches each, no warmup) against the same two updates composed
    here: mean-loss gradient, then the optimizer's update of it (clipping included), then applied.
    The reported rate is the schedule's at the update's own count (step 1 at the peak, step 2 a
    little down the cosine), and the reported norm the gradient's before clipping."""
    c = small_config(rules="megatron_1d", mesh="dp=2,mp=4", batch_size=16, grad_accum=2)
    c.optim.warmup_steps, c.optim.clip_norm = 0, 0.5  # the initial gradient's norm is about 0.6
    s = run_setup.setup(c)
    state = state_lib.init_state(s.model_cfg, s.tx, s.mesh, s.rules, c.seq_len, c.seed)
    initial = jax.tree.map(np.asarray, state.params)
    batches = [jax.device_put(step_lib.host_batch(s, b), s.batch_sharding) for b in token_batches(c, 2)]
    with state_lib.sharding_context(s.mesh, s.rules):
        plain = _plain_mean_loss(s)
        update = jax.jit(s.tx.update)
        params, opt_state, want = state.params, state.opt_state, []
        for tokens in batches:
            loss, grads = plain(params, tokens)
            updates, opt_state = update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            want.append((float(loss), float(optax.global_norm(grads))))
    params = jax.tree.map(np.asarray, params)
    step = step_lib.compile_train_step(s)
    lrs = []
    for tokens, (loss, norm) in zip(batches, want, strict=True):
        state, stats = step(state, tokens)
        assert float(stats["loss"]) == pytest.approx(loss, rel=1e-5)
        assert float(stats["grad_norm"]) == pytest.approx(norm, rel=1e-4)
        lrs.append(float(stats["learning_rate"]))
    assert want[0][1] > c.optim.clip_norm  # the first gradient was clipped
    assert lrs == pytest.approx([c.optim.lr, float(s.schedule(1))]) and lrs[1] < lrs[0]
    # Adam moves a weight by up to about lr a step: agreeing to 1% of lr is agreeing on the update.
    for got, ref in zip(jax.tree.leaves(state.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=0.01 * c.optim.lr)
    moved = jax.tree.map(lambda a, b: np.abs(a - b).mean(), params, initial)
    assert min(jax.tree.leaves(moved)) > 0.5 * c.optim.lr  # two updates of about lr each


def test_gradient_accumulation_reduces_over_data_parallel_once_per_step():
    """Parameters replicated over dp: the microbatches' gradients are summed on each batch shard
    and all-reduced over dp once, so the step moves what the full-batch step moves."""
    moved = {}
    for accum in (1, 4):
        c = small_config(rules="megatron_1d", mesh="dp=2,mp=4", batch_size=16, grad_accum=accum)
        s = run_setup.setup(c)
        text = step_lib.compile_train_step(s).as_text()
        found = [x for x in hlo.collectives(text, 8) if x.group_size == s.mesh.shape["dp"]]
        moved[accum] = sum(x.ring_bytes_per_call for x in found)
    assert moved[1] > 0
    assert moved[4] == pytest.approx(moved[1], rel=0.01)


@pytest.mark.parametrize("loss_chunk", [0, 8])
def test_the_eval_step_counts_no_padding_row(loss_chunk):
    """A batch whose rows past the real ones are data.PAD sums those real rows' losses only: rows
    are independent, so [0-4, PAD x3] equals [0-4, 0-2] less [0-2, PAD x5]."""
    s = run_setup.setup(small_config(rules="megatron_1d", mesh="dp=2,mp=4", loss_chunk=loss_chunk))
    params = state_lib.init_state(s.model_cfg, s.tx, s.mesh, s.rules, 32, 0).params
    rows = token_batches(s.config, 1)[0]
    pad = np.full_like(rows[:1], pipeline.PAD)
    with state_lib.sharding_context(s.mesh, s.rules):
        eval_step = step_lib.make_eval_step(s)

    def sums(*parts):
        loss, count = eval_step(params, jax.device_put(np.concatenate(parts), s.batch_sharding))
        return float(loss), int(count)

    five = sums(rows[:5], pad, pad, pad)
    three = sums(rows[:3], *[pad] * 5)
    both = sums(rows[:5], rows[:3])
    assert five[1] == 5 * 32 and three[1] == 3 * 32 and both[1] == 8 * 32
    assert five[0] == pytest.approx(both[0] - three[0], rel=1e-5)


def test_a_bfloat16_gradient_reduction_with_nothing_to_reduce_is_a_warning(capsys):
    c = small_config(rules="megatron_1d", mesh="dp=1,mp=8", **{"optim.grad_reduce_dtype": "bfloat16"})
    s = run_setup.setup(c)
    assert step_lib.grad_reduce_dtype(s) == "float32"
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        f"warning: config.optim.grad_reduce_dtype=bfloat16 changes nothing: {s.rules.source} on mesh "
        "dp=1,mp=8 has no data-parallel axis of more than one device"
    )


@pytest.mark.parametrize("rules", SHIPPED)
def test_a_bfloat16_gradient_reduction_applies_under_every_shipped_rule_file(capsys, rules):
    """docs/training.md: with several microbatches dp, megatron_1d and megatron_1d_sp sum them per
    batch shard and all-reduce the sums in bfloat16; otherwise, and under the rule files that shard
    parameters over a batch axis, the step makes the gradients in bfloat16 where GSPMD reduces them:
    every shipped rule file applies it, with no warning."""
    s = run_setup.setup(
        small_config(rules=rules, mesh=mesh_for(rules), **{"optim.grad_reduce_dtype": "bfloat16"})
    )
    assert step_lib.grad_reduce_dtype(s) == "bfloat16"
    assert "grad_reduce_dtype" not in capsys.readouterr().err
