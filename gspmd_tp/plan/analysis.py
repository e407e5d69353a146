"""What a sharding costs by analysis alone, from the setup and nothing compiled: each parameter and
optimizer-state leaf's layout and bytes per device, and the bytes each device must send per step."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import numpy as np

from gspmd_tp.model import moe
from gspmd_tp.model.params import path_str
from gspmd_tp.sharding import axes
from gspmd_tp.sharding.rules import axes_of
from gspmd_tp.train import run_setup
from gspmd_tp.train import step as step_lib
from gspmd_tp.train.state import logical_specs, sharding_context

REPLICATED_FLAG_BYTES = 1 << 20  # flag replicated leaves from 1 MiB up


def leaf_table(s: run_setup.Setup, threshold: int = REPLICATED_FLAG_BYTES) -> list[dict]:
    """One row per parameter and optimizer-state array: path, shape, logical axes, spec, bytes.

    `replicated_over` lists the mesh axes that could shard a leaf of `threshold` bytes or more.
    """
    boxed, _ = logical_specs(s.model_cfg, s.tx)
    mesh_shape = dict(s.mesh.shape)
    is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731
    boxes = jax.tree_util.tree_flatten_with_path(boxed, is_leaf=is_box)[0]
    shardings = jax.tree.leaves(s.shardings)
    rows = []
    for (path, leaf), sharding in zip(boxes, shardings, strict=True):
        names = tuple(leaf.names) if is_box(leaf) else (None,) * len(leaf.shape)
        value = leaf.value if is_box(leaf) else leaf
        spec = tuple(sharding.spec) + (None,) * (len(value.shape) - len(sharding.spec))
        shards = math.prod(mesh_shape[a] for entry in spec for a in axes_of(entry))
        total = int(np.prod(value.shape)) * np.dtype(value.dtype).itemsize
        used = {a for entry in spec for a in axes_of(entry)}
        # A mesh axis could shard this leaf if some unsharded dimension divides by its size.
        could = [
            a
            for a, size in mesh_shape.items()
            if size > 1
            and a not in used
            and any(
                e is None and dim % size == 0 and dim > 1 for dim, e in zip(value.shape, spec, strict=True)
            )
        ]
        p = path_str(path)
        rows.append(
            {
                "path": p,
                "kind": "params" if p.startswith("params/") else "opt_state",
                "shape": list(value.shape),
                "logical": list(names),
                "spec": [list(axes_of(e)) if isinstance(e, tuple) else e for e in spec],
                "bytes": total,
                "bytes_per_device": total // shards,
                "replicated_over": could if total >= threshold else [],
            }
        )
    return rows


def analytical_bytes(s: run_setup.Setup, rows: list[dict], backend: str) -> dict[str, float]:
    """Bytes per device per step that the sharding needs, by source (ring algorithms).

    Tensor parallelism (Megatron), each sublayer over the mesh axes that shard its own hidden
    dimension in the activations: per layer and microbatch, attention all-reduces its output
    forward (axes of `heads`) and its input gradient backward (axes of `kv_heads`, which shard the
    fused q/k/v weight), the MLP one each way (axes of `mlp`), and a vocabulary-sharded embedding
    lookup and output projection one each (axes of `vocab`); under sequence parallelism and 2D
    sharding these become all-gathers plus reduce-scatters of the same bytes. Data parallelism:
    each gradient all-reduced over the batch axes that do not shard it, once per step or, where
    parameters are sharded over those axes, once per microbatch; in bfloat16 with
    config.optim.grad_reduce_dtype (all but the norm scales' unless microbatches are summed per
    batch shard; float32 on XLA:CPU, which promotes it). FSDP (a parameter sharded
    over a batch axis): gathered forward and backward per microbatch, its gradient
    reduce-scattered. XLA:CPU lowers reduce-scatter as all-reduce plus slice, so on the CPU
    backend a reduce-scatter costs an all-reduce. On the TPU backend a float32 model's products
    read bf16 operands (JAX's default precision) and the compiler gathers them after the cast:
    weights and the all-gather half of a sequence-parallel or 2D pair count 2 bytes an element.
    A bf16 model casts each weight where it lies, so the TPU and GPU compilers gather it in bf16 and
    reduce-scatter its gradient in bf16.
    The embedding's gradient is float32 whatever the compute dtype (its lookup adds into a float32
    table). A remat policy's recomputation adds the collectives it runs again.
    Mixture of experts where the rules split `experts` (moe._sharded, the all-gather dispatcher):
    per layer and microbatch, each device's tokens are all-gathered over the expert group's batch
    axes forward and their outputs reduce-scattered back, the output gradients gathered and the
    input gradients scattered backward (in the compute dtype), with the routes (k float32 weights,
    k int32 ids a token) gathered forward and the weights' gradient scattered back; the outputs
    all-reduced forward and the input gradients backward over the axes of the experts' hidden width
    and the expert axes the batch does not use (in place of the dense MLP's reductions, which the
    shared experts keep). The experts' weights are gathered once a microbatch over their FSDP axes
    inside the map (in the compute dtype) and their gradients reduce-scattered back, never gathered
    over the expert axes (on the TPU the gradient is all-reduced and sliced where the model width is
    not its minor dimension or its shard there is one 128-lane tile or less); over the batch axes
    that split neither, their gradients are all-reduced as any weight's. Under model.moe_dispatch
    ragged the tokens' traffic is instead four ragged-all-to-alls a layer (each assignment's row out
    and back, forward and backward) counted as the HLO reader counts them, plus the counts gathered.
    `unmodelled` lists shardings the analysis does not cover (head_dim, layers, length, norm_length
    on an axis of its own): there the total is not what the rule file needs.
    """
    c, cfg = s.config, s.model_cfg
    mesh_shape = dict(s.mesh.shape)
    batch_axes = set(s.rules.batch_axes())

    def hidden_axes(name: str) -> set[str]:
        # The axes of `name` in an activation, where the batch has taken its axes first.
        logical = (axes.BATCH, axes.LENGTH) + ((name,) if name != axes.LENGTH else ())
        return set(axes_of(s.rules.spec(logical)[-1]))

    def ways(mesh_axes: set[str]) -> int:
        return math.prod(mesh_shape[a] for a in mesh_axes)

    d_ways = ways(batch_axes)
    k = c.grad_accum
    context = context_layout(s)
    seq = c.seq_len // (context["ways"] if context else 1)  # the positions of a device's queries
    act_bytes = _activation_bytes(cfg, backend)
    # What an all-gather moves per byte of a product's operand: the TPU compiler rounds float32
    # operands to bfloat16 (JAX's default precision) and gathers them after the cast.
    gather = 2 / act_bytes if backend == "tpu" else 1.0
    # And per byte of a float32 weight: the model casts a weight to the compute dtype where it lies
    # (transformer.cast_weight), so it is gathered in that dtype; on the TPU a float32 model's in
    # bfloat16 too, as above.
    weight_gather = {"tpu": 0.5, "gpu": act_bytes / 4}.get(backend, 1.0)
    # A weight used in products gets its gradient in the compute dtype, all-reduced or
    # reduce-scattered in it before the float32 update (XLA:CPU promotes the all-reduce to float32).
    gradient = act_bytes / 4
    activation = (c.batch_size // k // d_ways) * seq * cfg.d_model * act_bytes
    layout = expert_layout(s)
    # (all-reduces per microbatch, the mesh axes they run over), one entry per kind.
    reductions = [
        (cfg.num_layers, hidden_axes(axes.HEADS)),  # attention output, forward
        (cfg.num_layers, hidden_axes(axes.KV_HEADS)),  # attention input gradient, backward
        # MLP output forward, input gradient backward: the dense MLP's, or the shared experts'
        (2 * cfg.num_layers if not cfg.num_experts or cfg.shared_experts else 0, hidden_axes(axes.MLP)),
        (2, hidden_axes(axes.VOCAB)),  # embedding lookup forward, output projection backward
    ]
    tensor_parallel = sum(k * n * 2 * (ways(a) - 1) / ways(a) * activation for n, a in reductions)
    expert_dispatch = 0.0
    if layout is not None:
        # The routed experts' outputs and input gradients, reduced over their hidden width's axes
        # and the expert axes the batch does not split (the router weights' gradient with them).
        r = ways(set(layout["hidden"] + layout["rest"]))
        routes = (c.batch_size // k // d_ways) * seq * cfg.experts_per_token * 4  # per device
        tensor_parallel += k * cfg.num_layers * 2 * (r - 1) / r * (2 * activation + routes)
        # Tokens out and back, forward and backward, and the routes gathered (ids, weights) and the
        # weights' gradient scattered: each moves (g - 1) times a device's share.
        g = ways(set(layout["gather"]))
        expert_dispatch = float(k * cfg.num_layers * (g - 1) * (4 * activation + 3 * routes))
        if (
            cfg.remat != "none"
        ):  # every policy recomputes the forward's gathers (tokens, routes) for the backward
            expert_dispatch += k * cfg.num_layers * (g - 1) * (activation + 2 * routes)
        if cfg.moe_dispatch == "ragged" and not layout["rest"]:
            expert_dispatch = ragged_dispatch_bytes(s, layout, backend)
    # Sequence parallelism (norm_length) and 2D (embed in activations) turn each all-reduce into
    # an all-gather plus a reduce-scatter: the same ring bytes, except that XLA:CPU lowers the
    # reduce-scatter as a whole all-reduce, so there the pair costs 3/2 of the all-reduce.
    tp_axes = set().union(*(a for _, a in reductions))
    residual = s.rules.spec((axes.BATCH, axes.NORM_LENGTH, axes.EMBED))
    scattered = any(set(axes_of(e)) & tp_axes for e in list(residual)[1:])
    if scattered and backend == "cpu":
        tensor_parallel *= 1.5
    elif scattered:
        # Half of each pair is an all-gather, of a product's operand except for the embedding's
        # output gradient (half of the vocabulary entry's gathers), which a scatter-add reads.
        operands = [1.0] * (len(reductions) - 1) + [0.5]
        tensor_parallel = sum(
            k * n * 2 * (ways(a) - 1) / ways(a) * activation * (1 + f * gather + (1 - f)) / 2
            for (n, a), f in zip(reductions, operands, strict=True)
        )
    # A remat policy's recomputation, as the compiled HLO shows it (XLA:CPU and the TPU compiler
    # alike): under sequence parallelism and 2D every policy but `none` recomputes the sublayer
    # inputs and with them their all-gathers, unless it keeps them (attn_in, mlp_in); `full` also
    # recomputes the attention's output and its reduction, unless it keeps attn_out. The MLP's
    # output is the block's, which the layer boundary keeps.
    kept = cfg.kept_names
    recomputed = (
        [("attn_in", axes.KV_HEADS), ("mlp_in", axes.MLP)] if scattered and cfg.remat != "none" else []
    )
    for name, logical in recomputed:
        if name not in kept:
            w = ways(hidden_axes(logical))
            tensor_parallel += k * cfg.num_layers * (w - 1) / w * activation * gather
    if cfg.remat == "full" and "attn_out" not in kept:
        w = ways(hidden_axes(axes.HEADS))
        reduce_scatter = scattered and backend != "cpu"  # XLA:CPU lowers it as a whole all-reduce
        tensor_parallel += k * cfg.num_layers * (1 if reduce_scatter else 2) * (w - 1) / w * activation
    # Shardings the analysis has no term for: the rest of the total is still right, but not the total.
    unmodelled = {
        (name, tuple(axes_of(e)))
        for row in rows
        if row["kind"] == "params"
        for name, e in zip(row["logical"], row["spec"], strict=True)
        if name in (axes.HEAD_DIM, axes.LAYERS) and e
    }
    # head_dim lives in the queries and keys, after their heads (which may take its mesh axes first).
    head_dim = set().union(
        *(
            axes_of(s.rules.spec((axes.BATCH, axes.LENGTH, h, axes.HEAD_DIM))[-1])
            for h in (axes.HEADS, axes.KV_HEADS)
        )
    )
    unmodelled |= {
        (n, tuple(sorted(a)))
        for n, a in ((axes.LENGTH, hidden_axes(axes.LENGTH)), (axes.HEAD_DIM, head_dim))
        if a and not (n == axes.LENGTH and context)  # context parallelism: its own terms below
    }
    unmodelled |= context_unmodelled(s, context)
    # A weight split over an axis that neither the batch nor its own activations use is gathered
    # whole for every use ([mlp, [dp, mp]] after [batch, dp]: the activation cannot take dp).
    for row in rows:
        if row["kind"] != "params":
            continue
        known = batch_axes.union(*(hidden_axes(n) for n in row["logical"] if n))
        for name, e in zip(row["logical"], row["spec"], strict=True):
            if set(axes_of(e)) - known:
                unmodelled.add((name, tuple(axes_of(e))))
    # Sequence parallelism over axes the sublayers do not split (norm_length on an axis of its own):
    # the residual stream is gathered over them for every sublayer, which no term above counts.
    length_axes = set(axes_of(list(residual)[1])) if len(residual) > 1 else set()
    context_axes = set(context["axes"]) if context else set()
    if length_axes - tp_axes - context_axes:
        unmodelled.add((axes.NORM_LENGTH, tuple(sorted(length_axes - tp_axes - context_axes))))
    # Query heads split where their key/value heads are not (fewer kv_heads than the mesh axis):
    # every device computes the scores of the heads it does not hold, and they are gathered.
    if hidden_axes(axes.HEADS) != hidden_axes(axes.KV_HEADS):
        unmodelled.add((f"{axes.HEADS} (not {axes.KV_HEADS})", tuple(sorted(hidden_axes(axes.HEADS)))))

    # With microbatches, gradients are reduced over the batch axes once per step where the trainer
    # sums them per batch shard, else once per microbatch (onto parameters sharded over those axes).
    per_shard = k > 1 and step_lib.sums_per_batch_shard(
        tuple(batch_axes), s.shardings.params, c.batch_size // k
    )
    dp_reductions = 1 if k == 1 or per_shard else k
    # config.optim.grad_reduce_dtype=bfloat16: where the step sums microbatches per batch shard every
    # gradient crosses the batch axes in bfloat16; elsewhere every gradient a product or the embedding's
    # scatter makes (model.grad_dtype), the norm scales' in float32. XLA:CPU promotes each bf16
    # reduction to float32.
    bf16_reduce = step_lib.grad_reduce_dtype(s) == "bfloat16"
    data_parallel = fsdp_gather = fsdp_reduce = 0.0
    compute_dtype = np.dtype(cfg.dtype).itemsize / 4
    for row in rows:
        if row["kind"] != "params":
            continue
        used = {a for e in row["spec"] for a in axes_of(e)}
        g = math.prod(mesh_shape[a] for a in batch_axes - used)
        f = math.prod(mesh_shape[a] for a in batch_axes & used)
        if layout is not None and _expert_weight(row):
            # Gathered inside the dispatch's map over its FSDP axes alone, in the compute dtype, and
            # the gradient reduce-scattered there in model.grad_dtype (or the compute dtype).
            f = ways(set(layout["fsdp"]))
            gathered = row["bytes_per_device"] * f
            # gathered again for the backward under a remat policy (its recomputed forward)
            fsdp_gather += k * (1 if cfg.remat == "none" else 2) * (f - 1) / f * gathered * compute_dtype
            reduced = np.dtype(cfg.grad_dtype).itemsize / 4 if cfg.grad_dtype else compute_dtype
            # The TPU compiler all-reduces such a gradient whole and slices it where the model width
            # is not its minor dimension (gate_up) or its shard there is one 128-lane tile or less.
            if backend == "tpu" and (_expert_weight(row) == "in" or cfg.d_model // f <= 128):
                reduced *= 2
            fsdp_reduce += k * (f - 1) / f * gathered * reduced
            f = 1
        local = row["bytes_per_device"]
        matrix = len(row["shape"]) > 1
        if g > 1:
            dtype_factor = gradient if matrix else 1
            if row["path"] == "params/embedding" and not cfg.tie_embeddings:
                dtype_factor = 1  # the lookup's scatter adds its gradient in float32 (kernels.embed)
            if bf16_reduce and (matrix or per_shard):
                dtype_factor = 1.0 if backend == "cpu" else 0.5
            per_reduction = 2 * (g - 1) / g * local * dtype_factor
            data_parallel += dp_reductions * per_reduction
        if f > 1 and row["path"] == "params/embedding" and not cfg.tie_embeddings:
            # A lookup table split on embed is read where it lies: each device looks up its own
            # slice of every row and the rows are exchanged (all-to-all) forward and backward; the
            # table is never gathered and its gradient never reduced.
            rows_bytes = (c.batch_size // k // d_ways) * seq * cfg.d_model * act_bytes
            fsdp_gather += k * 2 * (f - 1) / f * rows_bytes
        elif f > 1:
            gathered = local * f
            # A layer's weight is gathered for the forward pass and again for the backward (ZeRO-3),
            # scanned or unrolled (XLA:CPU and the TPU compiler both gather again rather than keep
            # every layer's gathered copy); the output projection's gathered copy is kept.
            gathers = 2 if row["path"].startswith("params/layers") else 1
            fsdp_gather += k * gathers * (f - 1) / f * gathered * (weight_gather if matrix else 1)
            reduced = 2 if backend == "cpu" else (gradient if matrix else 1)
            if bf16_reduce and matrix and backend != "cpu":
                reduced = 0.5
            fsdp_reduce += k * (f - 1) / f * gathered * reduced
    context_kv = context_kv_bytes(s, context, backend)
    context_grad = context_gradient_bytes(s, context, rows, backend, dp_reductions)
    return {
        "tensor_parallel": tensor_parallel,
        "data_parallel": data_parallel,
        "fsdp_gather": fsdp_gather,
        "fsdp_reduce": fsdp_reduce,
        "expert_dispatch": expert_dispatch,
        "context_kv": context_kv,
        "context_grad": context_grad,
        "total": tensor_parallel
        + data_parallel
        + fsdp_gather
        + fsdp_reduce
        + expert_dispatch
        + context_kv
        + context_grad,
        "unmodelled": sorted(f"{name}->{','.join(mesh_axes)}" for name, mesh_axes in unmodelled),
    }


def expert_layout(s: run_setup.Setup) -> dict | None:
    """moe._layout under the setup's mesh and rules where the model has experts and the rules split
    them (the all-gather dispatcher's shard_map); None where the experts run on every device's own
    tokens (a dense model, or `experts` replicated)."""
    if not s.model_cfg.num_experts:
        return None
    with sharding_context(s.mesh, s.rules):
        layout = moe._layout()
    return layout if layout and layout["experts"] else None


def ragged_dispatch_bytes(s: run_setup.Setup, layout: dict, backend: str) -> float:
    """Bytes per device per step of the ragged dispatch (moe._exchanged) under `layout`, as the HLO
    reader counts a ragged-all-to-all (its payload, the operand it sends from, at the even split:
    (g - 1) / g of it): per layer and microbatch, each assignment's row out to its expert's device
    (a payload of the k rows a token) and back from the receive buffer (a payload of its
    moe.receive_rows rows, model.moe_buffer_factor's), forward and as the backward's transposes,
    and once more forward where a remat policy recomputes the layer; plus each device's per-expert
    counts all-gathered, forward and recomputed (which the TPU compiler writes as an all-reduce:
    twice an all-gather's ring bytes). The TPU compiler pads each row to a multiple of 512 bytes."""
    c, cfg = s.config, s.model_cfg
    mesh_shape = dict(s.mesh.shape)
    g = math.prod(mesh_shape[a] for a in layout["gather"])
    local = cfg.num_experts // math.prod(mesh_shape[a] for a in layout["experts"])
    k = c.grad_accum
    tokens = c.batch_size // k // math.prod(mesh_shape[a] for a in s.rules.batch_axes()) * c.seq_len
    row = cfg.d_model * (4 if (backend == "cpu" or cfg.dtype == "float32") else 2)
    row = -(-row // 512) * 512 if backend == "tpu" else row
    received = moe.receive_rows(tokens, cfg.experts_per_token, local, g, cfg.moe_buffer_factor)
    passes = 2 if cfg.remat == "none" else 3  # forward, backward, and the forward recomputed
    exchange = passes * (g - 1) / g * (tokens * cfg.experts_per_token + received) * row
    counts = (1 if cfg.remat == "none" else 2) * (g - 1) * cfg.num_experts * 4
    counts *= 2 if backend == "tpu" else 1
    return float(k * cfg.num_layers * (exchange + counts))


def _expert_weight(row: dict) -> str:
    """ "in" for a routed expert's gate_up weight, "out" for its down weight (stacked over layers or
    not), "" for any other parameter row."""
    names = tuple(row["logical"])
    return "in" if names[-4:] == moe.EXPERT_IN else "out" if names[-3:] == moe.EXPERT_OUT else ""


# --- context parallelism ---

# How the keys and values of the whole sequence reach a device's queries (model.context_parallel
# where the config has it): all_gather (gathered whole inside attention, kv_length unsharded) or
# ring (blocks passed round the context axis by collective-permute).
CONTEXT_STRATEGIES = ("all_gather", "ring")


def context_strategy(s: run_setup.Setup) -> str:
    """model.context_parallel of the setup (the resolved model config's, else the config's), or
    all_gather where the config has no such key (the only strategy before the ring)."""
    strategy = getattr(s.model_cfg, "context_parallel", None)
    if strategy is None and "context_parallel" in s.config.model:
        strategy = s.config.model.context_parallel
    return strategy or "all_gather"


def context_layout(s: run_setup.Setup) -> dict | None:
    """Context parallelism under the setup's rules, or None where no mesh axis splits the queries'
    `length`: the strategy, the mesh axes of `length` and how many ways they split it, and the axes
    of the keys' `kv_length` and of their heads."""
    mesh_shape = dict(s.mesh.shape)
    length = tuple(axes_of(s.rules.spec((axes.BATCH, axes.LENGTH))[-1]))
    ways = math.prod(mesh_shape[a] for a in length)
    if ways == 1:
        return None
    kv_spec = s.rules.spec((axes.BATCH, axes.KV_LENGTH, axes.KV_HEADS, axes.HEAD_DIM))
    return {
        "strategy": context_strategy(s),
        "axes": length,
        "ways": ways,
        "kv_axes": tuple(axes_of(kv_spec[1])),
        "kv_heads_ways": math.prod(mesh_shape[a] for a in axes_of(kv_spec[2])),
    }


def context_unmodelled(s: run_setup.Setup, layout: dict | None) -> set[tuple[str, tuple[str, ...]]]:
    """The context-parallel layouts the analysis has no term for: a strategy it does not know, keys
    split by position under all_gather (kv_length sharded), and a residual stream not split as the
    queries are (norm_length over other axes: the sublayers' outputs would be gathered or sliced)."""
    if layout is None:
        return set()
    found = set()
    if layout["strategy"] not in CONTEXT_STRATEGIES:
        found.add((f"{axes.LENGTH} (context_parallel {layout['strategy']})", layout["axes"]))
    if layout["strategy"] == "all_gather" and layout["kv_axes"]:
        found.add((axes.KV_LENGTH, layout["kv_axes"]))
    residual = s.rules.spec((axes.BATCH, axes.NORM_LENGTH, axes.EMBED))
    if set(axes_of(residual[1])) != set(layout["axes"]):
        found.add((f"{axes.NORM_LENGTH} (not {axes.LENGTH})", tuple(sorted(axes_of(residual[1])))))
    return found


def _activation_bytes(cfg, backend: str) -> int:
    """Bytes of an activation element on the wire: float32 on XLA:CPU, which promotes bf16."""
    return 4 if (backend == "cpu" or cfg.dtype == "float32") else 2


def context_kv_bytes(s: run_setup.Setup, layout: dict | None, backend: str) -> float:
    """Bytes per device per step that move the keys and values across the context axes.

    all_gather, per layer and microbatch: the keys and the values all-gathered forward, each device's
    (batch shard, sequence / context, its kv heads) block to every other ((n - 1) / n of the whole
    sequence's), in the compute dtype (on the TPU a float32 model's in bfloat16, as any product's
    operand); their gradients reduce-scattered back in the backward (XLA:CPU: all-reduced whole):
    the TPU compiler scatters dK in float32 (rotary embedding's gradient) and all-reduces dV whole in
    the compute dtype, the same bytes in bfloat16. A remat policy recomputes both gathers for the
    backward, the keys' unless it keeps `key` (model.remat_save).
    ring (model.context_parallel ring): n - 1 collective-permute steps forward, each passing the
    local keys and values on; backward as many for dK and dV, and for the keys and values again
    (K/V in the compute dtype, with the blocks' int32 positions and segment ids; the gradients'
    float32 accumulators n times).
    """
    if layout is None:
        return 0.0
    c, cfg = s.config, s.model_cfg
    n = layout["ways"]
    k = c.grad_accum
    d_ways = math.prod(dict(s.mesh.shape)[a] for a in s.rules.batch_axes())
    act_bytes = _activation_bytes(cfg, backend)
    gather = 2 / act_bytes if backend == "tpu" else 1.0  # float32 operands gathered after the cast
    # One of K or V of the whole sequence on one device, in elements.
    whole = (
        (c.batch_size // k // d_ways) * c.seq_len * cfg.num_kv_heads // layout["kv_heads_ways"] * cfg.head_dim
    )
    share = (n - 1) / n * whole  # what each device receives of a gather, or sends of a scatter
    recompute = cfg.remat != "none"
    if layout["strategy"] == "all_gather":
        forward = 2 * share * act_bytes * gather
        d_k = (2 if backend == "cpu" else 1) * share * 4
        d_v = 2 * share * act_bytes
        again = (2 - ("key" in cfg.kept_names)) * share * act_bytes * gather if recompute else 0.0
        per_layer = forward + d_k + d_v + again
    elif layout["strategy"] == "ring":
        # Each step passes a block on: its K and V, and its positions and segment ids (int32).
        rows = (c.batch_size // k // d_ways) * c.seq_len / n
        block = 2 * whole / n * act_bytes + rows * 4 * (1 + bool(c.data.document_mask))
        forward = (n - 1) * block
        # Backward (model/context._ring_backward): the blocks round again, and the float32 dK and
        # dV accumulators n times (the last permute brings them home).
        # No remat policy runs the ring again: the custom_vjp's backward starts from its saved
        # residuals (tiny, remat full, on CPU: the same bytes as without).
        per_layer = 2 * forward + n * 2 * whole / n * 4
    else:
        return 0.0
    return float(k * cfg.num_layers * per_layer)


def context_gradient_bytes(
    s: run_setup.Setup, layout: dict | None, rows: list[dict], backend: str, reductions: int
) -> float:
    """Bytes per device per step that reduce the gradients over the context axes: each device's
    gradients are sums over its positions alone, so every parameter's is summed over the context
    axes that do not shard it, `reductions` times a step (the data-parallel reductions' count).
    XLA:CPU all-reduces each gradient shard over the context axes apart from the batch axes (two
    all-reduces, after FSDP's reduction); the TPU compiler reduces over the context and batch axes
    together, one all-reduce over their product in the gradient's dtype: what is counted here is
    the part beyond data_parallel's over the batch axes alone."""
    if layout is None:
        return 0.0
    cfg = s.model_cfg
    mesh_shape = dict(s.mesh.shape)
    batch_axes = set(s.rules.batch_axes())
    act_bytes = _activation_bytes(cfg, backend)
    total = 0.0
    for row in rows:
        if row["kind"] != "params":
            continue
        used = {a for e in row["spec"] for a in axes_of(e)}
        n = math.prod(mesh_shape[a] for a in set(layout["axes"]) - used)
        if n == 1:
            continue
        matrix = len(row["shape"]) > 1
        dtype = act_bytes / 4 if matrix and row["path"] != "params/embedding" else 1.0
        if backend == "cpu":
            total += 2 * (n - 1) / n * row["bytes_per_device"] * dtype
        else:
            g = math.prod(mesh_shape[a] for a in batch_axes - used)
            beyond = 2 * (n * g - 1) / (n * g) - 2 * (g - 1) / g
            total += beyond * row["bytes_per_device"] * dtype
    return float(reductions * total)
