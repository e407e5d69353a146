"""A decoder-only, Llama-style transformer annotated with logical axis names only.

RMSNorm, rotary position embedding, causal attention with grouped key/value heads, SwiGLU MLP,
layers stacked with nn.scan. Every parameter is created through nn.with_logical_partitioning and
the key activations are constrained with nn.with_logical_constraint; which mesh axes those names
land on is the business of a rule file, never of this module.

Fused weights (as Megatron): q/k/v live in one kernel laid out per query group,
(embed, kv_heads, group + 2, head_dim) — the `group` query heads of each key/value head, then its
key, then its value — and the SwiGLU gate/up projections in one (embed, 2, mlp) kernel. With
separate weights GSPMD all-reduces each input gradient separately in the backward pass.

Read top to bottom: the config, the remat policies, then the model as it runs: embedding -> blocks
(norm, attention, norm, MLP) -> norm -> logits. Attention, the MLP and the embedding lookup are
each one call into kernels.py, where the config picks the implementation.

Windows packed from several documents come with segment ids and positions: attention stays within
each document and rotary positions restart at each, so every document reads as if it ran alone.
"""

from __future__ import annotations

import dataclasses

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from gspmd_tp.model import context, kernels, moe
from gspmd_tp.sharding.axes import (
    BATCH,
    EMBED,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    KV_LENGTH,
    LAYERS,
    LENGTH,
    NORM_LENGTH,
    VOCAB,
)
from gspmd_tp.sharding.rules import axes_of

# Activations that a rule file may make a collective produce: each sublayer's input once it is
# whole-width (an all-gather under sequence parallelism and 2D) and its output once reduced to the
# residual stream's layout (an all-reduce or reduce-scatter under tensor parallelism).
COLLECTIVE_OUTPUTS = ("attn_in", "attn_out", "mlp_in", "mlp_out")
# Every named activation that model.remat_save may keep on top of the remat policy: the collective
# outputs (attn_in and mlp_in are also the norms' outputs), the queries and keys after rotary
# embedding, SwiGLU's output, and the weights in the compute dtype.
SAVEABLE_NAMES = (*COLLECTIVE_OUTPUTS, "query", "key", "mlp_hidden", "weights")

_dots_no_batch = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
# The named activations a policy keeps on top of its products (plan's analysis reads them too).
POLICY_NAMES = {"dots_no_batch_comm": COLLECTIVE_OUTPUTS}
REMAT_POLICIES = {
    "none": None,  # no rematerialization
    "full": jax.checkpoint_policies.nothing_saveable,  # recompute the whole block
    "dots": jax.checkpoint_policies.checkpoint_dots,  # keep matmul outputs
    "dots_no_batch": _dots_no_batch,  # keep the weight products' outputs
    # dots_no_batch, plus the fused attention's residuals (model.attention cudnn): the backward
    # pass runs no attention forward again.
    "dots_no_batch_attention": jax.checkpoint_policies.save_from_both_policies(
        _dots_no_batch, kernels.fused_attention_saveable
    ),
    # dots_no_batch, plus the collective outputs: the backward pass repeats no communication.
    "dots_no_batch_comm": jax.checkpoint_policies.save_from_both_policies(
        _dots_no_batch, jax.checkpoint_policies.save_only_these_names(*POLICY_NAMES["dots_no_batch_comm"])
    ),
}


def remat_policy(cfg):
    """The remat policy of config.model: REMAT_POLICIES[remat], also keeping model.remat_save's names."""
    policy = REMAT_POLICIES[cfg.remat]
    if not cfg.saved_names:
        return policy
    return jax.checkpoint_policies.save_from_both_policies(
        policy, jax.checkpoint_policies.save_only_these_names(*cfg.saved_names)
    )


