"""Context parallelism: each sequence split by position over the mesh axes a rule file gives `length`
(rules/context_dp.yaml, rules/fsdp_context_tensor.yaml), and how attention reaches the other devices'
keys and values (model.context_parallel):

- "all_gather": the keys and values constrained by `kv_length`, which those rule files leave whole,
  so GSPMD gathers them and each device scores its queries against every key (kernels.attention).
- "ring": the keys and values stay split like the queries; ring_attention, a shard_map over the
  context axes, passes each device's block (keys, values, their positions and segment ids) round
  the ring by ppermute, one step per device, and accumulates a streaming (log-sum-exp) softmax.
  Each step's permute of the next block is issued before the products on the current one, so the
  transfer can run beside them.

model.context_load_balance: under the causal mask the device of the last chunk scores every key and
the first almost none. The train and eval steps lay the sequence out in zigzag order (zigzag_order:
of 2n chunks, device i holds chunks i and 2n-1-i), inputs, targets, segment ids and positions alike
(a sum of token losses does not depend on the order), and the model masks by the true positions it
is given, not by index. Under the ring each step then computes only blocks it needs (zigzag
schedule in _ring_body), the same on every device.

Logical names only: the mesh axes come from the logical axis rules in force when tracing, as in
kernels.sliced_mlp.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from gspmd_tp.sharding.axes import BATCH, HEAD_DIM, HEADS, KV_HEADS, LENGTH
from gspmd_tp.sharding.rules import axes_of

STRATEGIES = ("all_gather", "ring")
_NEG = float(jnp.finfo(jnp.float32).min)  # a masked score (finite: no inf - inf in the running max)


def _auto_axes(mesh) -> set[str]:
    """The mesh axes left to GSPMD here (not manual: inside the step's per-shard sums, the batch's)."""
    manual = jax.sharding.AxisType.Manual
    return {a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t != manual}


def context_axes() -> tuple[str, ...]:
    """The mesh axes of more than one device that the logical rules in force split `length` over
    (the context axes), () with no mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    auto = _auto_axes(mesh)
    return tuple(a for a in axes_of(nn.logical_to_mesh_axes((LENGTH,))[0]) if a in auto and mesh.shape[a] > 1)


def context_shards() -> int:
    """How many devices the context axes split each sequence over here (1: no context parallelism)."""
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[a] for a in context_axes()) if not mesh.empty else 1


def balanced_shards(cfg) -> int:
    """The context shards n where model.context_load_balance lays sequences out in zigzag order
    here, else 0 (off, or no context axis)."""
    n = context_shards()
    return n if cfg.context_load_balance and n > 1 else 0


def rings(cfg) -> bool:
    """Whether model.context_parallel 'ring' applies here: a context axis of more than one device."""
    return cfg.context_parallel == "ring" and bool(context_axes())


def zigzag_order(length: int, shards: int) -> np.ndarray:
    """The original position at each place of the zigzag layout of `length` positions over `shards`
    devices: 2 * shards chunks, device i's contiguous share holding chunks i and 2 * shards - 1 - i
    (x[:, order] lays x out so)."""
    h = length // (2 * shards)
    chunks = [c for i in range(shards) for c in (i, 2 * shards - 1 - i)]
    return np.concatenate([np.arange(c * h, (c + 1) * h) for c in chunks]).astype(np.int32)


def useful_pairs(order: np.ndarray, shards: int, segment_ids: np.ndarray | None = None) -> np.ndarray:
    """(shards,) the query-key pairs that the causal mask (and, given (length,) `segment_ids` in the
    original order, the document mask) lets through for each device's queries, under the layout
    `order` (zigzag_order's, or np.arange for the plain split): the attention work each device
    cannot skip."""
    length = len(order)
    q = np.arange(length)[:, None]
    allowed = q >= np.arange(length)[None, :]
    if segment_ids is not None:
        allowed &= segment_ids[:, None] == segment_ids[None, :]
    per_position = allowed.sum(1)[order]  # by place in the layout
    return per_position.reshape(shards, -1).sum(1)


