"""Hugging Face Llama checkpoints <-> orbax checkpoints of our model, one command each way.

    python -m gspmd_tp.convert from-hf --hf_dir=DIR --workdir=RUN \
        [--config=configs/tiny.py --config.rules=megatron_1d --config.mesh=dp=4,mp=2]
    python -m gspmd_tp.convert to-hf --workdir=RUN --hf_dir=OUT [--step=N --dtype=bfloat16 --hf_base=DIR]

from-hf reads config.json and the safetensors shards of a LlamaForCausalLM and writes step 0 of a run
that `train.py --workdir=RUN` resumes from (fresh optimizer, data from the start). Every parameter is
built with jax.make_array_from_callback: each device's shard is read straight from the memory-mapped
safetensors file, so no host ever holds the whole model. to-hf reads only the parameters of a
checkpoint of ours onto a mesh, writing nothing in the workdir (a run may go on training there), and
writes the Hugging Face layout one layer-tensor at a time. The conventions and how each maps are
tabulated in the README section "Hugging Face Llama checkpoints".
"""

from __future__ import annotations

if __name__ == "__main__":  # before jax is imported: no TPU probe on a host without one
    from gspmd_tp import host_devices

    host_devices.cpu_platform_where_alone()

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from ml_collections import ConfigDict

from gspmd_tp import checkpoint, outputs, restore, trainer
from gspmd_tp import state as state_lib
from gspmd_tp.errors import UserError, define_config, loaded_config, parse_flags
from gspmd_tp.model import ModelConfig

# Our keys that a Hugging Face config.json determines; the rest of config.model (dtype, remat,
# scan_layers) says how to compute, not what the model is, and stays as the run's config sets it.
HF_MODEL_KEYS = (
    "vocab_size",
    "d_model",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "mlp_dim",
    "rope_theta",
    "norm_eps",
    "tie_embeddings",
)
# Files of a Hugging Face model directory that are not weights and that to-hf carries over.
_CARRIED_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def model_config_from_hf(hf: dict, base: ModelConfig) -> ModelConfig:
    """Our ModelConfig for a Hugging Face Llama config.json; UserError names an unsupported option."""
    if hf.get("model_type") != "llama":
        raise UserError(f"model_type {hf.get('model_type')!r} is not supported (only 'llama')")
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
    heads = hf["num_attention_heads"]
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
    )
    problems = cfg.validate()
    if problems:
        raise UserError(f"cannot express this Hugging Face model: {problems[0]}")
    return cfg


def hf_config(cfg: ModelConfig, dtype: str, max_positions: int, base: dict | None = None) -> dict:
    """A LlamaForCausalLM config.json for `cfg`; token ids and the like are kept from `base`."""
    out = {k: v for k, v in (base or {}).items() if k not in ("rope_scaling", "torch_dtype")}
    out.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
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
    out.setdefault("max_position_embeddings", max_positions)
    return out


# ---------------------------------------------------------------------------------------------
# Tensor layouts. HF stores nn.Linear weights as (out, in); ours are (in, ..., out), fused:
#   qkv     (embed, kv_heads, group + 2, head_dim): per kv head its `group` query heads, key, value
#   out     (heads, head_dim, embed)         gate_up (embed, 2, mlp): gate then up
#   down    (mlp, embed)   embedding (vocab, embed)   lm_head (embed, vocab)   norms (embed,)


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


def _read_param(read, cfg: ModelConfig, path: str, shape, index) -> np.ndarray:
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
    if name == "mlp/gate_up":
        return {f"{prefix}mlp.gate_proj.weight": w[:, 0].T, f"{prefix}mlp.up_proj.weight": w[:, 1].T}
    if name == "mlp/down":
        return {f"{prefix}mlp.down_proj.weight": w.T}
    raise AssertionError(f"no Hugging Face tensor for layer parameter {name}")


