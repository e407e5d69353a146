"""Orbax checkpoints: the train state, the data-iterator state, and a small JSON of what made them.

Restore always builds its target from the *current* mesh and rules (abstract arrays carrying the
new NamedShardings), never from the shardings saved in the checkpoint, so a run saved on one mesh
and rule file resumes on another, each device reading only its own shard.

Also a tool: python -m gspmd_tp.checkpoint info DIR | export DIR OUT.npz (see main()).
"""

from __future__ import annotations

if __name__ == "__main__":  # before jax is imported: no TPU probe on a host without one
    from gspmd_tp import host_devices

    host_devices.cpu_platform_where_alone()

import contextlib
import dataclasses
import json
import logging as std_logging
import os
import sys
import zipfile
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from gspmd_tp import distributed, outputs, paths
from gspmd_tp.checkpoint_files import (
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
    read_newest,
    read_step_meta,
    readable_checkpoints,
    short_error,
    steps_on_disk,
)
from gspmd_tp.data_files import absolute_patterns
from gspmd_tp.errors import ArgumentParser, JobError, UserError, exit_from_main, interrupted, warn
from gspmd_tp.model import ModelConfig

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
)
# Model keys that change how the model computes, not what its parameters are: they may differ.
FREE_MODEL_KEYS = ("dtype", "remat", "attention", "attention_block", "projection_grad")


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


def _agreed_read(read, path: str):
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
    """read(step directory) -> (state, data state), with one outcome on every process (_agreed_read)."""
    return lambda path: _agreed_read(lambda p: _restore_step(Path(p), abstract_state), path)


# --- mismatches, named before anything is written ---


def _param_shapes(model: dict) -> dict[str, tuple[int, ...]]:
    from gspmd_tp.state import param_axes  # state imports the model; only this check needs it

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in model.items() if k in fields})
    return {path: shape for path, (shape, _) in param_axes(cfg).items()}


def saved_model(model: dict) -> dict:
    """A checkpoint's model config, keys added since it was saved taking their defaults."""
    return {**dataclasses.asdict(ModelConfig()), **model}


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


