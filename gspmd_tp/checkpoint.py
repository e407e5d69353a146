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

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import time
import zipfile

import jax
import numpy as np
import orbax.checkpoint as ocp

from gspmd_tp import outputs
from gspmd_tp.errors import UserError
from gspmd_tp.model import ModelConfig

STATE, DATA, META = "state", "data", "meta"
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

CORRUPT_DIR = "corrupt_checkpoints"
# Tensorstore status codes that say a checkpoint's bytes are missing or cut short. The others
# (PERMISSION_DENIED, RESOURCE_EXHAUSTED, UNAVAILABLE, ...) say nothing against the checkpoint.
_MISSING_CODES = ("NOT_FOUND", "OUT_OF_RANGE", "DATA_LOSS")
# These two also cover requests that were wrong; only with a decoding failure do they mean damage.
_DECODE_CODES = ("FAILED_PRECONDITION", "INVALID_ARGUMENT")
_DECODE_WORDS = ("corrupt", "decod", "decompress", "checksum")
# Tensorstore appends its whole spec (some 60 lines) and source locations to every message.
_TENSORSTORE_TAIL = re.compile(r"\s*\[(tensorstore_spec|source locations)=.*", re.DOTALL)


def _causes(e: BaseException) -> list[BaseException]:
    chain = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def short_error(e: BaseException) -> str:
    """`e` in one line: its root cause's first line, without tensorstore's spec dump.

    Orbax wraps a tensorstore read error in a bare Exception whose message is the whole spec.
    """
    root = _causes(e)[-1]
    text = _TENSORSTORE_TAIL.sub("", str(root)).strip()
    line = text.splitlines()[0] if text else ""
    line = line if len(line) <= 300 else line[:300] + "..."
    return f"{type(root).__name__}: {line}" if line else type(root).__name__


def damage(e: BaseException) -> str | None:
    """`short_error(e)` where `e` shows that a checkpoint's files are missing, cut short or garbled;
    None where it may have another cause (permissions, memory, a flaky file system, a bug)."""
    for cause in _causes(e):
        if isinstance(cause, (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError)):
            return short_error(cause)
        text = str(cause)
        if isinstance(cause, KeyError) and "was not found in the checkpoint" in text:  # a missing item
            return short_error(cause)
        code = text.split(":", 1)[0]
        if code in _MISSING_CODES or (
            code in _DECODE_CODES and any(w in text.lower() for w in _DECODE_WORDS)
        ):
            return short_error(cause)
    return None


