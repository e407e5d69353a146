"""Every shipped config loads, names its command, and sets up on 8 devices without compiling."""

import importlib
from pathlib import Path

import pytest

from gspmd_tp.job.errors import UserError
from gspmd_tp.train import run_setup

CONFIGS = sorted(p.stem for p in (Path(__file__).parents[2] / "configs").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", CONFIGS)
def test_config_sets_up(name):
    module = importlib.import_module(f"configs.{name}")
    assert f"--config=configs/{name}.py" in module.__doc__
    config = module.get_config()
    s = run_setup.setup(config)
    assert s.mesh.size == 8
    assert s.model_cfg.validate() == []


def test_a_model_key_under_another_trainers_name_is_named_with_ours():
    config = importlib.import_module("configs.tiny").get_config()
    with config.unlocked():  # a config file cannot: tiny's is locked
        config.model.num_hidden_layers = 2
    with pytest.raises(
        UserError, match=r"^config.model has unknown key 'num_hidden_layers' \(gspmd_tp calls it"
    ):
        run_setup.model_config(config)


def test_the_train_steps_gradient_dtype_is_not_a_model_key():
    config = importlib.import_module("configs.tiny").get_config()
    with config.unlocked():
        config.model.grad_dtype = "bfloat16"
    with pytest.raises(UserError, match=r"^config.model.grad_dtype is the train step's, .*grad_reduce_dtype"):
        run_setup.model_config(config)


def test_every_name_of_another_trainer_points_to_a_key_we_have():
    from gspmd_tp.cli import config_keys

    config, absent = config_keys.default_config(), object()
    for theirs, path in config_keys.OTHER_NAMES.items():
        assert config_keys.lookup(config, path, absent) is not absent, (theirs, path)
    assert config_keys.lookup(config, "optim.learning_rate", absent) is absent
    assert config_keys.lookup(config, "optim.lr.value", absent) is absent


def test_llama3_8b_has_llama_3_8bs_parameter_count():
    """Meta's Llama 3 8B has 8.03B parameters (untied embedding and output projection)."""
    from gspmd_tp.model.params import param_count

    config = importlib.import_module("configs.llama3_8b").get_config()
    counts = param_count(run_setup.model_config(config))
    assert counts["total"] == 8_030_261_248, counts
