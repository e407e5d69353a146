"""Ctrl-C on the commands: one line on stderr saying what was left, status 130, never a traceback
(train.py's once it has begun: test_faults.py)."""

import signal
import subprocess
import sys

import pytest
from conftest import CTRL_C_AT, ROOT, child_env

COMMANDS = {
    "evaluate": ["-m", "gspmd_tp.evaluate", "--workdir=/nonexistent"],
    "generate": ["-m", "gspmd_tp.generate", "--workdir=/nonexistent"],
    "checkpoint": ["-m", "gspmd_tp.checkpoint", "info", "/nonexistent"],
    "convert": ["-m", "gspmd_tp.convert", "to-hf", "--workdir=/nonexistent", "--hf_dir=/nonexistent"],
    "plan": ["-m", "gspmd_tp.plan"],
    "bench": ["bench.py", "--config=configs/bench_cpu.py"],
    "train": ["train.py", "--workdir=/nonexistent/run"],
}


def _said(err: str) -> list[str]:
    return [line for line in err.splitlines() if not line.startswith("import time:")]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_ctrl_c_while_the_command_imports_is_one_line_and_status_130(command):
    """Ctrl-C inside jax's imports, before main() runs: it was a traceback through the imports, or
    jaxlib's initialisation broken into an ImportError or an abort. The signal is sent once the
    command has imported host_devices (each reports its imports as they finish: -X importtime), so
    while the rest imports."""
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", *COMMANDS[command]],
        cwd=ROOT, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.rstrip().endswith("gspmd_tp.job.host_devices"):
            proc.send_signal(signal.SIGINT)
            break
    err = "".join(seen) + proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err[-2000:]
    assert _said(err) == ["stopped by Ctrl-C (nothing written)"], _said(err)[-20:]


@pytest.mark.parametrize(
    "command, flags, left",
    [
        ("bench", [], "nothing written"),
        ("bench", ["--json_out={tmp}/old.json"], "--json_out={tmp}/old.json is as it was"),
        (
            "bench",
            ["--json_out={tmp}/old.json", "--profile_dir={tmp}/p"],
            "--json_out={tmp}/old.json is as it was; --profile_dir={tmp}/p holds the traces taken before it",
        ),
        ("plan", [], "nothing written"),
        (
            "plan",
            ["--compare=dp,fsdp", "--chart={tmp}/old.png", "--dump_hlo={tmp}/hlo"],
            "--chart={tmp}/old.png is as it was; --dump_hlo={tmp}/hlo holds the HLO of the steps "
            "compiled before it",
        ),
    ],
)
def test_ctrl_c_while_plan_or_bench_works_is_one_line_and_leaves_old_reports(tmp_path, command, flags, left):
    """Was KeyboardInterrupt's traceback (for plan, inside the compiler: then a segfault)."""
    for old in ("old.json", "old.png"):
        (tmp_path / old).write_text("an older report")
    if command == "bench":
        run = dict(module="gspmd_tp.bench.benchmark", name="run", argv0="bench.py", run="run_path")
        run["target"] = "bench.py"
        flags = ["--config=configs/bench_cpu.py", *flags]
    else:
        run = dict(module="gspmd_tp.train.step", name="compile_train_step", argv0="plan", run="run_module")
        run["target"] = "gspmd_tp.plan"
    result = subprocess.run(
        [sys.executable, "-c", CTRL_C_AT.format(**run), *(f.format(tmp=tmp_path) for f in flags)],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 130, result.stderr[-2000:]
    assert _said(result.stderr) == [f"stopped by Ctrl-C ({left.format(tmp=tmp_path)})"], result.stderr[-2000:]
    for old in ("old.json", "old.png"):
        assert (tmp_path / old).read_text() == "an older report"
    assert {p.name for p in tmp_path.iterdir()} <= {"hlo", "old.json", "old.png", "p"}  # no partial file
