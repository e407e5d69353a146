"""A trained run brought back for sampling, evaluation and export (generate, evaluate, convert to-hf).

The run's own config comes from its newest checkpoint, with `--config.KEY=VALUE` overrides on top
(typically `rules` and `mesh`: a model trained under one rule file samples under another). Only
the parameters are read, not the optimizer state, each device reading its shard of the sharding
the current mesh and rule file give it. Nothing in the workdir is written or removed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from typing import TYPE_CHECKING

from absl import flags
from ml_collections import ConfigDict

from gspmd_tp.cli import arguments, config_keys
from gspmd_tp.cli.config_keys import default_config, laid_over
from gspmd_tp.job import job_flags
from gspmd_tp.job.errors import UserError, interrupted, warn
from gspmd_tp.storage import paths

if TYPE_CHECKING:
    from gspmd_tp.train import run_setup

DEFAULT_DEVICES = 8  # what train.py simulates by default (configs/tiny.py host_device_count)
# A reader's --config.model overrides that change the parameters: the fix is to leave them out.
READ_AS_SAVED = (
    "the parameters are read as saved: leave out the --config.model overrides that change them "
    "(dtype, remat, remat_save, attention, attention_block, mlp_grad, moe_dispatch, moe_buffer_factor, "
    "context_parallel and context_load_balance may differ: checkpoint/store.FREE_MODEL_KEYS)"
)


def split_overrides(args: list[str]) -> dict[str, str]:
    """{"rules": "megatron_1d", "mesh": "dp=4,mp=2"} from ["--config.rules=megatron_1d", ...]."""
    overrides = {}
    for arg in args:
        key, eq, value = arg.removeprefix("--config.").partition("=")
        if not arg.startswith("--config.") or not eq or not key:
            raise UserError(f"unrecognized argument {arg!r} (config overrides are --config.KEY=VALUE)")
        overrides[key] = value
    return overrides


def saved_config(
    workdir: str, overrides: dict[str, str], step: int | None = None
) -> tuple[int, dict, ConfigDict]:
    """(step, meta, config) of checkpoint `step` (default: the newest readable one), overrides applied.

    Reads JSON only; raises UserError when there is no such checkpoint. `init_from` is cleared: it
    only says how a fresh run started, and that file may be long gone.
    """
    from gspmd_tp.checkpoint import step_dirs as files
    from gspmd_tp.checkpoint import store
    from gspmd_tp.job import distributed

    files.check_workdir_given(workdir)
    if step is None:
        # In a job of several processes, the steps whose metadata reads on every one of them.
        found = store.agreed_checkpoints(workdir, warn=warn)
        if not found:
            raise UserError(
                f"{workdir}: no checkpoint found (looked in {files.checkpoint_dir(workdir)}); "
                f"train one first: python train.py --workdir={workdir}"
            )
        step, meta = found[0]
    else:
        ckpt_dir = files.checkpoint_dir(workdir)
        step, meta = distributed.agreed(files.read_newest, ckpt_dir, step, files.read_step_meta)
    config = ConfigDict(laid_over(default_config(), meta["config"]))
    config.model = ConfigDict(store.saved_model(meta["model"]))  # what its parameters are
    if "document_mask" not in meta["config"].get("data", {}):
        config.data.document_mask = False  # saved before document masking: it trained on whole windows
    config.init_from = ""
    return step, meta, config_keys.apply_overrides(config, overrides)


def reader_flags() -> flags.FlagValues:
    """The flags every reader of a trained run takes (--workdir, --step and the job flags), in a
    FlagValues of the command's own: evaluate and generate each add theirs, of the same names in part."""
    values = flags.FlagValues()
    arguments.define_path("workdir", None, "A run directory (train.py --workdir).", flag_values=values)
    flags.mark_flag_as_required("workdir", flag_values=values)
    flags.DEFINE_integer(
        "step", None, "Checkpoint step (default: the newest that reads).", flag_values=values
    )
    job_flags.define(values)
    return values


def config_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the --config arguments, the others) of a reader's argv: the --config.KEY=VALUE overrides go
    on top of the run's saved config (split_overrides), not to the flag parser."""
    given, others = [], []
    for arg in argv:
        (given if arg == "--config" or arg.startswith(("--config.", "--config=")) else others).append(arg)
    return given, others


def _rule_file_found(name_or_path: str) -> bool:
    from gspmd_tp.sharding.rules import resolve_path

    try:
        resolve_path(name_or_path)
    except UserError:
        return False
    return True


