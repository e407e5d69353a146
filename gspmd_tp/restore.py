"""A trained run brought back for sampling and evaluation (gspmd_tp.generate, gspmd_tp.evaluate).

The run's own config comes from its newest checkpoint, with `--config.KEY=VALUE` overrides on top
(typically `rules` and `mesh`: a model trained under one rule file samples under another). Only
the parameters are read, not the optimizer state, each device reading its shard of the sharding
the current mesh and rule file give it. Nothing in the workdir is written or removed.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import orbax.checkpoint as ocp
from ml_collections import ConfigDict

from gspmd_tp import checkpoint, trainer
from gspmd_tp.errors import UserError
from gspmd_tp.rules import RULES_DIR

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
# Every shipped config starts from this one: its keys are the defaults of keys a run saved before
# they existed does not have.
DEFAULT_CONFIG = RULES_DIR.parent / "configs" / "tiny.py"


def _default_config() -> dict:
    spec = importlib.util.spec_from_file_location("gspmd_tp_default_config", DEFAULT_CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config().to_dict()


def _laid_over(defaults: dict, saved: dict) -> dict:
    """`saved`, with the keys it lacks (at any depth) taken from `defaults`."""
    merged = dict(defaults)
    for key, value in saved.items():
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            value = _laid_over(defaults[key], value)
        merged[key] = value
    return merged


def split_overrides(args: list[str]) -> dict[str, str]:
    """{"rules": "megatron_1d", "mesh": "dp=4,mp=2"} from ["--config.rules=megatron_1d", ...]."""
    overrides = {}
    for arg in args:
        key, eq, value = arg.removeprefix("--config.").partition("=")
        if not arg.startswith("--config.") or not eq or not key:
            raise UserError(f"unrecognized argument {arg!r} (config overrides are --config.KEY=VALUE)")
        overrides[key] = value
    return overrides


def _coerce(key: str, value: str, current):
    """`value` as the type of the key's saved value (bool before int: bool is an int)."""
    try:
        if isinstance(current, bool):
            if value.lower() not in _TRUE + _FALSE:
                raise ValueError(value)
            return value.lower() in _TRUE
        if isinstance(current, int):
            return int(value)
        if isinstance(current, float):
            return float(value)
    except ValueError:
        raise UserError(
            f"--config.{key}={value}: expected {type(current).__name__} (saved: {current!r})"
        ) from None
    return value


def apply_overrides(config: ConfigDict, overrides: dict[str, str]) -> ConfigDict:
    """Sets each dotted key of `overrides` on `config`, converted to the type of the saved value."""
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        target = config
        for part in parents:
            if part not in target or not isinstance(target[part], ConfigDict):
                raise UserError(f"--config.{key}: the run's config has no section {part!r}")
            target = target[part]
        if leaf not in target:
            raise UserError(f"--config.{key}: the run's config has no key {key!r}")
        target[leaf] = _coerce(key, value, target[leaf])
    return config


def saved_config(workdir: str, overrides: dict[str, str]) -> tuple[int, dict, ConfigDict]:
    """(step, meta, config) of the newest readable checkpoint in workdir, overrides applied.

    Reads JSON only; raises UserError when there is no checkpoint.
    """
    found = checkpoint.readable_checkpoints(workdir, warn=lambda m: print(m, file=sys.stderr))
    if not found:
        raise UserError(
            f"{workdir}: no checkpoint found (looked in {checkpoint.checkpoint_dir(workdir)}); "
            f"train one first: python train.py --workdir={workdir}"
        )
    step, meta = found[0]
    config = ConfigDict(_laid_over(_default_config(), meta["config"]))
    config.model = ConfigDict(checkpoint.saved_model(meta["model"]))  # what its parameters are
    return step, meta, apply_overrides(config, overrides)


def load_setup(workdir: str, overrides: dict[str, str]) -> tuple[int, dict, trainer.Setup]:
    """(step, meta, Setup) for the run in workdir: config, rule file and mesh checked, nothing compiled."""
    step, meta, config = saved_config(workdir, overrides)
    s = trainer.setup(config)
    checkpoint.check_model_matches(meta["model"], s.model_cfg, workdir)
    return step, meta, s


def restore_params(workdir: str, step: int, s: trainer.Setup):
    """The parameters of checkpoint `step`, read straight into the shardings of `s`."""
    target = s.abstract_state.params
    path = os.path.join(checkpoint.checkpoint_dir(workdir), str(step), checkpoint.STATE)
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            path,
            args=ocp.args.PyTreeRestore(
                item={"params": target}, restore_args={"params": restore_args}, partial_restore=True
            ),
        )
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: the parameters do not restore ({type(e).__name__}: {e})") from None
    return restored["params"]
