"""The model's hand-written kernels, each selected by config and called by the model by one name.

- `attention` (model.attention, model.attention_block): cuDNN's fused attention on GPU in 16 bits,
  or the attention written out, its causal square in query blocks where model.attention_block asks;
  every path but cuDNN's also masks packed documents apart by their segment ids.
- `mlp` (model.mlp_grad, model.mlp_slices): the SwiGLU MLP with autodiff's gradient, SwiGLU's
  gradient in one elementwise pass, or the whole MLP's backward written out; or, where the rules
  split its weights on the model width, with their gathers in slices overlapped with the products.
- `embed` (model.dtype): the embedding lookup in the compute dtype with a float32 table gradient.
- `project` and `spread` (model.grad_dtype): a product with a weight, and a weight copied per batch
  shard, whose gradients are made in that dtype (config.optim.grad_reduce_dtype).

Each stays for a gain measured on the platform it serves (docs/benchmarks.md, "Options measured
against the defaults").
Logical axis names only, as in transformer.py: a rule file decides where each operand lives.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from gspmd_tp.model import context
from gspmd_tp.sharding.axes import BATCH, EMBED, HEADS, KV_HEADS, KV_LENGTH, LENGTH, MLP, NORM_LENGTH, VOCAB
from gspmd_tp.sharding.rules import UNCONSTRAINED, axes_of

if TYPE_CHECKING:
    from gspmd_tp.model.transformer import ModelConfig

ATTENTION_IMPLEMENTATIONS = ("einsum", "xla", "cudnn", "auto")
MLP_GRADS = ("auto", "fused", "one_pass", "xla")
# The logical axes of the MLP's weights, gate_up (embed, 2, mlp) and down (mlp, embed).
MLP_IN, MLP_OUT = (EMBED, None, MLP), (MLP, EMBED)


# --- the dtype of the weight gradients ---
#
# GSPMD reduces a gradient over the batch's devices where the operation that makes it runs, in that
# operation's dtype. So a bfloat16 data-parallel reduction under float32 compute (and a
# reduce-scatter onto parameters sharded over the batch axes) is the weight-gradient products, and
# the embedding's scatter, written in bfloat16: model.grad_dtype, which the train step sets from
# config.optim.grad_reduce_dtype. Each gradient is cast to its weight's dtype after.


def _gradient_dtype(asked: str, natural) -> str | None:
    """`asked` (model.grad_dtype) where it is set and differs from `natural`, the dtype the gradient
    would otherwise be made in; else None (nothing to change)."""
    return asked if asked and jnp.dtype(natural) != jnp.dtype(asked) else None


def project(subscripts: str, x, w, names: tuple, grad_dtype: str = ""):
    """jnp.einsum(subscripts, x, w) of an activation and a weight (in the compute dtype) with the
    weight's logical axis `names`, each index in two of the three terms. With grad_dtype
    (model.grad_dtype) w's gradient product writes it, laid out as the weight before the cast to
    w's dtype, so that the reduction onto the weight's shards runs in grad_dtype."""
    dtype = _gradient_dtype(grad_dtype, w.dtype)
    if dtype is None:
        return jnp.einsum(subscripts, x, w)
    return _project(subscripts, dtype, names, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _project(subscripts, dtype, names, x, w):
    return jnp.einsum(subscripts, x, w)


def _project_fwd(subscripts, dtype, names, x, w):
    return jnp.einsum(subscripts, x, w), (x, w)


def _project_bwd(subscripts, dtype, names, residuals, dy):
    x, w = residuals
    operands, out = subscripts.split("->")
    a, b = operands.split(",")
    dx = jnp.einsum(f"{out},{b}->{a}", dy, w)
    dw = jnp.einsum(f"{a},{out}->{b}", x, dy, preferred_element_type=dtype)
    return dx, _as_weight(dw, names, w.dtype)


def _as_weight(g, names: tuple, dtype):
    """A weight's gradient g made in another dtype laid out as the weight (logical `names`), then
    cast to the weight's `dtype`; g as it is where it is made in that dtype already."""
    if g.dtype == dtype:
        return g
    if not _fully_manual():
        g = nn.with_logical_constraint(g, names)
    return g.astype(dtype)