# The ModelConfig fields that are sizes: each must be positive.
SIZES = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Model hyperparameters (config.model); saved with every checkpoint."""

    vocab_size: int = 256
    # > 0: ids from here to vocab_size are padding (a vocabulary rounded up so that the mesh divides
    # it); their logits are masked out of the softmax. 0: every id is a token.
    vocab_tokens: int = 0
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 32
    mlp_dim: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # Qwen3's query/key norm: an RMSNorm over head_dim (one scale of head_dim per layer, shared by
    # the heads) on each query and key head before rotary embedding. False: no such norm.
    qk_norm: bool = False
    tie_embeddings: bool = False
    dtype: str = "float32"  # compute dtype; parameters are always float32
    remat: str = "none"  # a key of REMAT_POLICIES
    # Named activations (SAVEABLE_NAMES, comma-separated) kept on top of the remat policy's, so the
    # backward pass reads them instead of recomputing them: memory for elementwise passes.
    remat_save: str = ""
    # einsum: the attention written out, its scores annotated with logical axes; xla / cudnn:
    # jax.nn.dot_product_attention with that implementation (cudnn: fused flash attention, GPU
    # only, bf16/fp16, no segment ids: kernels.CUDNN_SEGMENTS); auto: cudnn on GPU in bf16/fp16,
    # einsum elsewhere and with segment ids (kernels.attention_implementation).
    # Sampling from the key/value cache always takes the einsum path.
    attention: str = "einsum"
    # einsum path, training and evaluation: queries in blocks of this many positions, each block
    # scoring only the keys up to its own end, so the causal upper triangle beyond the diagonal
    # blocks is never computed (0: one block, the whole square). The same result, to rounding.
    attention_block: int = 0
    # Under a rule file that splits `length` over mesh axes (context parallelism, context.py): how
    # attention reaches the other devices' keys and values. all_gather: GSPMD gathers them whole
    # (kv_length left unsplit); ring: they go round the context axes by ppermute, a block a step,
    # under a streaming softmax (einsum blocks: model.attention einsum or auto, attention_block 0).
    # Without a context axis both are plain attention.
    context_parallel: str = "all_gather"
    # Under context parallelism: the train and eval steps lay each sequence out in zigzag order
    # (device i of n holds chunks i and 2n-1-i of 2n), so the causal square's work is the same on
    # every device; attention masks by true positions. seq_len must divide by 2n.
    context_load_balance: bool = False
    scan_layers: bool = True
    # The SwiGLU MLP's gradient. xla: autodiff's (its two halves zero-padded and added); one_pass:
    # SwiGLU's gradient as one elementwise pass; fused: the whole MLP's backward written out, SwiGLU's
    # output recomputed in the same pass as its gradient rather than in a pass of its own. auto: fused
    # on GPU where no mesh axis splits `mlp` (and mlp_hidden is not in remat_save), one_pass on GPU
    # otherwise, xla elsewhere (kernels.mlp_implementation).
    mlp_grad: str = "auto"
    # > 1: where the rules split the MLP's weights on the model width (megatron_2d, fsdp_tp, fsdp,
    # data_fsdp_tensor), their gathers run in this many slices of the mlp dimension, each beside
    # the products of the slice before (MeshSlice's sliced GeMM; kernels.sliced_mlp). The same
    # result, to rounding.
    mlp_slices: int = 1
    # The dtype the products that make the weights' gradients (and the embedding's scatter) write,
    # then cast to float32; "": autodiff's, the compute dtype. Not a config.model key: the train
    # step sets it from config.optim.grad_reduce_dtype where GSPMD places the data-parallel
    # reduction (kernels.project).
    grad_dtype: str = ""
    # Mixture of experts (moe.py). 0: the dense MLP. > 0: each block's MLP is that many SwiGLU experts
    # of hidden width expert_mlp_dim (0: mlp_dim), each token sent to experts_per_token of them by a
    # softmax router over all of them (Mixtral, Qwen3-MoE), the k weights renormalised to sum to 1
    # where router_renormalize; plus, with shared_experts > 0, a dense SwiGLU MLP of hidden width
    # shared_experts * expert_mlp_dim that every token goes through (DeepSeekMoE's shared experts).
    # Dropless: every token reaches its k experts on any mesh.
    num_experts: int = 0
    experts_per_token: int = 2
    expert_mlp_dim: int = 0
    shared_experts: int = 0
    router_renormalize: bool = True
    # How tokens reach their experts' devices where the rules split `experts` (moe.DISPATCHES):
    # auto (ragged on TPU and GPU, gather on CPU), gather (all-gather and reduce-scatter), ragged
    # (ragged_all_to_all to the experts' devices and back; TPU and GPU only).
    moe_dispatch: str = "auto"
    # The ragged dispatch's receive buffer (moe.receive_rows): 0, sized for the worst case (every
    # token of the expert group to one device: dropless); >= 1, that many times a device's balanced
    # load, the assignments past a full buffer left out and counted (the step's expert_dropped).
    moe_buffer_factor: float = 0.0
    # The weights of the router's losses in the training objective, averaged over the layers: Switch's
    # load-balancing loss (1 when balanced) and ST-MoE's z-loss (moe.router_losses).
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.001

    @property
    def expert_width(self) -> int:
        """The hidden width of one expert: expert_mlp_dim, or mlp_dim where it is 0."""
        return self.expert_mlp_dim or self.mlp_dim

    @property
    def saved_names(self) -> tuple[str, ...]:
        """model.remat_save as a tuple of names."""
        return tuple(n.strip() for n in self.remat_save.split(",") if n.strip())

    @property
    def kept_names(self) -> set[str]:
        """The named activations the remat policy keeps: its own and model.remat_save's."""
        return set(POLICY_NAMES.get(self.remat, ())) | set(self.saved_names)

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def validate(self) -> list[str]:
        """Problems with these sizes, as one-line messages (empty when fine)."""
        problems = []
        for name in SIZES:
            if getattr(self, name) <= 0:
                problems.append(f"model.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.vocab_tokens <= self.vocab_size:
            problems.append(
                f"model.vocab_tokens must be in 0..vocab_size ({self.vocab_size}), got {self.vocab_tokens}"
            )
        if self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            problems.append(
                f"model.num_heads ({self.num_heads}) must be a multiple of model.num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if not self.rope_theta > 0:  # "not >" so that NaN is refused too
            problems.append(f"model.rope_theta must be positive, got {self.rope_theta}")
        if not self.norm_eps >= 0:
            problems.append(f"model.norm_eps must be 0 or more, got {self.norm_eps}")
        if self.head_dim % 2:
            problems.append(f"model.head_dim must be even for rotary embedding, got {self.head_dim}")
        if self.remat not in REMAT_POLICIES:
            problems.append(f"model.remat {self.remat!r} is not one of {sorted(REMAT_POLICIES)}")
        unknown = [n for n in self.saved_names if n not in SAVEABLE_NAMES]
        if unknown:
            problems.append(
                f"model.remat_save {self.remat_save!r}: {', '.join(map(repr, unknown))} not among "
                f"{', '.join(SAVEABLE_NAMES)}"
            )
        elif self.saved_names and self.remat == "none":
            problems.append(
                f"model.remat_save {self.remat_save!r} needs a model.remat policy: with 'none' every "
                "activation is kept already"
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            problems.append(f"model.dtype {self.dtype!r} is not float32, bfloat16 or float16")
        if self.grad_dtype not in ("", "float32", "bfloat16", "float16"):
            problems.append(f"model.grad_dtype {self.grad_dtype!r} is not '', float32, bfloat16 or float16")
        if self.attention_block < 0:
            problems.append(f"model.attention_block must be 0 (off) or positive, got {self.attention_block}")
        if self.mlp_grad not in kernels.MLP_GRADS:
            problems.append(f"model.mlp_grad {self.mlp_grad!r} is not one of {kernels.MLP_GRADS}")
        elif self.mlp_grad == "fused" and "mlp_hidden" in self.saved_names:
            problems.append(
                "model.remat_save keeps mlp_hidden, which model.mlp_grad 'fused' never reads (its "
                "backward recomputes SwiGLU's output beside its gradient): drop one of the two"
            )
        if self.mlp_slices < 1:
            problems.append(f"model.mlp_slices must be 1 (whole gathers) or more, got {self.mlp_slices}")
        elif self.mlp_slices > 1 and self.mlp_grad == "fused":
            problems.append(
                "model.mlp_grad 'fused' writes the whole MLP's backward, which model.mlp_slices "
                f"{self.mlp_slices} slices: set one of the two"
            )
        problems += self._moe_problems()
        if self.context_parallel not in context.STRATEGIES:
            problems.append(
                f"model.context_parallel {self.context_parallel!r} is not one of {context.STRATEGIES}"
            )
        if self.attention not in kernels.ATTENTION_IMPLEMENTATIONS:
            problems.append(
                f"model.attention {self.attention!r} is not one of {kernels.ATTENTION_IMPLEMENTATIONS}"
            )
        elif self.attention == "cudnn" and self.dtype == "float32":
            problems.append("model.attention 'cudnn' needs model.dtype bfloat16 or float16, got float32")
        if self.attention in ("xla", "cudnn") and self.attention_block > 0:
            problems.append(
                f"model.attention_block={self.attention_block} applies to einsum attention only; with "
                f"model.attention {self.attention!r} set it to 0"
            )
        return problems

    def _moe_problems(self) -> list[str]:
        """Problems with the mixture-of-experts keys, as one-line messages."""
        problems = []
        for name in ("num_experts", "expert_mlp_dim", "shared_experts"):
            if getattr(self, name) < 0:
                problems.append(f"model.{name} must be 0 or more, got {getattr(self, name)}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            if not getattr(self, name) >= 0:  # "not >=" so that NaN is refused too
                problems.append(f"model.{name} must be 0 or more, got {getattr(self, name)}")
        if self.moe_dispatch not in moe.DISPATCHES:
            problems.append(f"model.moe_dispatch {self.moe_dispatch!r} is not one of {moe.DISPATCHES}")
        if not (self.moe_buffer_factor == 0 or self.moe_buffer_factor >= 1):  # NaN refused too
            problems.append(
                f"model.moe_buffer_factor must be 0 (the worst case's receive buffer) or at least 1 "
                f"(times a device's balanced load), got {self.moe_buffer_factor}"
            )
        if self.num_experts > 0 and not 1 <= self.experts_per_token <= self.num_experts:
            problems.append(
                f"model.experts_per_token must be in 1..model.num_experts ({self.num_experts}), "
                f"got {self.experts_per_token}"
            )
        return problems


def _constrain(x, names):
    return nn.with_logical_constraint(x, names)


def _constrain_cotangent(x, names):
    """Identity forward; in the backward pass the incoming gradient is constrained to `names`.

    A projection's output gradient feeds two matmuls (the input gradient and the weight gradient).
    When both need it gathered, GSPMD may gather it once per consumer; constraining it once here
    makes a single gathered copy that both read. Used on the MLP output, and on the attention output
    where the residual stream is split on the model width (_width_split), where the GPU compiler and
    XLA:CPU gather it once per consumer. Elsewhere the compilers gather the attention's once, and in
    a float32 model the TPU compiler gathers it in bf16 after its own cast for the products (JAX's
    default precision), where this constraint would gather it in float32 (as it does under 2D).
    """

    @jax.custom_vjp
    def identity(y):
        return y

    def fwd(y):
        return y, None

    def bwd(_, g):
        return (_constrain(g, names),)

    identity.defvjp(fwd, bwd)
    return identity(x)


def _width_split() -> bool:
    """Whether the logical axis rules split the residual stream on the model width (2D sharding)."""
    return bool(axes_of(nn.logical_to_mesh_axes((BATCH, NORM_LENGTH, EMBED))[-1]))


# The inputs of the projections and the output-projection gradients: whole per position, never split
# on the model width. Where a rule file shards `embed` in the residual stream (2D) the constraint is
# the all-gather, and the gathered copy is what the backward pass keeps for the weight gradient
# (otherwise it gathers the input a second time); elsewhere it changes nothing.
_WHOLE_WIDTH = (BATCH, LENGTH, None)


def _param(module, name, init, shape, names):
    return module.param(name, nn.with_logical_partitioning(init, names), shape, jnp.float32)


def cast_weight(w, dtype, names: tuple):
    """A float32 weight with logical axes `names` in the compute dtype. The cast runs where the
    weight lies, so a weight split over devices (FSDP, 2D) is gathered in the compute dtype: half
    float32's bytes in bfloat16, and its gradient reduce-scattered in it."""
    if w.dtype == dtype:
        return w
    return _constrain(w.astype(dtype), names)


def _weight(w, dtype, names: tuple):
    """cast_weight, named "weights" (model.remat_save may keep it)."""
    return checkpoint_name(cast_weight(w, dtype, names), "weights")


# The logical axes of the projections' weights (the MLP's are kernels.MLP_IN and MLP_OUT); the
# output projection's, tied to the embedding or not.
QKV_AXES = (EMBED, KV_HEADS, None, HEAD_DIM)
OUT_AXES = (HEADS, HEAD_DIM, EMBED)
HEAD_AXES = (EMBED, VOCAB)

# The key/value cache of one layer: logical names only, so a rule file decides where it lives.
CACHE_AXES = (BATCH, LENGTH, KV_HEADS, HEAD_DIM)


@flax.struct.dataclass
class Decoding:
    """Where the tokens of a decoding call sit: positions (batch, length) are each row's absolute
    positions (negative for left padding), `slot` the cache slot of the first of them."""

    positions: jax.Array
    slot: jax.Array
    cache_length: int = flax.struct.field(pytree_node=False)


def _extend_cache(module, k_blkd, v_blkd, decoding: Decoding):
    """Writes this call's keys/values into the layer's cache at decoding.slot.

    Returns (cached keys, cached values, mask (batch, 1, 1, q, slots)). The prompts are left-padded,
    so a row's tokens fill the slots from slot - position onwards: a query sees the slots of its own
    row up to its own slot, never the padding before it nor the unwritten slots after it.
    """
    b, length, k_heads, hd = k_blkd.shape
    shape = (b, decoding.cache_length, k_heads, hd)
    init = nn.with_logical_partitioning(jnp.zeros, CACHE_AXES)
    cached_k = module.variable("cache", "key", init, shape, k_blkd.dtype)
    cached_v = module.variable("cache", "value", init, shape, v_blkd.dtype)
    start = (0, decoding.slot, 0, 0)
    cached_k.value = _constrain(jax.lax.dynamic_update_slice(cached_k.value, k_blkd, start), CACHE_AXES)
    cached_v.value = _constrain(jax.lax.dynamic_update_slice(cached_v.value, v_blkd, start), CACHE_AXES)
    query_slot = decoding.slot + jnp.arange(length, dtype=jnp.int32)  # (q,)
    row_start = query_slot[None, :] - decoding.positions  # (batch, q): the slot of position 0
    key_slot = jnp.arange(decoding.cache_length, dtype=jnp.int32)[None, None, :]
    mask = (key_slot >= row_start[:, :, None]) & (key_slot <= query_slot[None, :, None])
    return cached_k.value, cached_v.value, mask[:, None, None]


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last axis (embed, or head_dim: `axis`), computed in float32."""

    eps: float
    dtype: jnp.dtype
    axis: str = EMBED

    @nn.compact
    def __call__(self, x):
        scale = _param(self, "scale", nn.initializers.ones, (x.shape[-1],), (self.axis,))
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * scale).astype(self.dtype)


def rotary(x, positions, theta: float):
    """Rotary position embedding (the rotate-half layout of Llama/HF) on the last axis of x.

    x: (batch, length, ..., head_dim); positions: (length,), or (batch, length) when each row has
    its own (decoding left-padded prompts).
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # ([batch,] length, d/2)
    angles = jnp.concatenate([freqs, freqs], axis=-1)  # ([batch,] length, d)
    lead = (1, x.shape[1]) if positions.ndim == 1 else x.shape[:2]
    shape = lead + (1,) * (x.ndim - 3) + (d,)
    cos, sin = jnp.cos(angles).reshape(shape), jnp.sin(angles).reshape(shape)
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


_INIT = nn.initializers.normal(0.02)


def _out_init(cfg: ModelConfig):
    """GPT-2's init of the projections that write into the residual stream: scaled down by the
    square root of their count, two per layer."""
    return nn.initializers.normal(0.02 / (2 * cfg.num_layers) ** 0.5)


class Attention(nn.Module):
    """Causal self-attention with grouped key/value heads and a fused qkv kernel."""

    cfg: ModelConfig
    zigzag: bool = False  # the sequence in context.zigzag_order, `positions` its true positions

    @nn.compact
    def __call__(self, x_ble, positions, segment_ids=None):
        """positions: (length,) or (batch, length); or a Decoding, to attend through (and extend) the
        "cache" collection. segment_ids (batch, length): a query attends to its own segment only."""
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        group, hd = cfg.group, cfg.head_dim
        decoding = positions if isinstance(positions, Decoding) else None
        if decoding is not None:
            positions = decoding.positions  # (batch, length)
        b, length, _ = x_ble.shape
        qkv_shape = (cfg.d_model, cfg.num_kv_heads, group + 2, hd)
        w_qkv = _param(self, "qkv", _INIT, qkv_shape, QKV_AXES)
        out_shape = (cfg.num_heads, hd, cfg.d_model)
        w_out = _param(self, "out", _out_init(cfg), out_shape, OUT_AXES)

        qkv_blkgd = kernels.project(
            "ble,ekgd->blkgd", x_ble, _weight(w_qkv, dtype, QKV_AXES), QKV_AXES, cfg.grad_dtype
        )
        qkv_blkgd = _constrain(qkv_blkgd, (BATCH, LENGTH, KV_HEADS, None, HEAD_DIM))
        q_blhd = qkv_blkgd[:, :, :, :group].reshape(b, length, cfg.num_heads, hd)
        k_blkd = qkv_blkgd[:, :, :, group]
        if cfg.qk_norm:
            q_blhd = RMSNorm(cfg.norm_eps, dtype, HEAD_DIM, name="q_norm")(q_blhd)
            k_blkd = RMSNorm(cfg.norm_eps, dtype, HEAD_DIM, name="k_norm")(k_blkd)
        q_blhd = rotary(q_blhd, positions, cfg.rope_theta) * hd**-0.5  # scaled once, here
        q_blhd = checkpoint_name(_constrain(q_blhd, (BATCH, LENGTH, HEADS, HEAD_DIM)), "query")
        k_blkd = rotary(k_blkd, positions, cfg.rope_theta)
        # Keys and values by kv_length, apart from the queries' length: context parallelism splits the
        # queries by position and gathers the keys and values whole here (rules: kv_length -> null);
        # the ring keeps them split as the queries are (context.py).
        kv_length = LENGTH if decoding is None and context.rings(cfg) else KV_LENGTH
        k_blkd = checkpoint_name(_constrain(k_blkd, (BATCH, kv_length, KV_HEADS, HEAD_DIM)), "key")
        v_blkd = _constrain(qkv_blkgd[:, :, :, group + 1], (BATCH, kv_length, KV_HEADS, HEAD_DIM))

        mask = None  # causal
        if decoding is not None:  # keys and values: the cache so far plus these tokens
            k_blkd, v_blkd, mask = _extend_cache(self, k_blkd, v_blkd, decoding)
        out_blhd = kernels.attention(
            cfg, q_blhd, k_blkd, v_blkd, mask, segment_ids, None if decoding else positions, self.zigzag
        )
        out_blhd = _constrain(out_blhd, (BATCH, LENGTH, HEADS, HEAD_DIM))
        y_ble = kernels.project(
            "blhd,hde->ble", out_blhd, _weight(w_out, dtype, OUT_AXES), OUT_AXES, cfg.grad_dtype
        )
        if _width_split():
            y_ble = _constrain_cotangent(y_ble, _WHOLE_WIDTH)
        return _constrain(y_ble, (BATCH, NORM_LENGTH, EMBED))


class FeedForward(nn.Module):
    """SwiGLU feed-forward with a fused gate/up kernel."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_ble):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        w_in = _param(self, "gate_up", _INIT, (cfg.d_model, 2, cfg.mlp_dim), kernels.MLP_IN)
        w_out = _param(self, "down", _out_init(cfg), (cfg.mlp_dim, cfg.d_model), kernels.MLP_OUT)
        y_ble = kernels.mlp(
            cfg, x_ble, _weight(w_in, dtype, kernels.MLP_IN), _weight(w_out, dtype, kernels.MLP_OUT)
        )
        return _constrain(_constrain_cotangent(y_ble, _WHOLE_WIDTH), (BATCH, NORM_LENGTH, EMBED))


class MoeFeedForward(nn.Module):
    """Mixture of SwiGLU experts (moe.py): a router's top-k experts per token, dropless, plus the
    shared experts where model.shared_experts > 0. Sows the router's statistics (moe.STATS) into
    "intermediates" for the router's losses."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_ble):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        e, d, m = cfg.num_experts, cfg.d_model, cfg.expert_width
        w_router = _param(self, "router", _INIT, (d, e), moe.ROUTER_AXES)
        w_in = _param(self, "gate_up", _INIT, (e, d, 2, m), moe.EXPERT_IN)
        w_out = _param(self, "down", _out_init(cfg), (e, m, d), moe.EXPERT_OUT)
        k, renormalize = cfg.experts_per_token, cfg.router_renormalize
        weights_blk, ids_blk, stats = moe.route(x_ble, w_router, k, renormalize)
        for name, value in stats.items():
            self.sow("intermediates", name, value)
        w_in, w_out = _weight(w_in, dtype, moe.EXPERT_IN), _weight(w_out, dtype, moe.EXPERT_OUT)
        y_ble, dropped = moe.experts(cfg, x_ble, weights_blk, ids_blk, w_in, w_out)
        if cfg.moe_buffer_factor:  # the assignments its receive buffers left out (moe.router_losses)
            self.sow("intermediates", "expert_dropped", dropped)
        y_ble = _constrain(_constrain_cotangent(y_ble, _WHOLE_WIDTH), (BATCH, NORM_LENGTH, EMBED))
        if cfg.shared_experts:
            shared = dataclasses.replace(cfg, mlp_dim=cfg.shared_experts * m)
            y_ble = y_ble + FeedForward(shared, name="shared")(x_ble)
        return y_ble


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    cfg: ModelConfig
    zigzag: bool = False  # Attention's

    @nn.compact
    def __call__(self, x_ble, positions, segment_ids=None):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        x_ble = _constrain(x_ble, (BATCH, NORM_LENGTH, EMBED))
        # Norms run where the residual stream lives (norm_length); the projections need whole
        # sequences (length). Under sequence parallelism the second constraint is the all-gather.
        h = _constrain(RMSNorm(cfg.norm_eps, dtype, name="attn_norm")(x_ble), (BATCH, NORM_LENGTH, EMBED))
        h = checkpoint_name(_constrain(h, _WHOLE_WIDTH), "attn_in")
        attn = Attention(cfg, self.zigzag, name="attn")
        x_ble = x_ble + checkpoint_name(attn(h, positions, segment_ids), "attn_out")
        h = _constrain(RMSNorm(cfg.norm_eps, dtype, name="mlp_norm")(x_ble), (BATCH, NORM_LENGTH, EMBED))
        h = checkpoint_name(_constrain(h, _WHOLE_WIDTH), "mlp_in")
        mlp = MoeFeedForward(cfg, name="moe") if cfg.num_experts else FeedForward(cfg, name="mlp")
        x_ble = x_ble + checkpoint_name(mlp(h), "mlp_out")
        return _constrain(x_ble, (BATCH, NORM_LENGTH, EMBED)), None


class Transformer(nn.Module):
    """tokens (batch, length) int32 -> logits (batch, length, vocab) float32."""

    cfg: ModelConfig

    @nn.compact
    def __call__(
        self,
        tokens_bl,
        return_hidden: bool = False,
        decoding: Decoding | None = None,
        segment_ids_bl=None,
        positions_bl=None,
        zigzag: bool = False,
    ):
        """Logits; with return_hidden, (final-normed hidden states, output projection (embed,
        vocab)) instead, so that a loss can project a block of positions at a time. With `decoding`,
        attention reads and extends the key/value cache (apply with mutable=["cache"]). Packed
        documents: segment_ids_bl (batch, length) keeps each position's attention within its
        segment, positions_bl (batch, length) are the rotary positions (by default 0, 1, ...).
        `zigzag`: the sequence comes in context.zigzag_order (the steps' under
        model.context_load_balance) and positions_bl are its true positions, which the causal mask
        compares."""
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        embedding = _param(self, "embedding", _INIT, (cfg.vocab_size, cfg.d_model), (VOCAB, EMBED))
        x_ble = kernels.embed(cfg, embedding, tokens_bl)
        # Look up whole sequences, then split them: a vocabulary-sharded lookup on split sequences
        # makes GSPMD all-reduce the gradient of the whole table under sequence parallelism.
        x_ble = _constrain(x_ble, (BATCH, LENGTH, EMBED))
        x_ble = _constrain(x_ble, (BATCH, NORM_LENGTH, EMBED))
        positions = jnp.arange(tokens_bl.shape[1], dtype=jnp.int32)
        if positions_bl is not None:
            positions = positions_bl
        elif zigzag:
            raise ValueError("a sequence in zigzag order needs its true positions (positions_bl)")
        if decoding is not None:
            positions = decoding  # Block hands it to Attention unchanged

        block = Block
        if cfg.remat != "none":
            block = nn.remat(Block, policy=remat_policy(cfg), prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:
            stack = nn.scan(
                block,
                # each layer its own cache, and its own row of the router's statistics (MoE)
                variable_axes={"params": 0, "cache": 0, "intermediates": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: LAYERS},
            )
            x_ble, _ = stack(cfg, zigzag, name="layers")(x_ble, positions, segment_ids_bl)
        else:
            for i in range(cfg.num_layers):
                x_ble, _ = block(cfg, zigzag, name=f"layers_{i}")(x_ble, positions, segment_ids_bl)

        x_ble = RMSNorm(cfg.norm_eps, dtype, name="final_norm")(x_ble)
        x_ble = _constrain(x_ble, _WHOLE_WIDTH)
        if cfg.tie_embeddings:
            head_ev = embedding.T
        else:
            head_ev = _param(self, "lm_head", _INIT, (cfg.d_model, cfg.vocab_size), HEAD_AXES)
        if return_hidden:
            return x_ble, head_ev
        logits_blv = kernels.project(
            "ble,ev->blv", x_ble, cast_weight(head_ev, dtype, HEAD_AXES), HEAD_AXES, cfg.grad_dtype
        )
        logits_blv = mask_vocab_padding(logits_blv.astype(jnp.float32), cfg.vocab_tokens)
        return _constrain(logits_blv, (BATCH, LENGTH, VOCAB))


def mask_vocab_padding(logits_v, vocab_tokens: int):
    """Logits (..., vocab) with the padding ids at and past `vocab_tokens` at -inf: no probability
    (and no gradient) goes to them. vocab_tokens 0: all ids are tokens, the logits as they are."""
    if not vocab_tokens:
        return logits_v
    ids = jnp.arange(logits_v.shape[-1])
    return jnp.where(ids < vocab_tokens, logits_v, -jnp.inf)
