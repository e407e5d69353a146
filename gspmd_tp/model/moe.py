"""Mixture of experts: the router and the experts' dropless dispatch (model.num_experts > 0).

Router (Mixtral, Qwen3-MoE): a softmax over every expert of the token's router logits (float32),
then its top model.experts_per_token, their weights renormalised to sum to 1 or not
(model.router_renormalize). Every token reaches each of its experts: nothing is dropped, so the
layer computes the same on every mesh as on one device.

Dispatch (`experts`), exact on every platform: the tokens of each expert group are sorted by expert
and each expert's rows multiplied by its weights in one grouped product (jax.lax.ragged_dot). Where a
rule file splits `experts` over mesh axes, it is Megatron's all-gather dispatcher as a shard_map over
the rules' axes: the devices that share a batch shard's expert axes gather their tokens, each
computes its own experts' share of every token, and the sums are reduce-scattered back to the
tokens' devices (each expert's hidden width may be split too, over the mesh axes of `mlp`, and its
partial sums added). No mesh axis is named here: they are read from the logical axis rules.

The router's statistics are sown into the "intermediates" collection, one row per layer, for the
load-balancing and z losses (`router_losses`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp

from gspmd_tp.model import kernels
from gspmd_tp.sharding.axes import BATCH, EMBED, EXPERTS, LENGTH, MLP
from gspmd_tp.sharding.rules import axes_of

if TYPE_CHECKING:
    from gspmd_tp.model.transformer import ModelConfig

# The logical axes of the experts' weights, gate_up (experts, embed, 2, mlp) and down (experts,
# mlp, embed), and of the router's (embed, experts).
EXPERT_IN, EXPERT_OUT = (EXPERTS, EMBED, None, MLP), (EXPERTS, MLP, EMBED)
ROUTER_AXES = (EMBED, EXPERTS)
# What each MoE layer sows: assignments per expert (experts,), router probabilities summed over the
# tokens (experts,), and the squared log-sum-exp of the router logits summed over the tokens ().
STATS = ("expert_counts", "router_probs", "router_z")
# And under a model.moe_buffer_factor: the token-expert assignments its receive buffers left out ().
DROPPED = "expert_dropped"
# model.moe_dispatch: auto (ragged on TPU and GPU, gather elsewhere), gather (the all-gather
# dispatcher), ragged (tokens sent to their experts' devices and back by ragged_all_to_all).
DISPATCHES = ("auto", "gather", "ragged")
# The exchange the ragged dispatch runs; a test substitutes an emulation, XLA:CPU having none.
_ragged_all_to_all = jax.lax.ragged_all_to_all


def dispatch_implementation(choice: str, platform: str | None = None) -> str:
    """What model.moe_dispatch `choice` means on `platform` (by default JAX's default backend):
    auto is ragged on TPU and GPU, gather elsewhere (XLA:CPU has no ragged-all-to-all)."""
    if choice != "auto":
        return choice
    return "ragged" if (platform or jax.default_backend()) in ("tpu", "gpu") else "gather"


def route(x_ble, w_router, k: int, renormalize: bool):
    """(weights (batch, length, k) float32, expert ids (batch, length, k) int32, stats) of tokens
    x (batch, length, embed) under the router's float32 weight (embed, experts): the softmax over all
    experts, its top k, renormalised to sum to 1 where `renormalize`. stats: STATS' sums over these
    tokens."""
    logits_blx = jnp.einsum("ble,ex->blx", x_ble.astype(jnp.float32), w_router)
    logits_blx = nn.with_logical_constraint(logits_blx, (BATCH, LENGTH, None))
    probs_blx = jax.nn.softmax(logits_blx, axis=-1)
    weights_blk, ids_blk = _top_k(probs_blx, k)
    if renormalize:
        weights_blk = weights_blk / weights_blk.sum(-1, keepdims=True)
    stats = {
        "expert_counts": jax.nn.one_hot(ids_blk, w_router.shape[1], dtype=jnp.float32).sum((0, 1, 2)),
        "router_probs": probs_blx.sum((0, 1)),
        "router_z": jnp.square(jax.nn.logsumexp(logits_blx, axis=-1)).sum(),
    }
    return weights_blk, ids_blk, stats


def _top_k(probs_blx, k: int):
    """jax.lax.top_k over the last axis, each device over its own tokens: a shard_map over the
    tokens' mesh axes, since the partitioner runs XLA:CPU's TopK whole (every device's probabilities
    gathered onto every device, found in the compiled step)."""
    mesh = jax.sharding.get_abstract_mesh()
    tokens = None if mesh.empty else nn.logical_to_mesh_axes((BATCH, LENGTH, None))
    if tokens is None or jax.sharding.AxisType.Manual in mesh.axis_types:
        return jax.lax.top_k(probs_blx, k)
    ways = [math.prod(mesh.shape[a] for a in axes_of(e)) for e in tokens[:2]]
    if any(n % w for n, w in zip(probs_blx.shape, ways, strict=False)):
        return jax.lax.top_k(probs_blx, k)
    return jax.shard_map(
        lambda p: tuple(jax.lax.top_k(p, k)), mesh=mesh, in_specs=tokens, out_specs=(tokens, tokens)
    )(probs_blx)


def router_losses(intermediates, k: int) -> dict:
    """The router's losses and balance over a batch, from the stats every MoE layer sowed into
    `intermediates` (the model's "intermediates" collection), each averaged over the layers:
    aux_loss, Switch's load-balancing loss E * sum_e f_e * P_e (f_e the share of the token-expert
    assignments expert e took, P_e its mean router probability; 1 when balanced); z_loss, ST-MoE's
    mean squared log-sum-exp of the logits; and max_load, the largest expert's share of the
    assignments over the mean share (1 when balanced), the worst layer's. Where the layers sowed
    DROPPED (a model.moe_buffer_factor), also dropped: the share of all layers' assignments that
    the ragged exchange's receive buffers left out (0 when no device's load exceeded its buffer)."""
    found = {name: [] for name in STATS + (DROPPED,)}
    for path, leaf in jax.tree_util.tree_flatten_with_path(intermediates)[0]:
        keys = {getattr(p, "key", None) for p in path}
        for name in found:
            if name in keys:
                found[name].append(leaf)
    counts = jnp.concatenate([c.reshape(-1, c.shape[-1]) for c in found["expert_counts"]])  # (layers, E)
    probs = jnp.concatenate([p.reshape(-1, p.shape[-1]) for p in found["router_probs"]])
    z = jnp.concatenate([z.reshape(-1) for z in found["router_z"]])  # (layers,)
    tokens = counts.sum(-1) / k  # each token makes k assignments
    n = counts.shape[-1]
    share = counts / counts.sum(-1, keepdims=True)
    out = {
        "aux_loss": (n * (share * probs / tokens[:, None]).sum(-1)).mean(),
        "z_loss": (z / tokens).mean(),
        "max_load": (n * share.max(-1)).max(),
    }
    if found[DROPPED]:
        out["dropped"] = sum(d.sum() for d in found[DROPPED]) / counts.sum()
    return out


# --- dispatch ---


def experts(cfg: ModelConfig, x_ble, weights_blk, ids_blk, w_in, w_out):
    """(sum_j weights[j] * expert_{ids[j]}(x) of tokens x (batch, length, embed), the number of
    token-expert assignments the ragged exchange's receive buffers left out (float32 (), 0 but
    under a model.moe_buffer_factor that some device's load exceeds)): SwiGLU experts w_in
    (experts, embed, 2, mlp), w_out (experts, mlp, embed) in the compute dtype, SwiGLU's gradient
    in one pass where model.mlp_grad means one_pass (kernels.mlp_implementation). Under a mesh
    whose rules the shapes divide, the sharded dispatch (_sharded); else every expert on this
    program's tokens (no mesh, inside another shard_map, a batch of one row at initialisation)."""
    one_pass_gradient = kernels.mlp_implementation(cfg) == "one_pass"
    layout = _layout()
    if layout is not None and _divides(layout, x_ble.shape, w_in.shape):
        grad_dtype = kernels._gradient_dtype(cfg.grad_dtype, w_in.dtype)
        # The ragged exchange where every expert axis splits the batch (else the tokens are whole there)
        ragged = (
            dispatch_implementation(cfg.moe_dispatch) == "ragged" and layout["experts"] and not layout["rest"]
        )
        factor = cfg.moe_buffer_factor if ragged else None
        y, dropped = _sharded(
            layout, x_ble, weights_blk, ids_blk, w_in, w_out, one_pass_gradient, grad_dtype, factor
        )
        return y, dropped.sum()
    b, length, d = x_ble.shape
    k = ids_blk.shape[-1]
    y_td = _grouped(
        x_ble.reshape(-1, d),
        weights_blk.reshape(-1, k),
        ids_blk.reshape(-1, k),
        w_in,
        w_out,
        0,
        one_pass_gradient,
    )
    return y_td.reshape(b, length, d).astype(x_ble.dtype), jnp.zeros((), jnp.float32)


def _grouped(x_td, weights_tk, ids_tk, w_in, w_out, first: int | jax.Array, one_pass_gradient: bool):
    """The experts first..first + w_in.shape[0] applied to the tokens x (tokens, embed) routed to
    them (ids (tokens, k), weights (tokens, k)), each token's weighted sum in float32 (tokens,
    embed); the other assignments add nothing. The assignments are sorted by expert (the others
    last) and each expert's rows multiplied in one grouped product: ragged_dot leaves the rows past
    the groups zero."""
    t, k = ids_tk.shape
    n, d, _, m = w_in.shape
    local = ids_tk.reshape(-1) - first  # (t * k,)
    key = jnp.where((local >= 0) & (local < n), local, n)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=n + 1)[:n].astype(jnp.int32)
    rows = order // k  # the token of each sorted assignment
    gate_up = jax.lax.ragged_dot(jnp.take(x_td, rows, axis=0), w_in.reshape(n, d, 2 * m), sizes).reshape(
        t * k, 2, m
    )
    hidden = kernels.swiglu(gate_up, one_pass_gradient)
    out = jax.lax.ragged_dot(hidden, w_out, sizes, preferred_element_type=jnp.float32)  # (t * k, d)
    out = out * weights_tk.reshape(-1)[order][:, None].astype(jnp.float32)
    return jnp.zeros((t, d), jnp.float32).at[rows].add(out)


