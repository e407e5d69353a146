"""A leading ~ in every command's path flags is the home directory (gspmd_tp/paths.py). bash leaves
`--workdir=~/x` as it is typed (the word is no assignment), so each command must expand it: before,
only train.py did, and the others read or wrote a directory named ~ under the working directory.

Each case gives a path under a HOME of the test's own, made so that the command stops with one line
naming the expanded path: a file where the flag's directory would go, or a run that is not there.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

from gspmd_tp.checkpoint import tool
from gspmd_tp.inference import evaluate, generate, saved_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A home directory holding a file `afile`, a config `cfg.py` and a prompt file; HOME set to it,
    and the working directory an empty one beside it (nothing may be made there)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "afile").write_text("a file where a directory would go")
    (home / "cfg.py").write_text((ROOT / "configs" / "tiny.py").read_text())
    (home / "prompts.txt").write_text("hello\n")
    monkeypatch.setenv("HOME", str(home))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield home
    assert list(cwd.iterdir()) == []


_NO_RUN = "error: {home}/nope: no checkpoint found (looked in {home}/nope/checkpoints)"


@pytest.mark.parametrize(
    "main, argv, message",
    [
        (evaluate.main, ["--workdir=~/nope"], _NO_RUN),
        (
            evaluate.main,
            ["--workdir=~/nope", "--plot=~/afile/loss.png"],
            "error: --plot={home}/afile/loss.png: {home}/afile is a file",
        ),
        (generate.main, ["--workdir=~/nope", "--prompt=hi"], _NO_RUN),
        (generate.main, ["--workdir=~/nope", "--prompts_file=~/prompts.txt"], _NO_RUN),
        (tool.main, ["info", "~/nope"], _NO_RUN),
        (
            tool.main,
            ["export", "~/nope", "~/afile/p.npz"],
            "error: OUT={home}/afile/p.npz: {home}/afile is a file",
        ),
    ],
)
def test_readers_of_a_run_expand_a_tilde(home, capsys, main, argv, message):
    """evaluate, generate and the checkpoint tool: --workdir (DIR), --plot, --prompts_file, OUT."""
    assert main(argv) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(message.format(home=home))


def test_the_device_count_read_before_jax_starts_finds_the_run_under_home(home, monkeypatch):
    """evaluate and generate simulate as many devices as the run was saved on, read from --workdir
    before the flags are parsed."""
    monkeypatch.setattr(saved_run, "saved_device_count", lambda w, s=None: 4 if w == f"{home}/run" else None)
    assert saved_run.device_count_from_argv(["evaluate", "--workdir=~/run"]) == 4


def _one_error_line(argv: list[str], home: Path) -> str:
    result = subprocess.run(
        [sys.executable, *argv], cwd=home.parent / "cwd", env=child_env(HOME=str(home), PYTHONPATH=str(ROOT)),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "flags, message",
    [
        (  # the config read first: its error would come before the output's
            ["--config=~/cfg.py", "--json_out=~/afile/b.json"],
            "error: --json_out={home}/afile/b.json: {home}/afile is a file",
        ),
        (
            ["--profile_dir=~/afile/p"],
            "error: --profile_dir={home}/afile/p: {home}/afile is a file",
        ),
    ],
)
def test_bench_expands_a_tilde(home, flags, message):
    # --rules=nosuch stops the run before anything is timed, once the outputs have checked out.
    argv = [str(ROOT / "bench.py"), f"--config={ROOT}/configs/bench_cpu.py", *flags, "--rules=nosuch"]
    assert _one_error_line(argv, home).startswith(message.format(home=home))


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--config=~/cfg.py", "--chart=~/afile/c.png"],
            "error: --chart={home}/afile/c.png: {home}/afile is a file",
        ),
        (
            ["--dump_hlo=~/afile/hlo"],
            "error: --dump_hlo={home}/afile/hlo: {home}/afile is a file",
        ),
    ],
)
def test_plan_expands_a_tilde(home, flags, message):
    # A rule file not found stops --compare before anything compiles, once the outputs have checked out.
    argv = ["-m", "gspmd_tp.plan", f"--config={ROOT}/configs/tiny.py", *flags, "--compare=dp,nosuch"]
    assert _one_error_line(argv, home).startswith(message.format(home=home))


@pytest.mark.parametrize(
    "command, flags, message",
    [  # each flag once: both commands read the one definition
        (
            "to-hf",
            ["--workdir=~/nope", "--hf_dir=~/hf", "--hf_base=~/nohf"],
            "error: --hf_base={home}/nohf: no config.json",
        ),
        (
            "from-hf",
            ["--workdir=~/afile/run", "--hf_dir=~/nohf"],
            "error: --workdir={home}/afile/run: {home}/afile is a file",
        ),
        (
            "from-hf",
            ["--workdir=~/run", "--hf_dir=~/nohf", "--config=~/cfg.py"],  # the default is relative
            "error: --hf_dir={home}/nohf: no config.json",
        ),
    ],
)
def test_convert_expands_a_tilde(home, command, flags, message):
    assert _one_error_line(["-m", "gspmd_tp.convert", command, *flags], home).startswith(
        message.format(home=home)
    )
    made = sorted(p.name for p in home.iterdir() if p.name != "__pycache__")  # Python's, beside cfg.py
    assert made == ["afile", "cfg.py", "prompts.txt"]  # nothing made there


@pytest.mark.parametrize(
    "command, path_flags",
    [
        ([str(ROOT / "train.py")], ["--workdir"]),
        ([str(ROOT / "bench.py")], ["--json_out", "--profile_dir"]),
        (["-m", "gspmd_tp.plan"], ["--chart", "--dump_hlo"]),
        (["-m", "gspmd_tp.convert"], ["--hf_base", "--hf_dir", "--workdir"]),
        (evaluate.main, ["--plot", "--workdir"]),  # their own flags, parsed in-process as in theirs
        (generate.main, ["--prompts_file", "--workdir"]),
    ],
)
def test_helpshort_lists_the_path_flags_as_the_commands_own(capsys, command, path_flags):
    """absl files a flag under the module that defines it: defined by arguments.define_path, the path
    flags were gspmd_tp.paths's and --helpshort (which the flag errors point to) left them out."""
    if callable(command):
        with pytest.raises(SystemExit):
            command(["--helpshort"])
        out = capsys.readouterr().out
    else:
        argv = [sys.executable, *command, "--helpshort"]
        out = subprocess.run(
            argv, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300
        ).stdout
    listed = [line.split(":")[0].strip() for line in out.splitlines() if line.startswith("  --")]
    assert set(path_flags) <= set(listed), out[-2000:]
