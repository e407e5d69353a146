"""A run's checkpoint directory as files: its step directories, their JSON metadata, which of them
read, and the damaged ones named and set aside (to workdir/corrupt_checkpoints/, never deleted).

Which directories are steps is orbax's answer (its standard step name format), the same that its
CheckpointManager gives; orbax is imported where the steps are listed, not at import, so the readers
that only parse flags stay light. Reading a step's arrays is the caller's (store.py, tool.py).
The run directory may be local or in a bucket: every path goes through paths.of (etils.epath).
"""

from __future__ import annotations

import json
import os
import re
import time

from gspmd_tp.job.errors import UserError
from gspmd_tp.storage import paths

STATE, DATA, META = "state", "data", "meta"  # the items of every step


def checkpoint_dir(workdir: str) -> str:
    """Where a run's checkpoints live."""
    return os.path.join(paths.absolute(workdir), "checkpoints")


CORRUPT_DIR = "corrupt_checkpoints"
# Tensorstore status codes that say a checkpoint's bytes are missing or cut short. The others
# (PERMISSION_DENIED, RESOURCE_EXHAUSTED, UNAVAILABLE, ...) say nothing against the checkpoint.
_MISSING_CODES = ("NOT_FOUND", "OUT_OF_RANGE", "DATA_LOSS")
# These two also cover requests that were wrong; only with a decoding failure do they mean damage.
_DECODE_CODES = ("FAILED_PRECONDITION", "INVALID_ARGUMENT")
_DECODE_WORDS = ("corrupt", "decod", "decompress", "checksum", "truncated")
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


class DamagedElsewhere(Exception):
    """Another process of a multi-process job found a checkpoint's files damaged (its own warning
    names them): every process skips that checkpoint alike."""


def damage(e: BaseException) -> str | None:
    """`short_error(e)` where `e` shows that a checkpoint's files are missing, cut short or garbled;
    None where it may have another cause (permissions, memory, a flaky file system, a bug)."""
    for cause in _causes(e):
        if isinstance(cause, DamagedElsewhere):
            return str(cause)
        if isinstance(cause, (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError)):
            return short_error(cause)
        # Tensorstore's Python errors carry their absl status code only as the text's first word.
        text = str(cause)
        code = text.split(":", 1)[0]
        if code in _MISSING_CODES or (
            code in _DECODE_CODES and any(w in text.lower() for w in _DECODE_WORDS)
        ):
            return short_error(cause)
    return None


def steps_on_disk(ckpt_dir: str) -> list[int]:
    """The finished steps in `ckpt_dir`, newest first, as orbax's CheckpointManager lists them (its
    standard name format's find_all): on local disk a step is a directory `N` (a save in progress or cut
    short is still `N.orbax-checkpoint-tmp-*`); in a bucket, where orbax does not rename, one holding
    orbax's commit_success.txt, which it writes last. Neither kind of unfinished save is a step here;
    the run's manager removes them (cleanup_tmp_directories). A finished step whose files were damaged
    afterwards is listed: reading it tells (damage)."""
    from orbax.checkpoint import path as ocp_path  # here only: jax and orbax are slow to import

    if not paths.of(ckpt_dir).is_dir():
        return []
    found = ocp_path.step.standard_name_format().find_all(paths.of(ckpt_dir))
    return sorted((m.step for m in found), reverse=True)


def _listing(directory: str) -> list[str]:
    """The names in `directory`; none where it does not exist."""
    d = paths.of(directory)
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def _is_step_dir(path: str) -> bool:
    """Whether `path` is one step of a checkpoints directory (finished, partial or damaged)."""

    def has(name: str) -> bool:
        return paths.of(os.path.join(path, name)).exists()

    # Not `data` alone: a run directory named 1 may hold the user's data/.
    named = os.path.basename(path).isdigit() and paths.of(path).is_dir()
    return named and (has("_CHECKPOINT_METADATA") or (has(STATE) and has(META)))


def check_workdir_given(workdir: str, flag: str = "--workdir") -> None:
    """Raises UserError where `workdir` is a run's checkpoints directory or one of its steps rather
    than the run's directory (the checkpoint tool takes those): a run started there would write its
    own checkpoints, metrics and lock inside the other run's, and a reader would find nothing.
    A bucket URL's bucket is checked first (paths.check_bucket)."""
    paths.check_bucket(workdir, flag)
    path = paths.absolute(workdir)
    parent = os.path.dirname(path)
    if paths.of(path).is_file():
        raise UserError(f"{flag}={workdir} is a file, not a run's directory")
    if _is_step_dir(path):
        run = os.path.dirname(parent)
        raise UserError(
            f"{flag}={workdir} is step {os.path.basename(path)} of the checkpoints of {run}, not a run's "
            f"directory; pass {flag}={run} (--step={os.path.basename(path)} reads that step)"
        )
    if any(_is_step_dir(os.path.join(path, str(step))) for step in steps_on_disk(path)):
        raise UserError(
            f"{flag}={workdir} is the checkpoints directory of {parent}, not a run's directory; "
            f"pass {flag}={parent}"
        )


