"""Two train.py processes x 4 simulated CPU devices, joined by jax.distributed over gloo; one job with its
workdir in a bucket (the GCS emulator)."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import child_env

# Alone, after the parallel part of the suite: a busy neighbour delays how fast a dead peer is seen.
pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    f"--config={ROOT / 'configs' / 'tiny.py'}",
    "--config.batch_size=8",
    "--config.seq_len=32",
    "--config.model.d_model=64",
    "--config.model.num_layers=1",  # no test here needs more: each compile is shorter (~0.7 s of CPU)
    "--config.model.mlp_dim=128",
    "--config.log_every=1",
    "--config.eval_every=100",
    "--config.eval_batches=1",
    "--config.checkpoint_every=2",
]


def small(*overrides):
    """The config train.py makes of SMALL and `overrides` (--config.KEY=VALUE flags)."""
    from configs import tiny

    c = tiny.get_config()
    for flag in [*SMALL[1:], *overrides]:
        key, value = flag.removeprefix("--config.").split("=", 1)
        *parents, leaf = key.split(".")
        target = c
        for part in parents:
            target = target[part]
        target[leaf] = value == "True" if isinstance(target[leaf], bool) else type(target[leaf])(value)
    return c


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(devices: int) -> dict:
    e = child_env(JAX_PLATFORMS="cpu")
    e["XLA_FLAGS"] = f"{e.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    return e


def start(
    workdir, steps, *extra, processes=2, only=((), ()), cwd=(ROOT, ROOT), devices=(4, 4), python=((), ())
):
    """Starts the job; 1 process gets 8 devices, 2 processes `devices[i]` each (default 4; process i
    adding `only[i]`, started in directory `cwd[i]`, Python given `python[i]` before train.py)."""
    train = [sys.executable, str(ROOT / "train.py"), *SMALL]
    args = [*train, f"--workdir={workdir}", f"--config.steps={steps}", *extra]
    if processes == 1:
        return [subprocess.Popen(args, cwd=ROOT, env=env(8), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)]  # fmt: skip
    port = free_port()
    return [
        subprocess.Popen(
            [
                sys.executable,
                *python[i],
                *args[1:],
                f"--coordinator_address=127.0.0.1:{port}",
                "--num_processes=2",
                f"--process_id={i}",
                *only[i],  # last: a job flag given here wins
            ],
            cwd=cwd[i],
            env=env(devices[i]),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]


def slurm_job(workdir, steps, *extra):
    """The job as SLURM starts it: train.py --distributed on each of 2 tasks on this host, each told
    its place by SLURM's variables (the coordinator's port by JAX_COORDINATOR_PORT)."""
    port = free_port()
    procs = []
    for task in range(2):
        e = env(4)
        e.update(
            SLURM_JOB_ID="4242", SLURM_NTASKS="2", SLURM_PROCID=str(task), SLURM_LOCALID=str(task),
            SLURM_STEP_NODELIST="localhost", SLURM_STEP_NUM_NODES="1", JAX_COORDINATOR_PORT=str(port),
        )  # fmt: skip
        args = [
            sys.executable,
            str(ROOT / "train.py"),
            *SMALL,
            f"--workdir={workdir}",
            f"--config.steps={steps}",
        ]
        procs.append(
            subprocess.Popen([*args, "--distributed", *extra], cwd=ROOT, env=e, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        )  # fmt: skip
    return procs


def finish(procs):
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return outs


def refused(procs):
    """The last stderr line of each process of a job that must stop before training, each exiting 1
    (killed if still running after 120 s)."""
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    lasts = [(err.strip().splitlines() or [""])[-1] for _, err in outs]
    assert [p.returncode for p in procs] == [1, 1], [err[-2000:] for _, err in outs]
    return lasts


def losses(workdir):
    rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def test_two_processes_match_one_and_checkpoints_move_both_ways(tmp_path, capsys):
    from gspmd_tp.train import loop

    # A constant learning rate (no warmup, no decay): the schedule does not follow config.steps, so
    # one uninterrupted run of 8 steps is what the mixed run must match, stopped and resumed at 2,
    # 4 and 6, and each one-process start compiles the same step (the compilation cache serves it).
    constant = (
        "--config.optim.warmup_steps=0",
        "--config.optim.min_lr_ratio=1.0",
        "--config.keep_checkpoints=4",
    )
    # Every start reads the corpus from shards (data/shards.py): their resume by example index holds
    # from 1 process to 2 and from 2 back to 1.
    from gspmd_tp.data import prepare

    prepare.prepare(small().data, str(tmp_path / "shards"))
    constant += (f"--config.data.shards={tmp_path / 'shards'}",)
    one = tmp_path / "one"
    # 1 process x 8 devices (this one, as train.py runs it), checkpoints at 2, 4, 6 and 8
    loop.train(small(*constant, "--config.steps=8"), str(one))
    want = losses(one)

    # The mixed run: a copy of that run without its checkpoints of steps 4, 6 and 8.
    run = tmp_path / "mixed"
    later = ["4", "6", "8"]
    shutil.copytree(one, run, ignore=lambda d, names: later if Path(d).name == "checkpoints" else [])
    # Resumed by 2 processes x 4 devices, tensor parallel across both: every device needs every row,
    # so each process reads the whole batch, not half of it.
    outs = finish(start(run, 4, *constant, "--config.rules=megatron_1d", "--config.mesh=dp=1,mp=8"))
    assert "resumed from step 2" in outs[0][0]
    assert not [ln for ln in outs[1][0].splitlines() if ln.startswith(("step", "gspmd_tp", "resumed"))]
    # Then on three mesh axes, data across the two processes (each reads its half of the batch),
    # fsdp and tensor within each.
    three_axes = ("--config.rules=data_fsdp_tensor", "--config.mesh=data=2,fsdp=2,tensor=2")
    outs = finish(start(run, 6, *constant, *three_axes))
    assert "resumed from step 4" in outs[0][0]
    capsys.readouterr()
    loop.train(small(*constant, "--config.steps=8"), str(run))  # and back to 1 process x 8 devices
    assert "resumed from step 6" in capsys.readouterr().out
    got = losses(run)
    assert sorted(got) == [1, 2, 3, 4, 5, 6, 7, 8]
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-5 * abs(loss), (step, got[step], loss)


FSDP = ("--config.rules=fsdp", "--config.mesh=dp=8,mp=1", "--config.checkpoint_every=1")


def test_a_checkpoint_one_process_cannot_read_is_skipped_by_every_process(fsdp_job):
    """Under fsdp each process writes and reads only its own shards. With process 1's shards of
    step 2 garbled, process 0 alone would resume from step 2; both resume from step 1, and both
    evaluate step 1."""
    run, _, first = fsdp_job
    for f in (run / "checkpoints" / "2" / "state" / "ocdbt.process_1" / "d").iterdir():
        f.write_bytes(b"\0garbage" * 16)
    step_2 = run / "checkpoints" / "2"
    # A reader of the run, as a job of 2 processes, skips it too (and moves nothing).
    (out, err0), (_, err) = finish(reader_job("evaluate", f"--workdir={run}", "--json"))
    assert json.loads(out)["step"] == 1
    assert f"warning: skipping checkpoint {step_2}: partial or corrupted (process 1 of this job" in err0
    assert f"warning: process 1: {step_2} is partial or corrupted (" in err
    (out, _), (_, err) = finish(start(run, 2, *FSDP))
    assert (
        f"warning: skipping checkpoint {step_2}: partial or corrupted "
        "(process 1 of this job could not read its part: see its warning)\nwarning: moved "
    ) in out
    assert "resumed from step 1" in out
    assert f"warning: process 1: {step_2} is partial or corrupted (" in err
    assert sorted(os.listdir(run / "checkpoints")) == ["1", "2"]  # the garbled step 2 moved aside
    # Step 2 trained again from step 1's state on both processes: the loss it saw then.
    assert sorted(losses(run)) == [1, 2] and losses(run)[2] == first[2]


def test_processes_given_other_workdirs_are_refused_before_training(tmp_path):
    """Process 1 would save its shards of each checkpoint in its own workdir while process 0 waited
    in the save's barriers for them (a hang of minutes, then a crash with no checkpoint)."""
    procs = start(tmp_path / "a", 4, only=((), (f"--workdir={tmp_path / 'b'}",)))
    for last in refused(procs):
        assert (
            "process 1 of this job does not find the train.lock that process 0 wrote in its --workdir" in last
        )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_value_that_fails_on_one_process_only_is_named_on_every_process(tmp_path):
    """A rule file only process 1 was given (and lacks): before, it alone stopped with its own "not
    found" while process 0 waited 30 s in a collective and blamed a dead peer. The configs are
    compared before either is used, so any other value (a learning rate, a mesh process 1 cannot
    make) is refused by the same line."""
    procs = start(tmp_path / "run", 4, only=((), ("--config.rules=nonexistent",)))
    for last in refused(procs):
        assert last == (
            "error: config.rules differs between process 0 and process 1 of this job; "
            "start every process with the same config, rule file and overrides"
        )
    assert not (tmp_path / "run").exists()


