"""A run's setup: the config checked (check_config, model_config), the rule file and mesh checked and
the shardings derived (setup() -> Setup), and the compiled step's memory checked against the devices or
the host (check_memory): all before anything is written.
"""

from __future__ import annotations

import dataclasses
import math
import os

import flax.linen as nn
import jax
import optax

from gspmd_tp.cli.config_keys import check_keys, ours
from gspmd_tp.data import pipeline, tokenizer
from gspmd_tp.job.errors import UserError, warn
from gspmd_tp.model import moe
from gspmd_tp.model.context import heads_follow_kv_heads
from gspmd_tp.model.kernels import (
    CUDNN_SEGMENTS,
    attention_implementation,
    mlp_implementation,
    sliced_mlp_layout,
)
from gspmd_tp.model.transformer import ModelConfig
from gspmd_tp.sharding import axes
from gspmd_tp.sharding.mesh import make_mesh, mesh_string
from gspmd_tp.sharding.rules import Rules, axes_of, load_rules, mesh_ways
from gspmd_tp.train import optimizer
from gspmd_tp.train import state as state_lib
from gspmd_tp.train import step as step_lib


def model_config(config) -> ModelConfig:
    """config.model as a validated ModelConfig, its vocabulary checked against (or, with
    model.vocab_size=0, taken from) config.data.tokenizer."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(config.model) - fields)
    if unknown:
        named = ours(unknown[0])
        hint = f"gspmd_tp calls it {named}" if named else f"known: {', '.join(sorted(fields))}"
        raise UserError(f"config.model has unknown key {unknown[0]!r} ({hint})")
    if config.model.get("grad_dtype"):  # a saved run's model config holds it empty
        raise UserError(
            "config.model.grad_dtype is the train step's, set from config.optim.grad_reduce_dtype: set that"
        )
    cfg = ModelConfig(**config.model.to_dict())
    tok = tokenizer.load(config.data.tokenizer)
    if cfg.vocab_size == 0:
        # A model trained from scratch: the tokenizer's ids, padded to a multiple any power-of-two
        # mesh axis up to 128 divides (so that the vocab axis shards), the padding masked out.
        padded = pipeline.padded_vocab(tok.vocab_size)
        cfg = dataclasses.replace(
            cfg, vocab_size=padded, vocab_tokens=tok.vocab_size if padded > tok.vocab_size else 0
        )
    elif cfg.vocab_size < tok.vocab_size:
        raise UserError(
            f"config.model.vocab_size={cfg.vocab_size} cannot hold the {tok.vocab_size:,} ids of "
            f"config.data.tokenizer={config.data.tokenizer}; set it to at least {tok.vocab_size}, or to 0 "
            "(the tokenizer's size rounded up to a multiple of 128)"
        )
    problems = cfg.validate()
    if problems:
        raise UserError(problems[0])
    return cfg


def check_config(config) -> None:
    """Checks the run-level keys; raises UserError naming the key."""
    check_keys(config)
    for key in (
        "steps",
        "batch_size",
        "grad_accum",
        "seq_len",
        "log_every",
        "checkpoint_every",
        "keep_checkpoints",
        "eval_every",
        "eval_batches",
    ):
        if config[key] <= 0:
            raise UserError(f"config.{key} must be positive, got {config[key]}")
    if config.loss_chunk < 0 or (config.loss_chunk and config.seq_len % config.loss_chunk):
        raise UserError(
            f"config.loss_chunk={config.loss_chunk} must be 0 or divide config.seq_len={config.seq_len}"
        )
    if config.batch_size % config.grad_accum:
        raise UserError(
            f"config.batch_size={config.batch_size} is not divisible by config.grad_accum={config.grad_accum}"
        )
    if config.batch_size % jax.process_count():
        raise UserError(
            f"config.batch_size={config.batch_size} is not divisible by the {jax.process_count()} processes"
        )
    if config.overlap not in step_lib.OVERLAP_OPTIONS:
        expected = ", ".join(step_lib.OVERLAP_OPTIONS)
        raise UserError(f"config.overlap={config.overlap!r}: expected one of {expected}")
    optimizer.check(config.optim)
    if config.host_device_count < 0:
        raise UserError(
            f"config.host_device_count must be 0 (the host's devices) or more, got {config.host_device_count}"
        )
    if not 0 <= config.peak_flops_per_device < math.inf:
        peak = config.peak_flops_per_device
        raise UserError(f"config.peak_flops_per_device must be 0 (the known peak) or more, got {peak}")
    if not 0 <= config.data.seed < 2**32:
        raise UserError(f"config.data.seed must be in [0, 2**32), got {config.data.seed}")
    pipeline.check(config.data)
    for key in ("steps", "skip_steps"):
        if config.profile[key] < 0:
            raise UserError(f"config.profile.{key} must be 0 or more, got {config.profile[key]}")


@dataclasses.dataclass
class Setup:
    """Everything a run derives from its config before compiling anything."""

    config: object
    model_cfg: ModelConfig
    rules: Rules
    mesh: jax.sharding.Mesh
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    abstract_state: object  # ShapeDtypeStructs carrying NamedShardings
    shardings: object
    batch_sharding: jax.sharding.NamedSharding

    @property
    def micro_batch(self) -> int:
        return self.config.batch_size // self.config.grad_accum

    def meta(self) -> dict:
        """What a checkpoint records about how it was made."""
        return {
            "model": dataclasses.asdict(self.model_cfg),
            "rules": {"source": self.rules.source, "text": self.rules.text},
            "mesh": mesh_string(self.mesh),
            "process_count": jax.process_count(),
            "config": self.config.to_dict(),
        }


def setup(config, devices=None, rules: Rules | None = None) -> Setup:
    """Validates the config, rule file and mesh (raising UserError), and derives the shardings.

    `rules`, where given, stands in for the file config.rules names (a checkpoint's saved copy).
    """
    check_config(config)
    model_cfg = model_config(config)
    rules = rules or load_rules(config.rules)
    mesh = make_mesh(config.mesh, rules.mesh_axes, devices, rules.source)
    platform = mesh.devices.flat[0].platform
    if model_cfg.moe_dispatch == "ragged" and platform == "cpu":
        raise UserError(
            "config.model.moe_dispatch='ragged' needs TPU or GPU devices (XLA:CPU has no "
            "ragged-all-to-all); on CPU use 'gather' (or 'auto')"
        )
    if model_cfg.attention == "cudnn" and platform != "gpu":
        raise UserError(f"config.model.attention='cudnn' needs GPU devices; this run's are {platform}")
    if model_cfg.attention == "cudnn" and config.data.document_mask:
        raise UserError(f"config.{CUDNN_SEGMENTS}")
    if model_cfg.attention == "auto" and config.data.document_mask and platform == "gpu":
        warn(
            "note: config.model.attention=auto takes the einsum path, not cuDNN's fused attention, under "
            "config.data.document_mask (cuDNN cannot mask packed documents apart); "
            "config.data.document_mask=False attends whole windows with cuDNN"
        )
    if config.overlap != "auto" and platform == "cpu":
        warn(
            f"warning: config.overlap={config.overlap} changes nothing on CPU devices: XLA:CPU has no "
            "collective matmul (python -m gspmd_tp.plan --target=tpu:... shows what it does on a TPU)"
        )
    # "auto" follows the devices the step compiles for, not the host (a TPU plan made on a laptop).
    with nn.logical_axis_rules(rules.rules):
        mlp_grad = mlp_implementation(model_cfg, platform)
    if model_cfg.mlp_slices > 1:
        _check_mlp_slices(model_cfg, rules, mesh)
    _check_experts(model_cfg, rules, mesh)
    _check_sequence(config.seq_len, rules, mesh)
    # Ring attention and the zigzag order mask by positions, which cuDNN's fused attention cannot.
    positional = _check_context(model_cfg, config.seq_len, rules, mesh)
    model_cfg = dataclasses.replace(
        model_cfg,
        mlp_grad=mlp_grad,
        attention=attention_implementation(
            model_cfg.attention, model_cfg.dtype, platform, segmented=config.data.document_mask or positional
        ),
        moe_dispatch=moe.dispatch_implementation(model_cfg.moe_dispatch, platform),
    )
    micro_batch = config.batch_size // config.grad_accum
    ways, sizes = mesh_ways(mesh.shape, rules.batch_axes())
    if config.grad_accum > 1 and micro_batch % ways:
        raise UserError(
            f"config.batch_size={config.batch_size} / config.grad_accum={config.grad_accum} = {micro_batch} "
            f"rows per microbatch is not divisible by the batch's mesh axes {sizes} ({rules.source})"
        )
    state_lib.validate(model_cfg, rules, mesh, micro_batch, config.seq_len)
    if micro_batch % ways:  # every activation validate checks had a length rule take the batch's axes
        raise UserError(
            f"{rules.source}: the token batch (config.batch_size={config.batch_size}) is not divisible by "
            f"its mesh axes {sizes}"
        )
    for axis, shards in state_lib.idle_mesh_axes(model_cfg, rules, mesh).items():
        where = f"mesh axis {axis} ({mesh.shape[axis]} devices)"
        if shards:
            warn(
                f"warning: {where} shards {' and '.join(shards)} but no activation of the attention, MLP "
                f"or output layer under {rules.source}: its devices all compute the same products "
                f"(map batch or a hidden axis such as mlp to {axis})"
            )
        else:
            warn(
                f"warning: {where} shards no parameter and no activation under {rules.source}: "
                "its devices all compute the same thing"
            )
    for path, name, mine, theirs in state_lib.misaligned_params(model_cfg, rules, mesh):
        better = theirs + tuple(a for a in mine if a not in theirs)
        warn(
            f"warning: {rules.source}: {path} splits {name} over [{', '.join(mine)}] but the activations "
            f"over [{', '.join(theirs)}]: give [{name}, [{', '.join(better)}]], the activations' axes "
            "first, so that each device's slice of the weight lies in its slice of the activations "
            "(as written, every step shuffles the weight between devices and reduces its gradient whole)"
        )
    tx, schedule = optimizer.make_optimizer(config.optim, config.steps)
    abstract, shardings = state_lib.state_shardings(model_cfg, tx, mesh, rules)
    s = Setup(
        config=config,
        model_cfg=model_cfg,
        rules=rules,
        mesh=mesh,
        tx=tx,
        schedule=schedule,
        abstract_state=abstract,
        shardings=shardings,
        batch_sharding=jax.sharding.NamedSharding(mesh, rules.spec((axes.BATCH, None))),
    )
    asked = config.optim.grad_reduce_dtype
    if asked != step_lib.grad_reduce_dtype(s):
        why = f"{rules.source} on mesh {mesh_string(mesh)} has no data-parallel axis of more than one device"
        warn(f"warning: config.optim.grad_reduce_dtype={asked} changes nothing: {why}")
    return s


def _check_mlp_slices(model_cfg: ModelConfig, rules: Rules, mesh) -> None:
    """model.mlp_slices > 1: a warning where the rule file splits the MLP's weights on no mesh axis
    of the model width (nothing is gathered, so nothing is sliced); UserError where each device's
    share of the mlp dimension does not split into that many slices."""
    k = model_cfg.mlp_slices
    with nn.logical_axis_rules(rules.rules):
        layout = sliced_mlp_layout()
    if layout is None:
        warn(
            f"warning: config.model.mlp_slices={k} changes nothing: {rules.source} splits the MLP's "
            "weights on no mesh axis of the model width (embed), so no gather is sliced"
        )
        return
    ways = math.prod(mesh.shape[a] for a in layout["mlp"])
    if model_cfg.mlp_dim % (ways * k):
        share = f"model.mlp_dim={model_cfg.mlp_dim}"
        if ways > 1:
            share += (
                f" split {ways} ways over {', '.join(layout['mlp'])} ({model_cfg.mlp_dim // ways} a device)"
            )
        raise UserError(f"config.model.mlp_slices={k}: {share} does not divide into {k} equal slices")


def _check_sequence(seq_len: int, rules: Rules, mesh) -> None:
    """UserError where the mesh axes a rule file splits sequence positions over (length, norm_length,
    kv_length: context or sequence parallelism) do not divide config.seq_len."""
    for name in (axes.LENGTH, axes.NORM_LENGTH, axes.KV_LENGTH):
        ways, sizes = mesh_ways(mesh.shape, rules.spec((name,))[0])
        if seq_len % ways:
            raise UserError(
                f"config.seq_len={seq_len} is not divisible by the mesh axes {sizes} that {rules.source} "
                f"splits {name} over"
            )


def _check_context(model_cfg: ModelConfig, seq_len: int, rules: Rules, mesh) -> bool:
    """Whether model.context_parallel='ring' or model.context_load_balance applies: the rule file
    splits length over mesh axes of more than one device (a warning where it does not, and nothing
    changes). UserError where one of them cannot run: a seq_len the zigzag's 2 x context chunks do
    not divide, an attention path other than einsum blocks under the ring, query blocks or cuDNN
    under the zigzag order."""
    ring, balance = model_cfg.context_parallel == "ring", model_cfg.context_load_balance
    asked = [k for k, on in (("context_parallel='ring'", ring), ("context_load_balance=True", balance)) if on]
    if not asked:
        return False
    ways, sizes = mesh_ways(mesh.shape, rules.spec((axes.LENGTH,))[0])
    if ways == 1:
        warn(
            f"warning: config.model.{' and config.model.'.join(asked)} changes nothing: {rules.source} on "
            f"mesh {mesh_string(mesh)} splits length over no mesh axis of more than one device (no "
            "context parallelism: context_dp or fsdp_context_tensor split it)"
        )
        return False
    if balance and seq_len % (2 * ways):
        raise UserError(
            f"config.seq_len={seq_len} is not divisible by {2 * ways}, twice the mesh axes {sizes} that "
            f"{rules.source} splits length over: config.model.context_load_balance gives each device "
            "two chunks"
        )
    attention, block = model_cfg.attention, model_cfg.attention_block
    if ring and not heads_follow_kv_heads(rules.rules):
        warn(
            f"warning: config.model.context_parallel='ring' falls back to all-gather attention: "
            f"{rules.source} splits heads over mesh axes kv_heads is not split over (give kv_heads the "
            "axes of heads)"
        )
    if ring and attention in ("xla", "cudnn"):
        raise UserError(
            f"config.model.context_parallel='ring' attends block by block in its own einsum; "
            f"config.model.attention={attention!r} cannot run there: set config.model.attention='einsum' "
            "(or 'auto'), or config.model.context_parallel='all_gather'"
        )
    if ring and block:
        raise UserError(
            f"config.model.attention_block={block} splits the whole sequence's causal square, which "
            "config.model.context_parallel='ring' never holds (it attends a context chunk at a time): "
            "set config.model.attention_block=0, or config.model.context_parallel='all_gather'"
        )
    if balance and block:
        raise UserError(
            f"config.model.attention_block={block} leaves out keys by their index, which "
            "config.model.context_load_balance reorders: set config.model.attention_block=0, or "
            "config.model.context_load_balance=False"
        )
    if balance and attention == "cudnn":
        raise UserError(
            "config.model.context_load_balance masks by true positions, which "
            "config.model.attention='cudnn' cannot take (its causal mask is by index): set "
            "config.model.attention='einsum' or 'xla', or config.model.context_load_balance=False"
        )
    return True


def _check_experts(model_cfg: ModelConfig, rules: Rules, mesh) -> None:
    """UserError where the mesh axes the rule file splits `experts` over do not divide
    model.num_experts; a warning where it splits them but the model is dense (nothing has them)."""
    split = axes_of(rules.spec((axes.EXPERTS,))[0])
    if not split:
        return
    ways, sizes = mesh_ways(mesh.shape, split)
    if not model_cfg.num_experts:
        warn(
            f"warning: {rules.source} splits experts over mesh axes {sizes} but config.model.num_experts "
            "is 0 (a dense model): no weight has experts, the file's other rules apply as written"
        )
    elif model_cfg.num_experts % ways:
        raise UserError(
            f"config.model.num_experts={model_cfg.num_experts} is not divisible by the mesh axes {sizes} "
            f"that {rules.source} splits experts over"
        )


_TRAIN_STEP_FIX = (
    "shrink config.batch_size or config.seq_len, add config.grad_accum or another rule file "
    "(python -m gspmd_tp.plan shows each)"
)


def check_memory(stats, mesh, step: str = "train step", fix: str = _TRAIN_STEP_FIX) -> None:
    """UserError where the compiled `step` cannot fit: per device against an accelerator's memory,
    or all of this host's simulated CPU devices together against its RAM; `fix` says what helps.
    Before anything is written (or, for a reader, read)."""
    need = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    need -= stats.alias_size_in_bytes  # the donated state is written in place
    device = mesh.devices.flat[0]
    if device.platform == "cpu":
        local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
        have = _host_memory()
        what = f"this host's {_gib(have)} of RAM"
        need *= local
        where = f"{local} CPU devices x {_gib(need / local)}"
    else:
        have = (device.memory_stats() or {}).get("bytes_limit", 0)
        what, where = f"a {device.device_kind}'s {_gib(have)}", f"{_gib(need)} per device"
        if device.platform == "gpu" and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
            # JAX's allocator takes 75% of a GPU's memory unless told otherwise.
            what += " (JAX's share of it; XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 raises the share)"
    if have and need > have:
        raise UserError(f"the compiled {step} needs {where}, more than {what}; {fix}")


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"
