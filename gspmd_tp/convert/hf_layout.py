"""The Hugging Face Llama-family formats (Llama, Qwen3, Mixtral, Qwen3-MoE) and how our model maps
onto them: no mesh, run or checkpoint here.

config.json <-> ModelConfig; each HF tensor <-> a block of one of our fused parameters (read a
device's shard at a time on the way in, written one layer-tensor at a time on the way out); the
safetensors files of a model directory, read lazily and written in shards as save_pretrained does.
convert.py puts these together with our checkpoints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path

import jax
import numpy as np

from gspmd_tp.checkpoint.step_dirs import short_error
from gspmd_tp.job.errors import UserError
from gspmd_tp.model.params import path_str
from gspmd_tp.model.transformer import SIZES, ModelConfig

# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


# Our keys that a Hugging Face config.json determines; the rest of config.model (dtype, remat,
# scan_layers) says how to compute, not what the model is, and stays as the run's config sets it.
HF_MODEL_KEYS = (
    *SIZES,
    "rope_theta",
    "norm_eps",
    "tie_embeddings",
    "qk_norm",
    "num_experts",
    "experts_per_token",
    "expert_mlp_dim",
    "shared_experts",
    "router_renormalize",
)

# model_type -> the architecture's class. Qwen3 adds the query/key norm to Llama, Mixtral a mixture
# of experts, Qwen3-MoE both.
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_MOE_FAMILIES = ("mixtral", "qwen3_moe")


def family(cfg: ModelConfig) -> str:
    """The model_type of FAMILIES that `cfg` exports as."""
    if cfg.num_experts:
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    return "qwen3" if cfg.qk_norm else "llama"


def export_problem(cfg: ModelConfig) -> str | None:
    """Why `cfg` has no Hugging Face family to export as (one line), or None."""
    if cfg.num_experts and cfg.shared_experts:
        return (
            f"model.shared_experts={cfg.shared_experts}: no exported family (Mixtral, Qwen3-MoE) has "
            "shared experts"
        )
    if family(cfg) == "mixtral" and not cfg.router_renormalize:
        return (
            "model.router_renormalize=False without model.qk_norm: Mixtral always renormalises its top-k "
            "weights, and Qwen3-MoE (which need not) has the query/key norm"
        )
    return None


def read_hf_config(hf_dir, flag: str, given: str | None = None) -> dict:
    """config.json of a Hugging Face model directory; UserError naming `flag` (and the path `given`,
    where `hf_dir` is its local copy) if it does not read."""
    path = Path(hf_dir) / "config.json"
    hf_dir = given or hf_dir
    if not path.is_file():
        raise UserError(f"{flag}={hf_dir}: no config.json (expected a Hugging Face model directory)")
    try:
        hf = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{flag}={hf_dir}: config.json does not read ({e})") from None
    if not isinstance(hf, dict):
        raise UserError(f"{flag}={hf_dir}: config.json is not a JSON object")
    return hf


# The sizes model_config_from_hf cannot do without.
_REQUIRED_SIZES = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)


def model_config_from_hf(hf: dict, base: ModelConfig) -> ModelConfig:
    """Our ModelConfig for a Hugging Face config.json of one of FAMILIES; UserError names an option
    this model lacks."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise UserError(f"model_type {model_type!r} is not supported (only {', '.join(map(repr, FAMILIES))})")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"hidden_act {act!r} is not supported (the model's SwiGLU uses 'silu')")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise UserError(f"{flag}=true is not supported (the model's projections have no bias)")
    # transformers < 5 writes rope_theta + rope_scaling; 5.x writes rope_parameters.
    rope = hf.get("rope_parameters") or {}
    for name, options in (("rope_scaling", hf.get("rope_scaling")), ("rope_parameters", rope)):
        kind = (options or {}).get("rope_type", (options or {}).get("type", "default"))
        if kind != "default":
            raise UserError(f"{name} with rope_type {kind!r} is not supported (only the default rotary)")
    _check_attention_options(hf)
    moe = _moe_options(hf) if model_type in _MOE_FAMILIES else {}
    for key in (*_REQUIRED_SIZES, "head_dim", "num_key_value_heads"):  # the last two are optional
        value = hf.get(key)
        if value is None and key in _REQUIRED_SIZES:
            raise UserError(f"config.json has no {key} (a Llama config.json sets it)")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise UserError(f"config.json: {key} is {value!r}, not a positive integer")
    heads = hf["num_attention_heads"]
    if model_type == "qwen3" and "head_dim" not in hf:
        hf = {**hf, "head_dim": 128}  # Qwen3Config's default, where the others derive it
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if not hf.get("head_dim") and hf["hidden_size"] % heads:
        raise UserError(f"hidden_size {hf['hidden_size']} is not divisible by num_attention_heads {heads}")
    cfg = dataclasses.replace(
        base,
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        mlp_dim=hf["intermediate_size"],
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        **{"num_experts": 0, "shared_experts": 0, **moe},
    )
    problems = cfg.validate()
    if problems:
        raise UserError(f"cannot express this Hugging Face model: {problems[0]}")
    return cfg