def test_processes_with_other_device_counts_are_refused_on_joining(tmp_path):
    """Before: both failed in the config comparison's first exchange with JAX's 'Unable to compute
    global_shape due to non-uniform sharding', blaming a dead peer."""
    procs = start(tmp_path / "run", 4, devices=(4, 2))
    want = "error: process 1 of this job has 2 devices and process 0 has 4: start every process with as many"
    for last in refused(procs):
        assert last.startswith(want), last
    assert not (tmp_path / "run").exists()


def corpus_in(directory, skip=()):
    """directory/corpus/N.txt: the package's sources, less the `skip`th."""
    corpus = directory / "corpus"
    corpus.mkdir(parents=True)
    for i, doc in enumerate(sorted((ROOT / "gspmd_tp").rglob("*.py"))):
        if i not in skip:
            (corpus / f"{i}.txt").write_bytes(doc.read_bytes())


# The same relative paths, resolved in the directory each process started in.
FILES = ("--config.data.train_files=corpus/*.txt", "--config.data.eval_fraction=0.3")


def test_a_data_file_one_host_lacks_stops_every_process_with_one_line(tmp_path):
    """Only process 0's directory holds the files (as a host without the shared disk). Before,
    process 1 stopped alone."""
    corpus_in(tmp_path / "cwd0")
    (tmp_path / "cwd1").mkdir()
    procs = start(tmp_path / "run", 4, *FILES, cwd=(tmp_path / "cwd0", tmp_path / "cwd1"))
    assert refused(procs) == [
        "error: process 1 of this job stopped with an error (its output says which)",
        f"error: config.data.train_files: no file matches '{tmp_path / 'cwd1' / 'corpus' / '*.txt'}'",
    ]


