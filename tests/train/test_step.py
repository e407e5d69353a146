"""The train step: it really shards, and gradient accumulation equals the full batch and reduces
over data parallelism once per step where parameters are replicated over it. The eval step counts
no padding row."""

import jax
import numpy as np
import pytest
from conftest import loss_and_grads, small_config, token_batches

from gspmd_tp.data import pipeline
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


@pytest.mark.parametrize(
    "rules, mesh", [("dp", "dp=8,mp=1"), ("megatron_1d_sp", "dp=2,mp=4"), ("megatron_2d", "dp=2,mp=4")]
)
def test_gradient_accumulation_equals_full_batch(rules, mesh):
    c = small_config(rules=rules, mesh=mesh, batch_size=32)  # microbatches of 8 rows: 1 per device
    (loss1, grads1), (loss4, grads4) = loss_and_grads(c, [(1, 0), (4, 0)])
    np.testing.assert_allclose(float(loss4), float(loss1), rtol=1e-6)
    for g1, g4 in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads4), strict=True):
        np.testing.assert_allclose(np.asarray(g4), np.asarray(g1), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("rules, mesh", [("dp", "dp=8,mp=1"), ("megatron_1d", "dp=2,mp=4")])
def test_gradient_accumulation_reduces_over_data_parallel_once_per_step(rules, mesh):
    """Parameters replicated over dp: the microbatches' gradients are summed on each batch shard
    and all-reduced over dp once, so the step moves what the full-batch step moves."""
    moved = {}
    for accum in (1, 4):
        c = small_config(rules=rules, mesh=mesh, batch_size=32, grad_accum=accum)
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