def _check_attention_options(hf: dict) -> None:
    """UserError naming an attention option of the families that this model lacks."""
    if hf.get("sliding_window") and hf.get("use_sliding_window", True):
        raise UserError(
            f"sliding_window={hf['sliding_window']} is not supported (full causal attention only)"
        )
    other = sorted({t for t in hf.get("layer_types") or () if t != "full_attention"})
    if other:
        raise UserError(f"layer_types {other} are not supported (only 'full_attention')")


def _positive(hf: dict, key: str) -> int:
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"config.json: {key} is {value!r}, not a positive integer")
    return value


def _moe_options(hf: dict) -> dict:
    """Our mixture-of-experts keys for a Mixtral or Qwen3-MoE config.json; UserError names an option
    this model lacks (dense layers between the sparse ones, shared experts, router noise)."""
    kind = hf["model_type"]
    if hf.get("decoder_sparse_step", 1) != 1:
        raise UserError(
            f"decoder_sparse_step={hf['decoder_sparse_step']} is not supported "
            "(every layer a mixture of experts)"
        )
    if hf.get("mlp_only_layers"):
        raise UserError(
            f"mlp_only_layers={hf['mlp_only_layers']} is not supported (every layer a mixture of experts)"
        )
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if hf.get(key):
            raise UserError(f"{key}={hf[key]} is not supported (no shared experts in {kind}'s layout)")
    if hf.get("router_jitter_noise"):
        raise UserError(f"router_jitter_noise={hf['router_jitter_noise']} is not supported (no router noise)")
    # Qwen3-MoE's own name is num_experts; transformers 5 writes num_local_experts, Mixtral's.
    experts_key = "num_experts" if kind == "qwen3_moe" and "num_experts" in hf else "num_local_experts"
    width_key = "moe_intermediate_size" if kind == "qwen3_moe" else "intermediate_size"
    return {
        "num_experts": _positive(hf, experts_key),
        "experts_per_token": _positive(hf, "num_experts_per_tok"),
        "expert_mlp_dim": _positive(hf, width_key),
        # Mixtral always renormalises the top-k weights; Qwen3-MoE where norm_topk_prob.
        "router_renormalize": kind == "mixtral" or bool(hf.get("norm_topk_prob", False)),
    }


# Keys of one family's config.json that another's must not inherit from a base config.
_FAMILY_KEYS = (
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_jitter_noise",
    "output_router_logits",
    "router_aux_loss_coef",
)