def test_processes_that_read_other_data_are_refused_before_training(tmp_path):
    """Process 1's copy of the corpus lacks a file: before, both trained, on batches that mixed the
    two corpora (each process reads only its rows), and wrote checkpoints."""
    corpus_in(tmp_path / "cwd0")
    corpus_in(tmp_path / "cwd1", skip=(3,))
    procs = start(tmp_path / "run", 4, *FILES, cwd=(tmp_path / "cwd0", tmp_path / "cwd1"))
    for last in refused(procs):
        assert last.startswith(
            "error: the training corpus read by process 1 of this job differs from process 0's"
        )
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_processes_that_read_other_initial_parameters_are_refused_before_training(tmp_path):
    """config.init_from=init.npz from two directories holding different files: before, each process
    placed its own shards of its own file and both trained on from the mixture, exit 0."""
    from gspmd_tp.checkpoint import tool
    from gspmd_tp.train import run_setup

    c = small()
    shapes = {k: v.shape for k, v in tool._flat(run_setup.setup(c).abstract_state.params).items()}
    for i in range(2):
        rng = np.random.default_rng(i)
        (tmp_path / f"cwd{i}").mkdir()
        np.savez(tmp_path / f"cwd{i}" / "init.npz", **{k: rng.normal(0, 0.02, v) for k, v in shapes.items()})
    procs = start(
        tmp_path / "run", 4, "--config.init_from=init.npz", cwd=(tmp_path / "cwd0", tmp_path / "cwd1")
    )
    for last in refused(procs):
        assert last.startswith("error: config.init_from=init.npz read by process 1 of this job differs"), last
    assert not (tmp_path / "run" / "checkpoints").exists()


