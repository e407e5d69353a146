"""Orbax checkpoints: the train state, the data-iterator state, and a small JSON of what made them.

Restore always builds its target from the *current* mesh and rules (abstract arrays carrying the
new NamedShardings), never from the shardings saved in the checkpoint, so a run saved on one mesh
and rule file resumes on another, each device reading only its own shard.

Also a tool: python -m gspmd_tp.checkpoint info DIR | export DIR OUT.npz (see main()).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from gspmd_tp import outputs
from gspmd_tp.errors import UserError
from gspmd_tp.model import ModelConfig

STATE, DATA, META = "state", "data", "meta"
# Config keys that make a run the run it is: resuming with other values would train on another data
# stream (or from another init), so a workdir with different ones holds another run.
RUN_IDENTITY = ("seed", "seq_len", "data.train_files", "data.seed", "data.jsonl_field")
# Model keys that change how the model computes, not what its parameters are: they may differ.
FREE_MODEL_KEYS = ("dtype", "remat", "attention", "projection_grad")


def checkpoint_dir(workdir: str) -> str:
    """Where a run's checkpoints live."""
    return os.path.join(os.path.abspath(workdir), "checkpoints")


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
    """(state, data-iterator state) at `step`, read straight into abstract_state's shardings."""
    restored = mngr.restore(
        step,
        args=ocp.args.Composite(
            **{STATE: ocp.args.StandardRestore(abstract_state), DATA: ocp.args.JsonRestore()}
        ),
    )
    return restored[STATE], restored[DATA]


# --- finding the newest complete checkpoint (read-only, before anything is written) ---


def _steps_on_disk(ckpt_dir: str) -> list[int]:
    """Step directories, newest first; in-progress saves (`N.orbax-checkpoint-tmp`) are not steps."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted((int(n) for n in os.listdir(ckpt_dir) if n.isdigit()), reverse=True)


def _read_meta_file(step_dir: str) -> dict:
    """The meta item of a step, read as plain JSON; raises if the step is partial."""
    # orbax writes commit_success.txt last inside each finished item on file systems without
    # atomic rename; on local disks a missing item file means someone removed or truncated it.
    for item in (STATE, DATA, META):
        if not os.path.isdir(os.path.join(step_dir, item)):
            raise FileNotFoundError(f"item {item!r} is missing")
    if not os.path.isfile(os.path.join(step_dir, STATE, "_METADATA")):
        raise FileNotFoundError("state/_METADATA is missing")
    with open(os.path.join(step_dir, META, "metadata")) as f:
        return json.load(f)


def readable_checkpoints(workdir: str, warn=print) -> list[tuple[int, dict]]:
    """[(step, meta)] of the checkpoints in workdir whose metadata reads, newest first.

    Writes nothing. An unreadable one is reported through `warn`, naming its path.
    """
    ckpt_dir = checkpoint_dir(workdir)
    found = []
    for step in _steps_on_disk(ckpt_dir):
        path = os.path.join(ckpt_dir, str(step))
        try:
            found.append((step, _read_meta_file(path)))
        except (OSError, ValueError) as e:
            warn(f"warning: skipping checkpoint {path}: partial or corrupted ({e})")
    return found


def restore_newest(mngr: ocp.CheckpointManager, found: list[tuple[int, dict]], abstract_state, warn=print):
    """(step, meta, state, data state) of the newest checkpoint in `found` that restores.

    One that fails to read (a truncated array file, say) is named through `warn` and moved out of
    the checkpoints directory to workdir/corrupt_checkpoints/, so a later save of that step does
    not collide with it and it stays for inspection. Raises UserError when none restores.
    """
    ckpt_dir = str(mngr.directory)
    for step, meta in found:
        try:
            state, data_state = restore(mngr, step, abstract_state)
            return step, meta, state, data_state
        except Exception as e:  # noqa: BLE001 - any read failure means this step is unusable
            path = os.path.join(ckpt_dir, str(step))
            warn(f"warning: skipping checkpoint {path}: it does not restore ({type(e).__name__}: {e})")
            _move_aside(ckpt_dir, step, warn)
            mngr.reload()
    raise UserError(f"{ckpt_dir} holds no checkpoint that restores; move it away to start afresh")


def _move_aside(ckpt_dir: str, step: int, warn) -> None:
    """Moves a broken step out of the way (to workdir/corrupt_checkpoints/) rather than deleting it."""
    if jax.process_index() != 0:
        return
    aside = os.path.join(os.path.dirname(ckpt_dir), "corrupt_checkpoints", f"{step}-{int(time.time())}")
    os.makedirs(os.path.dirname(aside), exist_ok=True)
    shutil.move(os.path.join(ckpt_dir, str(step)), aside)
    warn(f"warning: moved {os.path.join(ckpt_dir, str(step))} to {aside}")


def move_aside_unreadable(workdir: str, readable: list[int], warn=print) -> None:
    """Moves step directories whose metadata did not read (not in `readable`) out of the way."""
    ckpt_dir = checkpoint_dir(workdir)
    for step in _steps_on_disk(ckpt_dir):
        if step not in readable:
            _move_aside(ckpt_dir, step, warn)


# --- mismatches, named before anything is written ---


def _param_shapes(model: dict) -> dict[str, tuple[int, ...]]:
    from gspmd_tp.state import param_axes  # state imports the model; only this check needs it

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in model.items() if k in fields})
    return {path: shape for path, (shape, _) in param_axes(cfg).items()}


def saved_model(model: dict) -> dict:
    """A checkpoint's model config, keys added since it was saved taking their defaults."""
    return {**dataclasses.asdict(ModelConfig()), **model}