def hf_config(cfg: ModelConfig, dtype: str, max_positions: int, base: dict | None = None) -> dict:
    """The config.json of `cfg`'s family (family()); token ids and the like are kept from `base`."""
    skipped = ("rope_scaling", "torch_dtype", *_FAMILY_KEYS)
    out = {k: v for k, v in (base or {}).items() if k not in skipped}
    kind = family(cfg)
    out.update(
        architectures=[FAMILIES[kind]],
        model_type=kind,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.mlp_dim,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        # Both spellings, so that transformers 4.x (rope_theta) and 5.x (rope_parameters) read it.
        rope_theta=cfg.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        dtype=dtype,
    )
    if kind in ("qwen3", "qwen3_moe"):
        out.update(
            use_sliding_window=False, sliding_window=None, layer_types=["full_attention"] * cfg.num_layers
        )
    if kind == "mixtral":
        out.update(
            intermediate_size=cfg.expert_width,
            num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token,
            router_jitter_noise=0.0,
            sliding_window=None,
        )
    if kind == "qwen3_moe":
        out.update(
            moe_intermediate_size=cfg.expert_width,
            num_experts=cfg.num_experts,
            num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token,
            norm_topk_prob=cfg.router_renormalize,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    out.setdefault("max_position_embeddings", max_positions)
    return out


# ---------------------------------------------------------------------------------------------
# Tensor layouts. HF stores nn.Linear weights as (out, in); ours are (in, ..., out), fused:
#   qkv     (embed, kv_heads, group + 2, head_dim): per kv head its `group` query heads, key, value
#   out     (heads, head_dim, embed)         gate_up (embed, 2, mlp): gate then up
#   down    (mlp, embed)   embedding (vocab, embed)   lm_head (embed, vocab)   norms (embed,)
#   q_norm, k_norm (head_dim,)   moe: router (embed, experts)   gate_up (experts, embed, 2, expert
#   width): each expert's gate then up   down (experts, expert width, embed)
# The families name the experts' tensors differently (_moe_names).


def _moe_names(cfg: ModelConfig, prefix: str):
    """(router's HF name, expert j -> its (gate, up, down) HF names) of layer `prefix`."""
    if family(cfg) == "mixtral":
        base = f"{prefix}block_sparse_moe."
        parts = ("w1", "w3", "w2")
    else:
        base = f"{prefix}mlp."
        parts = ("gate_proj", "up_proj", "down_proj")
    return f"{base}gate.weight", lambda j: tuple(f"{base}experts.{j}.{p}.weight" for p in parts)


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The name and shape of every tensor of the HF checkpoint of `cfg`."""
    e, h, k, d, m, v = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (v, e), "model.norm.weight": (e,)}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (v, e)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                f"{p}input_layernorm.weight": (e,),
                f"{p}post_attention_layernorm.weight": (e,),
                f"{p}self_attn.q_proj.weight": (h * d, e),
                f"{p}self_attn.k_proj.weight": (k * d, e),
                f"{p}self_attn.v_proj.weight": (k * d, e),
                f"{p}self_attn.o_proj.weight": (e, h * d),
            }
        )
        if cfg.qk_norm:
            shapes.update({f"{p}self_attn.q_norm.weight": (d,), f"{p}self_attn.k_norm.weight": (d,)})
        if cfg.num_experts:
            router, experts = _moe_names(cfg, p)
            x = cfg.expert_width
            shapes[router] = (cfg.num_experts, e)
            for j in range(cfg.num_experts):
                gate, up, down = experts(j)
                shapes.update({gate: (x, e), up: (x, e), down: (e, x)})
        else:
            shapes.update(
                {
                    f"{p}mlp.gate_proj.weight": (m, e),
                    f"{p}mlp.up_proj.weight": (m, e),
                    f"{p}mlp.down_proj.weight": (e, m),
                }
            )
    return shapes


def _bounds(index: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    out = []
    for sl, n in zip(index, shape, strict=True):
        start, stop, step = sl.indices(n)
        assert step == 1, "shardings are contiguous blocks"
        out.append((start, stop))
    return out


def _read_layer(read, cfg: ModelConfig, prefix: str, name: str, b: list[tuple[int, int]]) -> np.ndarray:
    """The block `b` of our per-layer parameter `name` (e.g. 'attn/qkv'), read from HF tensors."""
    if name in ("attn_norm/scale", "mlp_norm/scale"):
        hf = "input_layernorm" if name == "attn_norm/scale" else "post_attention_layernorm"
        ((e0, e1),) = b
        return read(f"{prefix}{hf}.weight", np.s_[e0:e1])
    if name in ("attn/q_norm/scale", "attn/k_norm/scale"):
        ((d0, d1),) = b
        return read(f"{prefix}self_attn.{name.split('/')[1]}.weight", np.s_[d0:d1])
    if name.startswith("moe/"):
        return _read_moe(read, cfg, prefix, name, b)
    if name == "attn/qkv":
        (e0, e1), (k0, k1), (g0, g1), (d0, d1) = b
        hd, group = cfg.head_dim, cfg.group
        # Rows of q_proj for kv heads k0..k1 are contiguous: head k * group + g, row head * hd + d.
        q = read(f"{prefix}self_attn.q_proj.weight", np.s_[k0 * group * hd : k1 * group * hd, e0:e1])
        k = read(f"{prefix}self_attn.k_proj.weight", np.s_[k0 * hd : k1 * hd, e0:e1])
        v = read(f"{prefix}self_attn.v_proj.weight", np.s_[k0 * hd : k1 * hd, e0:e1])
        nk, ne = k1 - k0, e1 - e0
        qkv = np.concatenate(
            [q.reshape(nk, group, hd, ne), k.reshape(nk, 1, hd, ne), v.reshape(nk, 1, hd, ne)], axis=1
        )
        return qkv[:, g0:g1, d0:d1].transpose(3, 0, 1, 2)
    if name == "attn/out":
        (h0, h1), (d0, d1), (e0, e1) = b
        hd = cfg.head_dim
        o = read(f"{prefix}self_attn.o_proj.weight", np.s_[e0:e1, h0 * hd : h1 * hd])
        return o.reshape(e1 - e0, h1 - h0, hd)[:, :, d0:d1].transpose(1, 2, 0)
    if name == "mlp/gate_up":
        (e0, e1), (c0, c1), (m0, m1) = b
        parts = [read(f"{prefix}mlp.{p}_proj.weight", np.s_[m0:m1, e0:e1]).T for p in ("gate", "up")]
        return np.stack(parts[c0:c1], axis=1)
    if name == "mlp/down":
        (m0, m1), (e0, e1) = b
        return read(f"{prefix}mlp.down_proj.weight", np.s_[e0:e1, m0:m1]).T
    raise AssertionError(f"no Hugging Face tensor for layer parameter {name}")


def _read_moe(read, cfg: ModelConfig, prefix: str, name: str, b: list[tuple[int, int]]) -> np.ndarray:
    """The block `b` of our MoE parameter `name` ('moe/router', 'moe/gate_up', 'moe/down')."""
    router, experts = _moe_names(cfg, prefix)
    if name == "moe/router":
        (e0, e1), (x0, x1) = b
        return read(router, np.s_[x0:x1, e0:e1]).T
    if name == "moe/gate_up":
        (x0, x1), (e0, e1), (c0, c1), (m0, m1) = b
        return np.stack(
            [
                np.stack([read(t, np.s_[m0:m1, e0:e1]).T for t in experts(j)[:2]][c0:c1], axis=1)
                for j in range(x0, x1)
            ]
        )
    if name == "moe/down":
        (x0, x1), (m0, m1), (e0, e1) = b
        return np.stack([read(experts(j)[2], np.s_[e0:e1, m0:m1]).T for j in range(x0, x1)])
    raise AssertionError(f"no Hugging Face tensor for layer parameter {name}")


def read_param(read, cfg: ModelConfig, path: str, shape, index) -> np.ndarray:
    """The block `index` of our parameter at `path` ('layers/attn/qkv', 'embedding', ...)."""
    b = _bounds(index, shape)
    if path == "embedding":
        (v0, v1), (e0, e1) = b
        return read("model.embed_tokens.weight", np.s_[v0:v1, e0:e1])
    if path == "lm_head":
        (e0, e1), (v0, v1) = b
        return read("lm_head.weight", np.s_[v0:v1, e0:e1]).T
    if path == "final_norm/scale":
        return read("model.norm.weight", np.s_[b[0][0] : b[0][1]])
    top, _, name = path.partition("/")
    if top == "layers":  # nn.scan stacks the layers on axis 0
        (l0, l1), *rest = b
        return np.stack([_read_layer(read, cfg, f"model.layers.{i}.", name, rest) for i in range(l0, l1)])
    return _read_layer(read, cfg, f"model.layers.{int(top.removeprefix('layers_'))}.", name, b)


def _layer_tensors(cfg: ModelConfig, prefix: str, name: str, w: np.ndarray) -> dict[str, np.ndarray]:
    """The HF tensors of one layer's parameter `name`, from our (whole, per-layer) array `w`."""
    e, hd, group = cfg.d_model, cfg.head_dim, cfg.group
    if name == "attn_norm/scale":
        return {f"{prefix}input_layernorm.weight": w}
    if name == "mlp_norm/scale":
        return {f"{prefix}post_attention_layernorm.weight": w}
    if name == "attn/qkv":
        return {
            f"{prefix}self_attn.q_proj.weight": w[:, :, :group].reshape(e, -1).T,
            f"{prefix}self_attn.k_proj.weight": w[:, :, group].reshape(e, -1).T,
            f"{prefix}self_attn.v_proj.weight": w[:, :, group + 1].reshape(e, -1).T,
        }
    if name == "attn/out":
        return {f"{prefix}self_attn.o_proj.weight": w.reshape(cfg.num_heads * hd, e).T}
    if name in ("attn/q_norm/scale", "attn/k_norm/scale"):
        return {f"{prefix}self_attn.{name.split('/')[1]}.weight": w}
    if name.startswith("moe/"):
        router, experts = _moe_names(cfg, prefix)
        if name == "moe/router":
            return {router: w.T}
        out = {}
        for j in range(cfg.num_experts):
            gate, up, down = experts(j)
            out.update({gate: w[j, :, 0].T, up: w[j, :, 1].T} if name == "moe/gate_up" else {down: w[j].T})
        return out
    if name == "mlp/gate_up":
        return {f"{prefix}mlp.gate_proj.weight": w[:, 0].T, f"{prefix}mlp.up_proj.weight": w[:, 1].T}
    if name == "mlp/down":
        return {f"{prefix}mlp.down_proj.weight": w.T}
    raise AssertionError(f"no Hugging Face tensor for layer parameter {name}")


def hf_tensors(cfg: ModelConfig, params):
    """Yields (HF name, host array) one layer-tensor at a time, gathering nothing larger."""
    flat = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    yield "model.embed_tokens.weight", np.asarray(flat["embedding"])
    for i in range(cfg.num_layers):
        for path, x in flat.items():
            top, _, name = path.partition("/")
            if top == "layers":
                yield from _layer_tensors(cfg, f"model.layers.{i}.", name, np.asarray(x[i])).items()
            elif top == f"layers_{i}":
                yield from _layer_tensors(cfg, f"model.layers.{i}.", name, np.asarray(x)).items()
    yield "model.norm.weight", np.asarray(flat["final_norm/scale"])
    if not cfg.tie_embeddings:  # tied models store no lm_head; transformers ties it on load
        yield "lm_head.weight", np.asarray(flat["lm_head"]).T


# ---------------------------------------------------------------------------------------------
# safetensors files


@contextlib.contextmanager
def hf_reader(hf_dir: Path):
    """read(name, np.s_[...]) -> float32 block of a tensor, from whichever safetensors shard has it.

    read(name) without a block gives the tensor's shape.
    """
    from safetensors import safe_open

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"weight_map is a {type(weight_map).__name__}, not an object")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{index} does not read as a safetensors index ({short_error(e)})") from None
    elif (hf_dir / "model.safetensors").is_file():
        weight_map = None
    else:
        raise UserError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
    with contextlib.ExitStack() as stack:
        files = {}

        def read(name: str, block=None):
            file = weight_map.get(name) if weight_map is not None else "model.safetensors"
            if file is None:
                raise UserError(f"{hf_dir}: tensor {name} is missing")
            try:
                if file not in files:
                    # framework="flax": numpy cannot slice bfloat16 tensors; jax can.
                    files[file] = stack.enter_context(safe_open(str(hf_dir / file), framework="flax"))
                if block is None and name not in files[file].keys():
                    raise UserError(f"{hf_dir / file}: tensor {name} is missing")
                tensor = files[file].get_slice(name)
                if block is None:
                    return tuple(tensor.get_shape())
                return np.asarray(tensor[block], dtype=np.float32)
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - safetensors' own errors have no common base
                raise UserError(f"{hf_dir / file}: {name} does not read ({short_error(e)})") from None

        yield read


