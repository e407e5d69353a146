"""Packed documents kept apart: a window of several documents, given their segment ids and
positions, gives every document the per-token losses and gradients it gets run alone, on every
attention path that runs on CPU; the train step carries them from the batch into the model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config

from gspmd_tp.model import kernels
from gspmd_tp.model.transformer import ModelConfig, Transformer
from gspmd_tp.train import run_setup
from gspmd_tp.train import state as state_lib
from gspmd_tp.train import step as step_lib

CFG = ModelConfig(
    vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64
)
LENGTH = 24
# Two windows: row 0 holds the end of a document cut by the window's start, one of 7 tokens and one
# of 8; row 1 a single document of 4, then one of 20 (segments need not be in order of size).
SEGMENTS = [[1] * 9 + [2] * 7 + [3] * 8, [1] * 4 + [2] * 20]
# The paths that run on CPU: einsum whole and in query blocks (5 does not divide the length, and
# blocks span two documents), and jax.nn.dot_product_attention's xla.
PATHS = [("einsum", 0), ("einsum", 5), ("xla", 0)]


def _window():
    """(tokens, targets, segment_ids, positions), each (2, LENGTH); positions counted from each
    segment's first token, by hand."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, (2, LENGTH)).astype(np.int32)
    targets = rng.integers(0, CFG.vocab_size, (2, LENGTH)).astype(np.int32)
    segment_ids = np.array(SEGMENTS, np.int32)
    positions = np.zeros_like(segment_ids)
    for r in range(2):
        for i in range(1, LENGTH):
            positions[r, i] = 0 if segment_ids[r, i] != segment_ids[r, i - 1] else positions[r, i - 1] + 1
    return tokens, targets, segment_ids, positions


def _token_losses(cfg, params, tokens, targets, **documents):
    """Per-token cross entropy (batch, length) of the model's logits, in float32."""
    logits = Transformer(cfg).apply({"params": params}, jnp.asarray(tokens), **documents)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], axis=-1)[..., 0]


def _spans():
    """(row, index array) of every document of the window."""
    return [
        (r, np.flatnonzero(np.array(SEGMENTS[r]) == s)) for r in range(2) for s in sorted(set(SEGMENTS[r]))
    ]