def _hf_tensors(cfg: ModelConfig, params):
    """Yields (HF name, host array) one layer-tensor at a time, gathering nothing larger."""
    flat = {state_lib.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
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
# The two directions


@contextlib.contextmanager
def _hf_reader(hf_dir: Path):
    """read(name, np.s_[...]) -> float32 block of a tensor, from whichever safetensors shard has it.

    read(name) without a block gives the tensor's shape.
    """
    from safetensors import safe_open

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
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
            if file not in files:
                # framework="flax": numpy cannot slice bfloat16 tensors; jax can.
                files[file] = stack.enter_context(safe_open(str(hf_dir / file), framework="flax"))
            if block is None and weight_map is None and name not in files[file].keys():
                raise UserError(f"{hf_dir}: tensor {name} is missing")
            tensor = files[file].get_slice(name)
            if block is None:
                return tuple(tensor.get_shape())
            return np.asarray(tensor[block], dtype=np.float32)

        yield read


def from_hf(hf_dir: str, workdir: str, config) -> trainer.Setup:
    """Writes step 0 of a run in `workdir` holding the HF model in `hf_dir`, sharded per `config`.

    config.model's sizes are replaced by the HF config's; its rules and mesh choose the shardings.
    Returns the Setup of that run (its config carries the mapped model).
    """
    hf_path = Path(hf_dir)
    hf = _read_hf_config(hf_dir, "--hf_dir")
    ckpt_dir = checkpoint.checkpoint_dir(workdir)
    if checkpoint.steps_on_disk(ckpt_dir):
        raise UserError(f"{ckpt_dir} already holds checkpoints; use a new --workdir")
    config = ConfigDict(config.to_dict())
    cfg = model_config_from_hf(hf, trainer.model_config(config))
    config.model.update({k: getattr(cfg, k) for k in HF_MODEL_KEYS})
    try:
        s = trainer.setup(config)
    except UserError as e:
        # Typically a vocab or kv_heads that the mesh does not divide. The vocab is not padded:
        # padded rows would take part in the softmax and change the logits.
        raise UserError(f"{hf_dir} on mesh {config.mesh} with rules {config.rules}: {e}") from None

    with _hf_reader(hf_path) as read:
        # Slicing past a tensor's end would quietly return less: check every shape up front.
        for name, shape in hf_shapes(s.model_cfg).items():
            if read(name) != shape:
                raise UserError(f"{hf_dir}: {name} has shape {read(name)}, config.json implies {shape}")

        def build(path, abstract):
            name = state_lib.path_str(path)
            return jax.make_array_from_callback(
                abstract.shape,
                abstract.sharding,
                lambda index: _read_param(read, s.model_cfg, name, abstract.shape, index),
                dtype=abstract.dtype,
            )

        params = jax.tree_util.tree_map_with_path(build, s.abstract_state.params)

    def fresh_state(params):
        return state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=s.tx.init(params))

    with state_lib.sharding_context(s.mesh, s.rules):
        state = jax.jit(fresh_state, out_shardings=s.shardings, donate_argnums=0)(params)
    meta = {**s.meta(), "hf": {"source": str(hf_path.resolve()), "config": hf}}
    # The first write, once every input has checked out: a failed import leaves no workdir behind.
    mngr = checkpoint.manager(workdir, keep=config.keep_checkpoints, async_save=False)
    # The data position of a fresh run (data.BatchIterator.get_state() before the first batch).
    checkpoint.save(mngr, 0, state, {"next_example": 0}, meta)
    mngr.wait_until_finished()
    mngr.close()
    return s


