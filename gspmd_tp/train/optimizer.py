"""The optax chain: global-norm clipping, then AdamW on a warmup + cosine schedule."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from gspmd_tp.cli.config_keys import laid_over, lookup
from gspmd_tp.job.errors import UserError

_FLOAT32_MAX = float(np.finfo(np.float32).max)  # the optimizer's rates and factors are float32 on the devices
MU_DTYPES = ("float32", "bfloat16")  # config.optim.mu_dtype: the first moment's dtype
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")  # config.optim.grad_reduce_dtype


def _decays(path) -> bool:
    # Norm scales are not decayed (they multiply, and pulling them to 0 shrinks the signal).
    keys = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
    return not any("norm" in k for k in keys)


def decay_mask(params):
    """True for leaves that get weight decay: everything but the norm scales."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _decays(path), params)


def check(optim) -> None:
    """Checks config.optim's values; raises UserError naming the key."""
    for key in ("lr", "warmup_steps", "eps", "weight_decay", "clip_norm"):
        if not 0 <= optim[key] < math.inf:  # nan and inf too: the first step would be non-finite
            finite = "" if math.isfinite(optim[key]) else " and finite"
            raise UserError(f"config.optim.{key} must be 0 or more{finite}, got {optim[key]}")
        if optim[key] > _FLOAT32_MAX:  # inf on the devices: the first update would be NaN or Inf
            raise UserError(
                f"config.optim.{key}={optim[key]} is beyond float32's range ({_FLOAT32_MAX:.4g}), "
                "in which the optimizer computes"
            )
    if not 0 <= optim.min_lr_ratio <= 1:
        raise UserError(f"config.optim.min_lr_ratio must be in [0, 1], got {optim.min_lr_ratio}")
    for key in ("b1", "b2"):
        if not 0 <= optim[key] < 1:
            raise UserError(f"config.optim.{key} must be in [0, 1), got {optim[key]}")
    for key, choices in (("mu_dtype", MU_DTYPES), ("grad_reduce_dtype", GRAD_REDUCE_DTYPES)):
        if optim[key] not in choices:
            raise UserError(f"config.optim.{key} must be one of {', '.join(choices)}, got {optim[key]!r}")


def make_schedule(optim, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to optim.lr, then cosine decay to optim.lr * optim.min_lr_ratio."""
    warmup = min(optim.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=optim.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=optim.lr * optim.min_lr_ratio,
    )


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm as one scalar factor, min(1, max_norm / norm), on every update.

    The same values as optax's per-element select; a scalar multiply fuses into AdamW's moment
    updates, so the update makes one pass fewer over the gradients. Same state (none) as optax's,
    so checkpoints of either restore with the other.
    """

    def update(updates, state, params=None):
        del params
        scale = jnp.minimum(1.0, max_norm / optax.global_norm(updates))
        return jax.tree.map(lambda t: t * scale.astype(t.dtype), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def make_optimizer(optim, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer for config.optim; clipping sees the whole accumulated gradient (clip_norm 0:
    no clipping); AdamW keeps its first moment in optim.mu_dtype."""
    schedule = make_schedule(optim, total_steps)
    clip = clip_by_global_norm(optim.clip_norm) if optim.clip_norm > 0 else optax.identity()
    tx = optax.chain(
        clip,
        optax.adamw(
            schedule,
            b1=optim.b1,
            b2=optim.b2,
            eps=optim.eps,
            mu_dtype=jnp.dtype(optim.mu_dtype),
            weight_decay=optim.weight_decay,
            mask=decay_mask,
        ),
    )
    return tx, schedule


SCHEDULE_KEYS = ("optim.lr", "optim.warmup_steps", "optim.min_lr_ratio", "steps")


def note_schedule_change(saved_config: dict, config, step: int, count: int, log) -> None:
    """Logs one line where a resumed run's schedule differs from the one its checkpoint at `step`
    was trained on (a new config.steps stretches the cosine decay): what changed, and the learning
    rate of the first step from the next one on (the optimizer's update `count`) whose rate differs,
    before and now. Nothing where every step left trains at the rate it would have (a constant
    schedule, a warmup that ends before the decay it changed)."""
    now = config.to_dict()
    saved = laid_over(now, saved_config)  # keys added since: as now
    changed = []
    for key in SCHEDULE_KEYS:
        before, after = (lookup(d, key) for d in (saved, now))
        if before != after:
            changed.append(f"config.{key} {before} -> {after}")
    if not changed:
        return
    old = make_schedule(ml_collections.ConfigDict(saved["optim"]), saved["steps"])
    new = make_schedule(config.optim, config.steps)
    counts = np.arange(count, max(count + 1, config.steps))
    now_lr, before_lr = map(np.asarray, jax.jit(lambda c: (new(c), old(c)))(counts))  # one compile
    differs = np.flatnonzero(~np.isclose(now_lr, before_lr, rtol=1e-6, atol=0))
    if not differs.size:
        return
    first = differs[0]
    log(
        f"note: the learning-rate schedule differs from the one step {step} was trained on "
        f"({', '.join(changed)}): step {step + 1 + first} trains at lr {now_lr[first]:.3e}, "
        f"not {before_lr[first]:.3e}"
    )