def _lookup(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config.get(part, _ABSENT) if isinstance(config, dict) else _ABSENT
    return config


def _identity(config: dict, key: str):
    """`key`'s value as far as it shapes the run; _ABSENT where a run saved before the key existed."""
    if key == "data.eval_fraction" and _lookup(config, "data.eval_files") not in ("", None, _ABSENT):
        return _UNUSED  # held-out files replace the hashed held-out fraction
    value = _lookup(config, key)
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


# --- one unsharded file of parameters: export and import ---


def _flat(tree) -> dict:
    from gspmd_tp.state import path_str

    return {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _locate(path: str, step: int | None) -> tuple[str, int | None]:
    """(checkpoints dir, step or None for the newest) for a workdir, its checkpoints dir or one step dir."""
    path = os.path.abspath(path)
    name = os.path.basename(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UserError(f"{path} is a file, not a run's directory, its checkpoints or one of their steps")
    if name.isdigit() and os.path.isdir(path) and not steps_on_disk(path):
        if step is not None and step != int(name):
            raise UserError(
                f"{path} is the directory of step {name} but --step {step} was given; "
                f"pass {os.path.dirname(path)} with --step {step}, or leave --step out"
            )
        return os.path.dirname(path), int(name)
    ckpt_dir = path if steps_on_disk(path) else checkpoint_dir(path)
    if not steps_on_disk(ckpt_dir):
        raise UserError(f"{path}: no checkpoint found (looked in {ckpt_dir})")
    return ckpt_dir, step


def _state_tree_metadata(step_dir: str) -> dict:
    metadata = ocp.PyTreeCheckpointer().metadata(os.path.join(step_dir, STATE)).item_metadata
    if metadata is None:  # orbax's answer where the array metadata's own files are gone or garbled
        raise FileNotFoundError(
            "state: the arrays' metadata does not read (its files are missing or cut short)"
        )
    return metadata.tree


def export_params(path: str, out: str, step: int | None = None) -> dict[str, tuple[int, ...]]:
    """Writes the parameters of a checkpoint (newest step by default) to one unsharded .npz file.

    Only the parameters are read (not the optimizer state), straight to host numpy arrays.
    Returns {parameter path: shape}.
    """
    if not out.endswith(".npz"):
        raise UserError(f"{out}: export writes .npz files; name the output *.npz")

    def read(step_dir):
        read_step_meta(step_dir)  # a partial step is not exported
        params_md = _state_tree_metadata(step_dir)["params"]
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), params_md)
        with quiet_after_a_failed_read():
            return ocp.PyTreeCheckpointer().restore(
                os.path.join(step_dir, STATE),
                args=ocp.args.PyTreeRestore(
                    item={"params": params_md}, restore_args={"params": restore_args}, partial_restore=True
                ),
            )["params"]

    _, params = read_newest(*_locate(path, step), read, warn=warn)
    flat = _flat(params)
    with outputs.whole_file(out) as partial, open(partial, "wb") as f:
        np.savez(f, **flat)  # a file object: savez adds no .npz to the temporary name
    return {k: v.shape for k, v in flat.items()}


def import_params(path: str, abstract_params, digest=None):
    """Parameters from an exported .npz, each placed straight into its target sharding.

    Raises UserError naming every missing, extra or differently shaped parameter before placing any.
    `digest` (a hashlib object), where given, takes in every parameter as the check reads it (name,
    dtype, shape, values): files that give other parameters give another digest, without a read of
    its own.
    """
    if not os.path.isfile(path):
        raise UserError(f"config.init_from: no file {path}")
    not_npz = (
        f"config.init_from={path} is not a readable .npz of parameters "
        "(python -m gspmd_tp.checkpoint export writes one)"
    )
    if not zipfile.is_zipfile(path):  # np.load would take it for a pickle, and suggest loading it unsafely
        raise UserError(f"{not_npz}: not a zip archive")
    try:
        have, non_finite = {}, []
        with np.load(path) as npz:
            for k in npz.files:  # each member read once, one at a time
                value = npz[k]
                have[k] = value.shape
                if digest is not None:
                    digest.update(repr((k, value.dtype.str, value.shape)).encode())
                    digest.update(np.ascontiguousarray(value).data)
                if value.dtype.kind in "fc" and not np.isfinite(value).all():
                    non_finite.append(k)
    except (OSError, ValueError, EOFError, AttributeError, zipfile.BadZipFile) as e:
        # np.load takes any other file for a pickle or .npy (AttributeError: no `with` on an array).
        raise UserError(f"{not_npz}: {short_error(e)}") from None
    want = {k: tuple(v.shape) for k, v in _flat(abstract_params).items()}
    problems = [
        f"{k}: file {have.get(k, 'absent')}, model {want.get(k, 'absent')}"
        for k in sorted(set(have) | set(want))
        if have.get(k) != want.get(k)
    ]
    if problems:
        raise UserError(f"config.init_from={path} does not fit the model: {'; '.join(problems)}")
    if non_finite:
        raise UserError(f"config.init_from={path}: NaN or Inf values in {', '.join(non_finite)}")

    def place(key_path, target):
        from gspmd_tp.state import path_str

        with np.load(path) as npz:  # one parameter on the host at a time
            value = npz[path_str(key_path)].astype(target.dtype)
        return jax.make_array_from_callback(value.shape, target.sharding, lambda idx: value[idx])

    return jax.tree_util.tree_map_with_path(place, abstract_params)


# --- the command-line tool ---


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def info(path: str, step: int | None = None) -> str:
    """A human-readable summary of the checkpoints under `path` (workdir, checkpoints dir or step)."""
    ckpt_dir, step = _locate(path, step)

    def read(step_dir):
        with open(os.path.join(step_dir, DATA, "metadata")) as f:
            return read_step_meta(step_dir), _state_tree_metadata(step_dir), json.load(f)

    step, (meta, tree, data_state) = read_newest(ckpt_dir, step, read, warn=warn)
    step_dir = os.path.join(ckpt_dir, str(step))
    sizes = {s: _size(os.path.join(ckpt_dir, str(s))) for s in sorted(steps_on_disk(ckpt_dir))}

    def nbytes(t):
        leaves = [m for m in jax.tree.leaves(t) if hasattr(m, "shape")]
        return sum(int(np.prod(m.shape)) * np.dtype(m.dtype).itemsize for m in leaves), leaves

    param_bytes, param_leaves = nbytes(tree["params"])
    opt_bytes, _ = nbytes(tree["opt_state"])
    n_params = sum(int(np.prod(m.shape)) for m in param_leaves)
    # info reads metadata only. Parameters compress little (zstd), so array files far smaller than
    # them mean files are missing: export, evaluate and a resume would find the damage.
    on_disk = _size(os.path.join(step_dir, STATE))
    if on_disk < param_bytes / 10:
        warn(
            f"warning: {step_dir}: its array files take {_mb(on_disk)} for {_mb(param_bytes)} of parameters; "
            "files may be missing (info reads the metadata only; export reads every array)"
        )
    model = " ".join(f"{k}={v}" for k, v in meta["model"].items())
    lines = [
        f"checkpoints in {ckpt_dir}",
        "  steps: " + ", ".join(f"{s} ({_mb(size)})" for s, size in sizes.items()),
        f"step {step}:",
        f"  saved on mesh {meta['mesh']} by {meta['process_count']} process(es) "
        f"with rules {meta['rules']['source']}",
        f"  model: {model}",
        f"  parameters: {n_params:,} ({_mb(param_bytes)}); optimizer state {_mb(opt_bytes)}; "
        f"on disk {_mb(sizes[step])}",
        f"  data position: next example {data_state.get('next_example')} "
        f"(batch_size {meta['config']['batch_size']}, seed {meta['config']['data']['seed']})",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    """python -m gspmd_tp.checkpoint {info DIR | export DIR OUT.npz} [--step N]."""
    parser = ArgumentParser(prog="python -m gspmd_tp.checkpoint", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="steps, model config, rules, mesh and sizes")
    p_info.add_argument(
        "dir", type=paths.expand, help="a workdir, its checkpoints/ directory or one step directory"
    )
    p_info.add_argument("--step", type=int, default=None, help="default: the newest")
    p_export = sub.add_parser(
        "export", help="the parameters as one unsharded .npz (config.init_from reads it)"
    )
    p_export.add_argument("dir", type=paths.expand)
    p_export.add_argument("out", type=paths.expand, help="OUT.npz")
    p_export.add_argument("--step", type=int, default=None, help="default: the newest")
    args = parser.parse_args(argv)
    # orbax warns, for every healthy step, that a lone item has no checkpoint-level metadata file.
    logging.set_verbosity(logging.ERROR)
    try:
        if args.command == "info":
            print(info(args.dir, args.step))
        else:
            outputs.check_file(args.out, "OUT", probe=True)
            shapes = export_params(args.dir, args.out, args.step)
            n = sum(int(np.prod(s)) for s in shapes.values())
            print(f"wrote {len(shapes)} parameters ({n:,} values) to {args.out}")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return interrupted("nothing written" if args.command == "info" else f"OUT={args.out} is as it was")
    return 0


if __name__ == "__main__":
    exit_from_main(main())