def _setup_with_saved_rules(config: ConfigDict, meta: dict, step: int) -> run_setup.Setup:
    """run_setup.setup with the rule-file text saved in the checkpoint in place of config.rules."""
    from gspmd_tp.sharding.rules import parse_rules
    from gspmd_tp.train import run_setup

    label = f"{config.rules} (the copy saved with step {step})"
    warn(
        f"note: rule file {config.rules!r} not found (cwd {os.getcwd()}); using the copy saved with "
        f"step {step} (pass --config.rules=NAME_OR_PATH to choose another)"
    )
    return run_setup.setup(config, rules=parse_rules(meta["rules"]["text"], label))


def load_setup(
    workdir: str,
    overrides: dict[str, str],
    step: int | None = None,
    sampling: bool = False,
    params_only: bool = False,
) -> tuple[int, dict, run_setup.Setup]:
    """(step, meta, Setup) for the run in workdir: config, rule file and mesh checked, nothing compiled.

    A rule file that is no longer where the run found it (another cwd, a moved file) is replaced by
    the copy saved in the checkpoint, with a note on stderr, unless --config.rules names one. So is
    cuDNN attention away from a GPU, by the einsum path that computes the same. With `sampling` the
    training batch is not checked against the mesh (sampling pads its own batch of prompts), and
    sequence positions are sharded over no mesh axis: a prompt has any length, and decoding makes
    one position at a time (the parameters' shardings do not change). With `params_only` (a reader
    of the parameters alone, such as to-hf) the training batch is not checked either.
    """
    from gspmd_tp.job import distributed

    step, meta, config = saved_config(workdir, overrides, step)
    # Processes given other overrides would read apart; what fails on one process only (a rule file
    # its host lacks) stops every one, named on each.
    args = (workdir, step, meta, config, overrides, sampling, params_only)
    return step, meta, distributed.agreed_setup(config, _setup, *args)


def _setup(workdir, step, meta, config, overrides, sampling, params_only) -> run_setup.Setup:
    import jax

    from gspmd_tp.checkpoint import store
    from gspmd_tp.train import run_setup

    if (sampling or params_only) and "batch_size" not in overrides and "grad_accum" not in overrides:
        # A batch every mesh of these devices divides: the batch axes' product divides the count.
        config.batch_size, config.grad_accum = jax.device_count(), 1
    if config.model.attention == "cudnn" and "model.attention" not in overrides:
        platform = jax.devices()[0].platform
        if platform != "gpu":
            warn(f"note: the run trained with cuDNN attention; read on {platform} with einsum attention")
            config.model.attention = "einsum"
    saved_text = meta.get("rules", {}).get("text")
    if "rules" not in overrides and saved_text and not _rule_file_found(config.rules):
        s = _setup_with_saved_rules(config, meta, step)
    else:
        s = run_setup.setup(config)
    store.check_model_matches(meta["model"], s.model_cfg, workdir, READ_AS_SAVED)
    if sampling:
        from gspmd_tp.sharding import axes
        from gspmd_tp.sharding.rules import unsharded

        s = dataclasses.replace(s, rules=unsharded(s.rules, (axes.LENGTH, axes.NORM_LENGTH)))
    return s


def _read_params(workdir: str, step: int, s: run_setup.Setup):
    import orbax.checkpoint as ocp

    from gspmd_tp.checkpoint import step_dirs as files
    from gspmd_tp.checkpoint import store

    target = s.abstract_state.params
    path = paths.of(os.path.join(files.checkpoint_dir(workdir), str(step), files.STATE))  # it calls .exists()
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    # The handler, not a Checkpointer: the Checkpointer's barrier after the read would wait for a
    # process whose own read failed (checkpoint.agreed_read settles the outcome instead).
    reader = ocp.PyTreeCheckpointHandler()
    try:
        with store.quiet_after_a_failed_read():
            restored = reader.restore(
                path,
                args=ocp.args.PyTreeRestore(
                    item={"params": target}, restore_args={"params": restore_args}, partial_restore=True
                ),
            )
    finally:
        reader.close()
    return restored["params"]


def restore_params(workdir: str, step: int, s: run_setup.Setup):
    """The parameters of checkpoint `step`, read straight into the shardings of `s`; a step that does
    not read is a one-line UserError (files.read_newest), never skipped."""
    from gspmd_tp.checkpoint import step_dirs as files
    from gspmd_tp.checkpoint import store

    read = functools.partial(store.agreed_read, lambda _: _read_params(workdir, step, s))
    _, params = files.read_newest(files.checkpoint_dir(workdir), step, read)
    return params


def params_for(workdir: str, step: int, s: run_setup.Setup, exact: bool):
    """(step, parameters) of the step load_setup found: that step only where a reader's --step
    asked for it (`exact`), else it or the newest older one that restores."""
    if exact:
        return step, restore_params(workdir, step, s)
    return restore_newest_params(workdir, step, s)


