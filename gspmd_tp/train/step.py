"""The jit-compiled train and eval steps of a Setup: loss sums, gradient accumulation over
microbatches (reduced over data parallelism once per step where the sharding allows), a mixture of
experts' router losses in the objective, clipping and AdamW with the state donated.

A batch is a dict of (batch, ...) int32 arrays (pipeline.global_batch): "tokens" (batch, seq_len +
1), and under config.data.document_mask "segment_ids" and "positions" (batch, seq_len) of the
inputs, which the model masks attention and places rotary positions by. A bare token array is a
batch of one sequence per row.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from gspmd_tp.data import pipeline
from gspmd_tp.model import context, moe
from gspmd_tp.model.transformer import Transformer
from gspmd_tp.sharding import axes
from gspmd_tp.sharding.rules import axes_of, batch_mesh_axes, mesh_ways
from gspmd_tp.train import loss as loss_lib
from gspmd_tp.train import state as state_lib

if TYPE_CHECKING:  # run_setup builds the Setup; trainer calls this module
    from gspmd_tp.train.run_setup import Setup


def batch_tokens(batch):
    """The (batch, seq_len + 1) token array of a step's batch (a dict, or the tokens themselves)."""
    return batch["tokens"] if isinstance(batch, dict) else batch


def _loss_sums(model: Transformer, params, batch, loss_chunk: int = 0, padded: bool = False):
    """(sum of token losses, number of tokens) for a batch of (batch, seq_len + 1) tokens, with
    their inputs' segment_ids and positions where it holds them (packed documents kept apart).

    loss_chunk > 0 computes the logits that many positions at a time (see gspmd_tp/loss.py).
    padded: the tokens may hold data.PAD (an evaluation pass's last batch), whose targets do not count.
    """
    return _loss_sums_and_router(model, params, batch, loss_chunk, padded)[:2]


def _loss_sums_and_router(model: Transformer, params, batch, loss_chunk: int = 0, padded: bool = False):
    """_loss_sums and the router's losses of a mixture-of-experts model over this batch
    (moe.router_losses; {} for a dense model)."""
    tokens = batch_tokens(batch)
    documents = {}
    if isinstance(batch, dict) and "segment_ids" in batch:
        documents = {"segment_ids_bl": batch["segment_ids"], "positions_bl": batch["positions"]}
    inputs, targets, valid = tokens[:, :-1], tokens[:, 1:], None
    if padded:
        valid = targets != pipeline.PAD
        inputs, targets = (jnp.where(t == pipeline.PAD, 0, t) for t in (inputs, targets))
    shards = context.balanced_shards(model.cfg)
    if shards:
        inputs, targets, valid, documents = _zigzag(shards, inputs, targets, valid, documents)
        documents["zigzag"] = True
    out, router = _apply(model, params, inputs, return_hidden=bool(loss_chunk), documents=documents)
    if loss_chunk:
        hidden, head = out
        sums = loss_lib.chunked_cross_entropy_sums(
            hidden, head, targets, loss_chunk, valid, model.cfg.vocab_tokens, model.cfg.grad_dtype
        )
    else:
        sums = loss_lib.cross_entropy_sums(out, targets, valid)
    return (*sums, router)


def _zigzag(shards: int, inputs, targets, valid, documents: dict):
    """(inputs, targets, valid, documents) laid out in context.zigzag_order over `shards` context
    devices, and documents' positions_bl the true positions (the original ones where there are
    none). The same permutation of every (batch, seq_len) array: the sum of token losses is the
    same, and so is every token's loss. Each row is whole on its devices here (the batch is split
    by rows), so the reorder moves nothing between devices."""
    order = context.zigzag_order(inputs.shape[1], shards)
    take = lambda x: None if x is None else jnp.take(x, order, axis=1)  # noqa: E731
    documents = {k: take(v) for k, v in documents.items()}
    documents.setdefault("positions_bl", jnp.broadcast_to(jnp.asarray(order), inputs.shape))
    return take(inputs), take(targets), take(valid), documents


