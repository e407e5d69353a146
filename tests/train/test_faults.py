"""Faults: stop signals, SIGKILL during an async save, corrupted checkpoints, NaN/Inf, mismatches."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import child_env, small_config
from test_train_cli import ROOT, SMALL

from gspmd_tp.checkpoint import step_dirs, store, tool
from gspmd_tp.job import distributed, signals
from gspmd_tp.job.errors import JobError, UserError
from gspmd_tp.storage import lock
from gspmd_tp.train import faults, loop, optimizer

# On one device, which compiles in two thirds of the time 8 take; what the processes show is the same.
RUN_FOREVER = ["--config.steps=100000", "--config.log_every=1", "--config.eval_every=100000"]
RUN_FOREVER += ["--config.host_device_count=1", "--config.mesh=dp=1,mp=1"]


def start(workdir, *flags):
    """train.py as a child process, its output line by line on .stdout."""
    env = child_env()
    cmd = [sys.executable, "train.py", "--config=configs/tiny.py", f"--workdir={workdir}", *SMALL, *flags]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1
    )


def wait_for(proc, pattern, timeout=120):
    """Reads stdout until a line matches `pattern`; returns the lines read."""
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if re.search(pattern, line):
            return lines
    proc.kill()
    raise AssertionError(f"never printed {pattern!r}: {''.join(lines)[-2000:]} {proc.stderr.read()[-2000:]}")


def test_a_stop_signal_before_training_begins_is_one_line(tmp_path):
    """Ctrl-C here; SIGTERM: test_multiprocess.py, on one process of a job and on every one."""
    workdir = tmp_path / "new"
    proc = start(workdir, *RUN_FOREVER)
    wait_for(proc, r"^gspmd_tp: .* parameters")  # then the data is read and the step compiled
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, (out[-1000:], err[-2000:])
    assert (
        err.strip().splitlines()[-1] == "stopped by Ctrl-C before training began; no checkpoint was written"
    )
    # The workdir this run created held only its lock: removed, as a run that fails early removes it.
    assert "Traceback" not in err and not workdir.exists()


def test_in_a_multi_process_job_every_process_reads_the_signals_one_check_later(monkeypatch):
    """Each check starts the all-reduce of the processes' signals and reads the previous one's, so
    the host never waits for the step it just dispatched; here one process poses as process 0 of 2."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # the one jax module everywhere
    with signals.StopSignal(lambda msg: None) as stop:
        assert not stop.requested()  # nothing shared before
        signal.raise_signal(signal.SIGTERM)
        assert not stop.requested()  # reads the check before the signal; shares it
        assert stop.requested()
        assert stop.stopped_by == "SIGTERM on process 0"
        assert stop.requested()  # and stays stopped, sharing nothing more


def test_a_signal_after_the_job_agreed_on_a_peers_stop_keeps_the_peers_reason(monkeypatch):
    """Process 1's SIGTERM is read at a check, then this process gets a SIGINT before the step
    boundary (a preemption signals every host): the run stops as agreed, named by the signal that
    stopped it on every process, and says so; before, the SIGINT renamed the stop on this process."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(distributed, "read", lambda shared: np.array([[0], [int(signal.SIGTERM)]]))
    logged = []
    with signals.StopSignal(logged.append) as stop:
        assert not stop.requested()  # nothing shared before
        assert stop.requested() and stop.stopped_by == "SIGTERM on process 1"
        signal.raise_signal(signal.SIGINT)
        assert stop.stopped_by == "SIGTERM on process 1"
        assert logged == [
            "received SIGINT: already stopping at the next step boundary, by SIGTERM on process 1 "
            "(send again to exit at once)"
        ]


# The main thread inside one long call into C (as in a step or a save): Python runs the handler once,
# after the call, however many signals came meanwhile.
BUSY_IN_C = """
import sys, numpy as np
from gspmd_tp.job import signals
with signals.StopSignal(print) as stop:
    a = np.random.default_rng(0).random((1600, 1600))
    print("busy", flush=True)
    np.linalg.svd(a)
    print("stop requested:", stop.requested(), flush=True)
"""


def test_a_second_signal_while_the_first_waits_to_be_handled_still_exits_at_once():
    """A second signal exits at once, without saving; here in the hardest case, which a run's save or
    step (one long call into C) poses."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", BUSY_IN_C], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "busy\n"
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, (out, err[-2000:])
    assert "received SIGINT again: exiting at once without saving" in err and "stop requested" not in out


