"""The optimizer chain: clipping by one scalar factor equals optax's clip, and its AdamW update
writes no clipped copy of the gradients."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import small_config

from gspmd_tp import optim

TREE = {"w": jnp.linspace(-1.0, 1.0, 64 * 48).reshape(64, 48), "scale": jnp.arange(48.0) / 48}


@pytest.mark.parametrize("max_norm", [1e-3, 1.0, 1e6])  # clipping hard, a little, not at all
def test_clip_equals_optax(max_norm):
    ours, theirs = optim.clip_by_global_norm(max_norm), optax.clip_by_global_norm(max_norm)
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
    assert _passes_writing(optim.make_optimizer(c, 10)[0], (512, 256)) == 3
    monkeypatch.setattr(optim, "clip_by_global_norm", optax.clip_by_global_norm)
    assert _passes_writing(optim.make_optimizer(c, 10)[0], (512, 256)) == 4