def check_model_matches(saved: dict, current: ModelConfig, where: str) -> None:
    """A checkpoint made by a different model cannot be resumed: name every differing key and parameter."""
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
    raise UserError(
        f"{where} holds a checkpoint of a different model ({'; '.join(diffs)}; parameters: "
        f"{'; '.join(shapes) or 'same shapes'}); use a new --workdir or the saved model config"
    )


def _lookup(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def check_same_run(saved_config: dict, config, where: str) -> None:
    """A workdir whose checkpoints were made with other data or seeds holds another run: refuse it."""
    now = config.to_dict()
    diffs = [
        f"{k}: saved {_lookup(saved_config, k)!r}, now {_lookup(now, k)!r}"
        for k in RUN_IDENTITY
        if _lookup(saved_config, k) != _lookup(now, k)
    ]
    if diffs:
        raise UserError(
            f"{where} holds another run ({'; '.join(diffs)}); use a new --workdir or the same values"
        )


# --- one unsharded file of parameters: export and import ---


def _flat(tree) -> dict:
    from gspmd_tp.state import path_str

    return {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _step_dir(path: str, step: int | None) -> tuple[str, int]:
    """Accepts a workdir, its checkpoints dir or one step dir; returns (step dir, step)."""
    path = os.path.abspath(path)
    if os.path.basename(path).isdigit() and os.path.isdir(os.path.join(path, STATE)):
        return path, int(os.path.basename(path))
    ckpt_dir = path if _steps_on_disk(path) else checkpoint_dir(path)
    steps = _steps_on_disk(ckpt_dir)
    if not steps:
        raise UserError(f"{path}: no checkpoint found (looked in {ckpt_dir})")
    step = steps[0] if step is None else step
    if step not in steps:
        raise UserError(f"{ckpt_dir}: no step {step} (have {', '.join(map(str, sorted(steps)))})")
    return os.path.join(ckpt_dir, str(step)), step


def _state_tree_metadata(step_dir: str) -> dict:
    return ocp.PyTreeCheckpointer().metadata(os.path.join(step_dir, STATE)).item_metadata.tree


def export_params(path: str, out: str, step: int | None = None) -> dict[str, tuple[int, ...]]:
    """Writes the parameters of a checkpoint (newest step by default) to one unsharded .npz file.

    Only the parameters are read (not the optimizer state), straight to host numpy arrays.
    Returns {parameter path: shape}.
    """
    if not out.endswith(".npz"):
        raise UserError(f"{out}: export writes .npz files; name the output *.npz")
    step_dir, _ = _step_dir(path, step)
    params_md = _state_tree_metadata(step_dir)["params"]
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), params_md)
    params = ocp.PyTreeCheckpointer().restore(
        os.path.join(step_dir, STATE),
        args=ocp.args.PyTreeRestore(
            item={"params": params_md}, restore_args={"params": restore_args}, partial_restore=True
        ),
    )["params"]
    flat = _flat(params)
    outputs.make_parent(out)
    np.savez(out, **flat)
    return {k: v.shape for k, v in flat.items()}


