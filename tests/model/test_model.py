"""The model: causal, GQA-correct, scan equals unrolled, remat changes nothing, no mesh names."""

import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals  # jax.ad_checkpoint.print_saved_residuals' list

from gspmd_tp.model import transformer
from gspmd_tp.model.transformer import ModelConfig, Transformer, rotary

CFG = ModelConfig(
    vocab_size=256, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64
)
# numpy, so that collecting this module (in every pytest process) starts no JAX backend
TOKENS = np.random.default_rng(1).integers(0, 256, (2, 12), dtype=np.int32)


def init(cfg):
    """cfg's initial parameters, unboxed."""
    return nn.meta.unbox(jax.jit(lambda: Transformer(cfg).init(jax.random.key(0), TOKENS)["params"])())


def logits_of(cfg, params, tokens=TOKENS):
    """The logits of `tokens`, jit-compiled (one program, not one dispatch per operation)."""
    return jax.jit(lambda p, t: Transformer(cfg).apply({"params": p}, t))(params, tokens)


def mean_logit(cfg):
    """params -> the mean logit of TOKENS: the loss the gradient checks differentiate."""
    return lambda p: Transformer(cfg).apply({"params": p}, TOKENS).mean()


def mean_logit_grad(cfg, params):
    """The gradient of the mean logit, jit-compiled."""
    return jax.jit(jax.grad(mean_logit(cfg)))(params)


def test_logits_shape_and_causality():
    params = init(CFG)
    logits = logits_of(CFG, params)
    assert logits.shape == (2, 12, 256) and logits.dtype == jnp.float32
    changed = TOKENS.copy()
    changed[:, 7] = (TOKENS[:, 7] + 1) % 256
    logits2 = logits_of(CFG, params, changed)
    np.testing.assert_allclose(logits2[:, :7], logits[:, :7], atol=1e-6)  # the past is unaffected
    assert not np.allclose(logits2[:, 7:], logits[:, 7:])


def reference_attention(cfg, layer, x):
    """Plain multi-head attention with each key/value head repeated for its query group."""
    qkv = jnp.einsum("ble,ekgd->blkgd", x, layer["qkv"])
    g = cfg.group
    q = qkv[:, :, :, :g].reshape(*x.shape[:2], cfg.num_heads, cfg.head_dim)
    k = jnp.repeat(qkv[:, :, :, g], g, axis=2)
    v = jnp.repeat(qkv[:, :, :, g + 1], g, axis=2)
    pos = jnp.arange(x.shape[1])
    q, k = rotary(q, pos, cfg.rope_theta), rotary(k, pos, cfg.rope_theta)
    s = jnp.einsum("bqhd,bshd->bhqs", q, k) / np.sqrt(cfg.head_dim)
    s = jnp.where(pos[:, None] >= pos[None, :], s, -jnp.inf)
    out = jnp.einsum("bhqs,bshd->bqhd", jax.nn.softmax(s, -1), v)
    return jnp.einsum("blhd,hde->ble", out, layer["out"])


def test_grouped_attention_matches_repeated_heads():
    from gspmd_tp.model.transformer import Attention

    x = jax.random.normal(jax.random.key(2), (2, 12, CFG.d_model))
    pos = jnp.arange(12)
    params = nn.meta.unbox(Attention(CFG).init(jax.random.key(3), x, pos)["params"])
    got = Attention(CFG).apply({"params": params}, x, pos)
    np.testing.assert_allclose(got, reference_attention(CFG, params, x), rtol=1e-5, atol=1e-6)


def test_rotary_preserves_norm_and_relative_positions():
    x = jax.random.normal(jax.random.key(4), (1, 6, 1, 8))
    pos = jnp.arange(6)
    y = rotary(x, pos, 10000.0)
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    # <R(p)a, R(p+d)b> depends on d only.
    a, b = x[0, 0, 0], x[0, 1, 0]
    both = jnp.stack([jnp.tile(a, (6, 1)), jnp.tile(b, (6, 1))])[:, :, None]  # (2, 6, 1, 8)
    r = rotary(both, pos, 10000.0)
    dots = [float(r[0, p, 0] @ r[1, p + 2, 0]) for p in range(4)]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-4)


