"""The checkpoint tool, python -m gspmd_tp.checkpoint info DIR | export DIR OUT.npz (see main()):
a run's checkpoints described and their parameters written to one unsharded .npz, read on the host
with no mesh; and that .npz read back onto a mesh (import_params: config.init_from).
"""

from __future__ import annotations

import json
import os
import sys
import zipfile

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import flags, logging

from gspmd_tp.checkpoint import store
from gspmd_tp.checkpoint.step_dirs import (
    DATA,
    STATE,
    checkpoint_dir,
    read_newest,
    read_step_meta,
    short_error,
    steps_on_disk,
)
from gspmd_tp.cli.arguments import parse_command_flags
from gspmd_tp.job.errors import UserError, interrupted, warn
from gspmd_tp.model.params import path_str
from gspmd_tp.storage import outputs, paths

# --- one unsharded file of parameters: export and import ---


def _flat(tree) -> dict:

    return {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _locate(path: str, step: int | None) -> tuple[str, int | None]:
    """(checkpoints dir, step or None for the newest) for a workdir, its checkpoints dir or one step dir."""
    paths.check_bucket(path, "DIR")
    path = paths.absolute(path)
    name = os.path.basename(path)
    if paths.of(path).is_file():
        raise UserError(f"{path} is a file, not a run's directory, its checkpoints or one of their steps")
    if name.isdigit() and paths.of(path).is_dir() and not steps_on_disk(path):
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
    metadata = ocp.PyTreeCheckpointer().metadata(paths.of(os.path.join(step_dir, STATE))).item_metadata
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
        with store.quiet_after_a_failed_read():
            return ocp.PyTreeCheckpointer().restore(
                paths.of(os.path.join(step_dir, STATE)),
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
    if not paths.of(path).is_file():
        raise UserError(f"config.init_from: no file {path}")
    not_npz = (
        f"config.init_from={path} is not a readable .npz of parameters "
        "(python -m gspmd_tp.checkpoint export writes one)"
    )
    with paths.of(path).open("rb") as f:  # read in ranges where it is in a bucket
        is_zip = zipfile.is_zipfile(f)
    if not is_zip:  # np.load would take it for a pickle, and suggest loading it unsafely
        raise UserError(f"{not_npz}: not a zip archive")
    try:
        have, non_finite = {}, []
        with paths.of(path).open("rb") as f, np.load(f) as npz:
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

        with paths.of(path).open("rb") as f, np.load(f) as npz:  # one parameter on the host at a time
            value = npz[path_str(key_path)].astype(target.dtype)
        return jax.make_array_from_callback(value.shape, target.sharding, lambda idx: value[idx])

    return jax.tree_util.tree_map_with_path(place, abstract_params)


# --- the command-line tool ---


def _size(path: str) -> int:
    if paths.is_url(path):
        import fsspec

        fs, _ = fsspec.core.url_to_fs(path)
        return sum(info["size"] for info in fs.find(path, detail=True).values())
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def info(path: str, step: int | None = None) -> str:
    """A human-readable summary of the checkpoints under `path` (workdir, checkpoints dir or step)."""
    ckpt_dir, step = _locate(path, step)

    def read(step_dir):
        data_state = json.loads(paths.of(os.path.join(step_dir, DATA, "metadata")).read_text())
        return read_step_meta(step_dir), _state_tree_metadata(step_dir), data_state

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


FLAGS = flags.FlagValues()  # the command's own: train.py imports this module (import_params)
flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).", flag_values=FLAGS)
_PROG = "python -m gspmd_tp.checkpoint"
_USAGE = f"{_PROG} info DIR | export DIR OUT.npz [--step=N]"
_COMMANDS = {"info": ("DIR",), "export": ("DIR", "OUT.npz")}  # their positional arguments


def main(argv: list[str] | None = None) -> int:
    """python -m gspmd_tp.checkpoint {info DIR | export DIR OUT.npz} [--step=N]; `argv` is the
    command's arguments (default: sys.argv[1:]). Returns the exit status."""
    args = parse_command_flags(FLAGS, [_PROG, *(sys.argv[1:] if argv is None else argv)], __doc__)[1:]
    command, given = (args[0], [paths.expand(a) for a in args[1:]]) if args else (None, [])
    if command not in _COMMANDS or len(given) != len(_COMMANDS[command]):
        if command not in _COMMANDS:
            mistake = f"unknown command {command!r}; " if command else ""
        else:
            mistake = f"{command} takes {' '.join(_COMMANDS[command])} ({len(given)} given); "
        print(f"error: {mistake}usage: {_USAGE}", file=sys.stderr)
        sys.exit(1)
    # orbax warns, for every healthy step, that a lone item has no checkpoint-level metadata file.
    logging.set_verbosity(logging.ERROR)
    try:
        if command == "info":
            print(info(given[0], FLAGS.step))
        else:
            path, out = given
            outputs.check_file(out, "OUT", probe=True)
            shapes = export_params(path, out, FLAGS.step)
            n = sum(int(np.prod(s)) for s in shapes.values())
            print(f"wrote {len(shapes)} parameters ({n:,} values) to {out}")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return interrupted("nothing written" if command == "info" else f"OUT={given[1]} is as it was")
    return 0