def test_sigkill_during_async_save_keeps_the_previous_checkpoint_and_a_stop_signal_saves(tmp_path):
    """Killed while a save is half written, the run resumes from the save before; then a stop
    signal saves at the step boundary and exits 0 (both starts compile the same step)."""
    proc = start(tmp_path, *RUN_FOREVER, "--config.checkpoint_every=2")
    ckpt = tmp_path / "checkpoints"
    deadline = time.time() + 240
    while time.time() < deadline:
        names = os.listdir(ckpt) if ckpt.is_dir() else []
        if any(n.isdigit() for n in names) and any("tmp" in n for n in names):
            proc.kill()  # SIGKILL while a save is half written
            break
        time.sleep(0.002)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    names = os.listdir(ckpt)
    assert any("tmp" in n for n in names), names  # the kill did land inside a save
    kept = {n for n in names if n.isdigit()}
    newest = max(int(n) for n in kept)

    proc = start(tmp_path, *RUN_FOREVER, "--config.checkpoint_every=100000")
    said = "".join(wait_for(proc, rf"step +{newest + 2}/"))
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert f"resumed from step {newest}" in said
    stopped = re.search(r"stopped by SIGTERM after step (\d+): checkpoint saved", out)
    assert stopped, out[-2000:]
    # The one checkpoint the run added is the one the signal asked for, complete; the half-written
    # save was cleaned up.
    names = set(os.listdir(ckpt))
    assert names - kept == {stopped[1]} and not [n for n in names if "tmp" in n], names
    assert (ckpt / stopped[1] / "state" / "_METADATA").is_file()


# --- in-process runs on one trained workdir ---


@pytest.fixture(scope="module")
def trained(trained_workdir):
    """A finished 4-step run with checkpoints at steps 2 and 4: the session's shared one (the tests
    copy it before changing anything, or check that nothing in it changed)."""
    assert sorted(os.listdir(trained_workdir / "checkpoints")) == ["2", "4"]
    return trained_workdir


def _tree(path: Path) -> dict:
    """Each path under `path` and when it was last written; the lock file, which every start
    rewrites with its pid, left out."""
    return {str(p): p.stat().st_mtime_ns for p in path.rglob("*") if p.name != lock.LOCK}


def _garble_arrays(step_dir: Path):
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(b"\0garbage" * 16)


