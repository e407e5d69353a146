"""Orbax checkpoints: the train state, the data-iterator state, and a small JSON of what made them.

Restore always builds its target from the *current* mesh and rules (abstract arrays carrying the
new NamedShardings), never from the shardings saved in the checkpoint, so a run saved on one mesh
and rule file resumes on another, each device reading only its own shard.

The tool python -m gspmd_tp.checkpoint (info, export) is tool.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging as std_logging
import os
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.metadata import array_metadata_store

from gspmd_tp.checkpoint.step_dirs import (
    CORRUPT_DIR,
    DATA,
    META,
    STATE,
    DamagedElsewhere,
    checkpoint_dir,
    damage,
    first_that_reads,
    move_aside,
    not_damage,
    readable_checkpoints,
)
from gspmd_tp.cli.config_keys import laid_over, lookup
from gspmd_tp.data.documents import absolute_patterns
from gspmd_tp.job import distributed
from gspmd_tp.job.errors import JobError, UserError, warn
from gspmd_tp.model.params import param_axes
from gspmd_tp.model.transformer import ModelConfig
from gspmd_tp.storage import paths

# Config keys that make a run the run it is: resuming with other values would train on another data
# stream (or from another init), so a workdir with different ones holds another run.
# The held-out split is part of it: another eval_fraction or eval_files moves documents between the
# training and held-out sets, so the saved data position would point into another stream.
RUN_IDENTITY = (
    "seed",
    "seq_len",
    "data.train_files",
    "data.seed",
    "data.jsonl_field",
    "data.eval_files",
    "data.eval_fraction",
    "data.shards",
)
# Model keys that change how the model computes, not what its parameters are: they may differ.
FREE_MODEL_KEYS = (
    "dtype",
    "remat",
    "remat_save",
    "attention",
    "attention_block",
    "mlp_grad",
    "moe_dispatch",
    "moe_buffer_factor",  # how many rows a device receives into, not what the parameters are
    "context_parallel",
    "context_load_balance",
)

# An array replicated over several devices is saved a slice per replica, in parallel; each slice
# is a program compiled per shape and device. Below this many bytes a slice, that costs more than
# the parallel copy saves: one replica writes the whole array (orbax's default handler otherwise).
MIN_REPLICA_SLICE_BYTES = 1 << 20


def _register_array_handler() -> None:
    handler = ocp.type_handlers.ArrayHandler(
        array_metadata_store=array_metadata_store.Store(),
        min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES,
    )
    absl_log = std_logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(std_logging.ERROR)  # orbax warns of any handler replaced
    try:
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl_log.setLevel(level)


_register_array_handler()


def manager(workdir: str, keep: int, async_save: bool = True) -> ocp.CheckpointManager:
    """A CheckpointManager over workdir/checkpoints keeping the newest `keep` steps.

    Leftovers of a save that was killed midway (`N.orbax-checkpoint-tmp`) are removed on creation;
    they were never renamed to `N`, so no reader ever took them for a checkpoint.
    """
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=async_save, cleanup_tmp_directories=True
    )
    return ocp.CheckpointManager(checkpoint_dir(workdir), options=options, item_names=(STATE, DATA, META))


def save(mngr: ocp.CheckpointManager, step: int, state, data_state: dict, meta: dict) -> None:
    """Starts saving (asynchronously when the manager is async) the state at `step`."""
    mngr.save(
        step,
        args=ocp.args.Composite(
            **{
                STATE: ocp.args.StandardSave(state),
                DATA: ocp.args.JsonSave(data_state),
                META: ocp.args.JsonSave(meta),
            }
        ),
        force=True,
    )


def read_meta(mngr: ocp.CheckpointManager, step: int) -> dict:
    """The JSON metadata saved with `step` (model config, rules, mesh), without touching arrays."""
    return mngr.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]


def restore(mngr: ocp.CheckpointManager, step: int, abstract_state):
    """(state, data-iterator state) at `step`, read straight into abstract_state's shardings.

    Each process reads through the items' handlers, not mngr.restore: that ends in a barrier of
    orbax's, which a process whose read failed never reaches, so in a multi-process job the next
    collective it joined (another step's read) would pair with it. Agreeing on the outcome is
    restore_newest's.
    """
    return _restore_step(mngr.directory / str(step), abstract_state)


def _restore_step(step_dir, abstract_state):
    state_reader, data_reader = ocp.StandardCheckpointHandler(), ocp.JsonCheckpointHandler()
    try:
        with quiet_after_a_failed_read():
            state = state_reader.restore(step_dir / STATE, args=ocp.args.StandardRestore(abstract_state))
            data_state = data_reader.restore(step_dir / DATA, args=ocp.args.JsonRestore())
    finally:
        state_reader.close()
        data_reader.close()
    return state, data_state


_read_failed = False  # a read failed in this process: what it left in flight may end at any later time


@contextlib.contextmanager
def quiet_after_a_failed_read():
    """Where a read fails, the array reads still in flight end later, each printing a traceback:
    asyncio's "exception was never retrieved", their own error when the coroutine is collected, or
    "Event loop is closed" from orbax's finished loop. Those, and only those, go unprinted from the
    read on where it fails, so that the one-line warning about the checkpoint is what the user sees.
    Once a read failed they stay unprinted for good: a later read's success says nothing about the
    leftovers of the earlier one."""
    global _read_failed
    if _read_failed:
        yield
        return
    asyncio_log, hooks = std_logging.getLogger("asyncio"), (sys.unraisablehook, sys.excepthook)
    asyncio_log.addFilter(_not_never_retrieved)
    sys.unraisablehook = _dropping(
        hooks[0], lambda i: _closed_loop(i.exc_value) or _orbax_coroutine(i.object)
    )
    sys.excepthook = _dropping(hooks[1], lambda *info: _closed_loop(info[1]))
    try:
        yield
    except BaseException:
        _read_failed = True  # the filters stay for the reads still in flight
        raise
    asyncio_log.removeFilter(_not_never_retrieved)
    sys.unraisablehook, sys.excepthook = hooks


def _orbax_coroutine(obj) -> bool:
    """An orbax coroutine (a read of one array's part) collected unfinished."""
    code = getattr(obj, "cr_code", None)
    return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def _not_never_retrieved(record) -> bool:
    return "exception was never retrieved" not in record.getMessage()


def _closed_loop(e) -> bool:
    return isinstance(e, RuntimeError) and str(e) == "Event loop is closed"


def _dropping(hook, orphan):
    """`hook`, except for what `orphan` says a read left in flight raised."""

    def dropping(*args):
        if not orphan(*args):
            hook(*args)

    return dropping


_UNUSABLE = -1  # shared in place of a process's steps where it cannot use the checkpoint directory


def agreed_checkpoints(workdir: str, warn=print) -> list[tuple[int, dict]]:
    """checkpoint_files.readable_checkpoints on every process of the job, less the steps whose
    metadata some other process could not read, each named through `warn`: every process then
    tries the same steps.

    Raises UserError on every process where that leaves no step though some process found one
    (starting afresh would throw the run away), and where some process cannot use the checkpoint
    directory at all: that one says why, the others name it. A one-process job lists its own.
    """
    try:
        found, mine = readable_checkpoints(workdir, warn=warn), None
    except UserError as e:
        found, mine = [], e
    lists = distributed.every_process([_UNUSABLE] if mine else [step for step, _ in found])
    if mine:
        raise JobError(str(mine)) from None  # every process stops here: none tells the others
    ckpt_dir = checkpoint_dir(workdir)
    unusable = [i for i, steps in enumerate(lists) if steps == [_UNUSABLE]]
    if unusable:
        raise JobError(
            f"{ckpt_dir} cannot be resumed from on process {unusable[0]} of this job (its error says "
            "why); nothing was moved"
        )
    everywhere = set(lists[0]).intersection(*lists[1:])
    for step in sorted(set().union(*lists) - everywhere, reverse=True):
        elsewhere = [i for i, steps in enumerate(lists) if step not in steps]
        warn(
            f"warning: skipping checkpoint {os.path.join(ckpt_dir, str(step))}: its metadata does not read "
            f"on process {', '.join(map(str, elsewhere))} of this job"
        )
    if not everywhere and any(lists):
        raise JobError(
            f"{ckpt_dir}: no checkpoint's metadata reads on every process of this job (see the warnings "
            "above); nothing was moved: repair the files or the hosts' view of them and run again"
        )
    return [(step, meta) for step, meta in found if step in everywhere]


_READ, _DAMAGED, _FAILED = 0, 1, 2  # how a process's read of a step went, worst last


def agreed_read(read, path: str):
    """read(path) on every process of the job, with one outcome for all: where some process found
    the files damaged, every process raises as for damage; where some process failed otherwise,
    every process raises UserError. So all go on to the same step, or all stop."""
    try:
        result, mine = read(path), None
    except Exception as e:  # noqa: BLE001 - sorted below and raised again
        result, mine = None, e
    damaged = mine is not None and not isinstance(mine, UserError) and damage(mine)
    code = _READ if mine is None else _DAMAGED if damaged else _FAILED
    codes = np.array([outcome for [outcome] in distributed.every_process([code])])
    worst = int(codes.max())
    if mine is not None and code == worst:
        if damaged and jax.process_index() != 0:  # process 0 warns for the job; this names the cause
            warn(f"warning: process {jax.process_index()}: {path} is partial or corrupted ({damaged})")
        if code == _FAILED:  # every process stops here: none tells the others
            why = mine if isinstance(mine, UserError) else not_damage(mine, path)
            raise JobError(str(why)) from None
        raise mine
    other = int(np.argmax(codes == worst))
    if worst == _FAILED:
        raise JobError(
            f"{path} does not read on process {other} of this job (its error says why); nothing was "
            "skipped or moved: fix the cause and run again"
        )
    if worst == _DAMAGED:
        raise DamagedElsewhere(f"process {other} of this job could not read its part: see its warning")
    return result


def restore_newest(
    mngr: ocp.CheckpointManager,
    found: list[tuple[int, dict]],
    abstract_state,
    warn=print,
    damaged: dict[int, str] | None = None,
):
    """(step, meta, state, data state) of the newest checkpoint in `found` (agreed_checkpoints) that
    restores on every process of the job.

    One whose files are damaged (missing, cut short, undecodable) on any process is named through
    `warn` and moved to workdir/corrupt_checkpoints/; so is each step of `damaged` ({step: warning},
    from damage_warning), without reading it again. Any other failure (permissions, memory,
    storage) moves nothing and raises UserError, as does having no step left that restores.
    """
    ckpt_dir, metas, moved, damaged = str(mngr.directory), dict(found), [], damaged or {}

    def set_aside(step: int) -> None:
        move_aside(ckpt_dir, step, warn)
        moved.append(step)
        mngr.reload()

    for step in sorted(damaged, reverse=True):
        warn(damaged[step])
        set_aside(step)
    read = _agreed_restore(abstract_state)
    steps = [step for step, _ in found if step not in damaged]
    hit = first_that_reads(ckpt_dir, steps, read, warn, on_damage=set_aside)
    if hit is None:
        where = os.path.join(os.path.dirname(ckpt_dir), CORRUPT_DIR)
        raise JobError(
            f"no checkpoint in {ckpt_dir} restores: steps {', '.join(map(str, moved))} are damaged and "
            f"were moved to {where}; inspect them, then remove {where} to start this run afresh"
        )
    step, (state, data_state) = hit
    return step, metas[step], state, data_state


def damage_warning(workdir: str, step: int, abstract_state) -> str | None:
    """None where checkpoint `step` restores on every process of the job (its arrays are read, then
    dropped); where its files are damaged on some process, the warning that names it, unprinted:
    restore_newest(damaged=...) prints it and moves the step without reading it a second time.
    Any other failure raises UserError, as in restore_newest."""
    read, warnings = _agreed_restore(abstract_state), []
    hit = first_that_reads(checkpoint_dir(workdir), [step], read, warn=warnings.append)
    return None if hit is not None else warnings[0]


def _agreed_restore(abstract_state):
    """read(step directory) -> (state, data state), with one outcome on every process (agreed_read)."""
    return lambda path: agreed_read(lambda p: _restore_step(paths.of(p), abstract_state), path)


# --- mismatches, named before anything is written ---


def _param_shapes(model: dict) -> dict[str, tuple[int, ...]]:
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in model.items() if k in fields})
    return {path: shape for path, (shape, _) in param_axes(cfg).items()}


