"""The sampler's choice of the next token at an ordinary temperature: only the k likeliest tokens
are drawn, each as often as softmax(logits / temperature) renormalised over them says."""

import jax
import jax.numpy as jnp
import numpy as np

from gspmd_tp.inference import generate

DRAWS = 20_000  # rows of one call: each row is an independent draw
# The chi-square statistic's 0.1% critical values (2 and 4 degrees of freedom): a correct sampler
# exceeds them for one seed in a thousand, and the seeds are fixed, so a pass stays a pass.
CRITICAL = {2: 13.82, 4: 18.47}


def _counts(logits_v, temperature: float, top_k: int, seed: int) -> np.ndarray:
    """How often each id is chosen over DRAWS rows that all hold `logits_v`."""
    rows = jnp.broadcast_to(jnp.asarray(logits_v, jnp.float32), (DRAWS, len(logits_v)))
    chosen = jax.jit(generate._choose, static_argnums=(2, 3))(rows, jax.random.key(seed), temperature, top_k)
    return np.bincount(np.asarray(chosen), minlength=len(logits_v))


def _chi_square(counts: np.ndarray, probabilities: np.ndarray) -> float:
    expected = probabilities * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# Byte ids in a shuffled order, so that "the k best" is not "the first k"; ids past 255 (padding
# of the vocabulary) hold the largest logits and must still never be drawn.
LOGITS = np.full(300, -1.0)
LOGITS[[7, 200, 42, 99, 3]] = [1.0, 0.6, 0.2, -0.1, -0.3]
LOGITS[256:] = 5.0
TOP3 = [7, 200, 42]


def test_top_k_draws_only_the_k_likeliest_tokens_as_often_as_their_softmax_says_and_a_seed_draws_the_same():
    """Two seeds' draws, each checked; the first drawn again is the same, the second differs."""
    draws = {seed: _counts(LOGITS, 0.8, 3, seed) for seed in (0, 1)}
    for seed, counts in draws.items():
        assert set(np.flatnonzero(counts)) == set(TOP3), (seed, np.flatnonzero(counts))
        want = _softmax(LOGITS[TOP3] / 0.8)
        assert _chi_square(counts[TOP3], want) < CRITICAL[2], (seed, counts[TOP3])
        # The test can tell the temperature: the same draws reject softmax(logits) at temperature 1.
        assert _chi_square(counts[TOP3], _softmax(LOGITS[TOP3])) > CRITICAL[2], (seed, counts[TOP3])
    assert np.array_equal(_counts(LOGITS, 0.8, 3, 0), draws[0]), "seed 0 drew other tokens the second time"
    assert not np.array_equal(draws[0], draws[1]), "seeds 0 and 1 drew the same tokens"


def test_without_top_k_every_token_is_drawn_as_often_as_its_softmax_says():
    """Five tokens with any real chance (the rest 30 below them: e^-37 at 0.8); no top-k."""
    logits = np.full(300, -30.0)
    five = [7, 200, 42, 99, 3]
    logits[five] = LOGITS[five]
    logits[256:] = 5.0
    counts = _counts(logits, 0.8, 0, 0)
    assert set(np.flatnonzero(counts)) == set(five)
    assert _chi_square(counts[five], _softmax(logits[five] / 0.8)) < CRITICAL[4]
    assert _chi_square(counts[five], _softmax(logits[five])) > CRITICAL[4]