def process_1_killed(procs, once) -> tuple[str, float]:
    """SIGKILL to process 1 of the job, `once` returned: process 0's stderr, and how long after the
    kill it ended (within 90 s; every process is killed after)."""
    try:
        once()
        procs[1].send_signal(signal.SIGKILL)
        killed = time.time()
        _, err = procs[0].communicate(timeout=90)
        print(f"process 0 ended {time.time() - killed:.1f} s after process 1 was killed")
        return err, time.time() - killed
    finally:
        for p in procs:
            p.kill()


def joined(proc) -> None:
    """Returns once the process printed gloo's first line on stderr: the job's processes exchange
    their first values (on CPU)."""
    for line in proc.stderr:
        if line.startswith("[Gloo]"):
            return


def compiling(proc) -> None:
    """Returns once the process printed its first line: every process joined and compared configs,
    and it compiles now."""
    for line in proc.stdout:
        if line.startswith("gspmd_tp: "):
            return


def wait_for_training(workdir):
    metrics = Path(workdir) / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    assert metrics.exists(), "the job never started training"


# The job's --heartbeat_timeout_s in the tests of a dead or silent peer, and the slack a loaded machine
# adds to it before the survivors have exited.
HEARTBEAT = ("--heartbeat_timeout_s=10",)
SLACK_S = 25
# How the survivors' line says a peer went.
HOW = "killed, crashed, or silent for --heartbeat_timeout_s"
IN_TRAINING = "killed, crashed, exited at once, or silent for --heartbeat_timeout_s"


def test_a_peer_killed_during_training_stops_the_others_within_the_heartbeat_timeout(tmp_path):
    """The coordination service no longer lists it among the live processes. Before (without
    recoverability), a collective in flight failed on gloo's closed connection (a guess, "another
    process ... has probably died"), or the others waited until the heartbeat timeout and JAX ended
    them with its own fatal message and stack dumps."""
    procs = start(tmp_path / "run", 100_000, "--config.checkpoint_every=100000", *HEARTBEAT)
    err, took = process_1_killed(procs, once=lambda: wait_for_training(tmp_path / "run"))
    assert procs[0].returncode == 1, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        f"stopped: process 1 died during training ({IN_TRAINING}); run again to resume from the newest "
        "complete checkpoint"
    )
    assert took < 10 + SLACK_S, took


def test_a_stop_signal_stops_every_process_at_one_step(tmp_path):
    """SIGTERM on process 1, whose stop process 0 learns only from the all-reduced signals, then
    SIGINT on process 0 (a preemption reaches every host at about the same time). Every step
    evaluates 4 batches, each preceded by a stop check, and the host runs ahead of the devices: the
    processes still stop at one check, each reading the same signals, and save one checkpoint."""
    evaluating = ("--config.eval_every=1", "--config.eval_batches=4")
    procs = start(tmp_path / "run", 100_000, "--config.checkpoint_every=100000", *evaluating)
    wait_for_training(tmp_path / "run")
    procs[1].send_signal(signal.SIGTERM)
    time.sleep(0.3)
    procs[0].send_signal(signal.SIGINT)
    (out, _), _ = finish(procs)
    by = "SIGTERM on process 1|SIGINT on process 0"
    stopped = re.search(rf"stopped by (?:{by}) after step (\d+): checkpoint saved", out)
    assert stopped, out[-2000:]
    assert os.listdir(tmp_path / "run" / "checkpoints") == [stopped.group(1)]


@pytest.mark.parametrize("signalled", [1, 0])
def test_sigterm_to_one_process_before_training_stops_every_process_at_once(tmp_path, signalled):
    """Before, the others waited for the signalled process in a collective until the heartbeat
    timeout (100 s) and JAX aborted them with a stack trace."""
    procs = start(tmp_path / "run", 100_000)
    try:
        compiling(procs[0])
        procs[signalled].send_signal(signal.SIGTERM)
        sent = time.time()
        errs = [p.communicate(timeout=60)[1] for p in procs]
        assert time.time() - sent < 30
    finally:
        for p in procs:
            p.kill()
    for i, (p, err) in enumerate(zip(procs, errs, strict=True)):
        where = "" if i == signalled else f" on process {signalled}"
        assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
        assert err.strip().splitlines()[-1] == (
            f"stopped by SIGTERM{where} before training began; no checkpoint was written"
        )
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("job", ["flags", "distributed"])
def test_a_process_killed_before_training_stops_the_others_within_the_heartbeat_timeout(tmp_path, job):
    """SIGKILL (as the OOM killer; a crash alike) says nothing: the coordination service misses its
    heartbeats. Before recoverability, JAX aborted process 0 with a stack trace, leaving the new
    workdir behind. `distributed`: the job as --distributed finds it (a SLURM job here; a TPU pod
    alike) is followed the same way."""
    launch = start if job == "flags" else slurm_job
    procs = launch(tmp_path / "run", 100_000, *HEARTBEAT)
    err, took = process_1_killed(procs, once=lambda: compiling(procs[0]))
    assert procs[0].returncode == 1, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        f"stopped: process 1 died ({HOW}) before training began; no checkpoint was written"
    )
    assert took < 10 + SLACK_S, took
    assert not (tmp_path / "run").exists()