@pytest.mark.parametrize("attention, block", PATHS)
def test_a_packed_window_gives_each_document_its_losses_and_gradients_alone(attention, block):
    cfg = dataclasses.replace(CFG, attention=attention, attention_block=block)
    tokens, targets, segment_ids, positions = _window()
    params = Transformer(cfg).init(jax.random.key(0), jnp.asarray(tokens))["params"]
    documents = {"segment_ids_bl": jnp.asarray(segment_ids), "positions_bl": jnp.asarray(positions)}

    packed = jax.jit(lambda p: _token_losses(cfg, p, tokens, targets, **documents))(params)
    grad_packed = jax.jit(jax.grad(lambda p: _token_losses(cfg, p, tokens, targets, **documents).sum()))(
        params
    )

    def summed(p, t, y):
        losses = _token_losses(cfg, p, t, y)
        return losses.sum(), losses

    alone_step = jax.jit(jax.value_and_grad(summed, has_aux=True))  # compiled once per document length
    grad_alone = jax.tree.map(jnp.zeros_like, params)
    for r, idx in _spans():
        # The document alone: a batch of one row, positions 0, 1, ... by default, nothing to mask.
        (alone, alone_losses), g = alone_step(params, tokens[r : r + 1, idx], targets[r : r + 1, idx])
        np.testing.assert_allclose(packed[r, idx].sum(), alone, rtol=1e-5)
        np.testing.assert_allclose(packed[r, idx], alone_losses[0], atol=1e-5)
        grad_alone = jax.tree.map(jnp.add, grad_alone, g)
    for a, b in zip(jax.tree.leaves(grad_packed), jax.tree.leaves(grad_alone), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

    # Attended whole, the later documents read the earlier ones: the losses differ.
    whole = jax.jit(lambda p: _token_losses(cfg, p, tokens, targets))(params)
    r, idx = _spans()[1]
    assert np.abs(np.asarray(whole[r, idx]) - np.asarray(packed[r, idx])).max() > 1e-3


def test_positions_restart_with_each_document_in_rotary_embedding():
    """Masked but with positions running on, each document's scores are the same (rotary embedding
    depends on differences of position only), to rounding: the mask is what keeps documents apart,
    and positions restarting keeps the angles of a document alone."""
    tokens, targets, segment_ids, positions = _window()
    params = Transformer(CFG).init(jax.random.key(0), jnp.asarray(tokens))["params"]
    restart = _token_losses(
        CFG,
        params,
        tokens,
        targets,
        segment_ids_bl=jnp.asarray(segment_ids),
        positions_bl=jnp.asarray(positions),
    )
    running = _token_losses(CFG, params, tokens, targets, segment_ids_bl=jnp.asarray(segment_ids))
    np.testing.assert_allclose(running, restart, atol=1e-5)
    shifted = _token_losses(
        CFG,
        params,
        tokens,
        targets,
        segment_ids_bl=jnp.asarray(segment_ids),
        positions_bl=jnp.asarray(positions) * 2,
    )
    assert np.abs(np.asarray(shifted) - np.asarray(restart)).max() > 1e-4  # positions are read


@pytest.mark.parametrize("loss_chunk", [0, 8])
def test_the_steps_loss_sums_read_the_batchs_segments(loss_chunk):
    """step._loss_sums of a batch dict: the sum over its tokens of each document's losses alone."""
    cfg = dataclasses.replace(CFG, attention_block=8)
    tokens, _, segment_ids, positions = _window()
    window = np.concatenate([tokens, tokens[:, :1]], axis=1)  # seq_len + 1: targets are the next token
    model = Transformer(cfg)
    params = model.init(jax.random.key(1), jnp.asarray(tokens))["params"]
    batch = {"tokens": window, "segment_ids": segment_ids, "positions": positions}
    loss_sums = jax.jit(lambda p, b: step_lib._loss_sums(model, p, b, loss_chunk))
    total, count = loss_sums(params, jax.tree.map(jnp.asarray, batch))
    alone = jax.jit(lambda p, t, y: _token_losses(cfg, p, t, y).sum())
    want = sum(
        float(alone(params, window[r : r + 1, idx], window[r : r + 1, idx + 1])) for r, idx in _spans()
    )
    assert int(count) == 2 * LENGTH
    np.testing.assert_allclose(float(total), want, rtol=1e-5)
    unmasked, _ = loss_sums(params, jnp.asarray(window))  # a bare token array
    assert abs(float(unmasked) - want) > 1e-3


def test_sharded_steps_with_microbatches_keep_documents_apart():
    """Under megatron_1d on dp=4,mp=2 with 2 microbatches (each batch shard summing its own), the
    gradient of a packed batch is that of its documents one by one on one device."""
    c = small_config(rules="megatron_1d", mesh="dp=4,mp=2", grad_accum=2)
    c.seq_len = 16
    s = run_setup.setup(c)
    state = state_lib.init_state(s.model_cfg, s.tx, s.mesh, s.rules, c.seq_len, c.seed)
    rng = np.random.default_rng(3)
    tokens = rng.integers(1, 256, (c.batch_size, c.seq_len + 1)).astype(np.int32)
    tokens[:, [3, 9]] = 0  # byte 0 ends a document: three documents a row
    batch = step_lib.host_batch(s, tokens)
    np.testing.assert_array_equal(batch["segment_ids"][0], [1] * 3 + [2] * 6 + [3] * 7)
    with state_lib.sharding_context(s.mesh, s.rules):
        loss, grads = jax.jit(
            lambda p, b: step_lib.accumulated_grads(Transformer(s.model_cfg), 2, s.shardings.params, p, b)
        )(state.params, jax.device_put(batch, s.batch_sharding))
    params = jax.device_get(state.params)
    model = Transformer(s.model_cfg)

    def alone_sum(p):
        total = 0.0
        for lo, hi in ((0, 3), (3, 9), (9, 16)):  # each row's first, second and third documents
            total = total + step_lib._loss_sums(model, p, jnp.asarray(tokens[:, lo : hi + 1]))[0]
        return total / (c.batch_size * c.seq_len)

    want_loss, want_grads = jax.jit(jax.value_and_grad(alone_sum))(params)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.device_get(grads)), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_cudnn_cannot_mask_documents_and_says_what_to_use():
    assert kernels.attention_implementation("auto", "bfloat16", "gpu") == "cudnn"
    assert kernels.attention_implementation("auto", "bfloat16", "gpu", segmented=True) == "einsum"
    q = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
    cfg = dataclasses.replace(CFG, attention="cudnn", dtype="bfloat16")
    with pytest.raises(
        ValueError,
        match=r"^model\.attention 'cudnn' cannot keep packed documents apart .*"
        r"config\.data\.document_mask=False$",
    ):
        kernels.attention(cfg, q, q, q, segment_ids=jnp.ones((1, 4), jnp.int32))