def saved_model(model: dict) -> dict:
    """A checkpoint's model config, keys added since it was saved taking their defaults and keys
    removed since (model.projection_grad) left out."""
    return laid_over(dataclasses.asdict(ModelConfig()), model)


def check_model_matches(
    saved: dict,
    current: ModelConfig,
    where: str,
    advice: str = "use a new --workdir or the saved model config",
) -> None:
    """A checkpoint made by a different model cannot be resumed (or read): name every differing key
    and parameter, then `advice`."""
    saved = saved_model(saved)
    now = dataclasses.asdict(current)
    diffs = [
        f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}"
        for k in sorted(set(saved) | set(now))
        if k not in FREE_MODEL_KEYS and saved.get(k) != now.get(k)
    ]
    if not diffs:
        return
    before, after = _param_shapes(saved), _param_shapes(now)
    shapes = [
        f"{p} saved {before.get(p, 'absent')}, now {after.get(p, 'absent')}"
        for p in sorted(set(before) | set(after))
        if before.get(p) != after.get(p)
    ]
    raise JobError(  # every process reads the same checkpoints (agreed_checkpoints): each says it
        f"{where} holds a checkpoint of a different model ({'; '.join(diffs)}; parameters: "
        f"{'; '.join(shapes) or 'same shapes'}); {advice}"
    )