# Python's -c, then train.py as usual: on a host whose RAM is 1 MiB (os.sysconf's count of pages).
SMALL_HOST = (
    "-c",
    "import os, runpy, sys\n"
    "real = os.sysconf\n"
    "os.sysconf = lambda name: 256 if name == 'SC_PHYS_PAGES' else real(name)\n"
    "sys.argv = sys.argv[1:]\n"
    "sys.path.insert(0, os.path.dirname(sys.argv[0]))\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n",
)


def test_an_error_of_one_process_alone_before_training_stops_the_others_at_once(tmp_path):
    """Process 1's host has too little RAM for the compiled step: a UserError there alone (its
    check_memory), after process 0 went on. Before, process 0 waited for it in a collective (30 s
    in gloo's setup here) and blamed a dead peer."""
    procs = start(tmp_path / "run", 100_000, python=((), SMALL_HOST))
    try:
        for line in procs[1].stderr:
            if line.startswith("error: "):
                break
        failed = time.time()
        _, err = procs[0].communicate(timeout=60)
        took = time.time() - failed
        _, err1 = procs[1].communicate(timeout=60)
    finally:
        for p in procs:
            p.kill()
    assert line.startswith("error: the compiled train step needs 4 CPU devices x "), line
    assert procs[1].returncode == 1, err1[-2000:]
    assert procs[0].returncode == 1, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        f"stopped: process 1 stopped with an error before training began ({line.strip()}); "
        "no checkpoint was written"
    )
    assert took < 20, took
    assert not (tmp_path / "run").exists()


def test_a_silent_peer_ends_the_job_after_the_heartbeat_timeout_and_the_newest_checkpoint_reads(tmp_path):
    """A stopped process keeps its connections open: only --heartbeat_timeout_s ends this. Before,
    the coordination service aborted process 0 with its fatal message and a stack dump (exit 134)."""
    from gspmd_tp.checkpoint import step_dirs

    run = tmp_path / "run"
    procs = start(run, 100_000, "--config.checkpoint_every=2", *HEARTBEAT)
    wait_for_training(run)
    time.sleep(3)  # a few steps and saves
    procs[1].send_signal(signal.SIGSTOP)
    stopped = time.time()
    try:
        _, err = procs[0].communicate(timeout=120)
    finally:
        procs[1].kill()
        procs[1].communicate()
    print(f"process 0 ended {time.time() - stopped:.1f} s after process 1 was stopped (SIGSTOP)")
    assert procs[0].returncode == 1, err[-2000:]
    assert time.time() - stopped < 10 + SLACK_S, time.time() - stopped
    assert err.strip().splitlines()[-1].startswith("stopped: process 1 died during training"), err[-2000:]
    readable = [step for step, _ in step_dirs.readable_checkpoints(str(run), warn=lambda _: None)]
    assert readable and max(readable) == max(step_dirs.steps_on_disk(str(run / "checkpoints"))), readable


def test_a_job_that_never_fully_joins_is_one_line_after_join_timeout_s(tmp_path):
    """Process 1 never started (or given another address or id): before, process 0 waited 300 s
    and JAX aborted it (exit 134) with a stack trace blaming a dead task."""
    address = f"127.0.0.1:{free_port()}"
    job = [f"--coordinator_address={address}", "--num_processes=2", "--process_id=0"]
    args = [*SMALL, f"--workdir={tmp_path / 'run'}", *job]
    t = time.time()
    done = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args, "--join_timeout_s=1"],
        env=env(4), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: --coordinator_address='{address}' --num_processes=2 --process_id=0: the job's processes "
        "did not all join within --join_timeout_s=1: start every process, each with the same coordinator "
        "address and process count and its own process id from 0"
    )
    assert time.time() - t < 60
    assert not (tmp_path / "run").exists()