def restore_newest_params(workdir: str, step: int, s: run_setup.Setup):
    """(step, parameters) of checkpoint `step` or, where its files are damaged, of the newest older
    checkpoint that restores; each one skipped is named in a warning on stderr."""
    from gspmd_tp.checkpoint import step_dirs as files
    from gspmd_tp.checkpoint import store

    def read_here(path: str):
        candidate = int(os.path.basename(path))
        if candidate != step:  # `step` was checked by load_setup
            model = files.read_step_meta(path)["model"]
            store.check_model_matches(model, s.model_cfg, workdir, READ_AS_SAVED)
        return _read_params(workdir, candidate, s)

    read = functools.partial(store.agreed_read, read_here)  # one outcome on every process

    ckpt_dir = files.checkpoint_dir(workdir)
    older = [n for n in files.steps_on_disk(ckpt_dir) if n < step]
    hit = files.first_that_reads(ckpt_dir, [step, *older], read, warn=warn)
    if hit is None:
        raise UserError(f"{ckpt_dir}: no checkpoint restores (see the warnings above)")
    return hit


# --- how many devices to simulate: read from the checkpoints' metadata, before jax's backend starts ---


def _mesh_size(mesh: str) -> int | None:
    """Devices a mesh string like "dp=2,mp=4" spans; None where a size is -1 or it does not parse."""
    try:
        sizes = [int(axis.partition("=")[2]) for axis in mesh.split(",")]
    except (AttributeError, ValueError):
        return None
    return math.prod(sizes) if sizes and all(n > 0 for n in sizes) else None


def saved_device_count(workdir: str, step: int | None = None) -> int | None:
    """Devices the mesh of checkpoint `step` (default: the newest whose metadata reads) spans, or None.

    Plain JSON: no jax, no orbax.
    """
    from gspmd_tp.checkpoint import step_dirs as files

    ckpt_dir = files.checkpoint_dir(workdir)
    try:
        steps = files.steps_on_disk(ckpt_dir)
    except OSError:
        return None
    for candidate in [step] if step is not None else steps:
        try:
            size = _mesh_size(files.read_step_meta(os.path.join(ckpt_dir, str(candidate)))["mesh"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if size:
            return size
    return None


def reader_device_count(workdir: str | None, mesh: str | None = None, step: int | None = None) -> int:
    """Devices for a command reading a run: those `mesh` spans where it gives every size, else those
    checkpoint `step` (default: the newest) of `workdir` was saved on, else 8."""
    return (mesh and _mesh_size(mesh)) or (workdir and saved_device_count(workdir, step)) or DEFAULT_DEVICES


def request_devices(argv: list[str]) -> None:
    """Asks for the simulated CPU devices of a command reading a run (device_count_from_argv, where
    --config.host_device_count does not say), before jax's backend starts."""
    from gspmd_tp.job import host_devices

    host_devices.request(arguments.count_from_argv(argv, device_count_from_argv(argv)))


def device_count_from_argv(argv: list[str]) -> int:
    """reader_device_count for the --workdir and --config.mesh of argv, shared among the processes
    of --num_processes where they divide it."""
    workdir = paths.expand(arguments.flag_from_argv(argv, "--workdir"))
    count = reader_device_count(workdir, arguments.flag_from_argv(argv, "--config.mesh"))
    try:
        processes = int(arguments.flag_from_argv(argv, "--num_processes") or 1)
    except ValueError:
        processes = 1  # the flag parser names the bad value
    return count // processes if processes > 0 and count % processes == 0 else count


def _asks_for_a_job(flag_values: flags.FlagValues) -> bool:
    """Whether the job flags of `flag_values` name a job of several processes (or --distributed)."""
    v = job_flags.values(flag_values)
    return v["num_processes"] != 1 or v["distributed"] or bool(v["coordinator_address"])


def run_reader(work, flag_values: flags.FlagValues, left: str) -> int:
    """Runs work() -> text for stdout (or None) as a reader of a trained run; returns the exit status.
    Alone: a UserError is one line (status 1), Ctrl-C one line saying what it `left` (130). In a job:
    joined and run under signals.run_job; stdout holds process 0's text alone (gloo prints there)."""
    if not _asks_for_a_job(flag_values):
        try:
            text = work()
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return interrupted(left)
        if text is not None:
            print(text, flush=True)
        return 0
    from gspmd_tp.job import signals

    def job():
        import jax

        with job_flags.stdout_to_stderr():
            job_flags.join(flag_values)
            text = work()
        if text is not None and jax.process_index() == 0:
            print(text, flush=True)

    signals.run_job(job, before=f"({left})", after=f"({left})")
    return 0