def _apply(model: Transformer, params, inputs, return_hidden: bool, documents: dict):
    """(model.apply's output, the router's losses): an MoE model's layers sow their router
    statistics, read here; a dense model's apply is as it always was. `documents`: the inputs'
    segment_ids_bl and positions_bl, or {}, and zigzag where they are in context.zigzag_order."""
    if not model.cfg.num_experts:
        return model.apply({"params": params}, inputs, return_hidden=return_hidden, **documents), {}
    out, state = model.apply(
        {"params": params}, inputs, return_hidden=return_hidden, mutable=["intermediates"], **documents
    )
    return out, moe.router_losses(state["intermediates"], model.cfg.experts_per_token)


# The router's losses in a step's stats (mean over the microbatches), by moe.router_losses' names.
# "dropped": the share of assignments a full receive buffer left out, under model.moe_buffer_factor alone.
ROUTER_STATS = {
    "aux_loss": "router_aux_loss",
    "z_loss": "router_z_loss",
    "max_load": "expert_max_load",
    "dropped": "expert_dropped",
}


def _objective_and_grad(model: Transformer, params, batch_i, count: int, accum: int, loss_chunk: int):
    """((loss, router stats), gradient) of one microbatch: loss its token losses' sum over the
    whole batch's `count` tokens; the gradient that loss's plus, for an MoE model, the router's
    losses weighted by model.router_aux_loss_coef and model.router_z_loss_coef, each a mean over
    the `accum` microbatches (as are the stats, ROUTER_STATS' names)."""
    cfg = model.cfg

    def objective(p):
        total, _, router = _loss_sums_and_router(model, p, batch_i, loss_chunk)
        loss = total / count
        if not router:
            return loss, (loss, {})
        extra = cfg.router_aux_loss_coef * router["aux_loss"] + cfg.router_z_loss_coef * router["z_loss"]
        stats = {ROUTER_STATS[k]: v / accum for k, v in router.items()}
        return loss + extra / accum, (loss, stats)

    (_, aux), grads = jax.value_and_grad(objective, has_aux=True)(params)
    return aux, grads


def accumulated_grads(*args, **kwargs):
    """(mean token loss, gradient of it): accumulated_grads_and_stats without the router's stats."""
    loss, grads, _ = accumulated_grads_and_stats(*args, **kwargs)
    return loss, grads


