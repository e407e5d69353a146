"""The optimizer chain: clipping by one scalar factor equals optax's clip, its AdamW update
writes no clipped copy of the gradients, and its first moment may be kept in bfloat16."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import small_config

from gspmd_tp.job.errors import UserError
from gspmd_tp.train import optimizer

TREE = {"w": jnp.linspace(-1.0, 1.0, 64 * 48).reshape(64, 48), "scale": jnp.arange(48.0) / 48}


@pytest.mark.parametrize("max_norm", [1e-3, 1.0, 1e6])  # clipping hard, a little, not at all
def test_clip_equals_optax(max_norm):
    ours, theirs = optimizer.clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
    assert jax.tree.structure(ours.init(TREE)) == jax.tree.structure(theirs.init(TREE))
    got, _ = ours.update(TREE, ours.init(TREE))
    want, _ = theirs.update(TREE, theirs.init(TREE))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-12)


def _passes_writing(tx, shape) -> int:
    """Fusions of the compiled clip + AdamW update whose output is a whole leaf of `shape`."""
    params = {"w": jnp.ones(shape), "norm": jnp.ones(shape[-1:])}

    def update(p, state, g):
        u, state = tx.update(g, state, p)
        return optax.apply_updates(p, u), state

    text = jax.jit(update).lower(params, tx.init(params), params).compile().as_text()
    out = f"f32[{','.join(map(str, shape))}]"
    return len(re.findall(rf"= {re.escape(out)}\{{[0-9,]*\}} fusion\(", text))


def test_the_update_writes_no_clipped_gradient(monkeypatch):
    """optax's clip writes the clipped gradient whole for the two moment updates to read; the
    scalar factor fuses into them: new first moment, second moment and parameter, three passes."""
    c = small_config().optim
    assert _passes_writing(optimizer.make_optimizer(c, 10)[0], (512, 256)) == 3
    monkeypatch.setattr(optimizer, "clip_by_global_norm", optax.clip_by_global_norm)
    assert _passes_writing(optimizer.make_optimizer(c, 10)[0], (512, 256)) == 4


@pytest.mark.parametrize(
    "saved, now, count, said",
    [
        # A constant rate: a new config.steps changes no step's rate, so nothing is said (it said
        # "step 3 trains at lr 3.000e-03, not 3.000e-03").
        ({"steps": 4, "optim.warmup_steps": 0, "optim.min_lr_ratio": 1.0}, {"steps": 6}, 2, None),
        # The decay stretched: from the next step on.
        ({"steps": 4, "optim.warmup_steps": 1}, {"steps": 6}, 2, 3),
        # Still warming up, the warmup unchanged: the first step whose rate differs is named, the
        # second after the warmup's end (the decay's first is its peak in both).
        ({"steps": 10, "optim.warmup_steps": 5}, {"steps": 20}, 2, 7),
    ],
)
def test_a_schedule_change_is_noted_at_the_first_step_whose_rate_differs(saved, now, count, said):
    before = small_config(**saved)
    config = small_config(**{**saved, **now})
    lines = []
    optimizer.note_schedule_change(before.to_dict(), config, count, count, lines.append)
    if said is None:
        assert lines == []
        return
    old = optimizer.make_schedule(before.optim, before.steps)(said - 1)
    new = optimizer.make_schedule(config.optim, config.steps)(said - 1)
    assert lines == [
        f"note: the learning-rate schedule differs from the one step {count} was trained on "
        f"(config.steps {before.steps} -> {config.steps}): step {said} trains at lr {float(new):.3e}, "
        f"not {float(old):.3e}"
    ]
    assert float(new) != pytest.approx(float(old), rel=1e-6)


def test_a_bfloat16_first_moment_keeps_the_second_in_float32_and_updates_alike():
    c = small_config().optim
    tx32, _ = optimizer.make_optimizer(c, 10)
    c.mu_dtype = "bfloat16"
    tx16, _ = optimizer.make_optimizer(c, 10)
    state = tx16.init(TREE)
    adam = state[1][0]
    assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {jnp.dtype("bfloat16")}
    assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {jnp.dtype("float32")}
    grads = jax.tree.map(lambda x: jnp.sin(7 * x) + 0.1, TREE)
    got, state = tx16.update(grads, state, TREE)
    want, _ = tx32.update(grads, tx32.init(TREE), TREE)
    assert state[1][0].mu["w"].dtype == jnp.bfloat16 and got["w"].dtype == jnp.float32
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-9)  # bfloat16 keeps 8 bits of mantissa


@pytest.mark.parametrize("value", ["bf16", "float16", ""])
def test_a_first_moment_dtype_it_does_not_keep_is_one_line(value):
    c = small_config(**{"optim.mu_dtype": value}).optim
    with pytest.raises(
        UserError, match=rf"^config.optim.mu_dtype must be one of float32, bfloat16, got '{value}'$"
    ):
        optimizer.check(c)
