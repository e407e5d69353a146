"""The keys a run's config has: those of configs/tiny.py, which every shipped config starts from.

A key a config file misspells (`optim.learning_rate` for `optim.lr`) would otherwise be silently
unused; a key it lacks would fail deep inside the run. Imports no jax.
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

from ml_collections import ConfigDict

from gspmd_tp.job.errors import UserError

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.py"


# What other trainers (MaxText, t5x, levanter, Hugging Face) call some of the keys, for the hint a
# key given under such a name gets.
OTHER_NAMES = {
    "learning_rate": "optim.lr",
    "warmup": "optim.warmup_steps",
    "lr_warmup_steps": "optim.warmup_steps",
    "beta1": "optim.b1",
    "beta2": "optim.b2",
    "adam_b1": "optim.b1",
    "adam_b2": "optim.b2",
    "adam_eps": "optim.eps",
    "max_grad_norm": "optim.clip_norm",
    "gradient_clipping_threshold": "optim.clip_norm",
    "mu_dtype": "optim.mu_dtype",
    "num_train_steps": "steps",
    "total_steps": "steps",
    "max_steps": "steps",
    "train_steps": "steps",
    "global_batch_size": "batch_size",
    "train_batch_size": "batch_size",
    "gradient_accumulation_steps": "grad_accum",
    "max_target_length": "seq_len",
    "seq_length": "seq_len",
    "max_seq_len": "seq_len",
    "hidden_size": "model.d_model",
    "emb_dim": "model.d_model",
    "num_hidden_layers": "model.num_layers",
    "num_decoder_layers": "model.num_layers",
    "num_attention_heads": "model.num_heads",
    "num_key_value_heads": "model.num_kv_heads",
    "intermediate_size": "model.mlp_dim",
    "ffn_dim": "model.mlp_dim",
}


def ours(key: str) -> str | None:
    """`config.PATH` of the key other trainers call `key`, or None."""
    path = OTHER_NAMES.get(key.lower())
    return f"config.{path}" if path else None


def default_config() -> dict:
    """configs/tiny.py's config as a plain dict."""
    spec = importlib.util.spec_from_file_location("gspmd_tp_default_config", DEFAULT_CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config().to_dict()


def lookup(config: dict, dotted: str, default=None):
    """The value at `dotted` ("optim.lr") in a nested config dict; `default` where a part is missing."""
    for part in dotted.split("."):
        if not isinstance(config, dict) or part not in config:
            return default
        config = config[part]
    return config


def laid_over(defaults: dict, saved: dict) -> dict:
    """`saved`, with the keys it lacks (at any depth) taken from `defaults` and the keys `defaults`
    lacks (ones a newer version no longer reads) left out."""
    merged = dict(defaults)
    for key, value in saved.items():
        if key not in defaults:
            continue
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            value = laid_over(defaults[key], value)
        merged[key] = value
    return merged


def check_keys(config, skip: tuple[str, ...] = ("model",)) -> None:
    """Raises UserError naming the first key `config` has and the default config lacks, or the
    reverse; the sections in `skip` are checked elsewhere (config.model by run_setup.model_config)."""
    problem = _first_difference(config.to_dict(), default_config(), "config", skip)
    if problem:
        raise UserError(problem)


def _first_difference(given: dict, known: dict, where: str, skip: tuple[str, ...]) -> str | None:
    for key in given:
        if key in skip:
            continue
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f"; did you mean {where}.{close[0]}?" if close else f" (known: {', '.join(sorted(known))})"
            if named := ours(key):
                hint = f"; gspmd_tp calls it {named}"
            return f"{where}.{key} is not a key gspmd_tp reads{hint}"
        if isinstance(known[key], dict) and isinstance(given[key], dict):
            problem = _first_difference(given[key], known[key], f"{where}.{key}", ())
            if problem:
                return problem
    for key in known:
        if key not in given and key not in skip:
            tiny = f"configs/tiny.py sets {known[key]!r}"
            return f"{where}.{key} is missing ({tiny}); start from configs/tiny.py get_config()"
    return None


def changed(saved: dict, now: dict, skip: tuple[str, ...] = (), where: str = "") -> list[str]:
    """`KEY before -> after` for each key whose value differs between two config dicts (the keys
    `saved` lacks, added since it was written, are taken as equal); dotted keys in `skip` are left out."""
    lines = []
    for key, value in now.items():
        dotted = f"{where}{key}"
        if dotted in skip or key not in saved:
            continue
        if isinstance(value, dict) and isinstance(saved[key], dict):
            lines += changed(saved[key], value, skip, f"{dotted}.")
        elif saved[key] != value:
            lines.append(f"{dotted} {saved[key]!r} -> {value!r}")
    return lines


_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


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
            named = ours(leaf)
            hint = f" (gspmd_tp calls it {named})" if named else ""
            raise UserError(f"--config.{key}: the run's config has no key {key!r}{hint}")
        target[leaf] = _coerce(key, value, target[leaf])
    return config