def test_a_stop_signal_while_the_job_joins_is_one_line(tmp_path):
    """Process 0 waits for process 1, never started: before, SIGTERM ended it without a word (-15)."""
    port = free_port()
    job = [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", "--process_id=0"]
    args = [sys.executable, str(ROOT / "train.py"), *SMALL, f"--workdir={tmp_path / 'run'}", *job]
    p = subprocess.Popen(args, env=env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:  # until process 0 listens for the other processes
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except ConnectionRefusedError:
                time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert (
        err.strip().splitlines()[-1] == "stopped by SIGTERM before training began; no checkpoint was written"
    )
    assert not (tmp_path / "run").exists()


def test_processes_given_other_job_flags_are_refused_on_joining(tmp_path):
    """Process 1 started with --num_processes=3: before, JAX let it join process 0's job of 2 without
    a word, and both trained."""
    procs = start(tmp_path / "run", 4, only=((), ("--num_processes=3",)))
    for last in refused(procs):
        assert re.fullmatch(
            r"error: process 1 was started with --num_processes=3 and process 0 \(the coordinator, "
            r"127\.0\.0\.1:\d+\) with --num_processes=2: start every process with the same count",
            last,
        ), last
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (("", 0, 0, False, 100), "--num_processes=0: must be 1 or more"),
        (("", 1, 0, False, 0), "--heartbeat_timeout_s=0: must be 1 or more"),
        (("", 1, 0, False, 100, 0), "--join_timeout_s=0: must be 1 or more"),
        (("nohost", 2, 0, False, 100), "--coordinator_address='nohost': expected HOST:PORT"),
        (("127.0.0.1:99999", 2, 0, False, 100), "--coordinator_address='127.0.0.1:99999'"),
        (("127.0.0.1:1234", 2, 2, False, 100), "all three are needed, with 0 <= process_id < num_processes"),
        (("127.0.0.1:1234", 1, 0, False, 100), "a multi-process job has --num_processes of 2 or more"),
    ],
)
def test_bad_job_flags_are_named_before_joining(args, message):
    from gspmd_tp.job import distributed
    from gspmd_tp.job.errors import UserError

    with pytest.raises(UserError, match=re.escape(message)):
        distributed.initialize(*args)


def test_a_coordinator_port_already_taken_is_one_line():
    """Process 0 checks the port before jax's coordination service binds it (whose failed bind
    could take the whole process down with a segmentation fault)."""
    import socket

    from gspmd_tp.job import distributed
    from gspmd_tp.job.errors import UserError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=f"port {port} is already in use on this host"):
            distributed.initialize(f"127.0.0.1:{port}", 2, 0, False, 100)
    assert not distributed.jax.distributed.is_initialized()


# python -c: bench.py as `python bench.py` runs it, its matmul roofline timed on 256 x 256 products,
# not 2048 x 2048 (about 13 s of process 0's time on a 2-core test machine, twice per run: before
# and after the steps); the rate is still measured by process 0 alone and shared. {host}: more
# setup first.
BENCH = (
    "import runpy, socket, sys\n"
    "{host}"
    "from gspmd_tp.job import host_devices\n"
    "request = host_devices.request\n"
    "def small_matmuls(*args):\n"
    "    request(*args)  # before jax is imported\n"
    "    from gspmd_tp.bench import benchmark\n"
    "    benchmark.matmul_rate.__defaults__ = (256, 2)\n"
    "host_devices.request = small_matmuls\n"
    "sys.argv[0] = 'bench.py'\n"
    "runpy.run_path('bench.py', run_name='__main__')\n"
)