def flip_bytes(step_dir: Path):
    """Damages the compressed array chunks in place: orbax then raises a bare Exception around
    tensorstore's decoding error (with some 60 lines of tensorstore spec in its message)."""
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d" and f.stat().st_size > 10_000:
            data = bytearray(f.read_bytes())
            for i in range(len(data) // 4, 3 * len(data) // 4, 97):
                data[i] ^= 0xFF
            f.write_bytes(bytes(data))


def _remove_metadata(step_dir: Path):
    (step_dir / "state" / "_METADATA").unlink()


def _remove_a_data_file(step_dir: Path):
    """One file of array chunks gone: tensorstore reads it as a truncated zstd stream."""
    max(
        (f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d"),
        key=os.path.getsize,
    ).unlink()


@pytest.fixture
def workdir(trained, tmp_path) -> Path:
    """A copy of the trained run, to change."""
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def _train_again(workdir, capsys, damage=None) -> str:
    """The run in `workdir`, its step 4 damaged, trained to step 4 again; its stdout."""
    if damage:
        damage(workdir / "checkpoints" / "4")
    capsys.readouterr()
    loop.train(small_config(log_every=1, eval_every=100), str(workdir))
    return capsys.readouterr().out


def _with_step_3(workdir: Path) -> Path:
    """Adds a step 3 to the run in `workdir`, a copy of its step 2: one more checkpoint to damage, so
    that one start skips two damaged steps (each its own way) before resuming from step 2."""
    shutil.copytree(workdir / "checkpoints" / "2", workdir / "checkpoints" / "3")
    return workdir / "checkpoints" / "3"


def _skipped_and_set_aside(workdir: Path, out: str, damaged: dict) -> None:
    """`damaged` ({step: how}) were each skipped with a one-line warning naming the damage alone (no
    tensorstore spec), the run resumed from step 2, and the damaged steps were moved aside, out of the
    way of the step 4 this run saved again."""
    ckpt = workdir / "checkpoints"
    for step, how in damaged.items():
        warning = [
            line
            for line in out.splitlines()
            if line.startswith(f"warning: skipping checkpoint {ckpt / step}: ")
        ]
        assert len(warning) == 1 and len(warning[0]) < 600, (how, out[-3000:])
    assert "tensorstore_spec" not in out and "TensorStore({" not in out
    assert "resumed from step 2" in out and "nothing to do" not in out, out[-3000:]
    aside = sorted(p.name.partition("-")[0] for p in (workdir / "corrupt_checkpoints").iterdir())
    assert aside == sorted(damaged), aside
    assert sorted(os.listdir(ckpt)) == ["2", "4"]
    assert (ckpt / "4" / "state" / "_METADATA").is_file()


def test_damaged_newest_checkpoints_are_skipped_and_a_signal_at_the_end_waits_for_the_last_save(
    workdir, capsys, monkeypatch
):
    """Step 4 partial (its metadata gone), step 3 corrupted (garbled arrays): both skipped. A SIGTERM
    once the loop is over, the last step's save in flight, waits for that save."""
    original = signals.StopSignal.finishing

    def signalled(stop):
        original(stop)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(signals.StopSignal, "finishing", signalled)
    _garble_arrays(_with_step_3(workdir))
    _remove_metadata(workdir / "checkpoints" / "4")
    capsys.readouterr()
    last = loop.train(small_config(log_every=1, eval_every=100), str(workdir))
    out = capsys.readouterr().out
    assert "received SIGTERM while the run finishes: it exits once its last checkpoint is written" in out
    assert last["step"] == 4 and "stopped" not in last and "done: metrics in" in out
    _skipped_and_set_aside(workdir, out, {"4": "partial", "3": "corrupted"})


def test_a_finished_run_whose_last_checkpoints_are_damaged_trains_its_last_steps_again(
    workdir, capsys, monkeypatch
):
    """Not "nothing to do": the newest step is read before the run says so, and only then (a read
    of every array of a large model's checkpoint takes minutes). Step 4's compressed chunks flipped
    (orbax's error carries some 60 lines of tensorstore spec), step 3's largest data file gone."""
    reads, original = [], store._restore_step
    monkeypatch.setattr(store, "_restore_step", lambda d, a: reads.append(d.name) or original(d, a))
    _remove_a_data_file(_with_step_3(workdir))
    out = _train_again(workdir, capsys, damage=flip_bytes)
    assert reads == ["4", "3", "2"]
    assert f"warning: skipping checkpoint {workdir / 'checkpoints' / '4'}: partial or corrupted (" in out
    _skipped_and_set_aside(workdir, out, {"4": "flipped bytes", "3": "data file gone"})


# A failed read, then a read that succeeds (the next older step), then what the failed read left in
# flight ending: an orbax coroutine collected unfinished, and asyncio's never-retrieved task.
LEFTOVERS_AFTER_A_LATER_SUCCESS = """
import inspect, logging, sys, types
from orbax.checkpoint._src.serialization import serialization
from gspmd_tp.checkpoint import store as checkpoint
try:
    with checkpoint.quiet_after_a_failed_read():
        raise ValueError("step 4 does not read")
except ValueError:
    pass
with checkpoint.quiet_after_a_failed_read():
    pass  # step 2 reads
read = serialization._read_array_index_and_device_put
kwargs = [p.name for p in inspect.signature(read).parameters.values() if p.kind == p.KEYWORD_ONLY]
orphan = read(None, None, None, **dict.fromkeys(kwargs))  # a coroutine object, never run
sys.unraisablehook(types.SimpleNamespace(
    exc_type=Exception, exc_value=Exception("reading array index"), exc_traceback=None,
    err_msg="Exception ignored in", object=orphan))
orphan.close()
logging.getLogger("asyncio").error("Task exception was never retrieved")
print("done", flush=True)
"""


def test_what_a_failed_read_left_in_flight_stays_unprinted_after_a_later_read_succeeds():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, "-c", LEFTOVERS_AFTER_A_LATER_SUCCESS]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "done\n", out.stderr[-2000:]
    assert out.stderr == ""


@pytest.mark.parametrize(
    "change, messages",
    [
        (
            {"model.d_model": 128},
            [
                r"different model \(d_model: saved 64, now 128",
                r"embedding saved \(256, 64\), now \(256, 128\)",
                r"layers/attn/qkv saved \(2, 64, 8, 4, 8\), now \(2, 128, 8, 4, 8\)",
            ],
        ),
        ({"data.seed": 1}, [r"holds another run \(data\.seed: saved 0, now 1"]),
        # The held-out split decides which documents are trained on.
        ({"data.eval_fraction": 0.5}, [r"holds another run \(data\.eval_fraction: saved 0\.05, now 0\.5"]),
        (
            {"data.eval_files": "held_out.txt"},
            [
                r"holds another run \(data\.eval_files: saved '', now '/.*held_out\.txt'; "
                r"data\.eval_fraction: saved 0\.05, now unused \(data\.eval_files given\)\)"
            ],
        ),
    ],
    ids=["model", "data.seed", "data.eval_fraction", "data.eval_files"],
)
def test_another_model_or_run_is_refused_before_anything_is_written(trained, tmp_path, change, messages):
    if "data.eval_files" in change:
        (tmp_path / "held_out.txt").write_text("held-out text " * 100)
        change = {"data.eval_files": str(tmp_path / "held_out.txt")}
    before = _tree(trained)
    with pytest.raises(UserError) as e:
        loop.train(small_config(steps=6, **change), str(trained))
    assert all(re.search(m, str(e.value)) for m in messages) and "\n" not in str(e.value), str(e.value)
    assert _tree(trained) == before


def test_other_eval_fraction_with_the_same_eval_files_is_the_same_run():
    """With held-out files the fraction is unused: changing it changes nothing. Without them the
    same change is another run."""
    saved = small_config(**{"data.eval_files": "held_out.txt"}).to_dict()
    now = small_config(**{"data.eval_files": "held_out.txt", "data.eval_fraction": 0.5})
    assert store.check_same_run(saved, now, "run") is None
    del saved["data"]["eval_files"]  # a run saved before the key existed used its default
    assert store.check_same_run(saved, small_config(), "run") is None
    with pytest.raises(
        JobError, match=r"^run holds another run \(data\.eval_fraction: saved 0\.05, now 0\.5\)"
    ):
        store.check_same_run(saved, small_config(**{"data.eval_fraction": 0.5}), "run")


def test_data_files_are_saved_absolute_and_one_file_spelled_two_ways_is_one_run(
    tmp_path, monkeypatch, capsys
):
    (tmp_path / "data").mkdir()
    for i in range(40):
        (tmp_path / "data" / f"doc{i}.txt").write_text(f"document {i} " * 40)
    monkeypatch.chdir(tmp_path)
    data = lambda files: {"checkpoint_every": 4, "data.train_files": files, "data.eval_fraction": 0.5}  # noqa: E731
    loop.train(small_config(**data("data/*.txt")), "run")  # the step compiled as the trained run's
    (meta,) = [m for _, m in step_dirs.readable_checkpoints(str(tmp_path / "run"))]
    assert meta["config"]["data"]["train_files"] == f"{tmp_path}/data/*.txt"
    monkeypatch.chdir(tmp_path / "data")  # the same files, spelled from another directory
    capsys.readouterr()
    assert loop.train(small_config(**data("./*.txt")), "../run")["step"] == 4  # nothing left to train
    assert "nothing to do: the newest checkpoint is at step 4" in capsys.readouterr().out
    message = r"data\.train_files: saved '.*/data/\*\.txt', now '.*/data/doc1\*\.txt'"
    with pytest.raises(UserError, match=message):
        loop.train(small_config(steps=5, **data("doc1*.txt")), "../run")


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda w: (w / "checkpoints").write_text(""),
            r"--workdir's checkpoints=.*/checkpoints: .* is a file",
        ),
        (lambda w: (w / "metrics.jsonl").mkdir(), r"--workdir's metrics=.*/metrics\.jsonl: is a directory"),
        (
            lambda w: (w / "metrics_replaced.jsonl").mkdir(),
            r"--workdir's replaced metrics=.*/metrics_replaced\.jsonl: is a directory",
        ),
        (
            lambda w: (w / "tensorboard").write_text(""),
            r"--workdir's tensorboard=.*: .* is a file, not a directory",
        ),
    ],
    ids=["checkpoints", "metrics", "replaced-metrics", "tensorboard"],
)
def test_what_the_run_writes_in_its_workdir_is_checked_before_compiling(tmp_path, monkeypatch, make, message):
    workdir = tmp_path / "run"
    workdir.mkdir()
    make(workdir)
    monkeypatch.setattr(loop.step_lib, "compile_train_step", lambda s: pytest.fail("compiled"))
    with pytest.raises(UserError, match=message):
        loop.train(small_config(), str(workdir))


