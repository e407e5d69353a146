"""Context parallelism's attention (gspmd_tp/model/context.py): the zigzag layout, ring attention
against a float64 softmax written out, and the attention work each device does, counted from the
causal mask (useful pairs) and from the compiled ring program (its dot FLOPs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config
from jax.sharding import NamedSharding

from gspmd_tp.model import context, kernels
from gspmd_tp.model.transformer import ModelConfig
from gspmd_tp.sharding import hlo_cost
from gspmd_tp.train import run_setup
from gspmd_tp.train import state as state_lib

B, L, H, KV, D = 4, 32, 4, 2, 8  # batch, length, query heads, key/value heads, head width


@pytest.mark.parametrize("n", [1, 2, 4])
def test_the_zigzag_gives_device_i_chunks_i_and_2n_minus_1_minus_i(n):
    order = context.zigzag_order(L, n)
    assert sorted(order) == list(range(L))
    h = L // (2 * n)
    for i, share in enumerate(order.reshape(n, -1)):
        assert list(share) == [*range(i * h, (i + 1) * h), *range((2 * n - 1 - i) * h, (2 * n - i) * h)]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_useful_pairs_are_even_under_the_zigzag_and_the_last_device_does_most_without(n):
    """The causal square's L (L + 1) / 2 pairs: each device's share 1/n under the zigzag; on the
    plain split device i's chunk of c positions sees i c^2 + c (c + 1) / 2 of them, the last
    device's share (2n - 1) / n^2 as L grows."""
    length = 64 * n
    c = length // n
    total = length * (length + 1) // 2
    balanced = context.useful_pairs(context.zigzag_order(length, n), n)
    assert list(balanced) == [total // n] * n
    plain = context.useful_pairs(np.arange(length), n)
    assert list(plain) == [i * c * c + c * (c + 1) // 2 for i in range(n)]
    assert plain.sum() == total
    assert plain[-1] / total == pytest.approx((2 * n - 1) / n**2, rel=1 / c)


def _reference(q, k, v, positions, segments):
    """float64 causal attention of (B, L, H, D) queries over (B, L, KV, D) keys and values, a query
    seeing the keys of no greater position in its own segment."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    k, v = (np.repeat(x, H // KV, axis=2) for x in (k, v))
    scores = np.einsum("bqhd,bshd->bhqs", q, k)
    causal = positions[:, :, None] >= positions[:, None, :]
    allowed = causal & (segments[:, :, None] == segments[:, None, :])
    scores = np.where(allowed[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqs,bshd->bqhd", p, v)


def _operands(zigzag: bool, n: int):
    """Random queries, keys, values and packed documents' (segment ids, positions), laid out in
    zigzag order over n context devices where `zigzag`; and the float64 reference in that layout."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = np.asarray(jax.random.normal(keys[0], (B, L, H, D)))
    k, v = (np.asarray(jax.random.normal(key, (B, L, KV, D))) for key in keys[1:])
    starts = np.zeros((B, L), bool)
    starts[:, ::7] = True  # documents of 7 positions, crossing the chunks
    segments = np.cumsum(starts, axis=1).astype(np.int32)
    positions = (np.arange(L) - np.maximum.accumulate(np.where(starts, np.arange(L), 0), axis=1)).astype(
        np.int32
    )
    want = _reference(q, k, v, positions, segments)
    order = context.zigzag_order(L, n) if zigzag else np.arange(L)
    return [x[:, order] for x in (q, k, v, positions, segments, want)]


def _attention(rules, mesh, cfg, q, k, v, positions, segments, zigzag):
    """kernels.attention under `rules` on `mesh`, the operands placed as the model places them;
    (output, the compiled program's text)."""
    s = run_setup.setup(small_config(rules=rules, mesh=mesh))
    rows = NamedSharding(s.mesh, s.rules.spec(("batch", "length")))
    qs = NamedSharding(s.mesh, s.rules.spec(("batch", "length", "heads", "head_dim")))
    kvs = NamedSharding(s.mesh, s.rules.spec(("batch", "length", "kv_heads", "head_dim")))
    fn = jax.jit(
        lambda q, k, v, p, g: kernels.attention(cfg, q, k, v, segment_ids=g, positions=p, zigzag=zigzag),
        in_shardings=(qs, kvs, kvs, rows, rows),
    )
    fn_shardings = (qs, kvs, kvs, rows, rows)
    args = [jax.device_put(x, sh) for x, sh in zip((q, k, v, positions, segments), fn_shardings, strict=True)]
    with state_lib.sharding_context(s.mesh, s.rules):
        compiled = fn.lower(*args).compile()
    return np.asarray(compiled(*args)), compiled.as_text()


CASES = [("context_dp", "data=2,context=4", 4), ("fsdp_context_tensor", "fsdp=2,context=2,tensor=2", 2)]


@pytest.mark.parametrize("rules, mesh, n", CASES)
@pytest.mark.parametrize("zigzag", [False, True])
def test_ring_attention_equals_the_softmax_written_out(rules, mesh, n, zigzag):
    """Packed documents crossing the context chunks; heads split over tensor in the 2x2x2 case."""
    q, k, v, positions, segments, want = _operands(zigzag, n)
    cfg = ModelConfig(context_parallel="ring", context_load_balance=zigzag)
    got, text = _attention(rules, mesh, cfg, q, k, v, positions, segments, zigzag)
    assert "collective-permute" in text and "all-gather" not in text
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("rules, mesh, n", CASES[:1])
@pytest.mark.parametrize("zigzag", [False, True])
def test_ring_attention_gradients_equal_plain_attentions_on_one_device(rules, mesh, n, zigzag):
    """The ring's written-out backward (a second ring, the scores recomputed from the saved
    log-sum-exp) against autodiff of the einsum path with no mesh, in the original order, for the
    gradients of a weighted sum of the output."""
    q, k, v, positions, segments, _ = _operands(False, n)
    weights = np.asarray(jax.random.normal(jax.random.key(1), q.shape))

    def plain(q, k, v):
        return jnp.sum(kernels.attention(ModelConfig(), q, k, v, segment_ids=jnp.asarray(segments)) * weights)

    want = jax.grad(plain, argnums=(0, 1, 2))(q, k, v)
    order = context.zigzag_order(L, n) if zigzag else np.arange(L)
    s = run_setup.setup(small_config(rules=rules, mesh=mesh))
    cfg = ModelConfig(context_parallel="ring", context_load_balance=zigzag)
    p, g, w = (jnp.asarray(x[:, order]) for x in (positions, segments, weights))

    def ring(q, k, v):
        return jnp.sum(kernels.attention(cfg, q, k, v, segment_ids=g, positions=p, zigzag=zigzag) * w)

    with state_lib.sharding_context(s.mesh, s.rules):
        got = jax.jit(jax.grad(ring, argnums=(0, 1, 2)))(*(x[:, order] for x in (q, k, v)))
    for name, a, b in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(a, np.asarray(b)[:, order], rtol=1e-4, atol=1e-5, err_msg=name)


def _dot_flops(text: str) -> float:
    """Matrix-product FLOPs of one run of a compiled program (per device)."""
    return hlo_cost.Costs(text).seconds(lambda flops, _: flops)[0]


def test_the_compiled_ring_does_the_useful_pairs_and_the_diagonal_under_the_zigzag():
    """context_dp on data=2,context=4, from the compiled programs' dot FLOPs per device (each
    query-key pair costs 2 D for its score and 2 D for its share of the output, per head and row):
    the plain ring scores every block whole, n c^2 pairs a device (its later chunks all masked);
    the zigzag ring each device's useful pairs (all equal) plus the masked upper triangles of its
    two diagonal blocks of h = c / 2, h (h - 1) pairs. The all-gather path scores c x L, as the
    plain ring, with or without the zigzag."""
    n, c = 4, L // 4
    h = c // 2
    per_pair = 4 * D * (B // 2) * H  # the batch split over data=2
    pairs = {}
    for strategy in ("ring", "all_gather"):
        for zigzag in (False, True):
            q, k, v, positions, segments, _ = _operands(zigzag, n)
            cfg = ModelConfig(context_parallel=strategy, context_load_balance=zigzag)
            text = _attention("context_dp", "data=2,context=4", cfg, q, k, v, positions, segments, zigzag)[1]
            pairs[strategy, zigzag] = _dot_flops(text) / per_pair
    useful = context.useful_pairs(context.zigzag_order(L, n), n)
    assert pairs["ring", True] == useful[0] + h * (h - 1)
    assert pairs["ring", False] == n * c * c == pairs["all_gather", False] == pairs["all_gather", True]
    print({f"{s} zigzag={z}": p for (s, z), p in pairs.items()}, "useful (zigzag):", list(useful))