# --- ring attention ---


def ring_layout(q_shape: tuple, k_shape: tuple, zigzag: bool) -> dict | None:
    """The shard_map's axes and specs for ring attention of queries (batch, length, heads, head_dim)
    over keys (batch, length, kv_heads, head_dim) under the rules in force: `axes` the context axes,
    `n` their devices, `q` and `kv` the specs of the grouped queries (batch, length, kv_heads,
    group, head_dim) and of keys/values, `rows` of (batch, length) positions and segment ids. None
    where there is no context axis, where the rules split the query heads over axes the key/value
    heads are not (heads_follow_kv_heads), or where the mesh does not split these shapes evenly (a
    batch of one row at initialisation): plain attention then."""
    axes = context_axes()
    mesh = jax.sharding.get_abstract_mesh()
    if not axes:
        return None
    auto = _auto_axes(mesh)
    free = lambda entry: tuple(a for a in axes_of(entry) if a in auto)  # noqa: E731
    names = (BATCH, LENGTH, KV_HEADS, HEAD_DIM)
    batch, length, kv, _ = (free(e) for e in nn.logical_to_mesh_axes(names))
    ways = lambda names: math.prod(mesh.shape[a] for a in names)  # noqa: E731
    b, seq, _, _ = q_shape
    n = ways(length)
    if (
        not heads_follow_kv_heads()
        or b % ways(batch)
        or seq % (n * (2 if zigzag else 1))
        or k_shape[2] % ways(kv)
        or set(kv) & set(batch + length)
    ):
        return None
    return {
        "axes": length,
        "n": n,
        "manual": auto,
        "q": nn.logical_to_mesh_axes((BATCH, LENGTH, KV_HEADS, None, HEAD_DIM)),
        "kv": nn.logical_to_mesh_axes(names),
        "rows": nn.logical_to_mesh_axes((BATCH, LENGTH)),
    }


def heads_follow_kv_heads(rules=None) -> bool:
    """Whether the logical rules (those in force, or the (name, mesh axes) pairs `rules`) split the
    query heads over no mesh axis the key/value heads are not split over: each device's query heads
    are then the groups of its own key/value heads, as the ring's shard_map takes them."""
    heads, kv = (axes_of(nn.logical_to_mesh_axes((name,), rules)[0]) for name in (HEADS, KV_HEADS))
    return set(heads) <= set(kv)