def steps_on_disk(ckpt_dir: str) -> list[int]:
    """Step directories, newest first; in-progress saves (`N.orbax-checkpoint-tmp`) are not steps."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted((int(n) for n in os.listdir(ckpt_dir) if n.isdigit()), reverse=True)


def read_step_meta(step_dir: str) -> dict:
    """The meta item of a step, read as plain JSON; raises if the step is partial."""
    # orbax writes commit_success.txt last inside each finished item on file systems without
    # atomic rename; on local disks a missing item file means someone removed or truncated it.
    for item in (STATE, DATA, META):
        if not os.path.isdir(os.path.join(step_dir, item)):
            raise FileNotFoundError(f"item {item!r} is missing")
    if not os.path.isfile(os.path.join(step_dir, STATE, "_METADATA")):
        raise FileNotFoundError("state/_METADATA is missing")
    with open(os.path.join(step_dir, META, "metadata")) as f:
        meta = json.load(f)
    if not isinstance(meta, dict):
        raise json.JSONDecodeError("not a JSON object", "", 0)
    return meta


def _corrupt_steps(workdir: str) -> list[str]:
    aside = os.path.join(os.path.abspath(workdir), CORRUPT_DIR)
    return sorted(os.listdir(aside)) if os.path.isdir(aside) else []


def readable_checkpoints(workdir: str, warn=print) -> list[tuple[int, dict]]:
    """[(step, meta)] of the checkpoints in workdir whose metadata reads, newest first.

    Writes nothing. A partial or garbled one is reported through `warn`, naming its path. Raises
    UserError where one cannot be read for another reason (permissions, say), and where the
    workdir held checkpoints but none is left that reads: starting afresh there would silently
    throw the run's progress away.
    """
    ckpt_dir = checkpoint_dir(workdir)
    found, damaged = [], []
    for step in steps_on_disk(ckpt_dir):
        path = os.path.join(ckpt_dir, str(step))
        try:
            found.append((step, read_step_meta(path)))
        except Exception as e:  # noqa: BLE001 - sorted into damage and the rest just below
            why = damage(e)
            if why is None:
                raise UserError(f"{path}: cannot read its metadata ({short_error(e)})") from None
            warn(f"warning: skipping checkpoint {path}: partial or corrupted ({why})")
            damaged.append(step)
    if found:
        return found
    if damaged:
        raise UserError(
            f"{ckpt_dir} holds no complete checkpoint (steps {', '.join(map(str, damaged))} are partial or "
            f"corrupted; nothing was moved): repair them, or remove {ckpt_dir} to start this run afresh"
        )
    aside = _corrupt_steps(workdir)
    if aside:
        where = os.path.join(os.path.abspath(workdir), CORRUPT_DIR)
        raise UserError(
            f"{where} holds checkpoints moved aside as damaged ({', '.join(aside)}) and {ckpt_dir} none: "
            f"inspect them, then move a repaired one back to {ckpt_dir}/STEP, or remove {where} "
            "to start this run afresh"
        )
    return found


def restore_newest(mngr: ocp.CheckpointManager, found: list[tuple[int, dict]], abstract_state, warn=print):
    """(step, meta, state, data state) of the newest checkpoint in `found` that restores.

    One whose files are damaged (missing, cut short, undecodable) is named through `warn` and moved
    out of the checkpoints directory to workdir/corrupt_checkpoints/, so a later save of that step
    does not collide with it and it stays for inspection. Any other failure (permissions, memory,
    storage) moves nothing and raises UserError, as does having no step left that restores.
    """
    ckpt_dir = str(mngr.directory)
    moved = []
    for step, meta in found:
        path = os.path.join(ckpt_dir, str(step))
        try:
            state, data_state = restore(mngr, step, abstract_state)
            return step, meta, state, data_state
        except Exception as e:  # noqa: BLE001 - sorted into damage and the rest just below
            why = damage(e)
            if why is None:
                raise UserError(
                    f"{path} does not restore ({short_error(e)}); this does not look like a damaged "
                    "checkpoint, so nothing was moved: fix the cause and run again"
                ) from None
            warn(f"warning: skipping checkpoint {path}: it does not restore ({why})")
            _move_aside(ckpt_dir, step, warn)
            moved.append(step)
            mngr.reload()
    where = os.path.join(os.path.dirname(ckpt_dir), CORRUPT_DIR)
    raise UserError(
        f"no checkpoint in {ckpt_dir} restores: steps {', '.join(map(str, moved))} are damaged and were "
        f"moved to {where}; inspect them, then remove {where} to start this run afresh"
    )


def _move_aside(ckpt_dir: str, step: int, warn) -> None:
    """Moves a broken step out of the way (to workdir/corrupt_checkpoints/) rather than deleting it."""
    if jax.process_index() != 0:
        return
    aside = os.path.join(os.path.dirname(ckpt_dir), CORRUPT_DIR, f"{step}-{int(time.time())}")
    os.makedirs(os.path.dirname(aside), exist_ok=True)
    shutil.move(os.path.join(ckpt_dir, str(step)), aside)
    warn(f"warning: moved {os.path.join(ckpt_dir, str(step))} to {aside}")


def move_aside_unreadable(workdir: str, readable: list[int], warn=print) -> None:
    """Moves step directories whose metadata did not read (not in `readable`) out of the way."""
    ckpt_dir = checkpoint_dir(workdir)
    for step in steps_on_disk(ckpt_dir):
        if step not in readable:
            _move_aside(ckpt_dir, step, warn)


def read_newest(ckpt_dir: str, step: int | None, read, warn=print):
    """(step, read(step dir)) of checkpoint `step`, or without one of the newest step that reads.

    Read-only. A damaged newer step is skipped with a warning naming it; a damaged explicit step,
    or a failure that is not damage, raises UserError in one line.
    """
    steps = steps_on_disk(ckpt_dir)
    if not steps:
        raise UserError(f"no checkpoint found in {ckpt_dir}")
    if step is not None and step not in steps:
        raise UserError(f"{ckpt_dir}: no step {step} (have {', '.join(map(str, sorted(steps)))})")
    for candidate in [step] if step is not None else steps:
        path = os.path.join(ckpt_dir, str(candidate))
        try:
            return candidate, read(path)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - sorted into damage and the rest just below
            why = damage(e)
            if why is None:
                raise UserError(f"{path}: cannot read it ({short_error(e)})") from None
            if step is not None:
                raise UserError(f"{path} is partial or corrupted ({why}); choose another --step") from None
            warn(f"warning: skipping checkpoint {path}: partial or corrupted ({why})")
    raise UserError(f"{ckpt_dir}: every checkpoint is partial or corrupted (see the warnings above)")


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


_ABSENT = object()


def _lookup(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config.get(part, _ABSENT) if isinstance(config, dict) else _ABSENT
    return config


def _identity(config: dict, key: str):
    """`key`'s value as far as it shapes the run; _ABSENT where a run saved before the key existed."""
    if key == "data.eval_fraction" and _lookup(config, "data.eval_files") not in ("", None, _ABSENT):
        return None  # held-out files replace the hashed held-out fraction, which is then unused
    return _lookup(config, key)


