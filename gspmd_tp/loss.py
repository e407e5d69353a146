"""Cross entropy on vocabulary-sharded logits, whole or in chunks of positions.

GSPMD partitions the softmax cross entropy of logits constrained (batch, length, vocab): the max
and the sum of exponentials are reduced across the vocabulary shards and the target logit is
picked where it lives, so the full [tokens, vocab] logits never move (tests/test_plan.py checks
the compiled step). For large vocabularies even the per-device logits are big: the chunked form
computes them a block of positions at a time, under jax.checkpoint, so the step never holds more
than one block of logits, in the forward or the backward pass.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from gspmd_tp.axes import BATCH, LENGTH, VOCAB
from gspmd_tp.projection import output_projection


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


def chunked_cross_entropy_sums(hidden_ble, head_ev, targets_bl, chunk: int, valid_bl=None):
    """cross_entropy_sums(hidden @ head, targets, valid), `chunk` positions at a time.

    hidden_ble: final-normed hidden states (batch, length, embed); head_ev: the output projection
    (embed, vocab). The length must divide by `chunk`.
    """
    b, length, e = hidden_ble.shape
    if length % chunk:
        raise ValueError(f"sequence length {length} is not divisible by loss_chunk {chunk}")
    n = length // chunk
    hidden_cble = hidden_ble.reshape(b, n, chunk, e).swapaxes(0, 1)  # (chunks, batch, chunk, embed)
    targets_cbl = targets_bl.reshape(b, n, chunk).swapaxes(0, 1)
    valid_cbl = None if valid_bl is None else valid_bl.reshape(b, n, chunk).swapaxes(0, 1)

    @jax.checkpoint  # recompute each block's logits in the backward pass instead of saving them
    def block(hidden, targets, valid):
        hidden = nn.with_logical_constraint(hidden, (BATCH, LENGTH, None))
        logits = output_projection(hidden, head_ev.astype(hidden.dtype))
        logits = nn.with_logical_constraint(logits.astype(jnp.float32), (BATCH, LENGTH, VOCAB))
        return cross_entropy_sums(logits, targets, valid)[0]

    def body(total, xs):
        return total + block(*xs), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (hidden_cble, targets_cbl, valid_cbl))
    return total, b * length if valid_bl is None else valid_bl.sum()
