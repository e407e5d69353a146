"""Cross entropy on vocabulary-sharded logits, whole or in chunks of positions.

GSPMD partitions the softmax cross entropy of logits constrained (batch, length, vocab): the max
and the sum of exponentials are reduced across the vocabulary shards and the target logit is
picked where it lives, so the full [tokens, vocab] logits never move (tests/plan/test_plan.py checks
the compiled step). For large vocabularies even the per-device logits are big: the chunked form
computes them a block of positions at a time, under jax.checkpoint, so the step never holds more
than one block of logits, in the forward or the backward pass.

A loop over blocks closes over the output projection, so autodiff sums its gradient across the
blocks in the loop's carry. A carry laid out like the projection (not split over the batch) makes
GSPMD reduce each block's gradient over the batch's devices before adding it: one data-parallel
reduction of the projection's gradient per block instead of per step. The chunked form therefore
reads a copy of the projection per batch shard (BATCH on a leading axis, no communication), so that
each shard sums its blocks' gradients locally and the reduction over the batch runs once, where the
copies' gradients are summed after the loop.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from gspmd_tp.model import kernels
from gspmd_tp.model.transformer import HEAD_AXES, cast_weight, mask_vocab_padding
from gspmd_tp.sharding.axes import BATCH, LENGTH, VOCAB
from gspmd_tp.sharding.rules import batch_mesh_axes


def cross_entropy_sums(logits_blv, targets_bl, valid_bl=None):
    """(sum of token losses, token count) of float32 logits against integer targets; with a
    boolean `valid_bl`, only the targets it marks count (the others must still be vocabulary ids)."""
    logits = logits_blv.astype(jnp.float32)
    # optax's softmax_cross_entropy_with_integer_labels, but for how the target logit leaves its
    # size-1 axis: optax's take(0) differentiates to a scatter of constants that XLA folds at
    # compile time, a literal of every token's -1 (seconds of "constant folding" alarms on large
    # batches); a squeeze differentiates to a reshape.
    target = jnp.take_along_axis(logits, targets_bl[..., None], axis=-1).squeeze(-1)
    losses = jax.nn.logsumexp(logits, axis=-1) - target
    if valid_bl is None:
        return losses.sum(), losses.size
    return jnp.where(valid_bl, losses, 0.0).sum(), valid_bl.sum()


def batch_shards(batch: int) -> int:
    """Devices a batch of `batch` rows is split over under the logical rules and mesh being traced
    with: the size of the mesh axes `batch` resolves to (1 outside them, or where they do not divide)."""
    mesh = dict(jax.sharding.get_abstract_mesh().shape)
    shards = math.prod(mesh.get(a, 1) for a in batch_mesh_axes())
    return shards if batch % shards == 0 else 1


def chunked_cross_entropy_sums(
    hidden_ble, head_ev, targets_bl, chunk: int, valid_bl=None, vocab_tokens=0, grad_dtype=""
):
    """cross_entropy_sums(hidden @ head, targets, valid), `chunk` positions at a time.

    hidden_ble: final-normed hidden states (batch, length, embed); head_ev: the output projection
    (embed, vocab). The length must divide by `chunk`. vocab_tokens > 0: the ids from there on are
    vocabulary padding, masked out as the model masks them (mask_vocab_padding). grad_dtype: the
    dtype the projection's gradient is reduced over the batch in (model.grad_dtype).
    """
    b, length, e = hidden_ble.shape
    if length % chunk:
        raise ValueError(f"sequence length {length} is not divisible by loss_chunk {chunk}")
    n, s = length // chunk, batch_shards(b)

    def blocks(x_bl):  # (batch, length, ...) -> (chunks, shards, batch / shards, chunk, ...)
        x = x_bl.reshape(s, b // s, n, chunk, *x_bl.shape[2:])
        return jnp.moveaxis(x, 2, 0)

    hidden_csble = blocks(hidden_ble)
    targets_csbl = blocks(targets_bl)
    valid_csbl = None if valid_bl is None else blocks(valid_bl)
    # One copy of the projection per batch shard, each on its own shard's devices (see the module
    # docstring): the gradient the loop carries is then split over the batch like the rows.
    head_ev = cast_weight(head_ev, hidden_ble.dtype, HEAD_AXES)
    head_sev = kernels.spread(head_ev, s, HEAD_AXES, grad_dtype)
    head_sev = nn.with_logical_constraint(head_sev, (BATCH, None, VOCAB))

    @jax.checkpoint  # recompute each block's logits in the backward pass instead of saving them
    def block(hidden, targets, valid):
        hidden = nn.with_logical_constraint(hidden, (BATCH, None, LENGTH, None))
        logits = jnp.einsum("sble,sev->sblv", hidden, head_sev)
        logits = mask_vocab_padding(logits.astype(jnp.float32), vocab_tokens)
        logits = nn.with_logical_constraint(logits, (BATCH, None, LENGTH, VOCAB))
        # Per shard, (shards,): the running total stays split over the batch too.
        return jax.vmap(lambda x, t, v: cross_entropy_sums(x, t, v)[0])(logits, targets, valid)

    def body(total_s, xs):
        return total_s + block(*xs), None

    zeros = nn.with_logical_constraint(jnp.zeros((s,), jnp.float32), (BATCH,))
    total_s, _ = jax.lax.scan(body, zeros, (hidden_csble, targets_csbl, valid_csbl))
    return total_s.sum(), b * length if valid_bl is None else valid_bl.sum()