_project.defvjp(_project_fwd, _project_bwd)


def spread(w, copies: int, names: tuple, grad_dtype: str = ""):
    """w broadcast to (copies, *w.shape), w's logical axes `names`; with grad_dtype the copies'
    gradients are summed in it (where each copy lives on its own batch shard, that sum is the
    reduction)."""
    dtype = _gradient_dtype(grad_dtype, w.dtype)
    if dtype is None:
        return jnp.broadcast_to(w, (copies, *w.shape))
    return _spread(copies, dtype, names, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _spread(copies, dtype, names, w):
    return jnp.broadcast_to(w, (copies, *w.shape))


def _spread_fwd(copies, dtype, names, w):
    return _spread(copies, dtype, names, w), None


def _spread_bwd(copies, dtype, names, _, g):  # g: w's dtype
    return (_as_weight(g.astype(dtype).sum(0, dtype=dtype), names, g.dtype),)


_spread.defvjp(_spread_fwd, _spread_bwd)


# --- attention ---


def attention_implementation(
    setting: str, dtype: str, platform: str | None = None, segmented: bool = False
) -> str:
    """The attention path ModelConfig.attention `setting` means on `platform` (by default JAX's
    default backend): "auto" is cuDNN's fused attention on GPU in bfloat16 or float16, the einsum
    path elsewhere, and where `segmented` (packed documents masked apart: CUDNN_SEGMENTS)."""
    if setting != "auto":
        return setting
    gpu = (platform or jax.default_backend()) == "gpu"
    return "cudnn" if gpu and dtype in ("bfloat16", "float16") and not segmented else "einsum"


# What model.attention 'cudnn' cannot do, and what to use instead (run_setup says it before compiling).
CUDNN_SEGMENTS = (
    "model.attention 'cudnn' cannot keep packed documents apart (jax.nn.dot_product_attention takes no "
    "segment ids, and hands cuDNN a mask as a dense bias of every row); use model.attention 'auto' "
    "(einsum under document masking), 'einsum' or 'xla', or set config.data.document_mask=False"
)


def attention(
    cfg: ModelConfig, q_blhd, k_bskd, v_bskd, mask=None, segment_ids=None, positions=None, zigzag=False
):
    """Softmax attention of scaled queries (batch, length, heads, head_dim) over keys and values
    (batch, s, kv_heads, head_dim), query head h reading key/value head h // group (the grouping of
    the fused qkv kernel). Causal, by model.attention's implementation, and with `segment_ids`
    (batch, length) a query sees only the keys of its own segment (packed documents); or, given
    `mask` (broadcasting to (batch, kv_heads, group, length, s): decoding from the cache), the einsum
    path under it. Returns (batch, length, heads, head_dim).

    Self-attention under a context axis (context.py): with model.context_parallel "ring", ring
    attention where the mesh splits these shapes evenly; `zigzag` (model.context_load_balance: the
    sequence in context.zigzag_order), causal by `positions` (batch, length), the true positions,
    rather than by index."""
    b, length, heads, hd = q_blhd.shape
    if mask is None and (zigzag or cfg.context_parallel == "ring"):
        layout = context.ring_layout(q_blhd.shape, k_bskd.shape, zigzag)
        if positions is None:
            positions = jnp.arange(length, dtype=jnp.int32)
        positions = jnp.broadcast_to(positions, (b, length)).astype(jnp.int32)
        if cfg.context_parallel == "ring" and layout is not None:
            return context.ring_attention(layout, q_blhd, k_bskd, v_bskd, positions, segment_ids, zigzag)
        if zigzag:
            mask = _positional_mask(positions, segment_ids)
            segment_ids = None
    implementation = attention_implementation(cfg.attention, cfg.dtype, segmented=segment_ids is not None)
    if segment_ids is not None:  # the queries' by length, the keys' by kv_length (gathered with the keys)
        segment_ids = _segments_of_queries_and_keys(segment_ids)
    if mask is not None and zigzag and implementation != "einsum":  # xla: the positional mask
        return jax.nn.dot_product_attention(
            q_blhd, k_bskd, v_bskd, mask=mask[:, 0], scale=1.0, implementation=implementation
        )
    if mask is None and implementation != "einsum":
        if segment_ids is None:
            return jax.nn.dot_product_attention(
                q_blhd, k_bskd, v_bskd, scale=1.0, is_causal=True, implementation=implementation
            )
        if implementation == "cudnn":
            raise ValueError(CUDNN_SEGMENTS)
        same = segment_ids[0][:, None, :, None] == segment_ids[1][:, None, None, :]  # (batch, 1, q, s)
        return jax.nn.dot_product_attention(
            q_blhd, k_bskd, v_bskd, mask=same, scale=1.0, is_causal=True, implementation=implementation
        )
    q_blkgd = q_blhd.reshape(b, length, k_bskd.shape[2], heads // k_bskd.shape[2], hd)
    if mask is not None:
        out = _attend(q_blkgd, k_bskd, v_bskd, mask)
    else:
        out = _causal_in_blocks(q_blkgd, k_bskd, v_bskd, cfg.attention_block, segment_ids)
    return out.reshape(b, length, heads, hd)


def _positional_mask(positions_bl, segment_ids=None):
    """(batch, 1, 1, length, s): a query sees a key of no greater position (positions (batch,
    length), the true ones of a reordered sequence) and, with `segment_ids`, of its own segment; the
    queries' by length, the keys' by kv_length (gathered with the keys)."""
    q_pos, k_pos = _segments_of_queries_and_keys(positions_bl)
    allowed = q_pos[:, :, None] >= k_pos[:, None, :]
    if segment_ids is not None:
        q_seg, k_seg = _segments_of_queries_and_keys(segment_ids)
        allowed &= q_seg[:, :, None] == k_seg[:, None, :]
    return allowed[:, None, None]


def _segments_of_queries_and_keys(segment_ids):
    """(batch, length) segment ids as the queries' (by `length`) and the keys' (by `kv_length`): under
    context parallelism the queries' stay split by position and the keys' are gathered as the keys."""
    return (
        nn.with_logical_constraint(segment_ids, (BATCH, LENGTH)),
        nn.with_logical_constraint(segment_ids, (BATCH, KV_LENGTH)),
    )


def _causal_in_blocks(q_blkgd, k_blkd, v_blkd, block: int, segment_ids=None):
    """Causal attention, queries in blocks of `block` positions (0: one block, the whole square);
    with `segment_ids` (the queries', the keys': _segments_of_queries_and_keys), within each query's
    segment only.

    Query block [start, end) sees keys [0, end): the keys after a block's end are masked for every
    one of its queries, so they are left out rather than masked, and the causal upper triangle beyond
    the diagonal blocks is never computed. The same result, to rounding.
    """
    length = q_blkgd.shape[1]
    block = block if 0 < block < length else length
    positions = jnp.arange(length, dtype=jnp.int32)

    def mask(start: int, end: int):  # broadcasting to (batch, kv_heads, group, q, s)
        causal = positions[start:end, None] >= positions[None, :end]
        if segment_ids is None:
            return causal
        same = segment_ids[0][:, start:end, None] == segment_ids[1][:, None, :end]  # (batch, q, s)
        return (causal & same)[:, None, None]

    return jnp.concatenate(
        [
            _attend(
                q_blkgd[:, start : start + block],
                k_blkd[:, : start + block],
                v_blkd[:, : start + block],
                mask(start, start + block),
            )
            for start in range(0, length, block)
        ],
        axis=1,
    )


def _score_heads() -> tuple:
    """Logical names of the scores' (kv_heads, group) axes. Where the query heads are split over
    mesh axes that the key/value heads are not (fewer key/value heads than the model-parallel
    degree, kv_heads -> null), a device holds its own query heads, a split across both axes that
    no single name describes, and every key/value head: the axes are left to GSPMD, which carries
    the queries' split into the scores. Named (kv_heads, none), every score was gathered."""
    mesh_axes = lambda name: set(axes_of(nn.logical_to_mesh_axes((name,))[0]))  # noqa: E731
    if mesh_axes(HEADS) <= mesh_axes(KV_HEADS):
        return KV_HEADS, None
    return UNCONSTRAINED, UNCONSTRAINED


def _attend(q_bqkgd, k_bskd, v_bskd, mask):
    """Softmax attention of grouped queries (batch, q, kv_heads, group, head_dim) over keys and
    values (batch, s, kv_heads, head_dim) where `mask` (broadcasting to (batch, kv_heads, group, q,
    s)) allows; the scores and softmax in float32. Returns (batch, q, kv_heads, group, head_dim)."""
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q_bqkgd, k_bskd, preferred_element_type=jnp.float32)
    scores = nn.with_logical_constraint(scores, (BATCH, *_score_heads(), LENGTH, KV_LENGTH))
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bskd.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v_bskd)