def check_same_run(saved_config: dict, config, where: str) -> None:
    """A workdir whose checkpoints were made with other data or seeds holds another run: refuse it."""
    now = config.to_dict()
    diffs = [
        f"{k}: saved {_identity(saved_config, k)!r}, now {_identity(now, k)!r}"
        for k in RUN_IDENTITY
        # A key the saved config lacks was added later; its default is what that run used.
        if _identity(saved_config, k) is not _ABSENT and _identity(saved_config, k) != _identity(now, k)
    ]
    if diffs:
        raise UserError(
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
    return ocp.PyTreeCheckpointer().metadata(os.path.join(step_dir, STATE)).item_metadata.tree


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
        return ocp.PyTreeCheckpointer().restore(
            os.path.join(step_dir, STATE),
            args=ocp.args.PyTreeRestore(
                item={"params": params_md}, restore_args={"params": restore_args}, partial_restore=True
            ),
        )["params"]

    _, params = read_newest(*_locate(path, step), read, warn=_stderr)
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
    try:
        with np.load(path) as npz:
            have = {k: npz[k].shape for k in npz.files}  # reads each member once; the file stays small
    except (OSError, ValueError, EOFError, AttributeError, zipfile.BadZipFile) as e:
        # np.load takes any other file for a pickle or .npy (AttributeError: no `with` on an array).
        raise UserError(
            f"config.init_from={path} is not a readable .npz of parameters (python -m gspmd_tp.checkpoint "
            f"export writes one): {short_error(e)}"
        ) from None
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


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def info(path: str, step: int | None = None) -> str:
    """A human-readable summary of the checkpoints under `path` (workdir, checkpoints dir or step)."""
    ckpt_dir, step = _locate(path, step)

    def read(step_dir):
        with open(os.path.join(step_dir, DATA, "metadata")) as f:
            return read_step_meta(step_dir), _state_tree_metadata(step_dir), json.load(f)

    step, (meta, tree, data_state) = read_newest(ckpt_dir, step, read, warn=_stderr)
    step_dir = os.path.join(ckpt_dir, str(step))
    steps = sorted(steps_on_disk(ckpt_dir))

    def nbytes(t):
        leaves = [m for m in jax.tree.leaves(t) if hasattr(m, "shape")]
        return sum(int(np.prod(m.shape)) * np.dtype(m.dtype).itemsize for m in leaves), leaves

    param_bytes, param_leaves = nbytes(tree["params"])
    opt_bytes, _ = nbytes(tree["opt_state"])
    n_params = sum(int(np.prod(m.shape)) for m in param_leaves)
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
