"""Vocabulary-parallel cross entropy: sharded equals float64 on one host, chunked equals whole, and
chunking saves memory for large vocabularies."""

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from conftest import loss_and_grads, small_config
from jax.sharding import NamedSharding

from gspmd_tp.job.errors import UserError
from gspmd_tp.train import loss, run_setup
from gspmd_tp.train import state as state_lib
from gspmd_tp.train import step as step_lib

# The loss's layouts: logits split over the vocabulary (megatron_1d), the hidden state split over
# embed too (megatron_2d), and sequence parallel with tied embeddings on 8 vocabulary shards.
CASES = [
    ("megatron_1d", "dp=2,mp=4", False),
    ("megatron_2d", "dp=2,mp=4", False),
    ("megatron_1d_sp", "dp=1,mp=8", True),
]


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


def _reference(hidden, head, targets, valid):
    """(loss sum, d hidden, d head, d logits) of masked cross entropy in float64 numpy: the loss of
    a token is logsumexp(logits) - its target's logit; its gradient softmax - one_hot(target)."""
    h, w = np.asarray(hidden, np.float64), np.asarray(head, np.float64)
    logits = h @ w
    top = logits.max(-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    target = np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]
    mask = np.asarray(valid, np.float64)
    d_logits = (np.exp(logits - lse[..., None]) - np.eye(logits.shape[-1])[np.asarray(targets)]) * mask[
        ..., None
    ]
    d_hidden = d_logits @ w.T
    d_head = np.einsum("ble,blv->ev", h, d_logits)
    return float(((lse - target) * mask).sum()), d_hidden, d_head, d_logits


@pytest.mark.parametrize("chunk", [0, 4])
def test_vocabulary_parallel_cross_entropy_equals_float64_numpy_on_eight_shards(chunk):
    """megatron_1d on dp=1,mp=8 splits the 256 logits of a position over 8 devices, 32 each; the
    loss sum, the counted tokens and the gradients (of the logits, or in chunks of hidden and
    head) equal a float64 computation on one host, with a mask that drops a fifth of the
    targets. The logits are never gathered: the compiled loss reduces across the shards."""
    s = run_setup.setup(small_config(rules="megatron_1d", mesh="dp=1,mp=8"))
    b, length, e, v = 4, 16, 32, 256
    keys = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(keys[0], (b, length, e))
    head = jax.random.normal(keys[1], (e, v)) * 0.5
    targets = jax.random.randint(keys[2], (b, length), 0, v)
    valid = jax.random.uniform(keys[3], (b, length)) > 0.2
    want, d_hidden, d_head, d_logits = _reference(hidden, head, targets, valid)
    put = lambda x, names: jax.device_put(x, NamedSharding(s.mesh, s.rules.spec(names)))
    targets, valid = put(targets, ("batch", "length")), put(valid, ("batch", "length"))
    with state_lib.sharding_context(s.mesh, s.rules):
        if chunk:
            fn = lambda x, w, t, m: loss.chunked_cross_entropy_sums(x, w, t, chunk, m)
            args = (put(hidden, ("batch", "length", "embed")), put(head, ("embed", "vocab")))
            wants = (d_hidden, d_head)
        else:
            fn = loss.cross_entropy_sums
            args = (put(hidden @ head, ("batch", "length", "vocab")),)
            wants = (d_logits,)
        assert args[-1].addressable_shards[0].data.shape[-1] == v // 8
        grad = jax.jit(jax.value_and_grad(lambda *a: fn(*a)[0], argnums=tuple(range(len(args)))))
        (total, grads), (_, count) = grad(*args, targets, valid), jax.jit(fn)(*args, targets, valid)
        text = grad.lower(*args, targets, valid).compile().as_text()
    assert int(count) == int(np.asarray(valid).sum()) < b * length
    assert float(total) == pytest.approx(want, rel=1e-5)
    for got, ref in zip(grads, wants, strict=True):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-5)
    assert "all-reduce" in text and "all-gather" not in text


def test_a_padded_vocabulary_gives_the_unpadded_loss_and_no_gradient_to_its_padding(bpe_path):
    """vocab_size=0 pads the tokenizer's 300 ids to 384 (mp=4 divides it, not 300), masking the rest
    out of the softmax: the loss, whole or chunked, and the real rows' gradients are the unpadded
    model's; the padding rows get none."""
    c = small_config(rules="megatron_1d", mesh="dp=2,mp=4", **{"data.tokenizer": bpe_path})
    c.model.vocab_size, c.model.num_layers = 0, 1
    padded_cfg = run_setup.model_config(c)
    assert (padded_cfg.vocab_size, padded_cfg.vocab_tokens) == (384, 300)
    unpadded_cfg = dataclasses.replace(padded_cfg, vocab_size=300, vocab_tokens=0)
    tokens = np.random.default_rng(0).integers(0, 300, (2, c.seq_len + 1), dtype=np.int32)
    padded, unpadded = step_lib.Transformer(padded_cfg), step_lib.Transformer(unpadded_cfg)
    shapes = jax.eval_shape(padded.init, jax.random.key(0), tokens[:, :-1])["params"]  # nothing compiled
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda x: rng.normal(0, 0.5, x.shape).astype(np.float32), nn.meta.unbox(shapes))
    cut = {**params, "embedding": params["embedding"][:300], "lm_head": params["lm_head"][:, :300]}

    def mean_loss(model, params, chunk):
        total, count = step_lib._loss_sums(model, params, tokens, chunk)
        return total / count

    @jax.jit  # one program, one compile
    def losses(params, cut):
        grad = jax.value_and_grad(mean_loss, argnums=1)
        return grad(unpadded, cut, 0), [grad(padded, params, chunk) for chunk in (0, 8)]

    (loss_u, grads_u), padded_runs = losses(params, cut)
    for loss_p, grads_p in padded_runs:
        np.testing.assert_allclose(float(loss_p), float(loss_u), rtol=1e-6)
        head = np.asarray(grads_p["lm_head"])
        np.testing.assert_allclose(head[:, :300], np.asarray(grads_u["lm_head"]), rtol=1e-5, atol=1e-7)
        assert not head[:, 300:].any()


def test_a_batch_with_no_target_counted_sums_to_zero_and_has_a_zero_gradient():
    """Every target masked out (an evaluation batch of padding rows alone): the loss sum and the
    count are 0 and every gradient is 0, whole or chunked. A mean taken inside the loss, or a mask
    applied after a log of zero, would give NaN here."""
    keys = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(keys[0], (2, 8, 16))
    head = jax.random.normal(keys[1], (16, 64))
    targets = jax.random.randint(keys[2], (2, 8), 0, 64)
    none = np.zeros((2, 8), bool)
    for name, fn in [
        ("whole", lambda x, w: loss.cross_entropy_sums(x @ w, targets, none)),
        ("chunked", lambda x, w: loss.chunked_cross_entropy_sums(x, w, targets, 4, none)),
    ]:
        total, count = fn(hidden, head)
        grads = jax.grad(lambda x, w, f=fn: f(x, w)[0], argnums=(0, 1))(hidden, head)
        assert (float(total), int(count)) == (0.0, 0), name
        for g in grads:
            assert np.isfinite(np.asarray(g)).all() and not np.asarray(g).any(), name