def accumulated_grads_and_stats(
    model: Transformer,
    accum: int,
    param_shardings,
    params,
    batch,
    loss_chunk: int = 0,
    reduce_dtype: str = "float32",
):
    """(mean token loss, gradient of it, router stats) for a batch (the module docstring) of
    (batch, seq_len + 1) tokens, over `accum` microbatches.

    Each microbatch differentiates its loss sum already divided by the tokens of the whole batch
    (a constant), so the gradients sum to the full-batch gradient for any `accum` and no pass over
    the gradients is left to divide them afterwards. Call it under the run's logical rules.

    Where no parameter is sharded over the batch's mesh axes (dp, Megatron), every batch shard
    keeps its own partial sum over the microbatches, and the data-parallel reduction runs once per
    step instead of once per microbatch. Where parameters are (FSDP, 2D), each microbatch's
    gradient is reduce-scattered onto them, as a sharded parameter needs.

    reduce_dtype "bfloat16": the gradients cross the batch axes in bfloat16 and come back as the
    parameters' dtype. Where the step sums microbatches per batch shard, each shard's sum is rounded
    once and all-reduced; elsewhere the products that make the gradients write bfloat16
    (model.grad_dtype), so that the reductions GSPMD places on them run in it (norm scales'
    gradients, a few floats per layer, stay float32). For one microbatch the shard_map would sum
    nothing locally, and under tensor parallelism the TPU compiler moves more bytes with it.

    The router's stats of a mixture-of-experts model ({} for a dense one): its losses (in the
    gradient, weighted by their model.router_*_coef) and balance, each a mean over the microbatches
    (ROUTER_STATS' names). The loss returned is the token loss alone.
    """
    b, t = batch_tokens(batch).shape
    count = b * (t - 1)
    batch_axes = batch_mesh_axes()
    # The router's losses are not sums over tokens, so an MoE model's microbatch is never split into
    # per-shard partial sums: each shard's would be its own tokens' balance, not the microbatch's.
    moe_model = bool(model.cfg.num_experts)
    if accum > 1 and not moe_model and sums_per_batch_shard(batch_axes, param_shardings, b // accum):
        micro = _microbatches(batch, accum)
        loss, grads = _shard_partial_sums(
            model, micro, count, batch_axes, params, param_shardings, loss_chunk, reduce_dtype
        )
        return loss, grads, {}
    if reduce_dtype != "float32":
        # GSPMD reduces each gradient where the backward pass makes it, in the dtype it is made in.
        model = Transformer(dataclasses.replace(model.cfg, grad_dtype=reduce_dtype))

    def loss_and_grad(batch_i):
        return _objective_and_grad(model, params, batch_i, count, accum, loss_chunk)

    if accum == 1:
        (loss, stats), grads = loss_and_grad(batch)
    else:
        (loss, stats), grads = _summed_over_microbatches(
            loss_and_grad, _microbatches(batch, accum), params, param_shardings
        )
    return loss, grads, stats


def _microbatches(batch, accum: int):
    """Each (batch, n) array of the batch as (accum, batch / accum, n): microbatch i takes rows i,
    i + accum, ..., so that each stays spread over the batch axes."""

    def split(x):
        b, n = x.shape
        return nn.with_logical_constraint(
            x.reshape(b // accum, accum, n).swapaxes(0, 1), (None, axes.BATCH, None)
        )

    return jax.tree.map(split, batch)


def _summed_over_microbatches(loss_and_grad, micro, params, param_shardings):
    """loss_and_grad's (values, gradients) summed over the microbatches (values: a tree of float32
    arrays, the loss and stats), the gradients' sum laid out as the parameters are."""

    def body(carry, batch_i):
        grads_acc, values_acc = carry
        values_i, grads_i = loss_and_grad(batch_i)
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads_i)
        grads_acc = jax.lax.with_sharding_constraint(grads_acc, param_shardings)
        return (grads_acc, jax.tree.map(jnp.add, values_acc, values_i)), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    # The loss and stats' shapes, from a trace of one microbatch (nothing computed).
    first = jax.tree.map(lambda x: x[0], micro)
    values = jax.tree.map(lambda v: jnp.zeros(v.shape, v.dtype), jax.eval_shape(loss_and_grad, first)[0])
    (grads, values), _ = jax.lax.scan(body, (zeros, values), micro)
    return values, grads


def sums_per_batch_shard(batch_axes: tuple, param_shardings, micro_batch: int) -> bool:
    """Whether accumulated_grads sums the microbatches' gradients per batch shard and reduces them
    over `batch_axes` once per step: no parameter is sharded over those axes, and a microbatch of
    `micro_batch` rows splits evenly over them."""
    mesh = jax.tree.leaves(param_shardings)[0].mesh
    shards, _ = mesh_ways(mesh.shape, batch_axes)
    sharded = {a for sh in jax.tree.leaves(param_shardings) for e in sh.spec for a in axes_of(e)}
    return shards > 1 and micro_batch % shards == 0 and not sharded & set(batch_axes)


def grad_reduce_dtype(s: Setup) -> str:
    """The dtype the step reduces gradients over data parallelism in: config.optim.grad_reduce_dtype
    where the batch is split over more than one device, else float32 (nothing to reduce)."""
    shards, _ = mesh_ways(s.mesh.shape, s.rules.batch_axes())
    return s.config.optim.grad_reduce_dtype if shards > 1 else "float32"


def _shard_partial_sums(
    model, micro, count, batch_axes: tuple, params, param_shardings, loss_chunk, reduce_dtype
):
    """accumulated_grads for parameters not sharded over `batch_axes`: manual over those axes
    (shard_map; GSPMD still shards the rest), each batch shard sums its microbatches' gradients
    locally, and one psum over the batch axes, in `reduce_dtype`, reduces the sums."""
    mesh = jax.tree.leaves(param_shardings)[0].mesh
    # Inside, a shard's rows are local: no activation may name the manual axes.
    inner = tuple(
        (name, tuple(a for a in axes_of(target) if a not in batch_axes) or None)
        for name, target in nn.get_logical_axis_rules()
    )

    def local(params, micro):  # micro's arrays: (accum, rows of this shard, seq_len [+ 1])
        def body(carry, batch_i):
            grads_acc, loss_acc = carry
            loss_i, grads_i = jax.value_and_grad(
                lambda p: _loss_sums(model, p, batch_i, loss_chunk)[0] / count
            )(params)
            return (jax.tree.map(jnp.add, grads_acc, grads_i), loss_acc + loss_i), None

        with nn.logical_axis_rules(inner):
            zeros = jax.tree.map(jnp.zeros_like, params)
            (grads, loss), _ = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), micro)
        if reduce_dtype == "float32":
            return jax.lax.psum((loss, grads), batch_axes)
        # Rounded once, after the local sum; each shard's sum leaves the map as one row of a stack
        # that GSPMD sums below. (A psum of bfloat16 here, with axes left to GSPMD, crashes
        # XLA:CPU's all-reduce promotion.)
        return jax.lax.psum(loss, batch_axes), jax.tree.map(lambda g: g.astype(reduce_dtype)[None], grads)

    # check_vma=False: the model's custom VJPs (kernels.py, the cotangent constraint) return cotangents
    # without shard_map's varying-axes types; nothing here is differentiated through the map.
    stacked = reduce_dtype != "float32"
    loss, grads = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(None, batch_axes, None)),
        out_specs=(P(), P(batch_axes) if stacked else P()),
        axis_names=set(batch_axes),
        check_vma=False,
    )(params, micro)
    if stacked:  # (batch shards, ...) -> the all-reduce over the batch axes, in reduce_dtype
        zero = jnp.zeros((), reduce_dtype)
        grads = jax.tree.map(lambda g: jax.lax.reduce(g, zero, jax.lax.add, (0,)), grads)
        grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return loss, jax.lax.with_sharding_constraint(grads, param_shardings)