def test_a_read_failure_that_is_not_damage_moves_nothing(workdir, monkeypatch):

    def unreadable(*_):
        raise PermissionError(13, "Permission denied", str(workdir / "checkpoints" / "4" / "state"))

    monkeypatch.setattr(store, "_restore_step", unreadable)
    with pytest.raises(UserError) as e:
        loop.train(small_config(), str(workdir))
    message = str(e.value)
    assert "does not look like a damaged checkpoint, so nothing was skipped or moved" in message
    assert "PermissionError: [Errno 13] Permission denied" in message and "\n" not in message
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
    assert not (workdir / "corrupt_checkpoints").exists()


# --- a multi-process job: every process goes on from the same step, here posed by one process ---


def _peer_answers(monkeypatch, *answers):
    """Poses as process 0 of 2: each call of every_process gets the next answer as process 1's
    values (None: the same as this process's)."""
    it = iter(answers)

    def every_process(values):
        peer = next(it)
        return [list(values), list(values) if peer is None else peer]

    monkeypatch.setattr(store.distributed, "every_process", every_process)


@pytest.mark.parametrize(
    "answers, why",
    [
        # A shard only process 1 reads: process 0, which read step 4, goes back to step 2 as well.
        (
            (None, [store._DAMAGED], None),
            "partial or corrupted (process 1 of this job could not read its part: see its warning)",
        ),
        # Step 4's metadata: tried by no process, and moved aside before this run saves its own step 4.
        (([2], None), "its metadata does not read on process 1 of this job"),
    ],
    ids=["arrays", "metadata"],
)
def test_a_checkpoint_another_process_cannot_read_is_skipped_by_every_process(
    workdir, monkeypatch, capsys, answers, why
):
    _peer_answers(monkeypatch, *answers)  # the steps listed, then each read's outcome
    out = _train_again(workdir, capsys)
    assert f"warning: skipping checkpoint {workdir / 'checkpoints' / '4'}: {why}\n" in out
    assert "resumed from step 2" in out
    assert [p.name[:2] for p in (workdir / "corrupt_checkpoints").iterdir()] == ["4-"]
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]