def import_params(path: str, abstract_params):
    """Parameters from an exported .npz, each placed straight into its target sharding.

    Raises UserError naming every missing, extra or differently shaped parameter before placing any.
    """
    if not os.path.isfile(path):
        raise UserError(f"config.init_from: no file {path}")
    with np.load(path) as npz:
        have = {k: npz[k].shape for k in npz.files}  # reads each member once; the file stays small
    want = {k: tuple(v.shape) for k, v in _flat(abstract_params).items()}
    problems = [
        f"{k}: file {have.get(k, 'absent')}, model {want.get(k, 'absent')}"
        for k in sorted(set(have) | set(want))
        if have.get(k) != want.get(k)
    ]
    if problems:
        raise UserError(f"config.init_from={path} does not fit the model: {'; '.join(problems)}")

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
    step_dir, step = _step_dir(path, step)
    ckpt_dir = os.path.dirname(step_dir)
    steps = sorted(_steps_on_disk(ckpt_dir))
    meta = _read_meta_file(step_dir)
    tree = _state_tree_metadata(step_dir)

    def nbytes(t):
        leaves = [m for m in jax.tree.leaves(t) if hasattr(m, "shape")]
        return sum(int(np.prod(m.shape)) * np.dtype(m.dtype).itemsize for m in leaves), leaves

    param_bytes, param_leaves = nbytes(tree["params"])
    opt_bytes, _ = nbytes(tree["opt_state"])
    n_params = sum(int(np.prod(m.shape)) for m in param_leaves)
    with open(os.path.join(step_dir, DATA, "metadata")) as f:
        data_state = json.load(f)
    model = " ".join(f"{k}={v}" for k, v in meta["model"].items())
    lines = [
        f"checkpoints in {ckpt_dir}",
        "  steps: " + ", ".join(f"{s} ({_mb(_size(os.path.join(ckpt_dir, str(s))))})" for s in steps),
        f"step {step}:",
        f"  saved on mesh {meta['mesh']} by {meta['process_count']} process(es) "
        f"with rules {meta['rules']['source']}",
        f"  model: {model}",
        f"  parameters: {n_params:,} ({_mb(param_bytes)}); optimizer state {_mb(opt_bytes)}; "
        f"on disk {_mb(_size(step_dir))}",
        f"  data position: next example {data_state.get('next_example')} "
        f"(batch_size {meta['config']['batch_size']}, seed {meta['config']['data']['seed']})",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    """python -m gspmd_tp.checkpoint {info DIR | export DIR OUT.npz} [--step N]."""
    parser = argparse.ArgumentParser(
        prog="python -m gspmd_tp.checkpoint", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="steps, model config, rules, mesh and sizes")
    p_info.add_argument("dir", help="a workdir, its checkpoints/ directory or one step directory")
    p_info.add_argument("--step", type=int, default=None, help="default: the newest")
    p_export = sub.add_parser(
        "export", help="the parameters as one unsharded .npz (config.init_from reads it)"
    )
    p_export.add_argument("dir")
    p_export.add_argument("out", help="OUT.npz")
    p_export.add_argument("--step", type=int, default=None, help="default: the newest")
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            print(info(args.dir, args.step))
        else:
            outputs.check_file(args.out, "OUT")
            shapes = export_params(args.dir, args.out, args.step)
            n = sum(int(np.prod(s)) for s in shapes.values())
            print(f"wrote {len(shapes)} parameters ({n:,} values) to {args.out}")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
