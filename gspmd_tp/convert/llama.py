"""Hugging Face Llama-family checkpoints (Llama, Qwen3, Mixtral, Qwen3-MoE: hf_layout.FAMILIES) <->
orbax checkpoints of our model, one command each way.

    python -m gspmd_tp.convert from-hf --hf_dir=DIR --workdir=RUN \
        [--config=configs/tiny.py --config.rules=megatron_1d --config.mesh=dp=4,mp=2]
    python -m gspmd_tp.convert to-hf --workdir=RUN --hf_dir=OUT [--step=N --dtype=bfloat16 --hf_base=DIR]

from-hf reads config.json and the safetensors shards of such a model and writes step 0 of a run
that `train.py --workdir=RUN` resumes from (fresh optimizer, data from the start). Every parameter is
built with jax.make_array_from_callback: each device's shard is read straight from the memory-mapped
safetensors file, so no host ever holds the whole model. to-hf reads only the parameters of a
checkpoint of ours onto a mesh, writing nothing in the workdir (a run may go on training there), and
writes the Hugging Face layout one layer-tensor at a time. The conventions and how each maps are
tabulated in docs/hf.md.
"""

from __future__ import annotations

if __name__ == "__main__":  # before jax is imported: no TPU probe on a host without one
    from gspmd_tp.job import entry

    entry.begin()  # main() asks for the devices once it has read the flags

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

from gspmd_tp.checkpoint import step_dirs, store
from gspmd_tp.cli import arguments
from gspmd_tp.cli.arguments import define_config, loaded_config, parse_flags
from gspmd_tp.convert import hf_layout
from gspmd_tp.inference import saved_run
from gspmd_tp.job import host_devices
from gspmd_tp.job.errors import UserError, exit_from_main, interrupted
from gspmd_tp.model.params import path_str
from gspmd_tp.sharding.mesh import DeviceCountError
from gspmd_tp.storage import lock, outputs, paths
from gspmd_tp.train import run_setup
from gspmd_tp.train import state as state_lib

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
# The two directions


def from_hf(hf_dir: str, workdir: str, config) -> run_setup.Setup:
    """Writes step 0 of a run in `workdir` holding the HF model in `hf_dir`, sharded per `config`.

    config.model's sizes are replaced by the HF config's; its rules and mesh choose the shardings.
    Returns the Setup of that run (its config carries the mapped model).
    """
    step_dirs.check_workdir_given(workdir)  # before the lock, which would leave its file there
    with lock.workdir_lock(workdir):  # a training run there would resume from a half-written step 0
        # An import cut short (Ctrl-C) leaves no checkpoints/ of its own: a train.py there would
        # start from scratch, where the user meant to fine-tune.
        with outputs.removed_if_cut_short(step_dirs.checkpoint_dir(workdir)):
            return _from_hf(hf_dir, workdir, config)


