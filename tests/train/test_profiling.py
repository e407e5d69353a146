"""config.profile traces a window of a training run's steps and says where their device time went."""

import gzip
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import pytest
from conftest import small_config

from gspmd_tp.checkpoint import step_dirs
from gspmd_tp.job.errors import UserError
from gspmd_tp.sharding import hlo
from gspmd_tp.train import loop, profiling

SHARES = re.compile(r"device time: (.*)$")


def _shares(line: str) -> dict[str, float]:
    """{'matrix products': 51.2, ...} from a `profile:` log line."""
    text = SHARES.search(line).group(1)
    return {name: float(pct) for name, pct in re.findall(r"([a-z, ]+?) ([\d.]+)%(?:, |$)", text)}


def _profile_lines(capsys) -> list[str]:
    return [x for x in capsys.readouterr().out.splitlines() if x.startswith("profile:")]


def test_a_run_traces_the_window_of_its_own_steps(tmp_path, capsys, monkeypatch):
    """One run and three resumes of it from step 2, all compiling the same step."""
    c = small_config(steps=4, log_every=1, eval_every=100, checkpoint_every=2)
    c.profile.steps, c.profile.skip_steps = 2, 1
    loop.train(c, str(tmp_path))
    out = capsys.readouterr().out
    [line] = [x for x in out.splitlines() if x.startswith("profile:")]
    # This start's first step is 1: left out, then steps 2 and 3.
    assert line.startswith("profile: steps 2..3 traced in ")
    trace = re.search(r" to (\S+\.trace\.json\.gz);", line).group(1)
    assert trace.startswith(str(tmp_path / profiling.PROFILE))
    shares = _shares(line)
    assert list(shares) == list(hlo.GROUPS)
    assert sum(shares.values()) == pytest.approx(100, abs=0.3)
    assert shares["matrix products"] > 0 and shares["collectives"] > 0  # megatron_2d on dp=2,mp=4
    assert f"profile in {tmp_path / profiling.PROFILE}" in out.splitlines()[-1]
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    ckpt_dir = step_dirs.checkpoint_dir(str(tmp_path))

    # A window after the last step is said, and traces nothing.
    shutil.rmtree(os.path.join(ckpt_dir, "4"))
    traces = sorted(str(p) for p in (tmp_path / profiling.PROFILE).rglob("*"))
    c.profile.steps, c.profile.skip_steps = 2, 5
    loop.train(c, str(tmp_path))
    out = capsys.readouterr().out
    assert "note: config.profile traces from step 8, after the run's last step 4" in out
    assert "profile:" not in out
    assert sorted(str(p) for p in (tmp_path / profiling.PROFILE).rglob("*")) == traces

    # A resumed run counts its window from where it starts.
    shutil.rmtree(os.path.join(ckpt_dir, "4"))
    c.profile.steps, c.profile.skip_steps = 1, 0
    loop.train(c, str(tmp_path))
    [line] = _profile_lines(capsys)
    assert line.startswith("profile: steps 3..3 traced in ")

    # A window cut at the run end stops once the save it started has finished: step 3's save runs in
    # the background while step 4, the last, trains; the profiler stops after it.
    shutil.rmtree(os.path.join(ckpt_dir, "4"))
    seen = []
    stop_trace = jax.profiler.stop_trace

    def stop_and_look():
        seen.append((step_dirs.steps_on_disk(ckpt_dir), os.listdir(ckpt_dir)))
        stop_trace()

    monkeypatch.setattr(jax.profiler, "stop_trace", stop_and_look)
    c.checkpoint_every, c.profile.steps, c.profile.skip_steps = 1, 10, 0
    loop.train(c, str(tmp_path))
    [line] = _profile_lines(capsys)
    assert line.startswith("profile: steps 3..4 traced in ")
    [(steps, names)] = seen
    assert sorted(steps) == [2, 3]  # step 3 saved whole
    assert sorted(names) == ["2", "3"]  # no save in progress


def test_python_calls_are_traced_when_asked(tmp_path):
    f = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((64, 64))
    step_text = f.lower(x).compile().as_text()

    def dispatch(y):
        return f(y)

    def traced_names(python: bool) -> list[str]:
        directory = tmp_path / str(python)
        trace = profiling.StepTrace(str(directory), 1, 1, step_text, lambda _: None, python=python)
        trace.before(1)
        trace.after(1, dispatch(x))
        with gzip.open(trace.written) as fh:
            return [e.get("name", "") for e in json.load(fh)["traceEvents"]]

    assert not any(name.startswith("$") for name in traced_names(False))  # jax's default would
    assert any(name.startswith("$") and name.endswith(" dispatch") for name in traced_names(True))


def test_a_trace_cut_short_by_a_failed_job_stops_without_waiting_for_its_save(tmp_path):
    f = jax.jit(lambda x: x + 1)
    x = jnp.ones((8,))
    settled = []
    trace = profiling.StepTrace(
        str(tmp_path), 1, 3, f.lower(x).compile().as_text(), lambda _: None, settle=lambda: settled.append(1)
    )
    trace.before(1)
    jax.block_until_ready(f(x))
    trace.close(settle=False)
    assert settled == [] and trace.written


@pytest.mark.parametrize("key", ["steps", "skip_steps"])
def test_a_negative_profile_value_is_refused(tmp_path, key):
    c = small_config()
    c.profile[key] = -1
    with pytest.raises(UserError, match=rf"^config\.profile\.{key} must be 0 or more, got -1$"):
        loop.train(c, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_trace_cut_short_ends_at_the_last_step_dispatched(tmp_path):
    """A stop or an error inside the window still ends the trace and says which steps it holds."""
    f = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((64, 64))
    lines = []
    trace = profiling.StepTrace(
        str(tmp_path), first=2, steps=5, step_text=f.lower(x).compile().as_text(), log=lines.append
    )
    for step in (1, 2, 3):
        trace.before(step)
        x = f(x)
        assert trace.after(step, x) == 0.0  # the window runs to step 6
    jax.block_until_ready(x)  # as the loop's stop does, saving the state before the trace closes
    trace.close()
    [line] = lines
    assert line.startswith("profile: steps 2..3 traced in ")
    assert trace.written.endswith(".trace.json.gz")
    assert _shares(line)["matrix products"] > 0
    trace.close()  # a second close writes nothing more
    assert len(lines) == 1


@pytest.mark.multiprocess
def test_each_process_of_a_job_traces_its_own_devices(fsdp_job):
    run, outs, _ = fsdp_job
    [line] = [x for x in outs[0][0].splitlines() if x.startswith("profile:")]
    assert line.startswith("profile: steps 2..2 traced in ")
    assert f"{run / profiling.PROFILE / 'process_0'}" in line
    assert "profile:" not in outs[1][0]  # process 0 logs
    for i in (0, 1):
        assert profiling.newest_trace(str(run / profiling.PROFILE / f"process_{i}"))