def make_train_step(s: Setup):
    """The jit-compiled step: accumulate gradients over microbatches, clip, AdamW; state donated.

    With config.skip_nonfinite_steps a step whose loss or gradient is NaN/Inf keeps the old
    parameters and optimizer state (a select on device, no host sync); only the step counter moves.
    """
    model = Transformer(s.model_cfg)
    skip_nonfinite = s.config.skip_nonfinite_steps

    def step(state: state_lib.TrainState, batch):
        loss, grads, router = accumulated_grads_and_stats(
            model,
            s.config.grad_accum,
            s.shardings.params,
            state.params,
            batch,
            s.config.loss_chunk,
            grad_reduce_dtype(s),
        )
        grad_norm = optax.global_norm(grads)
        updates, opt_state = s.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if skip_nonfinite:
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            keep = lambda new, old: jnp.where(finite, new, old)
            params = jax.tree.map(keep, params, state.params)
            opt_state = jax.tree.map(keep, opt_state, state.opt_state)
        new_state = state_lib.TrainState(step=state.step + 1, params=params, opt_state=opt_state)
        # The rate this update used: the optimizer's own step count, which a skipped step leaves.
        counts = optax.tree_utils.tree_get_all_with_path(state.opt_state, "count")
        lr = s.schedule(counts[0][1] if counts else state.step)
        stats = {"loss": loss, "grad_norm": grad_norm, "learning_rate": lr, **router}
        return new_state, stats

    replicated = state_lib.replicated(s.mesh)
    return jax.jit(
        step,
        in_shardings=(s.shardings, s.batch_sharding),
        out_shardings=(s.shardings, replicated),
        donate_argnums=(0,),
    )


def make_eval_step(s: Setup):
    """jit-compiled (sum of token losses, token count) on one held-out batch; padding rows
    (data.PAD) count no token."""
    model = Transformer(s.model_cfg)

    def step(params, batch):
        loss_sum, count = _loss_sums(model, params, batch, s.config.loss_chunk, padded=True)
        return loss_sum, jnp.asarray(count, jnp.float32)

    return jax.jit(step, in_shardings=(s.shardings.params, s.batch_sharding))