@pytest.mark.parametrize(
    "answers, message",
    [
        # Step 4's arrays fail to read on process 1 for a reason other than damage (permissions, say).
        (
            (None, [store._FAILED]),
            "{ckpt}/4 does not read on process 1 of this job (its error says why); nothing was skipped or "
            "moved: fix the cause and run again",
        ),
        # Process 1 reads no step's metadata.
        (
            ([],),
            "{ckpt}: no checkpoint's metadata reads on every process of this job (see the warnings above); "
            "nothing was moved: repair the files or the hosts' view of them and run again",
        ),
        # Process 1 stops with its own one line (no complete checkpoint in its view of the files); this
        # process names it instead of waiting for it in the next collective.
        (
            ([store._UNUSABLE],),
            "{ckpt} cannot be resumed from on process 1 of this job (its error says why); nothing was moved",
        ),
    ],
    ids=["read-failure", "no-step-everywhere", "directory-unusable"],
)
def test_what_another_process_cannot_read_stops_every_process_and_moves_nothing(
    workdir, monkeypatch, answers, message
):
    before = _tree(workdir)
    _peer_answers(monkeypatch, *answers)  # the steps listed, then each read's outcome
    with pytest.raises(JobError) as e:  # every process stops there: none tells the others (train.py)
        loop.train(small_config(), str(workdir))
    assert str(e.value) == message.format(ckpt=workdir / "checkpoints")
    assert _tree(workdir) == before


def test_damage_here_and_a_failure_elsewhere_stop_every_process(workdir, monkeypatch):
    """The worse outcome decides: this process found step 4 damaged, process 1 failed otherwise."""
    flip_bytes(workdir / "checkpoints" / "4")
    _peer_answers(monkeypatch, None, [store._FAILED])
    with pytest.raises(JobError, match=r"/4 does not read on process 1 of this job"):
        loop.train(small_config(), str(workdir))
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]