def fused_attention_saveable(prim, *_, **__) -> bool:
    """Remat policy: keep what cuDNN's fused attention forward returns (its output and softmax
    statistics, the residuals of its backward), so that the backward pass does not run it again."""
    return prim.name == "dot_product_attention_fwd_wrapper"


# --- SwiGLU MLP ---


def mlp_implementation(cfg: ModelConfig, platform: str | None = None) -> str:
    """The MLP gradient config.model.mlp_grad means on `platform` (by default JAX's default backend)
    under the current logical axis rules: "auto" is fused on GPU where no mesh axis splits `mlp`
    (its input gradient is two products, which would take two all-reduces there), mlp_hidden is
    not kept by remat_save (the fused backward recomputes it) and model.mlp_slices is 1, one_pass
    elsewhere on GPU, xla on other platforms."""
    if cfg.mlp_grad != "auto":
        return cfg.mlp_grad
    if (platform or jax.default_backend()) != "gpu":
        return "xla"
    split = axes_of(nn.logical_to_mesh_axes((MLP,))[0])
    return "one_pass" if split or "mlp_hidden" in cfg.saved_names or cfg.mlp_slices > 1 else "fused"


def mlp(cfg: ModelConfig, x_ble, w_in, w_out):
    """down(silu(gate) * up) of x (batch, length, embed) with w_in (embed, 2, mlp) and w_out (mlp,
    embed), the weights in the compute dtype, its gradient the one mlp_implementation chooses; with
    model.mlp_slices > 1, where sliced_mlp_layout finds weights to gather, sliced_mlp."""
    implementation = mlp_implementation(cfg)
    layout = sliced_mlp_layout() if cfg.mlp_slices > 1 else None
    if layout is not None and _divides(layout, cfg.mlp_slices, x_ble.shape, w_in.shape):
        return sliced_mlp(cfg, layout, x_ble, w_in, w_out, one_pass_gradient=implementation == "one_pass")
    if implementation == "fused":
        return fused_mlp(x_ble, w_in, w_out, _gradient_dtype(cfg.grad_dtype, w_in.dtype))
    gate_up = project("ble,etm->bltm", x_ble, w_in, MLP_IN, cfg.grad_dtype)
    gate_up = nn.with_logical_constraint(gate_up, (BATCH, LENGTH, None, MLP))
    hidden = swiglu(gate_up, one_pass_gradient=implementation == "one_pass")
    hidden = checkpoint_name(nn.with_logical_constraint(hidden, (BATCH, LENGTH, MLP)), "mlp_hidden")
    return project("blm,me->ble", hidden, w_out, MLP_OUT, cfg.grad_dtype)


