"""Context parallelism: each sequence split by position over the mesh axes a rule file gives `length`
(rules/context_dp.yaml, rules/fsdp_context_tensor.yaml), and how attention reaches the other devices'
keys and values (model.context_parallel):

- "all_gather": the keys and values constrained by `kv_length`, which those rule files leave whole,
  so GSPMD gathers them and each device scores its queries against every key (kernels.attention).
- "ring": the keys and values stay split like the queries; ring_attention, a shard_map over the
  context axes, passes each device's block (keys, values, their positions and segment ids) round
  the ring by ppermute, one step per device, and accumulates a streaming (log-sum-exp) softmax.
  Each step's permute of the next block is issued before the products on the current one, so the
  transfer can run beside them. The backward pass is a second ring (_ring_backward) that recomputes
  each block's scores from the saved log-sum-exp: no step's scores are kept.

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
    body = lambda *args: _ring(layout["axes"], layout["n"], zigzag, *args)  # noqa: E731
    out = jax.shard_map(
        body,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(layout["q"], layout["kv"], layout["kv"], layout["rows"], layout["rows"]),
        out_specs=layout["q"],
        axis_names=layout["manual"],
        check_vma=False,
    )(q, k_blkd, v_blkd, positions_bl, segment_ids_bl)
    return out.reshape(b, length, heads, hd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring(axes: tuple, n: int, zigzag: bool, q, k, v, pos, seg):
    """_ring_forward's output, its gradient _ring_backward's: a second ring that recomputes each
    block's scores from the saved log-sum-exp (FlashAttention's backward), so the backward pass keeps
    no step's scores."""
    return _ring_forward(axes, n, zigzag, q, k, v, pos, seg)[0]


def _ring_fwd(axes, n, zigzag, q, k, v, pos, seg):
    out, lse = _ring_forward(axes, n, zigzag, q, k, v, pos, seg)
    return out, (q, k, v, pos, seg, out, lse)


def _ring_forward(axes: tuple, n: int, zigzag: bool, q, k, v, pos, seg):
    """One device's ring, (output, log-sum-exp (b, kv_heads, group, c) of each query's scores): q
    (b, c, kv_heads, group, d) its queries, k and v (b, c, kv_heads, d) and pos, seg (b, c) its
    keys' block at the start (the queries' positions and segment ids too).

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
        return _finish(state, q.dtype), _lse(state)

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
    out = jnp.concatenate([_finish(state_a, q.dtype), _finish(state_b, q.dtype)], axis=1)
    return out, jnp.concatenate([_lse(state_a), _lse(state_b)], axis=-1)


def _ring_backward(axes, n, zigzag, residuals, d_out):
    """The gradients of (q, k, v) of _ring: the blocks go round again, each with the gradients of
    its keys and values accumulated so far (n permutes of them: the last brings them home); each
    step recomputes the products the forward made on that block, in the same schedule."""
    q, k, v, pos, seg, out, lse = residuals
    me = jax.lax.axis_index(axes)
    perm = [(j, (j + 1) % n) for j in range(n)]
    # D: each query's sum of d_out * out, (b, kv_heads, group, c), as lse.
    d = jnp.moveaxis(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1), 1, 3)
    block = (k, v, pos, seg)
    f32 = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    if not zigzag:
        dq, acc = f32(q), (f32(k), f32(v))
        queries = (q, d_out, lse, d, pos, seg)
        for s in range(n):
            ahead = jax.lax.ppermute(block, axes, perm) if s < n - 1 else None
            gq, gk, gv = _product_grads(queries, block)
            dq, acc = dq + gq, (acc[0] + gk, acc[1] + gv)
            acc = jax.lax.ppermute(acc, axes, perm)
            block = ahead
        return dq.astype(q.dtype), acc[0].astype(k.dtype), acc[1].astype(v.dtype), None, None

    h = q.shape[1] // 2
    half = lambda x, i, axis=1: jax.lax.slice_in_dim(x, i * h, (i + 1) * h, axis=axis)  # noqa: E731
    qs = [
        (half(q, i), half(d_out, i), half(lse, i, 3), half(d, i, 3), half(pos, i), half(seg, i))
        for i in (0, 1)
    ]
    dq = [f32(qs[0][0]), f32(qs[1][0])]
    zeros_kv = (f32(half(k, 0)), f32(half(v, 0)))
    acc = [zeros_kv, zeros_kv]  # (d keys, d values) of the block's first and second chunk
    add = lambda x, y: jax.tree.map(jnp.add, x, y)  # noqa: E731
    for s in range(n):
        ahead = jax.lax.ppermute(block, axes, perm) if s < n - 1 else None
        first, second = (tuple(half(x, i) for x in block) for i in (0, 1))
        if s == 0:
            gq, gk, gv = _product_grads(qs[0], first)
            dq[0], acc[0] = dq[0] + gq, add(acc[0], (gk, gv))
            gq, gk, gv = _product_grads(qs[1], block)
            dq[1] = dq[1] + gq
            acc = [add(acc[i], (half(gk, i), half(gv, i))) for i in (0, 1)]
        else:
            gq, gk, gv = _product_grads(qs[1], first)
            dq[1], acc[0] = dq[1] + gq, add(acc[0], (gk, gv))
            early = (me - s) % n < me
            pick = functools.partial(_pick, early)
            gq, gk, gv = _product_grads(pick(qs[0], qs[1]), pick(first, second))
            zero = jnp.zeros_like(gq)
            dq = [dq[0] + pick(gq, zero), dq[1] + pick(zero, gq)]
            g, none = (gk, gv), jax.tree.map(jnp.zeros_like, (gk, gv))
            acc = [add(acc[0], pick(g, none)), add(acc[1], pick(none, g))]
        acc = jax.lax.ppermute(acc, axes, perm)
        block = ahead
    dq = jnp.concatenate(dq, axis=1).astype(q.dtype)
    dk, dv = (jnp.concatenate([acc[0][i], acc[1][i]], axis=1) for i in (0, 1))
    return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_backward)


def _product_grads(queries, block):
    """(d q, d k, d v), float32, of one product of the ring: queries (q, d_out, lse, D, positions,
    segment ids) against a key block (k, v, positions, segment ids), the probabilities recomputed
    from the forward's log-sum-exp."""
    q, d_out, lse, d, q_pos, q_seg = queries
    k, v, k_pos, k_seg = block
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
    allowed = ((q_pos[:, :, None] >= k_pos[:, None, :]) & (q_seg[:, :, None] == k_seg[:, None, :]))[
        :, None, None
    ]
    p = jnp.where(allowed, jnp.exp(scores - lse[..., None]), 0.0)
    dv = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(v.dtype), d_out, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bqkgd,bskd->bkgqs", d_out, v, preferred_element_type=jnp.float32)
    ds = p * (dp - d[..., None])
    dq = jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(k.dtype), k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(q.dtype), q, preferred_element_type=jnp.float32)
    return dq, dk, dv


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


def _lse(state):
    """The log-sum-exp of each query's scores (b, kv_heads, group, q), from a finished streaming softmax."""
    m, total, _ = state
    return m + jnp.log(total)


def _finish(state, dtype):
    """The attention output (b, q, kv_heads, group, d) of a finished streaming softmax (every query
    sees at least its own key: the sums are positive)."""
    _, total, acc = state
    return jnp.moveaxis(acc / total[..., None], 3, 1).astype(dtype)