def test_a_process_that_cannot_use_the_checkpoint_directory_shares_that_before_it_stops(workdir, monkeypatch):
    for step in ("2", "4"):
        _remove_metadata(workdir / "checkpoints" / step)
    shared = []

    def every_process(values):  # process 0 of 2, whose peer reads steps 2 and 4
        shared.append(list(values))
        return [list(values), [4, 2]]

    monkeypatch.setattr(store.distributed, "every_process", every_process)
    with pytest.raises(JobError, match=r"holds no complete checkpoint \(steps 4, 2 are partial or corrupted"):
        loop.train(small_config(), str(workdir))
    assert shared == [[store._UNUSABLE]]


def test_no_checkpoint_that_restores_never_starts_the_run_afresh(workdir):
    for step in ("2", "4"):
        flip_bytes(workdir / "checkpoints" / step)
    with pytest.raises(UserError) as e:
        loop.train(small_config(), str(workdir))
    aside = workdir / "corrupt_checkpoints"
    assert str(e.value) == (
        f"no checkpoint in {workdir / 'checkpoints'} restores: steps 4, 2 are damaged and were moved to "
        f"{aside}; inspect them, then remove {aside} to start this run afresh"
    )
    assert os.listdir(workdir / "checkpoints") == [] and len(os.listdir(aside)) == 2
    # The next start must not quietly begin at step 0 with the run's progress set aside.
    before = _tree(workdir)
    with pytest.raises(
        UserError, match=rf"{aside} holds checkpoints moved aside as damaged \(2-\d+, 4-\d+\)"
    ):
        loop.train(small_config(), str(workdir))
    assert _tree(workdir) == before


def test_only_partial_checkpoints_are_an_error_and_stay_in_place(workdir):
    for step in ("2", "4"):
        _remove_metadata(workdir / "checkpoints" / step)
    before = _tree(workdir)
    with pytest.raises(
        UserError, match=r"holds no complete checkpoint \(steps 4, 2 are partial or corrupted; "
    ):
        loop.train(small_config(), str(workdir))
    assert _tree(workdir) == before


def test_damage_is_told_apart_from_other_read_failures():
    spec = "TensorStore({\n  'driver': 'zarr',\n" + "  'x': 1,\n" * 60 + "})"
    try:
        try:
            raise ValueError(
                'FAILED_PRECONDITION: Error reading "params.x/0.0" in OCDBT database: '
                "ZSTD_decompressStream() failed: Data corruption detected [source locations='a.cc:1']"
            )
        except ValueError:
            raise Exception(f"Encountered error while reading array index: (slice(0, 2, 1),). {spec}")  # noqa: B904
    except Exception as e:  # noqa: BLE001
        wrapped = e
    assert step_dirs.damage(wrapped) == (
        'ValueError: FAILED_PRECONDITION: Error reading "params.x/0.0" in OCDBT database: '
        "ZSTD_decompressStream() failed: Data corruption detected"
    )
    assert step_dirs.damage(ValueError("OUT_OF_RANGE: Error reading byte range [tensorstore_spec='{}']"))
    assert step_dirs.damage(FileNotFoundError("item 'meta' is missing"))
    for other in (
        PermissionError(13, "Permission denied"),
        MemoryError(),
        ValueError("PERMISSION_DENIED: Error opening file"),
        ValueError("UNAVAILABLE: connection reset"),
        ValueError("FAILED_PRECONDITION: generation mismatch"),
    ):
        assert step_dirs.damage(other) is None, other


# --- non-finite values ---

EXPLODE = {
    "optim.lr": 1e30,
    "optim.clip_norm": 1e30,
    "log_every": 1,
    "eval_every": 100,
    "checkpoint_every": 2,
}


# A rate near the top of float32's range times a large decay: step 3's loss and gradient are finite,
# its update is not.
OVERFLOW = {**EXPLODE, "optim.lr": 3e38, "optim.weight_decay": 1e3, "checkpoint_every": 1}


def _at_step_2(workdir) -> Path:
    """The run in `workdir` without its step 4: it resumes from step 2."""
    shutil.rmtree(workdir / "checkpoints" / "4")
    return workdir


