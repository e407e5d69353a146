"""train.py end to end, as a user runs it: metrics, checkpoints, resume, one-line user errors.

What fails inside the trainer is a UserError, which every command prints as one line: those errors
are raised here by the trainer's function in-process, and a real process is started only where the
process is the subject (its exit status and stderr, its flags and config file)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env, small_config

from gspmd_tp.job.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ", ".join(sorted(p.stem for p in (ROOT / "configs").glob("*.py") if p.stem != "__init__"))
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


def train(workdir, *flags, **env):
    """train.py as a user runs it, its output captured; `env` added to the environment."""
    return subprocess.run(
        [sys.executable, "train.py", "--config=configs/tiny.py", f"--workdir={workdir}", *SMALL, *flags],
        cwd=ROOT, env=child_env(**env), capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _rows(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_metrics_and_checkpoints_then_resumes(trained_workdir, tmp_path, capsys):
    rows = _rows(trained_workdir)  # 4 steps of small_config()
    assert [r["step"] for r in rows] == [1, 2, 4]  # the first step, then every log_every
    assert all({"step", "loss", "tokens_per_sec"} <= set(r) for r in rows)
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    assert sorted(os.listdir(trained_workdir / "checkpoints")) == ["2", "4"]
    assert list((trained_workdir / "tensorboard").iterdir())

    # Resume on another mesh and rule file, from step 2 (the step test_resume.py's run on that mesh
    # compiles): its metrics from step 3 on are written again.
    workdir = tmp_path / "run"
    shutil.copytree(trained_workdir, workdir)
    shutil.rmtree(workdir / "checkpoints" / "4")
    capsys.readouterr()
    from gspmd_tp.train import loop

    loop.train(small_config(rules="megatron_1d", mesh="dp=4,mp=2"), str(workdir))
    out = capsys.readouterr().out
    assert "resumed from step 2" in out and "step 4/4 | loss" in out and "tok/s" in out
    assert [r["step"] for r in _rows(workdir)] == [1, 2, 3, 4]


def test_user_errors_are_one_line_without_traceback(tmp_path):
    from gspmd_tp.train import loop

    bad_rules = tmp_path / "bad.yaml"
    bad_rules.write_text("mesh_axes: [dp, mp]\nrules:\n  - [batch, tp]\n")
    cases = [
        ({"rules": str(bad_rules)}, "bad.yaml: rule 1 (line 3) maps 'batch' to mesh axis 'tp'"),
        ({"mesh": "dp=3,mp=4"}, "mesh 'dp=3,mp=4' has 12 devices but 8 are available"),
        ({"grad_accum": 3}, "config.batch_size=8 is not divisible by config.grad_accum=3"),
        ({"data.train_files": "/nonexistent/*.txt"}, "no file matches '/nonexistent/*.txt'"),
        (
            {"model.attention": "cudnn", "model.dtype": "bfloat16"},
            "config.model.attention='cudnn' needs GPU devices; this run's are cpu",
        ),
    ]
    for overrides, message in cases:
        with pytest.raises(UserError) as e:
            loop.train(small_config(steps=2, **overrides), str(tmp_path / "run"))
        assert message in str(e.value) and "\n" not in str(e.value), (overrides, str(e.value))
    assert not (tmp_path / "run").exists()  # nothing written before the error
    with pytest.raises(UserError, match="^--workdir=/dev/null/run: /dev/null is a file, not a directory$"):
        loop.train(small_config(steps=2), "/dev/null/run")

    # As train.py prints one, here with a leading ~ in --workdir (bash leaves `--workdir=~/x` as it
    # is: the word is no assignment), which is the home directory.
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("x")
    result = train("~/notes.txt", "--config.steps=1", HOME=str(home))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: --workdir={home}/notes.txt is a file, not a run's directory"]


def test_a_tilde_in_the_rule_file_and_init_from_is_the_home_directory(tmp_path, monkeypatch):
    """train.py found no rule file `--config.rules=~/r.yaml`, as bash leaves it."""
    from gspmd_tp.train import loop

    home = tmp_path / "home"
    home.mkdir()
    (home / "mine.yaml").write_text((ROOT / "rules" / "megatron_1d.yaml").read_text())
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)  # a directory named ~ is not made here
    config = small_config(steps=1, rules="~/mine.yaml", init_from="~/p.npz")
    with pytest.raises(
        UserError, match=re.escape(f"config.init_from: no file {home}/p.npz")
    ):  # after the rules
        loop.train(config, str(tmp_path / "run"))
    assert sorted(os.listdir(tmp_path)) == ["home"]


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
        # A bare name is a shipped config's (configs/NAME.py), from any directory.
        (
            ["train.py", "--workdir=WORKDIR", "--config=tiny", "--config.steps=0"],
            "TMP",
            "config.steps must be positive, got 0",
        ),
        (
            ["train.py", "--workdir=WORKDIR", "--config=tiny_"],
            "TMP",
            "--config=tiny_: no such file (cwd TMP), nor a shipped config (SHIPPED)",
        ),
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
    for word, meaning in (("TMP", str(tmp_path)), ("ROOT", str(ROOT)), ("SHIPPED", SHIPPED)):
        message = message.replace(word, meaning)
    assert result.stderr.strip().splitlines()[-1] == f"error: {message}"
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


_TINY = (
    "from gspmd_tp.configs import tiny\ndef get_config():\n    c = tiny.get_config()\n    {}\n    return c\n"
)

# A config file's mistakes, read before jax is imported: {id: (the file, or None for none, and the
# start of its one line, CFG standing for its path)}.
CONFIG_FILES = {
    "missing": (None, "--config=CFG: no such file (cwd ROOT)"),
    "syntax": ("def get_config(:\n    pass\n", "--config=CFG: invalid syntax (line 1) in CFG"),
    "no-get_config": ("X = 1\n", "--config=CFG: the file defines no get_config()"),
    "dict": (
        "def get_config():\n    return {'steps': 1}\n",
        "--config=CFG: get_config() returned a value of type dict ({'steps",
    ),
    "int": (
        "def get_config():\n    return 5\n",
        "--config=CFG: get_config() returned a value of type int (5), not",
    ),
    "import": (
        "import no_such_module\n",
        "--config=CFG: ModuleNotFoundError: No module named 'no_such_module' (line 1)",
    ),
    "raises": (
        "def get_config():\n    raise RuntimeError('no data')\n",
        "--config=CFG: RuntimeError: no data (line 2)",
    ),
    # ml_collections re-raises a TypeError or ValueError with the whole traceback as its text
    "raises-valueerror": (
        "def get_config():\n    return int('abc')\n",
        "--config=CFG: ValueError: invalid literal for int() with base 10: 'abc' (line 2)",
    ),
    "needs-an-argument": (
        "def get_config(variant):\n    pass\n",
        "--config=CFG: TypeError: get_config() missing 1 required positional argument: 'variant'",
    ),
    "none": (
        "def get_config():\n    pass\n",
        "--config=CFG: get_config() returned a value of type NoneType (None), not",
    ),
    # tiny.get_config() is locked: a key it lacks, or one taken away, is refused as the file loads.
    "key-misspelt": (
        _TINY.format("c.rule = 'dp'"),
        """--config=CFG: the config has no key 'rule' (Did you mean "rules" instead of "rule"?) (line 4)""",
    ),
    "key-of-another-trainer": (
        _TINY.format("c.optim.learning_rate = 1e-4"),
        "--config=CFG: the config has no key 'learning_rate' (gspmd_tp calls it config.optim.lr) (line 4)",
    ),
    "key-deleted": (
        _TINY.format("del c['loss_chunk']"),
        "--config=CFG: deletes a key of tiny's config, whose keys are locked (set its value instead) "
        "(line 4)",
    ),
}


# `--config FILE` (absl's other spelling) named the default configs/tiny.py in the error.
@pytest.mark.parametrize(
    "case, spelling",
    [(case, "=") for case in list(CONFIG_FILES)[1:]]
    + [(case, " ") for case in ("missing", "raises", "no-get_config")],
)
def test_a_config_file_that_is_wrong_is_one_line(tmp_path, case, spelling):
    body, message = CONFIG_FILES[case]
    cfg = tmp_path / "mine.py"
    if body is not None:
        cfg.write_text(body)
    result = subprocess.run(
        [sys.executable, "train.py", *f"--config{spelling}{cfg}".split(" "), f"--workdir={tmp_path / 'run'}"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(result.stderr.splitlines()) == 1, result.stderr[-2000:]
    assert result.stderr.startswith(f"error: {message.replace('CFG', str(cfg)).replace('ROOT', str(ROOT))}")
    assert not (tmp_path / "run").exists()


def test_config_keys_gspmd_tp_does_not_read_or_lacks_are_named_in_a_config_built_unlocked(tmp_path):
    """A config that is not tiny's locked one (built by hand, or unlocked): checked once jax is
    imported (here in-process), with ml_collections' suggestion where it has one. (A config file's
    own mistakes, which the lock refuses as it loads: CONFIG_FILES.)"""
    from gspmd_tp.train import loop

    def unknown(c):
        c.optim.learning_rate = 1e-4

    cases = [
        (
            unknown,
            "config.optim.learning_rate is not a key gspmd_tp reads (gspmd_tp calls it config.optim.lr)",
        ),
        (lambda c: setattr(c, "rule", "dp"), 'config.rule is not a key gspmd_tp reads (Did you mean "rules"'),
        (lambda c: setattr(c, "wandb_project", "x"), "config.wandb_project is not a key gspmd_tp reads"),
        (
            lambda c: c.data.__delitem__("seed"),
            "config.data.seed is missing (configs/tiny.py sets 0); start from",
        ),
    ]
    for change, message in cases:
        config = small_config(steps=1)
        with config.unlocked():
            change(config)
        with pytest.raises(UserError) as e:
            loop.train(config, str(tmp_path / "run"))
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "run").exists()


_CHECKPOINTS_DIR = (
    "--workdir=RUN/checkpoints is the checkpoints directory of RUN, not a run's directory; pass --workdir=RUN"
)


def test_a_checkpoints_directory_given_as_workdir_is_one_line(tmp_path, capsys):
    """The checkpoint tool takes a run's checkpoints/ or one step directory; train.py given one
    started a fresh run inside the other run's checkpoints (its own checkpoints/, metrics and lock
    in there), and the readers looked for checkpoints/checkpoints."""
    from gspmd_tp.inference import evaluate
    from gspmd_tp.train import loop

    run = tmp_path / "run"
    step = run / "checkpoints" / "4"
    for item in ("state", "meta", "data"):
        (step / item).mkdir(parents=True)
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    said = lambda message: message.replace("RUN", str(run))  # noqa: E731
    with pytest.raises(UserError) as e:
        loop.train(small_config(steps=1), str(run / "checkpoints"))
    assert str(e.value) == said(_CHECKPOINTS_DIR)
    with pytest.raises(UserError) as e:
        loop.train(small_config(steps=1), str(step))
    assert str(e.value) == said(
        "--workdir=RUN/checkpoints/4 is step 4 of the checkpoints of RUN, not a run's directory; "
        "pass --workdir=RUN (--step=4 reads that step)"
    )
    capsys.readouterr()
    assert evaluate.main([f"--workdir={run / 'checkpoints'}"]) == 1
    assert capsys.readouterr().err == f"error: {said(_CHECKPOINTS_DIR)}\n"
    result = subprocess.run(
        [sys.executable, "-m", "gspmd_tp.convert", "from-hf", "--hf_dir=/x", f"--workdir={run}/checkpoints"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr == f"error: {said(_CHECKPOINTS_DIR)}\n"
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