def _read_hf_config(hf_dir: str, flag: str) -> dict:
    """config.json of a Hugging Face model directory; UserError naming `flag` if it does not read."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"{flag}={hf_dir}: no config.json (expected a Hugging Face model directory)")
    try:
        hf = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{flag}={hf_dir}: config.json does not read ({e})") from None
    if not isinstance(hf, dict):
        raise UserError(f"{flag}={hf_dir}: config.json is not a JSON object")
    return hf


def to_hf(
    workdir: str,
    hf_dir: str,
    step: int | None = None,
    rules: str | None = None,
    mesh: str | None = None,
    dtype: str = "float32",
    hf_base: str | None = None,
    max_shard_bytes: int = 2 << 30,
) -> list[str]:
    """Writes checkpoint `step` (default: newest that reads) of the run in `workdir` as a HF Llama model.

    Only the parameters are read, onto `mesh`/`rules` (default: those it was saved with); nothing in
    the workdir is written or removed, so a run may go on training there meanwhile. `hf_base`, a HF
    model directory, lends its token ids, tokenizer and generation config. Returns the files written.
    """
    if dtype not in _DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    base = _read_hf_config(hf_base, "--hf_base") if hf_base else None
    overrides = {key: value for key, value in (("rules", rules), ("mesh", mesh)) if value}
    explicit = step is not None
    step, meta, s = restore.load_setup(workdir, overrides, step)
    if explicit:
        params = restore.restore_params(workdir, step, s)
    else:
        step, params = restore.restore_newest_params(workdir, step, s)

    if base is None and "hf" in meta:
        base = meta["hf"]["config"]
    out = Path(hf_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = _write_safetensors(out, _hf_tensors(s.model_cfg, params), _DTYPES[dtype], max_shard_bytes)
    conf = hf_config(s.model_cfg, dtype, s.config.seq_len, base)
    (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    files.append(str(out / "config.json"))
    for name in _CARRIED_FILES if hf_base else ():
        if (Path(hf_base) / name).is_file():
            shutil.copy(Path(hf_base) / name, out / name)
            files.append(str(out / name))
    return files


def _write_safetensors(out: Path, tensors, dtype, max_shard_bytes: int) -> list[str]:
    """Writes (name, array) pairs into shards of at most ~max_shard_bytes, as save_pretrained does."""
    from safetensors.numpy import save_file

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    paths = []

    def flush():
        # Host memory holds one shard at a time.
        path = out / f"shard-{len(paths):05d}.tmp"
        save_file(shards[-1], str(path), metadata={"format": "pt"})  # transformers checks "format"
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


# ---------------------------------------------------------------------------------------------
# Command line


def _resume_command(s: trainer.Setup, workdir: str, config_path: str) -> str:
    model = " ".join(f"--config.model.{k}={getattr(s.model_cfg, k)}" for k in HF_MODEL_KEYS)
    return (
        f"python train.py --config={config_path} --workdir={workdir} --config.rules={s.config.rules} "
        f"--config.mesh={s.config.mesh} {model}"
    )


def main(argv) -> None:
    """Entry point: argv[1] is from-hf or to-hf."""
    from absl import flags, logging

    flags_ = flags.FLAGS
    logging.set_verbosity(logging.WARNING)
    command = argv[1] if len(argv) == 2 else None
    if command not in ("from-hf", "to-hf"):
        print("usage: python -m gspmd_tp.convert {from-hf,to-hf} --FLAG=VALUE ...", file=sys.stderr)
        sys.exit(2)
    try:
        if not flags_.workdir or not flags_.hf_dir:
            raise UserError("--workdir and --hf_dir are required")
        if command == "from-hf":
            outputs.check_dir(flags_.workdir, "--workdir")
            config = loaded_config()
            _set_cpu_devices(config.host_device_count)
            s = from_hf(flags_.hf_dir, flags_.workdir, config)
            print(f"wrote step 0 to {checkpoint.checkpoint_dir(flags_.workdir)}; fine-tune with:")
            print(_resume_command(s, flags_.workdir, flags_["config"].config_filename))
        else:
            outputs.check_dir(flags_.hf_dir, "--hf_dir")
            count = flags_.host_device_count
            if count is None:  # as many as the mesh it restores onto spans
                count = restore.reader_device_count(flags_.workdir, flags_.mesh, flags_.step)
            _set_cpu_devices(count)
            files = to_hf(
                flags_.workdir,
                flags_.hf_dir,
                step=flags_.step,
                rules=flags_.rules,
                mesh=flags_.mesh,
                dtype=flags_.dtype,
                hf_base=flags_.hf_base,
            )
            print(f"wrote {len(files)} files to {flags_.hf_dir}")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def _set_cpu_devices(count: int) -> None:
    # Simulated CPU devices, as train.py does; a device count the caller put in XLA_FLAGS wins.
    if count > 0 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", count)


def _define_flags() -> None:
    from absl import flags

    define_config("configs/tiny.py", "from-hf: run config (rules, mesh, optim).")
    flags.DEFINE_string("hf_dir", None, "Hugging Face model directory (read by from-hf, written by to-hf).")
    flags.DEFINE_string("workdir", None, "Run directory whose checkpoints/ is written or read.")
    flags.DEFINE_integer("step", None, "to-hf: checkpoint step to export (default: newest).")
    flags.DEFINE_string("rules", None, "to-hf: rule file to restore under (default: the saved one).")
    flags.DEFINE_string("mesh", None, "to-hf: mesh to restore onto (default: the saved one).")
    flags.DEFINE_string(
        "dtype", "float32", "to-hf: dtype of the written weights (float32, bfloat16, float16)."
    )
    flags.DEFINE_string("hf_base", None, "to-hf: HF model dir whose token ids and tokenizer files are kept.")
    flags.DEFINE_integer(
        "host_device_count",
        None,
        "to-hf: simulated CPU devices (ignored by accelerators); default: as many as --mesh, else the "
        "checkpoint's mesh, spans.",
    )


if __name__ == "__main__":
    from absl import app

    _define_flags()
    app.run(main, flags_parser=functools.partial(parse_flags, load=False))  # to-hf needs no config
