"""The model's parameters as a tree: their paths, shapes and logical axes (without allocating them),
their counts, and the training FLOPs per token that MFU divides by."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from gspmd_tp.model.transformer import ModelConfig, Transformer


def path_str(path) -> str:
    """A pytree path as 'params/layers/attn/qkv'."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return "/".join(p for p in parts if p != "value")


def param_axes(model_cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """{'layers/attn/qkv': (shape, logical names)} for every parameter."""
    return dict(_param_axes(model_cfg))


@functools.cache
def abstract_params(model_cfg: ModelConfig):
    """The parameters as ShapeDtypeStructs boxed with their logical names (nn.LogicallyPartitioned),
    traced once per model config: a setup, its state's specs, the checks and plan's tables all ask.
    Shared between callers: read it, do not change it."""
    return jax.eval_shape(
        lambda r: Transformer(model_cfg).init(r, jnp.zeros((1, 8), jnp.int32))["params"],
        jax.random.key(0),
    )


@functools.cache
def _param_axes(model_cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    out = {}
    leaves = jax.tree_util.tree_flatten_with_path(
        abstract_params(model_cfg), is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
    )[0]
    for path, leaf in leaves:
        out[path_str(path)] = (tuple(leaf.value.shape), tuple(leaf.names))
    return out


@functools.cache
def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts: total, and those in matrix products that each token meets (the N of the
    MFU formula): in a mixture of experts the router's, its k experts' and the shared experts'
    (the active parameters), not every expert's."""
    d, hd, h, k, m, v, n = (
        cfg.d_model,
        cfg.head_dim,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.mlp_dim,
        cfg.vocab_size,
        cfg.num_layers,
    )
    attention = d * (h + 2 * k) * hd + h * hd * d
    qk_norms = 2 * hd if cfg.qk_norm else 0  # no matmul: counted in the total only
    per_layer, per_layer_active = attention + 3 * d * m, attention + 3 * d * m
    if cfg.num_experts:
        expert, shared = 3 * d * cfg.expert_width, 3 * d * cfg.shared_experts * cfg.expert_width
        router = d * cfg.num_experts
        per_layer = attention + router + cfg.num_experts * expert + shared
        per_layer_active = attention + router + cfg.experts_per_token * expert + shared
    norms = n * (2 * d + qk_norms) + d
    embedding = v * d
    # The output projection takes part in a matmul whether or not it is tied to the embedding.
    matmul = n * per_layer_active + v * d
    total = n * per_layer + norms + embedding + (0 if cfg.tie_embeddings else v * d)
    return {"total": total, "matmul": matmul}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (PaLM appendix B): 6N + 12·L·H·Q·T, attention halved (causal); N
    the active parameters of a mixture of experts (param_count's matmul)."""
    n = param_count(cfg)["matmul"]
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len
    return 6 * n + attention / 2