def swiglu(gate_up, one_pass_gradient: bool = False):
    """silu(gate) * up of gate_up (..., 2, mlp), gate first. With `one_pass_gradient` its gradient is
    one elementwise pass that writes the stacked array: autodiff of the two slices adds two
    zero-padded halves instead, more memory traffic on the largest activations."""
    return _swiglu_one_pass(gate_up) if one_pass_gradient else _swiglu(gate_up)


def _swiglu(gate_up):
    return nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]


def _swiglu_grads(gate_up, d_hidden):
    """(d gate, d up), each shaped like d_hidden, computed in float32 and returned in gate_up's dtype."""
    x = gate_up.astype(jnp.float32)
    gate, up = x[..., 0, :], x[..., 1, :]
    d = d_hidden.astype(jnp.float32)
    sigmoid = jax.nn.sigmoid(gate)
    d_gate = d * up * sigmoid * (1 + gate * (1 - sigmoid))
    d_up = d * gate * sigmoid
    return d_gate.astype(gate_up.dtype), d_up.astype(gate_up.dtype)


@jax.custom_vjp
def _swiglu_one_pass(gate_up):
    return _swiglu(gate_up)


def _swiglu_forward(gate_up):
    return _swiglu(gate_up), gate_up


def _swiglu_backward(gate_up, d_hidden):
    # Each element takes the gate's or the up's derivative by its index on the stacked axis
    # (no concatenate, no zero-padded halves).
    d_gate, d_up = _swiglu_grads(gate_up, d_hidden)
    is_gate = jax.lax.broadcasted_iota(jnp.int32, gate_up.shape, gate_up.ndim - 2) == 0
    return (jnp.where(is_gate, d_gate[..., None, :], d_up[..., None, :]),)