def bench_job(*extra, only=((), ())):
    """bench.py on 2 processes x 4 devices, process 1 on a host of another name (its
    socket.gethostname made so): SMALL's model, megatron_1d on dp=2,mp=4, 1 timed step and no
    warmup (process i adding `only[i]`)."""
    port = free_port()
    args = [
        *SMALL[:5], "--rules=megatron_1d", "--meshes=dp=2,mp=4", "--steps=1", "--warmup=0", *extra,
        f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", *HEARTBEAT,
    ]  # fmt: skip
    other_host = "socket.gethostname = lambda: 'another-host'\n"
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                BENCH.format(host=other_host if i else ""),
                *args,
                f"--process_id={i}",
                *only[i],
            ],
            cwd=ROOT,
            env=env(4),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]


def test_bench_on_two_hosts_counts_the_bytes_between_them_and_process_0_reports():
    """dp=2,mp=4 on two hosts of 4 devices: tensor parallelism's collectives stay on each host, the
    data-parallel gradient reduction crosses between them."""
    (out0, _), (out1, _) = finish(bench_job("--json"))
    report = json.loads(out0)
    assert (report["devices"], report["processes"], report["hosts"]) == (8, 2, 2)
    [row] = report["results"]
    assert 0 < row["network_bytes_per_device"] < row["collective_bytes_per_device"]
    rates = report["matmul_flops_per_sec"]
    assert row["roofline_fraction"] == pytest.approx(row["model_flops_per_sec"] / (2 * max(rates.values())))
    assert out1 == ""  # the report is process 0's


def test_bench_processes_given_other_flags_are_refused_before_compiling():
    lasts = refused(bench_job(only=((), ("--warmup=2",))))
    assert lasts == ["error: --warmup differs between process 0 and process 1 of this job; start every "
                     "process with the same flags"] * 2  # fmt: skip


def test_a_bench_process_killed_stops_the_others_within_the_heartbeat_timeout():
    """bench.py's job ends as train.py's does before training: one line."""
    procs = bench_job("--steps=100000", "--json_out=report.json")
    err, took = process_1_killed(procs, once=lambda: joined(procs[0]))
    assert procs[0].returncode == 1, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        f"stopped: process 1 died ({HOW}) (--json_out=report.json is as it was)"
    )
    assert took < 10 + SLACK_S, took