def _from_hf(hf_dir: str, workdir: str, config) -> run_setup.Setup:
    hf_path = Path(paths.local_copy(hf_dir))  # a bucket's model read from a local copy (safetensors' mmap)
    hf = hf_layout.read_hf_config(hf_path, "--hf_dir", hf_dir)
    ckpt_dir = step_dirs.checkpoint_dir(workdir)
    if step_dirs.steps_on_disk(ckpt_dir):
        raise UserError(f"{ckpt_dir} already holds checkpoints; use a new --workdir")
    config = ConfigDict(config.to_dict())
    try:
        cfg = hf_layout.model_config_from_hf(hf, run_setup.model_config(config))
    except UserError as e:
        raise UserError(f"--hf_dir={hf_dir}: {e}") from None
    config.model.update({k: getattr(cfg, k) for k in hf_layout.HF_MODEL_KEYS})
    if any((hf_path / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        # The model's own tokenizer, recorded in the run's config: train.py, evaluate and generate
        # use it unless told otherwise (tokenizer.load reads the directory's file).
        config.data.tokenizer = hf_dir if paths.is_url(hf_dir) else str(hf_path.resolve())
    try:
        s = run_setup.setup(config)
    except UserError as e:
        # Typically a vocab or kv_heads that the mesh does not divide. The vocab is not padded:
        # padded rows would take part in the softmax and change the logits.
        raise UserError(f"{hf_dir} on mesh {config.mesh} with rules {config.rules}: {e}") from None

    with hf_layout.hf_reader(hf_path) as read:
        # Slicing past a tensor's end would quietly return less: check every shape up front.
        for name, shape in hf_layout.hf_shapes(s.model_cfg).items():
            if read(name) != shape:
                raise UserError(f"{hf_dir}: {name} has shape {read(name)}, config.json implies {shape}")

        def build(path, abstract):
            name = path_str(path)
            return jax.make_array_from_callback(
                abstract.shape,
                abstract.sharding,
                lambda index: hf_layout.read_param(read, s.model_cfg, name, abstract.shape, index),
                dtype=abstract.dtype,
            )

        params = jax.tree_util.tree_map_with_path(build, s.abstract_state.params)

    def fresh_state(params):
        return state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=s.tx.init(params))

    with state_lib.sharding_context(s.mesh, s.rules):
        state = jax.jit(fresh_state, out_shardings=s.shardings, donate_argnums=0)(params)
    source = hf_dir if paths.is_url(hf_dir) else str(hf_path.resolve())
    meta = {**s.meta(), "hf": {"source": source, "config": hf}}
    # The first write, once every input has checked out: a failed import leaves no workdir behind.
    mngr = store.manager(workdir, keep=config.keep_checkpoints, async_save=False)
    # The data position of a fresh run (data.BatchIterator.get_state() before the first batch).
    store.save(mngr, 0, state, {"next_example": 0}, meta)
    mngr.wait_until_finished()
    mngr.close()
    return s


def check_empty(hf_dir: str) -> None:
    """UserError where `hf_dir` holds anything: an export over another would overwrite its weights
    and leave its other files (a generation config, old shards) beside the new ones."""
    directory = paths.of(hf_dir)
    held = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    if held:
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise UserError(f"--hf_dir={hf_dir} is not empty (it holds {shown}); export into a new directory")


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
    """Writes checkpoint `step` (default: newest that reads) of the run in `workdir` as a HF model of
    its family (hf_layout.family: Llama, Qwen3, Mixtral or Qwen3-MoE).

    Only the parameters are read, onto `mesh`/`rules` (default: those it was saved with); nothing in
    the workdir is written or removed, so a run may go on training there meanwhile. `hf_base`, a HF
    model directory, lends its token ids, tokenizer and generation config. Returns the files written.
    """
    if dtype not in _DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    check_empty(hf_dir)
    base = hf_layout.read_hf_config(paths.local_copy(hf_base), "--hf_base", hf_base) if hf_base else None
    overrides = {key: value for key, value in (("rules", rules), ("mesh", mesh)) if value}
    explicit = step is not None
    step, meta, s = saved_run.load_setup(workdir, overrides, step, params_only=True)
    problem = hf_layout.export_problem(s.model_cfg)
    if problem:
        raise UserError(f"--workdir={workdir}: {problem}")
    if explicit:
        params = saved_run.restore_params(workdir, step, s)
    else:
        step, params = saved_run.restore_newest_params(workdir, step, s)

    if base is None and "hf" in meta:
        base = meta["hf"]["config"]
    if paths.is_url(hf_dir):  # written locally, then uploaded: an upload cut short leaves no model
        with outputs.whole_file(hf_dir) as staging:
            files = _write_hf(staging, s, params, dtype, base, hf_base, max_shard_bytes)
        return [f"{hf_dir}/{os.path.relpath(f, staging)}" for f in files]
    # An export cut short (Ctrl-C, a full disk) is removed: weights without their config.json, or a
    # config.json without the tokenizer, would pass for a model, and block the next export there.
    with outputs.removed_if_cut_short(hf_dir):
        return _write_hf(hf_dir, s, params, dtype, base, hf_base, max_shard_bytes)


def _write_hf(hf_dir: str, s, params, dtype: str, base, hf_base, max_shard_bytes: int) -> list[str]:
    """to_hf's files, written into local directory `hf_dir`; returns their paths."""
    out = Path(hf_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_layout.hf_tensors(s.model_cfg, params)
    files = hf_layout.write_safetensors(out, tensors, _DTYPES[dtype], max_shard_bytes)
    conf = hf_layout.hf_config(s.model_cfg, dtype, s.config.seq_len, base)
    (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    files.append(str(out / "config.json"))
    for source, name in _carried(hf_base, s.config.data.get("tokenizer", "bytes")):
        shutil.copy(source, out / name)
        files.append(str(out / name))
    return files


def _carried(hf_base: str | None, tokenizer: str) -> list[tuple[Path, str]]:
    """(file, name in the export) of the tokenizer and generation files an export carries: those of
    `hf_base`, else those beside the tokenizer the run trained with (a model directory that
    from-hf recorded, or a tokenizer file, carried under the name Hugging Face reads)."""
    if hf_base:
        directory = Path(paths.local_copy(hf_base))
    elif tokenizer == "bytes":
        return []
    elif Path(tokenizer := paths.local_copy(tokenizer)).is_file():
        name = "tokenizer.model" if tokenizer.endswith(".model") else "tokenizer.json"
        beside = Path(tokenizer).parent / "tokenizer_config.json"
        return [(Path(tokenizer), name)] + ([(beside, beside.name)] if beside.is_file() else [])
    else:
        directory = Path(tokenizer)
    return [(directory / name, name) for name in _CARRIED_FILES if (directory / name).is_file()]


# ---------------------------------------------------------------------------------------------
# Command line


def _resume_command(s: run_setup.Setup, workdir: str, config_path: str, argv: list[str]) -> str:
    """The train.py command that resumes the imported run: the model's sizes spelled out, and every
    other --config.KEY the import was given (a run's seq_len or data must match on resume)."""
    model = [f"--config.model.{k}={getattr(s.model_cfg, k)}" for k in hf_layout.HF_MODEL_KEYS]
    given = {a.split("=", 1)[0]: a for a in argv if a.startswith("--config.")}
    given.update(
        {
            "--config.rules": f"--config.rules={s.config.rules}",
            "--config.mesh": f"--config.mesh={s.config.mesh}",
        }
    )
    others = [a for key, a in given.items() if key.removeprefix("--config.") not in _MODEL_OVERRIDES]
    return " ".join([f"python train.py --config={config_path} --workdir={workdir}", *others, *model])


_MODEL_OVERRIDES = {f"model.{k}" for k in hf_layout.HF_MODEL_KEYS}


def main(argv) -> None:
    """Entry point: argv[1] is from-hf or to-hf."""
    from absl import flags, logging

    flags_ = flags.FLAGS
    logging.set_verbosity(logging.WARNING)
    command = argv[1] if len(argv) == 2 else None
    if command not in ("from-hf", "to-hf"):
        given = f"unknown command {command!r}; " if command else ""
        if len(argv) > 2:  # `config.steps=5` without its dashes, say
            given = f"unexpected argument {argv[2]!r} after {argv[1]!r} (flags are --NAME=VALUE); "
        print(
            f"error: {given}usage: python -m gspmd_tp.convert {{from-hf,to-hf}} --FLAG=VALUE ...",
            file=sys.stderr,
        )
        sys.exit(1)
    try:
        if not flags_.workdir or not flags_.hf_dir:
            raise UserError("--workdir and --hf_dir are required")
        _check_flags_apply(command, flags_)
        if command == "from-hf":
            outputs.check_dir(flags_.workdir, "--workdir")
            config = loaded_config()
            host_devices.request(config.host_device_count, tune=False)
            s = from_hf(flags_.hf_dir, flags_.workdir, config)
            print(f"wrote step 0 to {step_dirs.checkpoint_dir(flags_.workdir)}; fine-tune with:")
            print(_resume_command(s, flags_.workdir, flags_["config"].config_filename, sys.argv))
        else:
            outputs.check_dir(flags_.hf_dir, "--hf_dir", probe=True)
            check_empty(flags_.hf_dir)
            count = flags_.host_device_count
            if count is not None and count < 1:
                raise UserError(f"--host_device_count={count}: must be 1 or more")
            if count is None:  # as many as the mesh it restores onto spans
                count = saved_run.reader_device_count(flags_.workdir, flags_.mesh, flags_.step)
            host_devices.request(count, tune=False)
            try:
                files = to_hf(
                    flags_.workdir,
                    flags_.hf_dir,
                    step=flags_.step,
                    rules=flags_.rules,
                    mesh=flags_.mesh,
                    dtype=flags_.dtype,
                    hf_base=flags_.hf_base,
                )
            except DeviceCountError as e:  # its hint names train.py's flag; to-hf has its own
                raise e.naming("--host_device_count") from None
            print(f"wrote {len(files)} files to {flags_.hf_dir}")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        left = (
            f"no step 0 left in --workdir={flags_.workdir}"
            if command == "from-hf"
            else f"no export left in --hf_dir={flags_.hf_dir}; nothing in the workdir was written"
        )
        exit_from_main(interrupted(left))


# The flags only one of the two commands reads.
_TO_HF_ONLY = ("step", "rules", "mesh", "dtype", "hf_base", "host_device_count")


def _check_flags_apply(command: str, flags_) -> None:
    """UserError for a flag the command would silently ignore."""
    if command == "from-hf":
        given = [f"--{name}" for name in _TO_HF_ONLY if flags_[name].present]
        if given:
            raise UserError(
                f"{', '.join(given)}: to-hf flags; from-hf takes the rules, mesh and device count "
                "from --config (--config.rules, --config.mesh, --config.host_device_count)"
            )
    else:
        given = [a.split("=", 1)[0] for a in sys.argv[1:] if a.startswith("--config")]
        if given:
            raise UserError(
                f"{', '.join(given)}: from-hf flags; to-hf reads the run's saved config (--rules, --mesh, "
                "--step and --host_device_count choose how it is read)"
            )


def _define_flags() -> None:
    from absl import flags

    define_config("tiny", "from-hf: run config (rules, mesh, optim).")
    arguments.define_path("hf_dir", None, "Hugging Face model directory (read by from-hf, written by to-hf).")
    arguments.define_path("workdir", None, "Run directory whose checkpoints/ is written or read.")
    flags.DEFINE_integer("step", None, "to-hf: checkpoint step to export (default: newest).")
    flags.DEFINE_string("rules", None, "to-hf: rule file to restore under (default: the saved one).")
    flags.DEFINE_string("mesh", None, "to-hf: mesh to restore onto (default: the saved one).")
    flags.DEFINE_string(
        "dtype", "float32", "to-hf: dtype of the written weights (float32, bfloat16, float16)."
    )
    arguments.define_path(
        "hf_base", None, "to-hf: HF model dir whose token ids and tokenizer files are kept."
    )
    flags.DEFINE_integer(
        "host_device_count",
        None,
        "to-hf: simulated CPU devices (ignored by accelerators); default: as many as --mesh, else the "
        "checkpoint's mesh, spans.",
    )


if __name__ == "__main__":
    _define_flags()
    entry.run(main, flags_parser=functools.partial(parse_flags, load=False))  # to-hf needs no config