_swiglu_one_pass.defvjp(_swiglu_forward, _swiglu_backward)


def _mlp_forward(x_ble, w_in, w_out):
    gate_up = nn.with_logical_constraint(jnp.tensordot(x_ble, w_in, axes=1), (BATCH, LENGTH, None, MLP))
    hidden = nn.with_logical_constraint(_swiglu(gate_up), (BATCH, LENGTH, MLP))
    return jnp.tensordot(hidden, w_out, axes=1), gate_up


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fused_mlp(x_ble, w_in, w_out, grad_dtype=None):
    """down(silu(gate) * up) of x (batch, length, embed), w_in (embed, 2, mlp), w_out (mlp, embed),
    with its backward written out: SwiGLU's output, which the down projection's weight gradient
    needs, is recomputed in the same elementwise pass that computes SwiGLU's gradient (both read
    gate_up and write three arrays of one shape), where autodiff under remat recomputes it in a pass
    of its own; the gate and up gradients stay apart, so the input gradient is two products
    accumulated and the weight gradient two products stacked. Under remat the residuals are what
    autodiff keeps: the input, the weights and the gate_up product. grad_dtype: the dtype the weight
    gradient products write (model.grad_dtype), None for the weights' own."""
    return _mlp_forward(x_ble, w_in, w_out)[0]


def _fused_mlp_fwd(x_ble, w_in, w_out, grad_dtype):
    y, gate_up = _mlp_forward(x_ble, w_in, w_out)
    return y, (x_ble, w_in, w_out, gate_up)


def _fused_mlp_bwd(grad_dtype, res, dy):
    x_ble, w_in, w_out, gate_up = res
    names = (BATCH, LENGTH, MLP)
    d_hidden = nn.with_logical_constraint(jnp.einsum("ble,me->blm", dy, w_out), names)
    hidden = nn.with_logical_constraint(_swiglu(gate_up), names)
    d_gate, d_up = (nn.with_logical_constraint(d, names) for d in _swiglu_grads(gate_up, d_hidden))
    dx = jnp.einsum("blm,em->ble", d_gate, w_in[:, 0]) + jnp.einsum("blm,em->ble", d_up, w_in[:, 1])
    product = functools.partial(jnp.einsum, preferred_element_type=grad_dtype)
    d_w_in = jnp.stack([product("ble,blm->em", x_ble, d) for d in (d_gate, d_up)], axis=1)
    d_w_out = product("blm,ble->me", hidden, dy)
    return dx, _as_weight(d_w_in, MLP_IN, w_in.dtype), _as_weight(d_w_out, MLP_OUT, w_out.dtype)