def compile_eval_step(s: Setup):
    """Ahead-of-time compiles the eval step for the setup's abstract parameters and batch."""
    with state_lib.sharding_context(s.mesh, s.rules):
        params = s.abstract_state.params
        lowered = make_eval_step(s).lower(params, abstract_batch(s, s.config.batch_size))
        return lowered.compile(compiler_options=compiler_options(s))


def abstract_batch(s: Setup, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The batch the steps take, as pipeline.global_batch places it: (batch, seq_len + 1) int32
    tokens, and under config.data.document_mask (batch, seq_len) segment ids and positions."""
    length = s.config.seq_len
    batch = {"tokens": jax.ShapeDtypeStruct((batch_size, length + 1), jnp.int32, sharding=s.batch_sharding)}
    if s.config.data.document_mask:
        for key in ("segment_ids", "positions"):
            batch[key] = jax.ShapeDtypeStruct((batch_size, length), jnp.int32, sharding=s.batch_sharding)
    return batch


def host_batch(s: Setup, tokens) -> dict:
    """The batch (numpy) of (batch, seq_len + 1) tokens as the steps of `s` take it (abstract_batch):
    under config.data.document_mask with the segment ids and positions that the separators of
    config.data.tokenizer mark (pipeline.document_segments), as the pipeline reads them."""
    tokens = np.asarray(tokens, np.int32)
    batch = {"tokens": tokens}
    separator = pipeline.document_separator(s.config.data)
    if separator is not None:
        batch["segment_ids"], batch["positions"] = pipeline.document_segments(tokens[:, :-1], separator)
    return batch


def compile_train_step(s: Setup):
    """Ahead-of-time compiles the train step for the setup's abstract state and batch."""
    with state_lib.sharding_context(s.mesh, s.rules):
        lowered = make_train_step(s).lower(s.abstract_state, abstract_batch(s, s.config.batch_size))
        return lowered.compile(compiler_options=compiler_options(s))


# config.overlap: the compiler options each value passes, per platform of the devices the step
# compiles for (the flag names of libtpu 0.0.42 and jaxlib 0.10.2's XLA). "auto" passes none: the
# compiler's own choice, which on the TPU already decomposes the products whose operands exceed
# its size threshold (the V1 windowed einsum, on by default) and on the GPU none (its threshold is
# 100,000 MiB). XLA:CPU has no such pass: nothing is passed there (run_setup warns).
OVERLAP_OPTIONS = {
    "auto": {},
    "none": {
        "tpu": {
            "xla_tpu_enable_windowed_einsum_for_all_gather": False,
            "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
        },
    },
    "collective_matmul": {
        # The V2 collective matmul: every all-gather feeding a product and every reduce-scatter of
        # one, whatever its size, becomes a loop of collective-permutes between partial products.
        "tpu": {
            "xla_tpu_all_gather_collective_matmul_mode": "post_spmd",
            "xla_tpu_reduce_scatter_collective_matmul_mode": "post_spmd",
        },
        # The SPMD partitioner's windowed einsum from 0 MiB up, its partial products on several streams.
        "gpu": {
            "xla_gpu_threshold_for_windowed_einsum_mib": 0,
            "xla_gpu_multi_streamed_windowed_einsum": True,
        },
    },
}


# Passed on every compile for the platform, whatever config.overlap.
PLATFORM_OPTIONS = {
    "tpu": {
        # A gradient is reduce-scattered onto its parameter's shards over groups of 2 devices too:
        # by default the TPU compiler relayouts the gradient (so that the split dimension is the
        # major one) only for larger groups, and over 2 devices, where the split falls on the minor
        # dimension, all-reduces it whole and slices it instead, twice the bytes (FSDP over 2, as in
        # data_fsdp_tensor on 2x2x2: docs/estimates.md, "Both backends").
        "xla_tpu_relayout_group_size_threshold_for_reduce_scatter": 2,
    },
}


def compiler_options(s: Setup) -> dict:
    """The compiler options for the platform the setup's mesh compiles for: PLATFORM_OPTIONS', and
    those config.overlap asks for."""
    platform = s.mesh.devices.flat[0].platform
    return {**PLATFORM_OPTIONS.get(platform, {}), **OVERLAP_OPTIONS[s.config.overlap].get(platform, {})}