def test_a_non_finite_state_is_never_saved_nor_resumed(workdir, tmp_path, monkeypatch):
    """From step 2 at OVERFLOW's rate: step 3's update overflows from a finite loss and gradient
    (never saved, skipping or not), step 4's loss is NaN (the run stops, step 2 survives). A NaN state
    saved before saves were checked (check_state off, as in earlier versions) is not resumed."""
    _at_step_2(workdir)
    ckpt_dir = workdir / "checkpoints"
    overflowed = (
        "non-finite parameters or optimizer state at step 3: an update since step 2 made them NaN or Inf "
        "from a finite loss and gradient; stopped without saving (the newest checkpoint is step 2)"
    )
    with pytest.raises(UserError, match=re.escape(overflowed)):  # checkpoint_every=1: step 3 is due
        loop.train(small_config(**OVERFLOW), str(workdir))
    assert sorted(os.listdir(ckpt_dir)) == ["2"]
    # Skipping steps skips non-finite losses and gradients, not this check (the step is OVERFLOW's).
    nan_state = types.SimpleNamespace(params={"w": np.full(3, np.nan, np.float32)}, opt_state={})
    watch = faults.NonFiniteWatch(True, print, start=2)
    watch.add(3, {"loss": np.float32(2.0), "grad_norm": np.float32(1.0)})  # finite
    with pytest.raises(UserError, match=re.escape(overflowed)):
        watch.check_before_save(3, nan_state, stopping=False)
    with pytest.raises(UserError) as e:  # step 3 is not due: step 4's loss is NaN
        loop.train(small_config(**{**OVERFLOW, "checkpoint_every": 2}), str(workdir))
    assert re.search(r"non-finite (loss|gradient) at step 4 \(loss", str(e.value)), str(e.value)
    assert "the newest checkpoint is step 2" in str(e.value)
    assert os.listdir(ckpt_dir) == ["2"]
    saved = np.load(_export(workdir, 2))
    assert all(np.isfinite(saved[k]).all() for k in saved.files)

    monkeypatch.setattr(faults.NonFiniteWatch, "check_state", lambda *args: None)
    with pytest.raises(UserError, match="non-finite"):  # step 4's loss; step 3 was saved NaN
        loop.train(small_config(**OVERFLOW), str(workdir))
    monkeypatch.undo()
    assert sorted(os.listdir(ckpt_dir)) == ["2", "3"]
    # A resume names the NaN checkpoint and the older one, and moves nothing.
    message = (
        rf"checkpoint step 3 in {ckpt_dir} holds NaN or Inf parameters or optimizer state; every step "
        rf"resumed from it would be NaN: move {ckpt_dir}/3 out of {ckpt_dir} to resume from step 2, with a "
        r"lower config.optim.lr"
    )
    with pytest.raises(UserError, match=message):
        loop.train(small_config(checkpoint_every=1), str(workdir))
    assert sorted(os.listdir(ckpt_dir)) == ["2", "3"]
    shutil.move(ckpt_dir / "3", tmp_path / "3")
    assert loop.train(small_config(checkpoint_every=1), str(workdir))["step"] == 4


def test_skip_nonfinite_steps_keeps_the_old_state(tmp_path):
    skip = {**EXPLODE, "steps": 6, "skip_nonfinite_steps": True}  # steps 3 on are non-finite
    c, every_4_config = small_config(**skip), small_config(**{**skip, "checkpoint_every": 4})
    every_2, every_4 = tmp_path / "every_2", tmp_path / "every_4"
    # A checkpoint interval whose every step was skipped is a diverged run: it stops, saving nothing
    # (the state has not moved; a save would prune an older checkpoint for a copy of it).
    diverged = r"every step since checkpoint {} had a non-finite loss or gradient and was skipped: the run "
    with pytest.raises(
        UserError, match=diverged.format(r"2 \(3\.\.4\)") + r"has diverged; stopped without saving"
    ):
        loop.train(c, str(every_2))
    assert os.listdir(every_2 / "checkpoints") == ["2"]
    with pytest.raises(UserError, match=diverged.format(r"4 \(5\.\.6\)")):
        loop.train(every_4_config, str(every_4))
    at_4 = _rows(every_4)[3]
    assert at_4["step"] == 4 and at_4["skipped_steps"] == 2  # steps 3 and 4
    # Step 4 updated (or would have) at the rate of the optimizer's third update, as step 3 did.
    schedule = optimizer.make_schedule(c.optim, c.steps)
    assert at_4["learning_rate"] == pytest.approx(float(schedule(2)))
    assert float(schedule(2)) != pytest.approx(float(schedule(3)))
    at_2, at_4 = np.load(_export(every_2, 2)), np.load(_export(every_4, 4))
    for k in at_2.files:
        np.testing.assert_array_equal(at_4[k], at_2[k])
    # Resumed, the count goes on from the checkpoint's (steps 5 and 6 are skipped again), until the
    # save of a run that moved nothing since step 4.
    with pytest.raises(UserError, match=diverged.format(r"4 \(5\.\.6\)")):
        loop.train(every_4_config, str(every_4))
    rows = _rows(every_4)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[-1]["skipped_steps"] == 4
    assert os.listdir(every_4 / "checkpoints") == ["4"]


