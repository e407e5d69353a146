"""train.py end to end, as a user runs it: metrics, checkpoints, resume, one-line user errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "--config.batch_size=8",
    "--config.seq_len=32",
    "--config.model.d_model=64",
    "--config.model.num_layers=2",
    "--config.model.mlp_dim=128",
    "--config.log_every=2",
    "--config.eval_every=2",
    "--config.eval_batches=1",
    "--config.checkpoint_every=2",
]


def train(workdir, *flags):
    env = child_env()  # train.py asks for 8 devices
    return subprocess.run(
        [sys.executable, "train.py", "--config=configs/tiny.py", f"--workdir={workdir}", *SMALL, *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_train_writes_metrics_and_checkpoints_then_resumes(tmp_path):
    first = train(tmp_path, "--config.steps=4")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "step 4/4 | loss" in first.stdout and "tok/s" in first.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 4]  # the first step, then every log_every
    assert all({"step", "loss", "tokens_per_sec"} <= set(r) for r in rows)
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]
    assert list((tmp_path / "tensorboard").iterdir())

    # Resume on another mesh and rule file.
    second = train(tmp_path, "--config.steps=6", "--config.rules=megatron_1d", "--config.mesh=dp=4,mp=2")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from step 4" in second.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 4, 5, 6]


def test_user_errors_are_one_line_without_traceback(tmp_path):
    bad_rules = tmp_path / "bad.yaml"
    bad_rules.write_text("mesh_axes: [dp, mp]\nrules:\n  - [batch, tp]\n")
    cases = {
        f"--config.rules={bad_rules}": "bad.yaml: rule 1 (line 3) maps 'batch' to mesh axis 'tp'",
        "--config.mesh=dp=3,mp=4": "mesh 'dp=3,mp=4' has 12 devices but 8 are available",
        "--config.grad_accum=3": "config.batch_size=8 is not divisible by config.grad_accum=3",
        "--config.data.train_files=/nonexistent/*.txt": "no file matches '/nonexistent/*.txt'",
        "--config.model.attention=cudnn --config.model.dtype=bfloat16": (
            "config.model.attention='cudnn' needs GPU devices; this run's are cpu"
        ),
    }
    for flag, message in cases.items():
        result = train(tmp_path / "run", "--config.steps=2", *flag.split())
        assert result.returncode == 1, (flag, result.stderr[-2000:])
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert errors and message in errors[0], (flag, result.stderr[-2000:])
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # nothing written before the error
    result = train("/dev/null/run", "--config.steps=2")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: --workdir=/dev/null/run: /dev/null is a file, not a directory"]


@pytest.mark.parametrize(
    "command, cwd, message",
    [
        (
            ["train.py", "--workdir=WORKDIR", "--config=configs/tiny.py", "--config.rule=dp"],
            ROOT,
            """--config.rule: the config has no key 'rule' (Did you mean "rules" instead of "rule"?)""",
        ),
        (
            ["train.py", "--workdir=WORKDIR", "--config=configs/nope.py"],
            ROOT,
            "--config=configs/nope.py: no such file (cwd ROOT)",
        ),
        (
            ["train.py", "--workdir=WORKDIR", "config.steps=5"],
            ROOT,
            "unexpected argument 'config.steps=5' (flags are --NAME=VALUE, config keys --config.KEY=VALUE)",
        ),
        # No --config: bench.py loads its default, and applies the overrides, while defining its flags.
        (["bench.py", "--config.model.nope=1"], ROOT, "--config.model.nope: the config has no key 'nope'"),
        (
            ["train.py", "--workdir=WORKDIR", "--config.model.hidden_size=64"],
            ROOT,
            "--config.model.hidden_size: the config has no key 'hidden_size' "
            "(gspmd_tp calls it config.model.d_model)",
        ),
        (["-m", "gspmd_tp.plan"], "TMP", "--config=configs/tiny.py (the default): no such file (cwd TMP)"),
    ],
)
def test_config_file_and_key_mistakes_are_one_line(tmp_path, command, cwd, message):
    command = [a.replace("WORKDIR", str(tmp_path / "run")) for a in command]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cwd = tmp_path if cwd == "TMP" else cwd
    if command[0].endswith(".py"):
        command[0] = str(ROOT / command[0])
    result = subprocess.run(
        [sys.executable, *command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert (
        result.stderr.strip().splitlines()[-1]
        == f"error: {message.replace('TMP', str(tmp_path)).replace('ROOT', str(ROOT))}"
    )
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--config.steps=abc"], "flag --config.steps=abc: invalid literal for int() with base 10: 'abc'"),
        (["--worksdir=x"], "Unknown command line flag 'worksdir'. Did you mean: workdir ?"),
        ([], "flag --workdir=None: Flag --workdir must have a value other than None."),
    ],
)
def test_flag_mistakes_are_one_line(args, message):
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 1
    assert result.stderr == f"error: {message} (--helpshort lists the flags)\n"


@pytest.mark.parametrize(
    "body, message",
    [
        ("def get_config(:\n    pass\n", "--config=CFG: invalid syntax (line 1) in CFG"),
        ("X = 1\n", "--config=CFG: the file defines no get_config()"),
        (
            "def get_config():\n    return {'steps': 1}\n",
            "--config=CFG: get_config() returned a value of type dict ({'steps",
        ),
        (
            "def get_config():\n    return 5\n",
            "--config=CFG: get_config() returned a value of type int (5), not",
        ),
        (
            "import no_such_module\n",
            "--config=CFG: ModuleNotFoundError: No module named 'no_such_module' (line 1)",
        ),
        (
            "def get_config():\n    raise RuntimeError('no data')\n",
            "--config=CFG: RuntimeError: no data (line 2)",
        ),
        (  # ml_collections re-raises a TypeError or ValueError with the whole traceback as its text
            "def get_config():\n    return int('abc')\n",
            "--config=CFG: ValueError: invalid literal for int() with base 10: 'abc' (line 2)",
        ),
        (
            "def get_config(variant):\n    pass\n",
            "--config=CFG: TypeError: get_config() missing 1 required positional argument: 'variant'",
        ),
        (
            "def get_config():\n    pass\n",
            "--config=CFG: get_config() returned a value of type NoneType (None), not",
        ),
        (
            "from configs import tiny\ndef get_config():\n    c = tiny.get_config()\n"
            "    c.optim.learning_rate = 1e-4\n    return c\n",
            "config.optim.learning_rate is not a key gspmd_tp reads; gspmd_tp calls it config.optim.lr",
        ),
        (
            "from configs import tiny\ndef get_config():\n    c = tiny.get_config()\n"
            "    c.wandb_project = 'x'\n    return c\n",
            "config.wandb_project is not a key gspmd_tp reads (known: batch_size,",
        ),
        (
            "from configs import tiny\ndef get_config():\n    c = tiny.get_config()\n"
            "    del c['loss_chunk']\n    return c\n",
            "config.loss_chunk is missing (configs/tiny.py sets 0)",
        ),
    ],
    ids=[
        "syntax",
        "no-get_config",
        "dict",
        "int",
        "import",
        "raises",
        "raises-valueerror",
        "needs-an-argument",
        "none",
        "misspelt-key",
        "unknown-key",
        "missing-key",
    ],
)
def test_a_config_file_that_is_wrong_is_one_line(tmp_path, body, message):
    cfg = tmp_path / "mine.py"
    cfg.write_text(body)
    env = child_env()
    result = subprocess.run(
        [sys.executable, "train.py", f"--config={cfg}", f"--workdir={tmp_path / 'run'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.splitlines()) == 1, result.stderr[-2000:]
    assert result.stderr.startswith(f"error: {message.replace('CFG', str(cfg))}"), result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "body, message",
    [
        (None, "--config=CFG: no such file (cwd ROOT)"),
        (
            "def get_config():\n    raise RuntimeError('no data')\n",
            "--config=CFG: RuntimeError: no data (line 2)",
        ),
        ("X = 1\n", "--config=CFG: the file defines no get_config()"),
    ],
    ids=["missing", "raises", "no-get_config"],
)
def test_a_config_file_given_in_absls_space_form_is_the_one_named(tmp_path, body, message):
    """`--config FILE` (absl's other spelling) named the default configs/tiny.py in the error."""
    cfg = tmp_path / "mine.py"
    if body is not None:
        cfg.write_text(body)
    result = subprocess.run(
        [sys.executable, "train.py", "--config", str(cfg), f"--workdir={tmp_path / 'run'}"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr == f"error: {message.replace('CFG', str(cfg)).replace('ROOT', str(ROOT))}\n"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "command, given, message",
    [
        (
            ["train.py", "--config=configs/tiny.py", *SMALL, "--config.steps=1"],
            "run/checkpoints",
            "--workdir=RUN/checkpoints is the checkpoints directory of RUN, not a run's directory; "
            "pass --workdir=RUN",
        ),
        (
            ["train.py", "--config=configs/tiny.py", *SMALL, "--config.steps=1"],
            "run/checkpoints/4",
            "--workdir=RUN/checkpoints/4 is step 4 of the checkpoints of RUN, not a run's directory; "
            "pass --workdir=RUN (--step=4 reads that step)",
        ),
        (
            ["-m", "gspmd_tp.convert", "from-hf", "--hf_dir=/nonexistent"],
            "run/checkpoints",
            "--workdir=RUN/checkpoints is the checkpoints directory of RUN, not a run's directory; "
            "pass --workdir=RUN",
        ),
        (
            ["-m", "gspmd_tp.evaluate"],
            "run/checkpoints",
            "--workdir=RUN/checkpoints is the checkpoints directory of RUN, not a run's directory; "
            "pass --workdir=RUN",
        ),
    ],
    ids=["train-checkpoints-dir", "train-step-dir", "from-hf-checkpoints-dir", "evaluate-checkpoints-dir"],
)
def test_a_checkpoints_directory_given_as_workdir_is_one_line(tmp_path, command, given, message):
    """The checkpoint tool takes a run's checkpoints/ or one step directory; train.py given one
    started a fresh run inside the other run's checkpoints (its own checkpoints/, metrics and lock
    in there), and the readers looked for checkpoints/checkpoints."""
    step = tmp_path / "run" / "checkpoints" / "4"
    for item in ("state", "meta", "data"):
        (step / item).mkdir(parents=True)
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    result = subprocess.run(
        [sys.executable, *command, f"--workdir={tmp_path / given}"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr == f"error: {message.replace('RUN', str(tmp_path / 'run'))}\n"
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written


def test_a_run_directory_named_by_a_number_is_a_workdir(tmp_path):
    """Only a directory that holds a checkpoint's items is taken for a step: a run named 1 may keep
    its data/ (one of a step's item names) and its own checkpoints/."""
    from gspmd_tp.checkpoint import step_dirs

    run = tmp_path / "1"
    (run / "data").mkdir(parents=True)
    (run / "checkpoints" / "2" / "state").mkdir(parents=True)
    (run / "checkpoints" / "2" / "meta").mkdir()
    step_dirs.check_workdir_given(str(run))
    step_dirs.check_workdir_given(str(tmp_path))
    with pytest.raises(step_dirs.UserError, match="is the checkpoints directory of "):
        step_dirs.check_workdir_given(str(run / "checkpoints"))
    with pytest.raises(step_dirs.UserError, match="is step 2 of the checkpoints of "):
        step_dirs.check_workdir_given(str(run / "checkpoints" / "2"))


def test_a_file_given_as_workdir_is_named_a_file(tmp_path):
    """evaluate, generate and to-hf said 'no checkpoint found (looked in FILE/checkpoints)', and
    the checkpoint tool the same, for a --workdir that is a file."""
    from gspmd_tp.checkpoint import step_dirs, tool

    path = tmp_path / "notes.txt"
    path.write_text("x")
    with pytest.raises(step_dirs.UserError, match=rf"^--workdir={path} is a file, not a run's directory$"):
        step_dirs.check_workdir_given(str(path))
    with pytest.raises(step_dirs.UserError, match=rf"^{path} is a file, not a run's directory, its "):
        tool.info(str(path))


def test_a_tilde_in_the_workdir_rule_file_and_init_from_is_the_home_directory(tmp_path):
    """bash leaves `--workdir=~/x` and `--config.rules=~/r.yaml` as they are (the word is no
    assignment): train.py made a directory named ~ in the working directory, and found no rule file."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("x")
    (home / "mine.yaml").write_text((ROOT / "rules" / "megatron_1d.yaml").read_text())
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    train = [sys.executable, str(ROOT / "train.py"), "--config=" + str(ROOT / "configs" / "tiny.py"), *SMALL]
    runs = [
        (["--workdir=~/notes.txt"], f"error: --workdir={home}/notes.txt is a file, not a run's directory"),
        (
            [f"--workdir={tmp_path / 'run'}", "--config.rules=~/mine.yaml", "--config.init_from=~/p.npz"],
            f"error: config.init_from: no file {home}/p.npz",  # read once the rule file was
        ),
    ]
    for args, message in runs:
        result = subprocess.run(
            [*train, "--config.steps=1", *args],
            cwd=cwd, env=child_env(HOME=str(home)), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 1, result.stderr[-2000:]
        assert result.stderr.strip().splitlines()[-1] == message
    assert os.listdir(cwd) == [] and not (tmp_path / "run").exists()