fused_mlp.defvjp(_fused_mlp_fwd, _fused_mlp_bwd)


# --- the MLP with its weights gathered in slices (model.mlp_slices) ---
#
# Where the rules split the MLP's weights on the model width (megatron_2d, fsdp_tp, fsdp and
# data_fsdp_tensor), GSPMD gathers each weight whole before its product; the TPU compiler's
# collective matmul decomposes the activations' collectives, not these gathers over the batch
# axes. MeshSlice's sliced GeMM, written as a shard_map: each device's share of the mlp dimension in
# K slices, each slice's gate/up and down weights gathered, multiplied and added to the output in
# turn, so that the compiler may run the next slice's gathers beside this slice's products. The
# same products and sums; the output's sum over the mlp axes after the last slice. Whether the
# schedule gains is the compiler's: plan --compare --mlp_slices ranks it.


def sliced_mlp_layout() -> dict | None:
    """The mesh axes the sliced MLP works over, under the current logical axis rules: `batch` and
    `length` (the input's), `gather` (the weights' model width, gathered in slices), `mlp` (the
    hidden width), `scatter` (whether the output's model width lies over the mlp axes, as in 2D
    sharding: its sum is then a reduce-scatter, otherwise an all-reduce). None where nothing splits
    the weights on the model width (nothing to gather), or where the two weights or the input place
    their axes otherwise than this MLP can take."""
    g_in, _, m_in = (axes_of(a) for a in nn.logical_to_mesh_axes(MLP_IN))
    m_out, g_out = (axes_of(a) for a in nn.logical_to_mesh_axes(MLP_OUT))
    batch, length = (axes_of(a) for a in nn.logical_to_mesh_axes((BATCH, LENGTH)))
    if not g_in or (g_in, m_in) != (g_out, m_out) or set(m_in) & set(batch + length + g_in):
        return None
    residual = axes_of(nn.logical_to_mesh_axes((BATCH, NORM_LENGTH, EMBED))[-1])
    return {
        "batch": batch,
        "length": length,
        "gather": g_in,
        "mlp": m_in,
        "scatter": bool(m_in) and residual == m_in,
    }