def _umask() -> int:
    """The process's umask, read without setting it (os.umask would, for a moment, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0o022


def write_safetensors(out: Path, tensors, dtype, max_shard_bytes: int) -> list[str]:
    """Writes (name, array) pairs into shards of at most ~max_shard_bytes, as save_pretrained does."""
    from safetensors.numpy import save_file

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    paths = []

    def flush():
        # Host memory holds one shard at a time.
        path = out / f"shard-{len(paths):05d}.tmp"
        save_file(shards[-1], str(path), metadata={"format": "pt"})  # transformers checks "format"
        os.chmod(path, 0o666 & ~_umask())  # safetensors writes 0600; others on shared storage read it too
        paths.append((path, list(shards[-1])))
        shards[-1] = {}

    for name, array in tensors:
        array = np.ascontiguousarray(array.astype(dtype))
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            flush()
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    flush()
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # an earlier export into the same directory
    if len(paths) == 1:
        paths[0][0].rename(out / "model.safetensors")
        return [str(out / "model.safetensors")]
    weight_map, written = {}, []
    for i, (path, names) in enumerate(paths):
        final = out / f"model-{i + 1:05d}-of-{len(paths):05d}.safetensors"
        path.rename(final)
        weight_map.update({n: final.name for n in names})
        written.append(str(final))
    total = sum(os.path.getsize(p) for p in written)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [*written, str(out / "model.safetensors.index.json")]