def ring_attention(layout: dict, q_blhd, k_blkd, v_blkd, positions_bl, segment_ids_bl=None, zigzag=False):
    """Causal attention of scaled queries (batch, length, heads, head_dim) over keys and values
    (batch, length, kv_heads, head_dim), all split by position over layout["axes"] (ring_layout's):
    the key/value blocks with their positions and segment ids go round the ring, a query seeing a
    key where its position is no smaller and, with segment_ids_bl, its segment the same. `zigzag`:
    the sequence is in zigzag_order (model.context_load_balance), and each step computes only the
    blocks its queries need. Returns (batch, length, heads, head_dim)."""
    b, length, heads, hd = q_blhd.shape
    kv_heads = k_blkd.shape[2]
    q = q_blhd.reshape(b, length, kv_heads, heads // kv_heads, hd)
    if segment_ids_bl is None:  # one segment: the causal mask alone
        segment_ids_bl = jnp.zeros((b, length), jnp.int32)
    positions_bl = jnp.broadcast_to(positions_bl, (b, length)).astype(jnp.int32)
    body = lambda *args: _ring_body(layout["axes"], layout["n"], zigzag, *args)  # noqa: E731
    out = jax.shard_map(
        body,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(layout["q"], layout["kv"], layout["kv"], layout["rows"], layout["rows"]),
        out_specs=layout["q"],
        axis_names=layout["manual"],
        check_vma=False,
    )(q, k_blkd, v_blkd, positions_bl, segment_ids_bl)
    return out.reshape(b, length, heads, hd)


def _ring_body(axes: tuple, n: int, zigzag: bool, q, k, v, pos, seg):
    """One device's ring: q (b, c, kv_heads, group, d) its queries, k and v (b, c, kv_heads, d) and
    pos, seg (b, c) its keys' block at the start (the queries' positions and segment ids too).

    Step s holds the block of device (i - s) mod n: the permute that brings the next block is issued
    first, then the products on this one. Plain split (chunk i of n): every block computed whole
    under the mask, the blocks of later chunks wholly masked. Zigzag (chunks i and 2n-1-i, halves
    a and b of each block): step 0 the diagonal, a's queries against a's keys and b's against both;
    each later step, from device j, b's queries against a's keys (j's first chunk, always earlier)
    and one more half-square: a's queries against a's keys where j < i, b's against b's keys where
    j > i (the other pairs are all masked). Two half-by-half products a step, on every device."""
    me = jax.lax.axis_index(axes)
    block = (k, v, pos, seg)
    perm = [(j, (j + 1) % n) for j in range(n)]

    def stats(length):
        b, _, kh, g, d = q.shape
        m = jnp.full((b, kh, g, length), _NEG, jnp.float32)
        return m, jnp.zeros_like(m), jnp.zeros((b, kh, g, length, d), jnp.float32)

    if not zigzag:
        state = stats(q.shape[1])
        for s in range(n):
            ahead = jax.lax.ppermute(block, axes, perm) if s < n - 1 else None
            state = _update(state, q, pos, seg, block)
            block = ahead
        return _finish(state, q.dtype)

    h = q.shape[1] // 2
    half = lambda x, i: x[:, i * h : (i + 1) * h]  # noqa: E731
    qa, qb = half(q, 0), half(q, 1)
    (pa, pb), (sa, sb) = (half(pos, 0), half(pos, 1)), (half(seg, 0), half(seg, 1))
    state_a, state_b = stats(h), stats(h)
    for s in range(n):
        ahead = jax.lax.ppermute(block, axes, perm) if s < n - 1 else None
        first = tuple(half(x, 0) for x in block)
        if s == 0:
            state_a = _update(state_a, qa, pa, sa, first)
            state_b = _update(state_b, qb, pb, sb, block)
        else:
            state_b = _update(state_b, qb, pb, sb, first)
            early = (me - s) % n < me  # the block's device j holds earlier chunks: j < i
            pick = functools.partial(_pick, early)
            second = pick(first, tuple(half(x, 1) for x in block))
            new = _update(pick(state_a, state_b), pick(qa, qb), pick(pa, pb), pick(sa, sb), second)
            state_a, state_b = pick(new, state_a), pick(state_b, new)
        block = ahead
    return jnp.concatenate([_finish(state_a, q.dtype), _finish(state_b, q.dtype)], axis=1)


def _pick(which, x, y):
    """x where `which` (a scalar), else y, leaf by leaf of two trees of one structure."""
    return jax.tree.map(lambda u, w: jnp.where(which, u, w), x, y)


def _update(state, q, q_pos, q_seg, block):
    """The streaming softmax's (running max, sum, weighted values) of queries q (b, q, kv_heads,
    group, d) after one more key block (k, v (b, s, kv_heads, d), positions and segment ids (b, s)),
    scores in float32. The running max is held out of differentiation: the result does not depend
    on it."""
    m, total, acc = state
    k, v, k_pos, k_seg = block
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
    allowed = (q_pos[:, :, None] >= k_pos[:, None, :]) & (q_seg[:, :, None] == k_seg[:, None, :])
    allowed = allowed[:, None, None]  # (b, 1, 1, q, s)
    scores = jnp.where(allowed, scores, _NEG)
    m_new = jax.lax.stop_gradient(jnp.maximum(m, scores.max(-1)))
    p = jnp.where(allowed, jnp.exp(scores - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, total * alpha + p.sum(-1), acc * alpha[..., None] + pv


def _finish(state, dtype):
    """The attention output (b, q, kv_heads, group, d) of a finished streaming softmax (every query
    sees at least its own key: the sums are positive)."""
    _, total, acc = state
    return jnp.moveaxis(acc / total[..., None], 3, 1).astype(dtype)
