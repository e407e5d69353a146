"""The wheel `pip install .` builds: the shipped configs and rule files inside it, found by name from
any directory, with no checkout on the path; a config and a rule file of one's own found by path."""

import json
import math
import shutil
import subprocess
import sys

from conftest import ROOT, child_env

# The small model of tests/job/test_train_cli.py, so that plan and two steps compile in seconds.
SMALL = [
    "--config.batch_size=8",
    "--config.seq_len=32",
    "--config.model.d_model=64",
    "--config.model.num_layers=2",
    "--config.model.mlp_dim=128",
]


def _run(args, cwd, env):
    result = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_the_wheel_plans_and_trains_by_name_from_another_directory(tmp_path):
    # A copy of what the build reads (its links included), so that the build writes nothing here.
    source = tmp_path / "source"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "gspmd_tp", source / "gspmd_tp", symlinks=True, ignore=skip)
    for folder in ("configs", "rules"):
        shutil.copytree(ROOT / folder, source / folder, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = ["-m", "pip", "--disable-pip-version-check", "--quiet"]
    _run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
        tmp_path,
        None,
    )
    (wheel,) = (tmp_path / "dist").glob("gspmd_tp-*.whl")
    site = tmp_path / "site"
    _run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], tmp_path, None)
    assert sorted(p.name for p in (site / "gspmd_tp" / "rules").glob("*.yaml")) == sorted(
        p.name for p in (ROOT / "rules").glob("*.yaml")
    )

    # The installed package alone: no checkout on the path, and the cwd a directory of nothing.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = child_env(PYTHONPATH=str(site))
    found = _run(["-c", "import gspmd_tp; print(gspmd_tp.__file__)"], elsewhere, env)
    assert found.strip() == str(site / "gspmd_tp" / "__init__.py")

    plan = json.loads(
        _run(
            ["-m", "gspmd_tp.plan", "--config=tiny", "--config.rules=megatron_1d", "--json", *SMALL],
            elsewhere,
            env,
        )
    )
    assert plan["rules"] == str(site / "gspmd_tp" / "rules" / "megatron_1d.yaml")
    assert (plan["mesh"], plan["devices"]) == ("dp=2,mp=4", 8)  # tiny's mesh, on the 8 devices plan asks for

    # A config of one's own that starts from the wheel's, and a rule file of one's own: by path.
    (elsewhere / "mine.py").write_text(
        "from gspmd_tp.configs import tiny\n\n\ndef get_config():\n    c = tiny.get_config()\n"
        "    c.steps, c.log_every, c.eval_every, c.eval_batches = 2, 1, 2, 1\n    return c\n"
    )
    shutil.copy(ROOT / "rules" / "dp.yaml", elsewhere / "mine.yaml")
    flags = ["--config=mine.py", "--workdir=run", "--config.rules=mine.yaml", "--config.mesh=dp=8,mp=1"]
    out = _run(["-m", "gspmd_tp.train", *flags, *SMALL], elsewhere, env)
    assert "| rules mine.yaml\n" in out, out  # the file in the cwd, as the trainer shows a path under it
    rows = [json.loads(line) for line in (elsewhere / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # A fresh model over 256 byte tokens starts near the uniform guess's loss, ln 256.
    assert abs(rows[0]["loss"] - math.log(256)) < 0.3, rows[0]
    assert sorted(p.name for p in (elsewhere / "run" / "checkpoints").iterdir()) == ["2"]
