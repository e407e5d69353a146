"""A checkpoint written by an earlier version still reads, evaluates and resumes.

tests/checkpoint/old_run was trained by the flat-module layout (two steps of a d_model-16 model,
megatron_1d on dp=2,mp=4); its saved model config carries `projection_grad`, a key since removed.
"""

import json
import shutil
from pathlib import Path

import pytest

from gspmd_tp.inference import evaluate, saved_run
from gspmd_tp.train import loop

OLD_RUN = Path(__file__).parent / "old_run"


@pytest.fixture
def old_run(tmp_path) -> Path:
    return Path(shutil.copytree(OLD_RUN, tmp_path / "run"))


def _logged(run: Path) -> dict:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_an_old_checkpoint_evaluates_to_the_loss_it_logged_on_another_mesh(old_run):
    step, _, s = saved_run.load_setup(str(old_run), {"mesh": "dp=4,mp=2", "rules": "megatron_2d"})
    params = saved_run.restore_params(str(old_run), step, s)
    result = evaluate.evaluate_params(s, params)
    assert step == 2
    assert result["loss"] == pytest.approx(_logged(old_run)[2]["eval_loss"], rel=1e-5)


def test_an_old_checkpoint_resumes(old_run):
    _, _, config = saved_run.saved_config(str(old_run), {"steps": "3"})
    last = loop.train(config, str(old_run))
    assert last["step"] == 3 and 0 < last["loss"] < 10
    assert sorted(_logged(old_run)) == [1, 2, 3]