def read_step_meta(step_dir: str) -> dict:
    """The meta item of a step, read as plain JSON; raises if the step is partial."""
    # orbax writes commit_success.txt last inside each finished item on file systems without
    # atomic rename; on local disks a missing item file means someone removed or truncated it.
    step = paths.of(step_dir)
    for item in (STATE, DATA, META):
        if not (step / item).is_dir():
            raise FileNotFoundError(f"item {item!r} is missing")
    if not (step / STATE / "_METADATA").is_file():
        raise FileNotFoundError("state/_METADATA is missing")
    meta = json.loads((step / META / "metadata").read_text())
    if not isinstance(meta, dict):
        raise json.JSONDecodeError("not a JSON object", "", 0)
    return meta


def _corrupt_steps(workdir: str) -> list[str]:
    return _listing(os.path.join(paths.absolute(workdir), CORRUPT_DIR))


def _why_damaged(e: Exception, path: str) -> str:
    """damage(e); where `e` says nothing against the checkpoint at `path`, UserError instead."""
    why = damage(e)
    if why is None:
        raise not_damage(e, path) from None
    return why


def not_damage(e: Exception, path: str) -> UserError:
    """The error to raise for `e`, a failure to read the checkpoint at `path` that says nothing
    against the checkpoint itself (permissions, memory, storage)."""
    return UserError(
        f"{path} does not read ({short_error(e)}); this does not look like a damaged checkpoint, so "
        "nothing was skipped or moved: fix the cause and run again"
    )


def first_that_reads(ckpt_dir: str, steps: list[int], read, warn=print, on_damage=None):
    """(step, read(step directory)) of the first of `steps` that reads; None where every one is damaged.

    A step whose files are missing, cut short or garbled is named through `warn` and handed to
    `on_damage`. A UserError from `read` is raised as it is; any other failure raises UserError naming
    the step: it says nothing against the checkpoint, so no step after it is tried.
    """
    for step in steps:
        path = os.path.join(ckpt_dir, str(step))
        try:
            return step, read(path)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - sorted into damage and the rest by _why_damaged
            warn(f"warning: skipping checkpoint {path}: partial or corrupted ({_why_damaged(e, path)})")
            if on_damage is not None:
                on_damage(step)
    return None


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
        except Exception as e:  # noqa: BLE001 - sorted into damage and the rest by _why_damaged
            warn(f"warning: skipping checkpoint {path}: partial or corrupted ({_why_damaged(e, path)})")
            damaged.append(step)
    if found:
        return found
    if damaged:
        raise UserError(
            f"{ckpt_dir} holds no complete checkpoint (steps {', '.join(map(str, damaged))} are partial or "
            f"corrupted; nothing was moved): repair them, or remove {ckpt_dir} to start this run afresh"
        )
    aside = os.path.join(os.path.dirname(ckpt_dir), CORRUPT_DIR)
    if _listing(aside):
        raise UserError(
            f"{aside} holds checkpoints moved aside as damaged ({', '.join(_listing(aside))}) and "
            f"{ckpt_dir} none: inspect them, then move a repaired one back to {ckpt_dir}/STEP, or remove "
            f"{aside} to start this run afresh"
        )
    return found


def move_aside(ckpt_dir: str, step: int, warn=print) -> None:
    """Moves a damaged step out of the way (to workdir/corrupt_checkpoints/) rather than deleting it:
    a later save of that step does not collide with it, and it stays for inspection. Process 0 moves;
    every process returns once it has, so none lists the steps before the move."""
    import jax  # here only: listing and reading steps must not start jax

    from gspmd_tp.job import distributed

    if jax.process_index() == 0:
        aside = os.path.join(os.path.dirname(ckpt_dir), CORRUPT_DIR, f"{step}-{int(time.time())}")
        paths.of(os.path.dirname(aside)).mkdir(parents=True, exist_ok=True)
        paths.move(os.path.join(ckpt_dir, str(step)), aside)
        warn(f"warning: moved {os.path.join(ckpt_dir, str(step))} to {aside}")
    distributed.barrier()


def move_aside_unreadable(workdir: str, readable: list[int], warn=print) -> None:
    """Moves step directories whose metadata did not read (not in `readable`) out of the way."""
    ckpt_dir = checkpoint_dir(workdir)
    for step in steps_on_disk(ckpt_dir):
        if step not in readable:
            move_aside(ckpt_dir, step, warn)


def read_newest(ckpt_dir: str, step: int | None, read, warn=print):
    """(step, read(step dir)) of checkpoint `step`, or without one of the newest step that reads.

    Read-only. A damaged newer step is skipped with a warning naming it; a damaged explicit step,
    or a failure that is not damage, raises UserError in one line.
    """
    steps = steps_on_disk(ckpt_dir)
    if not steps:
        raise UserError(f"no checkpoint found in {ckpt_dir}")
    if step is None:
        hit = first_that_reads(ckpt_dir, steps, read, warn)
        if hit is None:
            raise UserError(f"{ckpt_dir}: every checkpoint is partial or corrupted (see the warnings above)")
        return hit
    if step not in steps:
        raise UserError(f"{ckpt_dir}: no step {step} (have {', '.join(map(str, sorted(steps)))})")
    path = os.path.join(ckpt_dir, str(step))
    try:
        return step, read(path)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a step asked for by number is read or refused, never skipped
        why = _why_damaged(e, path)
        raise UserError(f"{path} is partial or corrupted ({why}); choose another --step") from None
