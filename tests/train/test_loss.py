"""Vocabulary-parallel cross entropy: chunked equals whole, and saves memory for large vocabularies."""

import jax
import numpy as np
import optax
import pytest
from conftest import loss_and_grads, small_config

from gspmd_tp.job.errors import UserError
from gspmd_tp.sharding.rules import RULES_DIR
from gspmd_tp.train import loss, run_setup
from gspmd_tp.train import step as step_lib

SHIPPED = sorted(p.stem for p in RULES_DIR.glob("*.yaml"))
CASES = [(r, "dp=2,mp=4", False) for r in SHIPPED] + [("megatron_1d_sp", "dp=1,mp=8", True)]


@pytest.mark.parametrize("rules, mesh, tied", CASES)
def test_chunked_loss_and_gradients_equal_the_plain_ones(rules, mesh, tied):
    c = small_config(rules=rules, mesh=mesh, **{"model.tie_embeddings": tied})
    (loss0, grads0), (loss8, grads8) = loss_and_grads(c, [(1, 0), (1, 8)])
    np.testing.assert_allclose(float(loss8), float(loss0), rtol=1e-5)
    for g0, g8 in zip(jax.tree.leaves(grads0), jax.tree.leaves(grads8), strict=True):
        np.testing.assert_allclose(np.asarray(g8), np.asarray(g0), rtol=1e-5, atol=1e-7)


def test_chunking_cuts_step_memory_for_a_large_vocabulary():
    temps = {}
    for chunk in (0, 32):
        c = small_config(rules="megatron_1d", mesh="dp=2,mp=4", seq_len=256, loss_chunk=chunk)
        c.model.vocab_size = 16384
        temps[chunk] = step_lib.compile_train_step(run_setup.setup(c)).memory_analysis().temp_size_in_bytes
    # Per device the whole logits are 4 sequences x 256 positions x 4096 vocabulary x float32
    # (16.8 MB); chunking saves at least that much (measured: 60.0 MB -> 40.6 MB of temporaries).
    logits_bytes = 4 * 256 * (16384 // 4) * 4
    assert temps[0] - temps[32] > logits_bytes, temps


def test_loss_chunk_must_divide_the_sequence():
    with pytest.raises(UserError, match=r"config.loss_chunk=5 must be 0 or divide config.seq_len=32"):
        run_setup.setup(small_config(loss_chunk=5))


def test_the_loss_equals_optax_and_its_gradient_scatters_once():
    """One scatter (into the target logits) in the gradient: optax's take(0) of the target logit
    adds a second, of constants, which XLA folds into a literal of every token at compile time."""
    logits = jax.random.normal(jax.random.key(0), (4, 16, 50)) * 3
    targets = jax.random.randint(jax.random.key(1), (4, 16), 0, 50)
    total, count = loss.cross_entropy_sums(logits, targets)
    want = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    assert count == 64 and float(total) == pytest.approx(float(want.sum()), rel=1e-6)
    grad = jax.jit(jax.grad(lambda x: loss.cross_entropy_sums(x, targets)[0]))
    want_grad = jax.grad(lambda x: optax.softmax_cross_entropy_with_integer_labels(x, targets).sum())
    np.testing.assert_allclose(grad(logits), want_grad(logits), rtol=1e-5, atol=1e-7)
    lowered = grad.lower(logits).as_text()
    assert sum('"stablehlo.scatter"' in line for line in lowered.splitlines()) == 1