def test_scan_equals_unrolled_layers():
    scanned = init(CFG)
    unrolled_cfg = ModelConfig(**{**CFG.__dict__, "scan_layers": False})
    unrolled = {k: v for k, v in scanned.items() if k != "layers"}
    for i in range(CFG.num_layers):
        unrolled[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], scanned["layers"])
    a = logits_of(CFG, scanned)
    b = logits_of(unrolled_cfg, unrolled)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "policy", ["full", "dots", "dots_no_batch", "dots_no_batch_comm", "dots_no_batch_attention"]
)
def test_remat_policies_give_the_same_gradients(policy):
    params = init(CFG)
    remat_cfg = ModelConfig(**{**CFG.__dict__, "remat": policy})

    grads = lambda cfg: jax.tree.leaves(mean_logit_grad(cfg, params))  # noqa: E731
    for g0, g1 in zip(grads(CFG), grads(remat_cfg), strict=True):
        np.testing.assert_allclose(g1, g0, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize(
    "policy, saved",
    [("full", "attn_in,mlp_in"), ("dots_no_batch", "query,key"), ("dots_no_batch", "mlp_hidden,weights")],
)
def test_remat_save_keeps_its_names_and_changes_no_gradient(policy, saved):
    unrolled = ModelConfig(**{**CFG.__dict__, "scan_layers": False})  # names stay visible outside a scan
    params = init(unrolled)
    cfg = ModelConfig(**{**unrolled.__dict__, "remat": policy, "remat_save": saved})
    kept = lambda c: {
        name
        for _, where in saved_residuals(mean_logit(c), params)
        for name in transformer.SAVEABLE_NAMES
        if f"named '{name}'" in where
    }
    assert kept(cfg) == set(saved.split(","))
    assert not kept(ModelConfig(**{**cfg.__dict__, "remat_save": ""}))  # the policy alone keeps none
    for g0, g1 in zip(
        jax.tree.leaves(mean_logit_grad(unrolled, params)),
        jax.tree.leaves(mean_logit_grad(cfg, params)),
        strict=True,
    ):
        np.testing.assert_allclose(g1, g0, rtol=1e-5, atol=1e-8)


def test_dots_no_batch_keeps_the_weight_products():
    """dots_no_batch keeps every weight product's output, so the backward pass computes none of
    them a second time, as the full remat does."""
    params = init(CFG)

    def dots(remat):
        cfg = ModelConfig(**{**CFG.__dict__, "remat": remat})
        jaxpr = jax.make_jaxpr(jax.grad(mean_logit(cfg)))(params)
        return str(jaxpr).count("dot_general")

    assert dots("dots_no_batch") < dots("full")


def test_tied_embeddings_have_no_lm_head():
    tied = init(ModelConfig(**{**CFG.__dict__, "tie_embeddings": True}))
    assert "lm_head" not in tied and "lm_head" in init(CFG)


def test_bfloat16_compute_keeps_float32_params():
    cfg = ModelConfig(**{**CFG.__dict__, "dtype": "bfloat16"})
    params = init(cfg)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    logits = logits_of(cfg, params)
    assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))


def test_every_parameter_is_logically_annotated():
    boxed = Transformer(CFG).init(jax.random.key(0), TOKENS)["params"]
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert leaves and all(isinstance(x, nn.LogicallyPartitioned) for x in leaves)


def test_model_code_names_no_mesh_axis():
    modules = sorted((Path(__file__).parents[2] / "gspmd_tp" / "model").glob("*.py"))
    assert {"transformer.py", "kernels.py", "params.py"} <= {m.name for m in modules}
    for module in modules:
        source = module.read_text()
        assert not re.search(r"PartitionSpec|['\"](dp|mp)['\"]", source), module


def test_the_forward_path_calls_each_kernel_by_one_name():
    """transformer.py holds no platform kernel: attention, the MLP and the embedding lookup are each
    one call into kernels.py, which picks the implementation the config asks for; the projections
    are kernels.project (its gradient's dtype model.grad_dtype's)."""
    source = Path(transformer.__file__).read_text()
    assert set(re.findall(r"kernels\.([a-z_]+)\(", source)) == {"attention", "mlp", "embed", "project"}
    assert "dot_product_attention(" not in source and "default_backend" not in source


def test_config_validation_names_the_problem():
    bad = ModelConfig(num_heads=6, num_kv_heads=4, remat="sometimes")
    problems = bad.validate()
    assert any("num_heads (6) must be a multiple of model.num_kv_heads (4)" in p for p in problems)
    assert any("model.remat 'sometimes'" in p for p in problems)
    problems = ModelConfig(rope_theta=0.0, norm_eps=-1e-5).validate()
    assert problems == [
        "model.rope_theta must be positive, got 0.0",
        "model.norm_eps must be 0 or more, got -1e-05",
    ]
    assert len(ModelConfig(rope_theta=float("nan"), norm_eps=float("nan")).validate()) == 2
    assert ModelConfig(remat="full", remat_save="mlp_in, queries").validate() == [
        "model.remat_save 'mlp_in, queries': 'queries' not among attn_in, attn_out, mlp_in, mlp_out, "
        "query, key, mlp_hidden, weights"
    ]
    assert ModelConfig(remat_save="mlp_in").validate() == [
        "model.remat_save 'mlp_in' needs a model.remat policy: with 'none' every activation is kept already"
    ]


def test_attention_choice_is_validated():
    assert any("model.attention 'flash'" in p for p in ModelConfig(attention="flash").validate())
    assert any("needs model.dtype bfloat16" in p for p in ModelConfig(attention="cudnn").validate())
    assert ModelConfig(attention="cudnn", dtype="bfloat16").validate() == []
    # Query blocks are the einsum path's: with a fused kernel they would be silently ignored.
    blocked = ModelConfig(attention="xla", attention_block=64).validate()
    assert blocked == [
        "model.attention_block=64 applies to einsum attention only; with model.attention 'xla' set it to 0"
    ]
    assert ModelConfig(attention="einsum", attention_block=64).validate() == []


def test_mlp_grad_setting_is_checked():
    assert ModelConfig(mlp_grad="manual").validate() == [
        "model.mlp_grad 'manual' is not one of ('auto', 'fused', 'one_pass', 'xla')"
    ]
    assert ModelConfig(mlp_grad="fused", remat="full", remat_save="mlp_hidden").validate() == [
        "model.remat_save keeps mlp_hidden, which model.mlp_grad 'fused' never reads (its backward "
        "recomputes SwiGLU's output beside its gradient): drop one of the two"
    ]