def reader_job(module, *args, only=((), ()), cwd=(ROOT, ROOT)):
    """python -m gspmd_tp.MODULE as 2 processes, each simulating the devices the command chooses
    (the saved mesh's, shared between the two), process i adding `only[i]`, started in `cwd[i]`."""
    port = free_port()
    job = [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", *HEARTBEAT]
    return [
        subprocess.Popen(
            [sys.executable, "-m", f"gspmd_tp.{module}", *args, *job, f"--process_id={i}", *only[i]],
            cwd=cwd[i],
            env=child_env(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]


def test_evaluate_and_generate_as_two_processes_report_what_one_process_does(fsdp_job, capsys):
    """The fsdp run's mesh of 8 devices as 2 processes x 4: the held-out rows and the parameters
    split between the processes, each process reading only its shards of the checkpoint. Process 0
    prints what one process of 8 devices prints."""
    from gspmd_tp.inference import generate

    run = fsdp_job[0]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (out0, _), (out1, _) = finish(reader_job("evaluate", f"--workdir={run}", "--json"))
    report = json.loads(out0)
    assert (report["step"], report["mesh"], out1) == (2, "dp=8,mp=1", "")
    assert report["loss"] == pytest.approx(rows[-1]["eval_loss"], rel=1e-5)  # as training logged it

    greedy = ["--prompt=def ", "--temperature=0", "--max_new_tokens=4"]
    assert generate.main([f"--workdir={run}", *greedy]) == 0
    want = capsys.readouterr().out
    (out0, err0), (out1, _) = finish(reader_job("generate", f"--workdir={run}", *greedy))
    assert (out0, out1) == (want, "")
    assert "| mesh dp=8,mp=1 | rules " in err0


@pytest.mark.parametrize(
    "only, lasts",
    [
        (
            ("--prompt=a", "--seed=1"),
            ["error: --seed differs between process 0 and process 1 of this job; start every process "
             "with the same flags"] * 2,
        ),
        (
            ("--prompts_file=/nonexistent/prompts.txt",),  # a file only process 1 was given, and lacks
            ["error: process 1 of this job stopped with an error (its output says which)",
             "error: --prompts_file=/nonexistent/prompts.txt: [Errno 2] No such file or directory: "
             "'/nonexistent/prompts.txt'"],
        ),
    ],
)  # fmt: skip
def test_reader_processes_given_other_values_are_refused_before_reading(fsdp_job, only, lasts):
    procs = reader_job("generate", f"--workdir={fsdp_job[0]}", only=(("--prompt=a",), only))
    assert refused(procs) == lasts


def test_evaluating_processes_that_read_other_held_out_files_are_refused(fsdp_job, tmp_path):
    """The same relative --config.data.eval_files from two directories: each process would
    evaluate its rows of another split."""
    for i in range(2):
        (tmp_path / f"cwd{i}").mkdir()
        (tmp_path / f"cwd{i}" / "held_out.txt").write_text(f"process {i}'s own held-out text\n" * 200)
    procs = reader_job(
        "evaluate", f"--workdir={fsdp_job[0]}", "--config.data.eval_files=held_out.txt",
        cwd=(tmp_path / "cwd0", tmp_path / "cwd1"),
    )  # fmt: skip
    differs = "error: the held-out split read by process 1 of this job differs from process 0's"
    for last in refused(procs):
        assert last.startswith(differs), last


def test_a_reader_process_killed_stops_the_others_within_the_heartbeat_timeout(fsdp_job):
    """A reader's job ends as bench.py's does: one line."""
    procs = reader_job("generate", f"--workdir={fsdp_job[0]}", "--prompt=a", "--max_new_tokens=20")
    err, took = process_1_killed(procs, once=lambda: joined(procs[0]))
    assert procs[0].returncode == 1, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        f"stopped: process 1 died ({HOW}) (nothing in the workdir was written)"
    )
    assert took < 10 + SLACK_S, took


def test_a_job_in_a_bucket_stops_on_sigterm_to_one_process_and_resumes_on_another_mesh(
    gcs_emulator, tmp_path, monkeypatch
):
    """Both processes reach the emulator through the environment alone (STORAGE_EMULATOR_HOST,
    TENSORSTORE_GCS_HTTP_URL: conftest's gcs_emulator); SIGTERM to process 1 stops both at one step,
    each writes its part of that checkpoint into the bucket, and 1 process x 8 devices on another mesh
    and rule file resumes it with an uninterrupted run's losses."""
    from gspmd_tp.storage import paths
    from gspmd_tp.train import loop

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # this process's and the job's
    constant = ("--config.optim.warmup_steps=0", "--config.optim.min_lr_ratio=1.0")
    workdir = f"gs://bkt/runs/mp-{time.time_ns()}"
    procs = start(workdir, 100_000, "--config.checkpoint_every=100000", *constant)
    try:
        deadline = time.time() + 240
        while not paths.of(f"{workdir}/metrics.jsonl").exists():  # a first step logged there
            assert all(p.poll() is None for p in procs) and time.time() < deadline, procs[0].stderr.read()
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGTERM)
        (out, _), _ = finish(procs)
    finally:
        for p in procs:
            p.kill()
    stopped = re.search(r"stopped by SIGTERM on process 1 after step (\d+): checkpoint saved", out)
    assert stopped, out[-2000:]
    step = int(stopped.group(1))
    steps = paths.of(f"{workdir}/checkpoints").iterdir()
    assert [s.name for s in steps] == [str(step)]
    import gcsfs

    written = gcsfs.GCSFileSystem(skip_instance_cache=True).find(f"{workdir}/checkpoints/{step}")
    # orbax's array store keeps one part per process that wrote shards (OCDBT's process_N).
    assert any("process_0" in f for f in written) and any("process_1" in f for f in written), written

    rest = (*constant, f"--config.steps={step + 2}")
    loop.train(small(*rest, "--config.rules=megatron_1d", "--config.mesh=dp=2,mp=4"), workdir)
    loop.train(small(*rest), str(tmp_path / "uninterrupted"))
    want = losses(tmp_path / "uninterrupted")
    text = paths.of(f"{workdir}/metrics.jsonl").read_text()
    got = {r["step"]: r["loss"] for r in map(json.loads, text.splitlines())}
    assert sorted(got) == sorted(want) == list(range(1, step + 3))
    for s, loss in want.items():
        assert abs(got[s] - loss) <= 1e-5 * abs(loss), (s, got[s], loss)
