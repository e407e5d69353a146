"""The keys a run's config has: configs/tiny.py's, a locked ConfigDict every shipped config starts
from, so a key it lacks fails as the file loads with ml_collections' "did you mean". check_keys
holds a config built otherwise to the same keys. Imports no jax.
"""

from __future__ import annotations

import importlib.util
import re

from ml_collections import ConfigDict

from gspmd_tp.cli.arguments import CONFIGS
from gspmd_tp.job.errors import UserError

DEFAULT_CONFIG = CONFIGS / "tiny.py"


# What other trainers (MaxText, t5x, levanter, Hugging Face) call some keys: the hint such a key gets.
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
    # Mixtures of experts and the query/key norm: Hugging Face's names (Mixtral, Qwen3-MoE, Llama 4).
    "num_local_experts": "model.num_experts",
    "num_experts_per_tok": "model.experts_per_token",
    "moe_intermediate_size": "model.expert_mlp_dim",
    "norm_topk_prob": "model.router_renormalize",
    "use_qk_norm": "model.qk_norm",
}


def ours(key: str) -> str | None:
    """`config.PATH` of the key other trainers call `key`, or None."""
    path = OTHER_NAMES.get(key.lower())
    return f"config.{path}" if path else None


def _tiny() -> ConfigDict:
    """configs/tiny.py's config (locked), loaded by path: the package's layers import no config."""
    spec = importlib.util.spec_from_file_location("gspmd_tp_default_config", DEFAULT_CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def default_config() -> dict:
    """configs/tiny.py's config as a plain dict."""
    return _tiny().to_dict()


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
    """UserError naming the first key `config` has that tiny's locked config refuses, or one it
    lacks; the sections in `skip` are checked elsewhere (run_setup.model_config)."""
    _check(config.to_dict(), _tiny(), "config", skip)


def _check(given: dict, locked: ConfigDict, where: str, skip: tuple[str, ...] = ()) -> None:
    for key, value in given.items():
        if key in skip:
            continue
        if key not in locked:
            try:
                locked[key] = value  # refused: the key is not tiny's
            except KeyError as e:
                hint = refusal_hint(key, str(e.args[0]) if e.args else "")
                raise UserError(f"{where}.{key} is not a key gspmd_tp reads{hint}") from None
        if isinstance(value, dict) and isinstance(locked[key], ConfigDict):
            _check(value, locked[key], f"{where}.{key}")
    for key, value in locked.items():
        if key not in given and key not in skip:
            sets = f"configs/tiny.py sets {value.to_dict() if isinstance(value, ConfigDict) else value!r}"
            raise UserError(f"{where}.{key} is missing ({sets}); start from configs/tiny.py get_config()")


def refusal_hint(key: str, refusal: str) -> str:
    """ " (gspmd_tp calls it config.PATH)" for another trainer's name, else the locked ConfigDict's
    `refusal` suggestion (" (Did you mean ...?)"), else ""."""
    if named := ours(key):
        return f" (gspmd_tp calls it {named})"
    suggestion = re.search(r"Did you mean .*\?", refusal)
    return f" ({suggestion.group(0)})" if suggestion else ""


def changed(saved: dict, now: dict, skip: tuple[str, ...] = (), where: str = "") -> list[str]:
    """`KEY before -> after` for each key whose value differs (keys `saved` lacks count as equal);
    dotted keys in `skip` are left out."""
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