def _layout() -> dict | None:
    """Where the rules being traced with place the dispatch's operands: `batch` and `length` (the
    tokens' mesh axes), `experts` (the experts' weights' mesh axes, those of the tokens' length left
    out), `hidden` (the mesh axes of the experts' hidden width: those of `mlp` in the activations),
    `fsdp` (the mesh axes the weights' model width lies over: gathered inside the map, their
    gradient reduce-scattered back), `gather` (the experts' axes that also split the batch: the
    tokens are gathered over them) and `rest` (the experts' axes that do not: the tokens are already
    whole there). None with no mesh or inside another shard_map."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or jax.sharding.AxisType.Manual in mesh.axis_types:
        return None
    batch, length, hidden = (axes_of(a) for a in nn.logical_to_mesh_axes((BATCH, LENGTH, MLP)))
    weight = [axes_of(a) for a in nn.logical_to_mesh_axes(EXPERT_IN)]
    split = tuple(a for a in weight[0] if a not in length)
    hidden = tuple(a for a in hidden if a not in split)
    return {
        "batch": batch,
        "length": length,
        "experts": split,
        "hidden": hidden,
        "fsdp": tuple(a for a in weight[1] if a not in split + hidden),
        "gather": tuple(a for a in split if a in batch),
        "rest": tuple(a for a in split if a not in batch),
    }


def _divides(layout: dict, x_shape: tuple, w_in_shape: tuple) -> bool:
    """Whether the mesh splits the tokens (batch, length, embed) and the experts' weights
    (experts, embed, 2, mlp) evenly as `layout` places them."""
    mesh = jax.sharding.get_abstract_mesh()
    ways = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
    return (
        x_shape[0] % ways(layout["batch"]) == 0
        and x_shape[1] % ways(layout["length"]) == 0
        and w_in_shape[0] % ways(layout["experts"]) == 0
        and w_in_shape[-1] % ways(layout["hidden"]) == 0
        and w_in_shape[1] % ways(layout["fsdp"]) == 0
    )


def _sharded(
    layout: dict, x_ble, weights_blk, ids_blk, w_in, w_out, one_pass_gradient: bool, grad_dtype, factor=None
):
    """`experts` as a shard_map over the mesh: each device gathers the tokens of the devices that
    share its batch shard's other axes (layout["gather"]), applies its own experts (its share of
    each one's hidden width) to them, and the sums are reduce-scattered back over those axes and
    added over the hidden width's and the other experts' axes. With a buffer `factor` (the ragged
    dispatch, where every expert axis splits the batch) each device sends each token-expert
    assignment to the device holding the expert instead and gets its output back (_exchanged).
    Returns the outputs and the assignments left out, per batch and length shard (float32)."""
    gather, split, fsdp = layout["gather"], layout["experts"], layout["fsdp"]
    reduce = layout["hidden"] + layout["rest"]

    def body(x, w, ids, wi, wo):
        if fsdp:  # ZeRO-3: the weights gathered here, their gradients reduce-scattered onto the shards
            wi, wo = kernels._gather(wi, fsdp, 1, grad_dtype), kernels._gather(wo, fsdp, 2, grad_dtype)
        if reduce:  # marked as varying there before the products do it: so the backward sums
            # the tokens' gradients over those axes at their own size, not once per assignment
            x, w = (jax.lax.pcast(a, reduce, to="varying") for a in (x, w))
        if factor is not None:
            b, length, d = x.shape
            k = ids.shape[-1]
            flat = (x.reshape(-1, d), w.reshape(-1, k), ids.reshape(-1, k))
            y, dropped = _exchanged(*flat, wi, wo, split, one_pass_gradient, factor)
            y = y.reshape(b, length, d).astype(x.dtype)
            return (jax.lax.psum(y, reduce) if reduce else y), dropped.reshape(1, 1)
        if gather:
            x, w, ids = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (x, w, ids))
        b, length, d = x.shape
        k = ids.shape[-1]
        first = jax.lax.axis_index(split) * wi.shape[0] if split else 0
        y = _grouped(x.reshape(-1, d), w.reshape(-1, k), ids.reshape(-1, k), wi, wo, first, one_pass_gradient)
        y = y.reshape(b, length, d).astype(x.dtype)  # the sums cross devices in the compute dtype
        if gather:
            y = jax.lax.psum_scatter(y, gather, scatter_dimension=0, tiled=True)
        return (jax.lax.psum(y, reduce) if reduce else y), jnp.zeros((1, 1), jnp.float32)

    tokens = nn.logical_to_mesh_axes((BATCH, LENGTH, None))
    # The weights' specs: experts over the layout's expert axes, the hidden width over its hidden
    # axes, the model width over its FSDP axes.
    mine = ((EXPERTS, split or None), (MLP, layout["hidden"] or None), (EMBED, fsdp or None))
    w_in_spec, w_out_spec = (
        nn.logical_to_mesh_axes(n, mine) for n in ((EXPERTS, EMBED, None, MLP), (EXPERTS, MLP, EMBED))
    )
    return jax.shard_map(
        body,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(tokens, tokens, tokens, w_in_spec, w_out_spec),
        out_specs=(tokens, nn.logical_to_mesh_axes((BATCH, LENGTH))),  # one count a token shard
    )(x_ble, weights_blk, ids_blk, w_in, w_out)


def receive_rows(tokens: int, k: int, local: int, group: int, factor: float = 0.0) -> int:
    """Rows of a device's receive buffer in the ragged exchange, where each of the `group` devices
    sends the k assignments of its `tokens` tokens and holds `local` experts: the worst case
    (factor 0), every token of the group sending its assignments to one device, at most
    min(local, k) of a token's k distinct experts there; else `factor` times the balanced load (the
    tokens * k rows a device receives when the routing is even), never more than the worst case."""
    worst = group * tokens * min(local, k)
    return worst if factor <= 0 else min(worst, math.ceil(factor * tokens * k))


def _exchanged(x_td, weights_tk, ids_tk, w_in, w_out, axes: tuple, one_pass_gradient: bool, factor=0.0):
    """Inside the dispatch's map, where the mesh `axes` split both the tokens and the experts (w_in
    holds this device's n experts, device j's the j-th n of them): (each token's weighted sum over
    its k experts (tokens, embed) float32, the number of this device's assignments left out (1,)
    float32), by two ragged exchanges. The assignments are sorted by expert, so each device's rows
    are one slice; the per-expert counts are all-gathered, from which every device knows what it
    sends each peer and where in the peer's buffer it lands (after the rows of the devices before
    it), and what it receives. The received rows (grouped by sender, each sender's by expert) are
    sorted by expert, multiplied in one grouped product, and sent back to where they came from.
    The receive buffer holds receive_rows(factor) rows: by default the worst case's, and nothing
    is left out. With a smaller one a device keeps the first rows that fit, in sender order (each
    sender's sorted by expert); the rest are left out of the exchange, adding nothing to their
    tokens' sums (their tokens keep the residual and their other experts' outputs)."""
    t, k = ids_tk.shape
    n, d, _, m = w_in.shape
    g = jax.lax.axis_size(axes)
    me = jax.lax.axis_index(axes)
    flat = ids_tk.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    tokens = order // k  # the token of each sorted assignment
    counts = jnp.bincount(flat, length=n * g).astype(jnp.int32)  # this device's rows per expert
    # [sender, receiver, receiver's expert]: the rows every device sends every device, per expert
    every = jax.lax.all_gather(counts, axes, axis=0, tiled=False).reshape(g, g, n)
    rows = receive_rows(t, k, n, g, factor)
    between = every.sum(-1)  # [sender, receiver]
    # where my rows land in each receiver's buffer: after the rows of the senders before me
    landing = jnp.cumsum(between, axis=0) - between  # [sender, receiver]
    fits = rows >= receive_rows(t, k, n, g)  # the worst case's buffer: everything fits
    kept = between if fits else jnp.clip(rows - landing, 0, between)  # what fits, in sender order
    send_sizes, recv_sizes = kept[me], kept[:, me]
    input_offsets = jnp.cumsum(between[me]) - between[me]  # in my sorted rows
    sent = x_td[tokens]
    got = _ragged_all_to_all(
        sent,
        _buffer(rows, sent),
        input_offsets,
        send_sizes,
        landing[me] if fits else jnp.where(send_sizes > 0, landing[me], 0),
        recv_sizes,
        axis_name=axes,
    )
    # Each received row's local expert: the senders' slices in order, each sorted by expert (the
    # first kept rows of it); the rows past them are padding (expert n, left zero by the products).
    mine = jax.lax.dynamic_index_in_dim(every, me, axis=1, keepdims=False)  # [sender, my expert]
    if not fits:
        mine = jnp.clip(recv_sizes[:, None] - (jnp.cumsum(mine, axis=1) - mine), 0, mine)
    local = jnp.repeat(jnp.tile(jnp.arange(n), g), mine.reshape(-1), total_repeat_length=rows)
    local = jnp.where(jnp.arange(rows) < mine.sum(), local, n)
    by_expert = jnp.argsort(local, stable=True)
    sizes = mine.sum(0).astype(jnp.int32)
    gate_up = jax.lax.ragged_dot(got[by_expert], w_in.reshape(n, d, 2 * m), sizes).reshape(-1, 2, m)
    hidden = kernels.swiglu(gate_up, one_pass_gradient)
    out = jax.lax.ragged_dot(hidden, w_out, sizes).astype(x_td.dtype)  # back in the compute dtype
    out = jnp.zeros_like(out).at[by_expert].set(out)  # in the order received
    # Back to the senders: my slice from sender s returns to where s's own rows for me began.
    recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
    starts = jnp.cumsum(between, axis=1) - between  # [sender, receiver]: in the sender's sorted rows
    back = _ragged_all_to_all(
        out,
        _buffer(t * k, out),
        recv_offsets,
        recv_sizes,
        starts[:, me],
        send_sizes,
        axis_name=axes,
    )
    back = back.astype(jnp.float32) * weights_tk.reshape(-1)[order][:, None].astype(jnp.float32)
    dropped = (between[me].sum() - send_sizes.sum()).astype(jnp.float32).reshape(1)
    return jnp.zeros((t, d), jnp.float32).at[tokens].add(back), dropped


def _buffer(rows: int, like):
    """A zero receive buffer of `rows` rows like `like`'s, varying over the mesh axes `like` does and
    outside autodiff: left to the map's type rules, a constant's buffer is marked varying inside
    the exchange and its cotangent summed over every device (found in the compiled TPU step)."""
    vma = tuple(sorted(jax.typeof(like).manual_axis_type.varying))
    zeros = jnp.zeros((rows,) + like.shape[1:], like.dtype)
    return jax.lax.stop_gradient(jax.lax.pcast(zeros, vma, to="varying") if vma else zeros)