def _rows(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _export(workdir, step):
    out = str(workdir / f"params_{step}.npz")
    tool.export_params(str(workdir), out, step)
    return out


def test_stop_signal_during_evaluation_saves_at_that_step(trained_workdir, tmp_path, monkeypatch, capsys):
    original = loop.evaluate

    def interrupted(*args):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the held-out batches are read
        return original(*args)

    monkeypatch.setattr(loop, "evaluate", interrupted)
    last = loop.train(small_config(checkpoint_every=100), str(tmp_path))
    assert last["stopped"] and last["step"] == 2
    assert "eval_loss" not in last  # cut short, not reported as a full evaluation
    assert os.listdir(tmp_path / "checkpoints") == ["2"]
    monkeypatch.setattr(loop, "evaluate", original)
    # Shortened to the step it stopped at: the first start runs the evaluation and trains nothing;
    # the next has nothing to do (the figure is in metrics.jsonl).
    short = tmp_path.parent / f"{tmp_path.name}_short"
    shutil.copytree(tmp_path, short)
    capsys.readouterr()
    loop.train(small_config(steps=2, eval_every=2, checkpoint_every=100), str(short))
    out = capsys.readouterr().out
    assert "step 2's evaluation, cut short by the stop, done now" in out and "no step left to train" in out
    assert "learning-rate schedule" not in out
    loop.train(small_config(steps=2, eval_every=2, checkpoint_every=100), str(short))
    assert "nothing to do: the newest checkpoint is at step 2" in capsys.readouterr().out
    # The resumed run evaluates step 2 first and adds the figure to step 2's row.
    loop.train(small_config(steps=4, eval_every=2, checkpoint_every=100), str(tmp_path))
    assert "step 2's evaluation, cut short by the stop, done now: eval_loss" in capsys.readouterr().out
    rows = _rows(tmp_path)
    assert [(r["step"], "eval_loss" in r) for r in rows] == [(1, False), (2, True), (3, False), (4, True)]
    # The shared run is this config uninterrupted (its checkpoint_every=2 changes no figure).
    want = _rows(trained_workdir)
    assert want[1]["step"] == 2 and rows[1]["eval_loss"] == pytest.approx(want[1]["eval_loss"], rel=1e-6)


def test_a_second_run_on_a_workdir_in_use_stops_before_touching_it(workdir):
    """Two jobs on one workdir: the second would take the first one's newest checkpoints, still
    being written, for damaged ones and move them aside. It stops at the lock instead."""
    (workdir / "checkpoints" / "4" / "state" / "_METADATA").unlink()  # as a save in flight leaves it
    before = _tree(workdir)
    with lock.workdir_lock(str(workdir)):  # held as a running job holds it
        message = r"--workdir=.*/run is in use by another job \(pid \d+ on .* since .*train.lock\)"
        with pytest.raises(UserError, match=message):
            loop.train(small_config(steps=6), str(workdir))
    assert _tree(workdir) == before
    assert loop.train(small_config(steps=2), str(workdir))["step"] == 2  # released with the job


def test_a_run_that_fails_early_leaves_no_workdir_behind(tmp_path):
    workdir = tmp_path / "new"
    with pytest.raises(UserError, match="train_files: no file matches"):
        loop.train(small_config(**{"data.train_files": str(tmp_path / "none*.txt")}), str(workdir))
    assert not workdir.exists()