_ABSENT = object()


class _Unused:
    """eval_fraction's identity where held-out files replace it: named so in messages."""

    def __repr__(self) -> str:
        return "unused (data.eval_files given)"


_UNUSED = _Unused()


def _identity(config: dict, key: str):
    """`key`'s value as far as it shapes the run; _ABSENT where a run saved before the key existed."""
    if key == "data.eval_fraction" and lookup(config, "data.eval_files", _ABSENT) not in ("", None, _ABSENT):
        return _UNUSED  # held-out files replace the hashed held-out fraction
    value = lookup(config, key, _ABSENT)
    if key in ("data.train_files", "data.eval_files") and isinstance(value, str):
        # Runs save them absolute; one saved before that was relative to where it ran, taken as here.
        return absolute_patterns(value)
    return value


def check_same_run(saved_config: dict, config, where: str) -> None:
    """A workdir whose checkpoints were made with other data or seeds holds another run: refuse it."""
    now = config.to_dict()
    diffs = [
        f"{k}: saved {_identity(saved_config, k)!r}, now {_identity(now, k)!r}"
        for k in RUN_IDENTITY
        # A key the saved config lacks was added later; its default is what that run used.
        if _identity(saved_config, k) is not _ABSENT and _identity(saved_config, k) != _identity(now, k)
    ]
    if diffs:  # every process reads the same checkpoints (agreed_checkpoints): each says it
        raise JobError(
            f"{where} holds another run ({'; '.join(diffs)}); use a new --workdir or the same values"
        )