def _divides(layout: dict, slices: int, x_shape: tuple, w_in_shape: tuple) -> bool:
    """Whether the current mesh splits the input (batch, length, embed) and gate_up weight (embed, 2,
    mlp) evenly as `layout` places them, each device's mlp share into `slices` (False with no mesh,
    inside another shard_map, or for a batch of one row at initialisation: GSPMD's path then)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or jax.sharding.AxisType.Manual in mesh.axis_types:
        return False
    ways = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
    return (
        x_shape[0] % ways(layout["batch"]) == 0
        and x_shape[1] % ways(layout["length"]) == 0
        and w_in_shape[0] % ways(layout["gather"]) == 0
        and w_in_shape[-1] % (ways(layout["mlp"]) * slices) == 0
    )


def sliced_mlp(cfg: ModelConfig, layout: dict, x_ble, w_in, w_out, one_pass_gradient: bool = False):
    """The MLP of `mlp` as a shard_map over the mesh, in model.mlp_slices slices of each device's
    share of the mlp dimension (`layout`: sliced_mlp_layout's). The input arrives whole on the model
    width; the output leaves split on it over the mlp axes where layout["scatter"], else whole. Each
    weight gradient is reduce-scattered slice by slice, in model.grad_dtype where it is set."""
    k, gather, hidden_axes = cfg.mlp_slices, layout["gather"], layout["mlp"]
    grad_dtype = _gradient_dtype(cfg.grad_dtype, w_in.dtype)

    def body(x, wi, wo):
        width = wi.shape[-1] // k
        y = None
        for s in range(k):
            part = slice(s * width, (s + 1) * width)
            gate_up = jnp.einsum("ble,etm->bltm", x, _gather(wi[..., part], gather, 0, grad_dtype))
            hidden = checkpoint_name(swiglu(gate_up, one_pass_gradient), "mlp_hidden")
            wo_s = _gather(wo[part], gather, 1, grad_dtype)
            p = jnp.einsum("blm,me->ble", hidden, wo_s, preferred_element_type=jnp.float32)
            y = p if y is None else y + p
        y = y.astype(x.dtype)
        if layout["scatter"]:
            return jax.lax.psum_scatter(y, hidden_axes, scatter_dimension=2, tiled=True)
        return jax.lax.psum(y, hidden_axes) if hidden_axes else y

    # The specs from the logical axis rules, as sliced_mlp_layout read them.
    whole, out = (BATCH, LENGTH, None), (BATCH, LENGTH, MLP if layout["scatter"] else None)
    return jax.shard_map(
        body,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=tuple(nn.logical_to_mesh_axes(names) for names in (whole, MLP_IN, MLP_OUT)),
        out_specs=nn.logical_to_mesh_axes(out),
        check_vma=False,
    )(x_ble, w_in, w_out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather(w, axes: tuple, axis: int, grad_dtype):
    """w's shards gathered over mesh `axes` on `axis` (inside a shard_map); its gradient
    reduce-scattered back, in grad_dtype where it is not None."""
    return jax.lax.all_gather(w, axes, axis=axis, tiled=True)


def _gather_fwd(w, axes, axis, grad_dtype):
    return _gather(w, axes, axis, grad_dtype), None


def _gather_bwd(axes, axis, grad_dtype, _, g):
    sent = g.astype(grad_dtype) if grad_dtype else g
    return (jax.lax.psum_scatter(sent, axes, scatter_dimension=axis, tiled=True).astype(g.dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


# --- embedding lookup ---


def embed(cfg: ModelConfig, table_ve, tokens_bl):
    """The rows of the float32 table (vocab, embed) for tokens (batch, length), in the compute dtype.

    In float32 with the vocabulary whole, a plain lookup. Otherwise the table is cast before the
    lookup, so where a rule file splits the vocabulary the all-reduce that assembles the rows moves
    compute-dtype bytes (each row is non-zero on one device only, so the sum is exact in any dtype);
    the gradient adds every position's row gradient into the table in float32 (or model.grad_dtype),
    one vocabulary shard at a time (embed_lookup).
    """
    dtype, grad_dtype = jnp.dtype(cfg.dtype), _gradient_dtype(cfg.grad_dtype, table_ve.dtype)
    if dtype == table_ve.dtype and _table_shards(table_ve.shape)[0] == 1 and grad_dtype is None:
        # Autodiff's gradient scatters with the lookup's own indices: where the batch is split they
        # are gathered once for both (embed_lookup's backward gathers them again).
        rows_ble = jnp.take(table_ve, tokens_bl, axis=0)
    else:
        rows_ble = embed_lookup(table_ve, tokens_bl, dtype, grad_dtype)
    # The rows where the table lies, split on embed as it is, the batch left to GSPMD; the caller
    # then constrains them to the residual stream's layout, an all-to-all. Where embed's mesh axis
    # is also one of the batch's (data_fsdp_tensor: batch over data and fsdp, the table's embed over
    # fsdp), GSPMD otherwise looks them up split on embed alone and cannot reach the batch's split
    # in one step: it gathered the rows whole ("Involuntary full rematerialization").
    if _fully_manual():
        return rows_ble
    return nn.with_logical_constraint(rows_ble, (UNCONSTRAINED, LENGTH, EMBED))


def _fully_manual() -> bool:
    """Inside a shard_map manual over every mesh axis (the step's per-shard gradient sums under dp):
    nothing is left to GSPMD, and a constraint naming an unconstrained axis is refused."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and jax.sharding.AxisType.Auto not in mesh.axis_types


def _table_shards(shape: tuple[int, int]) -> tuple[int, int]:
    """How many ways GSPMD splits a (vocab, embed) table on each axis here: the product of the mesh
    axes each logical name maps to that are left to it (1 with no mesh, inside a fully manual
    shard_map, or where they do not divide the axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1, 1
    manual = {
        a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == jax.sharding.AxisType.Manual
    }
    ways = (
        math.prod(mesh.shape[a] for a in axes_of(e) if a not in manual)
        for e in nn.logical_to_mesh_axes((VOCAB, EMBED))
    )
    return tuple(w if n % w == 0 else 1 for w, n in zip(ways, shape, strict=True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def embed_lookup(table, tokens, dtype, grad_dtype=None):
    """jnp.take(table.astype(dtype), tokens, axis=0), whose gradient adds the rows' gradients into
    the table in table's dtype, as autodiff of take-then-cast does, rather than in `dtype`; or in
    grad_dtype where given (model.grad_dtype)."""
    return jnp.take(table.astype(dtype), tokens, axis=0)


def _embed_lookup_fwd(table, tokens, dtype, grad_dtype):
    # The table's shape rides along in an empty (vocab, 0) array of its dtype.
    rows = embed_lookup(table, tokens, dtype, grad_dtype)
    return rows, (tokens, jnp.zeros((table.shape[0], 0), table.dtype))


def _embed_lookup_bwd(dtype, grad_dtype, residuals, g_ble):
    tokens_bl, empty = residuals
    table_dtype = empty.dtype
    add_dtype = grad_dtype or table_dtype
    g_ble = g_ble.astype(add_dtype)
    vocab, width = empty.shape[0], g_ble.shape[-1]
    t, f = _table_shards((vocab, width))
    if t == 1:
        g_ve = jnp.zeros((vocab, width), add_dtype).at[tokens_bl].add(g_ble)
        return _as_weight(g_ve, (VOCAB, EMBED), table_dtype), None
    # Scattered into the whole table, a vocabulary-split gradient is one GSPMD partitions on the
    # batch alone: each device adds its tokens' rows into every row (data_fsdp_tensor: all-reduced
    # over the vocabulary's mesh axes as well as the batch's). Scattered into a stack of the table's
    # (t, f) shards, one scatter per shard, split as the table is, each device adds only into its
    # own shard (the other shards' tokens fall out of range and are dropped): the reduction is the
    # shard's, over the batch axes. Each element adds the same updates in the same order.
    b, length = tokens_bl.shape
    rows, cols = vocab // t, width // f
    names = (VOCAB, EMBED, UNCONSTRAINED, LENGTH, None)
    # Each shard's own rows numbered from 0, the other shards' tokens out of range (dropped).
    tokens_tfbl = nn.with_logical_constraint(jnp.broadcast_to(tokens_bl, (t, f, b, length)), names[:-1])
    shard_tfbl = jax.lax.broadcasted_iota(tokens_bl.dtype, tokens_tfbl.shape, 0)
    local_tfbl = jnp.where(tokens_tfbl // rows == shard_tfbl, tokens_tfbl % rows, rows)
    g_fblc = jnp.moveaxis(g_ble.reshape(b, length, f, cols), 2, 0)
    g_tfblc = jnp.broadcast_to(g_fblc, (t, f, b, length, cols))
    g_tfblc = nn.with_logical_constraint(g_tfblc, names)
    shards_tfrc = nn.with_logical_constraint(
        jnp.zeros((t, f, rows, cols), add_dtype), (VOCAB, EMBED, None, None)
    )
    add = lambda z_rc, i_bl, u_blc: z_rc.at[i_bl].add(u_blc, mode="drop")  # noqa: E731
    shards_tfrc = jax.vmap(jax.vmap(add))(shards_tfrc, local_tfbl, g_tfblc)
    shards_tfrc = nn.with_logical_constraint(shards_tfrc, (VOCAB, EMBED, None, None))
    g_ve = jnp.swapaxes(shards_tfrc, 1, 2).reshape(vocab, width)
    return _as_weight(g_ve, (VOCAB, EMBED), table_dtype), None


embed_lookup.defvjp(_embed_lookup_fwd, _embed_lookup_bwd)
