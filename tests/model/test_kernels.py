"""The kernels model.attention, model.mlp_grad and model.dtype select: each gives the plain
computation's values and autodiff's gradients, makes the passes it promises, and is chosen where
its setting says."""

import re

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config
from jax._src.ad_checkpoint import saved_residuals  # jax.ad_checkpoint.print_saved_residuals' list
from jax.sharding import NamedSharding
from test_model import CFG, TOKENS, init, logits_of, mean_logit, mean_logit_grad

from gspmd_tp.model import kernels
from gspmd_tp.model.kernels import fused_mlp, swiglu
from gspmd_tp.model.transformer import ModelConfig, Transformer
from gspmd_tp.train import run_setup
from gspmd_tp.train import state as state_lib


def _assert_same_model(cfg, other, grad_rtol):
    """`other` gives CFG's parameters the logits and gradients that `cfg` gives them."""
    params = init(CFG)

    def logits_and_grads(c):
        f = lambda p: Transformer(c).apply({"params": p}, TOKENS)
        return jax.jit(lambda p: (f(p), jax.grad(lambda q: (f(q) ** 2).mean())(p)))(params)

    (l0, g0), (l1, g1) = logits_and_grads(cfg), logits_and_grads(other)
    np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0), strict=True):
        np.testing.assert_allclose(a, b, rtol=grad_rtol, atol=1e-7)


# --- SwiGLU MLP (model.mlp_grad) ---


def test_swiglu_one_pass_gradient_is_autodiffs_without_padded_halves():
    gate_up = jax.random.normal(jax.random.key(2), (2, 5, 2, 16)) * 3
    d_hidden = jax.random.normal(jax.random.key(3), (2, 5, 16))
    plain = lambda g: nn.silu(g[..., 0, :]) * g[..., 1, :]
    one_pass = lambda g: swiglu(g, one_pass_gradient=True)
    np.testing.assert_array_equal(one_pass(gate_up), plain(gate_up))
    np.testing.assert_array_equal(swiglu(gate_up), plain(gate_up))  # by default: autodiff's gradient
    grad = lambda f: lambda g, d: jax.vjp(f, g)[1](d)[0]
    np.testing.assert_allclose(grad(one_pass)(gate_up, d_hidden), grad(plain)(gate_up, d_hidden), atol=1e-6)
    ops = lambda f: jax.jit(grad(f)).lower(gate_up, d_hidden).compile().as_text()
    assert re.search(r"= \S+ (pad|concatenate)\(", ops(plain))  # autodiff: two padded halves
    assert not re.search(r"= \S+ (pad|concatenate)\(", ops(one_pass))
    bf16 = gate_up.astype(jnp.bfloat16), d_hidden.astype(jnp.bfloat16)
    np.testing.assert_allclose(
        grad(one_pass)(*bf16).astype(jnp.float32), grad(plain)(*bf16).astype(jnp.float32), rtol=0.02, atol=0.1
    )


def test_fused_mlp_recomputes_swiglu_beside_its_gradient():
    """The fused backward's SwiGLU output and its two gradients come from one read of gate_up: the
    three are one elementwise expression of (gate_up, d_hidden), where autodiff's recompute is a
    separate function of gate_up alone that runs before d_hidden exists."""
    x = jax.random.normal(jax.random.key(4), (2, 6, 8))
    w_in = jax.random.normal(jax.random.key(5), (8, 2, 16)) * 0.3
    w_out = jax.random.normal(jax.random.key(6), (16, 8)) * 0.3
    dy = jax.random.normal(jax.random.key(7), (2, 6, 8))

    def plain(x, w_in, w_out):
        return jnp.tensordot(swiglu(jnp.tensordot(x, w_in, axes=1), one_pass_gradient=False), w_out, axes=1)

    vjp = lambda f: jax.vjp(f, x, w_in, w_out)[1](dy)
    for a, b in zip(vjp(plain), vjp(fused_mlp), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    text = str(jax.make_jaxpr(lambda *a: jax.vjp(fused_mlp, *a)[1](dy))(x, w_in, w_out))
    assert "concatenate" not in text and "pad" not in text


# --- attention, MLP choice and embedding lookup in the model ---


@pytest.mark.parametrize(
    "setting, dtype, platform, chosen",
    [
        ("auto", "bfloat16", "gpu", "cudnn"),
        ("auto", "float16", "gpu", "cudnn"),
        ("auto", "float32", "gpu", "einsum"),  # cuDNN's fused attention takes 16-bit inputs only
        ("auto", "bfloat16", "cpu", "einsum"),
        ("auto", "bfloat16", "tpu", "einsum"),
        ("xla", "float32", "gpu", "xla"),
        ("einsum", "bfloat16", "gpu", "einsum"),
    ],
)
def test_auto_attention_is_cudnn_on_gpu_in_16_bits_only(setting, dtype, platform, chosen):
    assert kernels.attention_implementation(setting, dtype, platform) == chosen


def test_auto_attention_on_cpu_is_the_einsum_path():
    auto = ModelConfig(**{**CFG.__dict__, "attention": "auto", "attention_block": 4})
    assert auto.validate() == []
    params = init(CFG)
    np.testing.assert_array_equal(
        logits_of(auto, params), logits_of(ModelConfig(**{**CFG.__dict__, "attention_block": 4}), params)
    )


def test_the_attention_remat_policy_names_the_fused_attention_of_this_jax():
    """The policy goes by the primitive's name; a jax that renamed it would silently save nothing."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    assert kernels.fused_attention_saveable(cudnn_attention._dot_product_attention_fwd_p_wrapper)
    assert not kernels.fused_attention_saveable(jax.lax.exp_p)


def test_dot_product_attention_equals_the_einsum_path():
    """jax.nn.dot_product_attention (xla) gives the einsum path's logits and gradients, GQA included."""
    _assert_same_model(CFG, ModelConfig(**{**CFG.__dict__, "attention": "xla"}), grad_rtol=1e-4)


@pytest.mark.parametrize("block", [4, 5, 12])
def test_blocked_causal_attention_equals_the_whole_square(block):
    """Query blocks that score only the keys up to their end give the logits and gradients of the
    whole masked square: blocks dividing the length (4), not dividing it (5: 5+5+2), one block (12)."""
    _assert_same_model(CFG, ModelConfig(**{**CFG.__dict__, "attention_block": block}), grad_rtol=1e-5)
    assert any("attention_block must be" in p for p in ModelConfig(attention_block=-1).validate())


@pytest.mark.parametrize("remat", ["none", "dots_no_batch"])
def test_fused_mlp_gradient_equals_autodiffs(remat):
    unrolled = ModelConfig(**{**CFG.__dict__, "scan_layers": False, "remat": remat})
    params = init(unrolled)
    cfgs = {g: ModelConfig(**{**unrolled.__dict__, "mlp_grad": g}) for g in ("xla", "one_pass", "fused")}
    grads = {g: mean_logit_grad(c, params) for g, c in cfgs.items()}
    for g in ("one_pass", "fused"):
        for a, b in zip(jax.tree.leaves(grads["xla"]), jax.tree.leaves(grads[g]), strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-8)
    if remat != "none":  # the fused backward keeps what autodiff keeps (the gate_up product), no more
        kept = lambda c: sorted(a.str_short() for a, _ in saved_residuals(mean_logit(c), params))
        assert kept(cfgs["fused"]) == kept(cfgs["xla"])


@pytest.mark.parametrize(
    "mlp_grad, platform, rules, saved, chosen",
    [
        ("auto", "cpu", "dp", "", "xla"),
        ("auto", "gpu", "dp", "", "fused"),
        ("auto", "gpu", "fsdp", "", "fused"),
        ("auto", "gpu", "megatron_1d", "", "one_pass"),  # mlp split: dx would take two all-reduces
        ("auto", "gpu", "dp", "mlp_hidden", "one_pass"),  # kept, so nothing to recompute
        ("fused", "cpu", "megatron_1d", "", "fused"),
        ("xla", "gpu", "dp", "", "xla"),
    ],
)
def test_mlp_implementation(mlp_grad, platform, rules, saved, chosen):
    from gspmd_tp.sharding.rules import load_rules

    cfg = ModelConfig(mlp_grad=mlp_grad, remat="full" if saved else "none", remat_save=saved)
    with nn.logical_axis_rules(load_rules(rules).rules):
        assert kernels.mlp_implementation(cfg, platform) == chosen


def test_embed_lookup_in_bf16_gives_take_then_cast_exactly_and_its_float32_gradient():
    """The table is cast before the lookup (so a vocabulary-parallel all-reduce moves bf16 rows);
    rows and gradient are bit for bit those of looking up in float32 and casting after."""
    table = jax.random.normal(jax.random.key(0), (256, 64), jnp.float32)
    tokens = jax.random.randint(jax.random.key(1), (4, 32), 0, 256)
    weights = jax.random.normal(jax.random.key(2), (4, 32, 64), jnp.float32)
    old = jnp.take(table, tokens, axis=0).astype(jnp.bfloat16)
    new = kernels.embed_lookup(table, tokens, jnp.bfloat16)
    assert new.dtype == jnp.bfloat16 and np.array_equal(np.asarray(new), np.asarray(old))

    def loss(lookup):
        return lambda t: jnp.sum(lookup(t).astype(jnp.float32) * weights)

    g_old = jax.grad(loss(lambda t: jnp.take(t, tokens, axis=0).astype(jnp.bfloat16)))(table)
    g_new = jax.grad(loss(lambda t: kernels.embed_lookup(t, tokens, jnp.bfloat16)))(table)
    assert g_new.dtype == jnp.float32 and np.array_equal(np.asarray(g_new), np.asarray(g_old))
    assert np.count_nonzero(np.asarray(g_new).any(axis=1)) == len(np.unique(np.asarray(tokens)))


def test_embed_is_a_plain_lookup_in_float32_and_the_cast_first_one_otherwise():
    table = jax.random.normal(jax.random.key(0), (256, 16), jnp.float32)
    tokens = TOKENS
    f32 = kernels.embed(CFG, table, tokens)
    assert f32.dtype == jnp.float32 and np.array_equal(f32, jnp.take(table, tokens, axis=0))
    bf16 = kernels.embed(ModelConfig(dtype="bfloat16"), table, tokens)
    assert bf16.dtype == jnp.bfloat16 and np.array_equal(
        bf16, kernels.embed_lookup(table, tokens, jnp.bfloat16)
    )


@pytest.mark.parametrize(
    "rules, mesh",
    [("data_fsdp_tensor", "data=2,fsdp=2,tensor=2"), ("megatron_1d", "dp=2,mp=4"), ("fsdp", "dp=8,mp=1")],
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embed_gradient_sharded_over_eight_devices_is_autodiffs_of_the_lookup(rules, mesh, dtype):
    """Split on vocab (tensor, mp), the table's gradient is scattered one table shard at a time;
    split on embed alone (fsdp), it is take's. In float32 either way: autodiff of take's, to the
    rounding of summing the batch shards' parts."""
    s = run_setup.setup(small_config(rules=rules, mesh=mesh))
    table = jax.random.normal(jax.random.key(0), (256, 64), jnp.float32)
    tokens = jax.random.randint(jax.random.key(1), (8, 32), 0, 256)
    weights = jax.random.normal(jax.random.key(2), (8, 32, 64), jnp.float32)
    want = jax.grad(
        lambda t: jnp.sum(jnp.take(t, tokens, axis=0).astype(dtype).astype(jnp.float32) * weights)
    )(table)
    cfg = ModelConfig(dtype=dtype)
    shardings = [NamedSharding(s.mesh, s.rules.spec(n)) for n in (("vocab", "embed"), ("batch", "length"))]
    with state_lib.sharding_context(s.mesh, s.rules):
        loss = lambda t, x: jnp.sum(kernels.embed(cfg, t, x).astype(jnp.float32) * weights)  # noqa: E731
        args = [jax.device_put(a, sh) for a, sh in zip((table, tokens), shardings, strict=True)]
        got = jax.jit(jax.grad(loss), in_shardings=shardings)(*args)
    assert args[0].addressable_shards[0].data.size <= table.size // 2  # the table really is split
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# --- the dtype of the weight gradients (model.grad_dtype) ---


def _outputs(jaxpr, primitive: str) -> list:
    """The output avals of every `primitive` equation in `jaxpr` and the jaxprs inside it."""
    found = [v.aval for eqn in jaxpr.eqns if eqn.primitive.name == primitive for v in eqn.outvars]
    for sub in jax.extend.core.subjaxprs(jaxpr):
        found += _outputs(sub, primitive)
    return found


@pytest.mark.parametrize("mlp_grad", ["xla", "fused"])
@pytest.mark.parametrize("tied", [False, True])
def test_grad_dtype_makes_every_weight_gradient_in_it(mlp_grad, tied):
    """model.grad_dtype=bfloat16 under float32 compute: the product that makes each weight's
    gradient writes bf16 (the qkv, output, MLP and output-head weights, each of its weight's shape)
    and the embedding's rows are added in bf16; the gradients come back float32, within bf16's
    rounding of autodiff's, and the logits are the same. Without it nothing is bf16."""
    cfg = ModelConfig(**{**vars(CFG), "mlp_grad": mlp_grad, "tie_embeddings": tied})
    bf16 = ModelConfig(**{**vars(cfg), "grad_dtype": "bfloat16"})
    params = init(cfg)

    def bf16_shapes(c, primitive):
        jaxpr = jax.make_jaxpr(jax.grad(mean_logit(c)))(params).jaxpr
        return sorted({a.shape for a in _outputs(jaxpr, primitive) if a.dtype == jnp.bfloat16})

    assert bf16_shapes(cfg, "dot_general") == bf16_shapes(cfg, "scatter-add") == []
    layer = params["layers"]
    weights = {layer["attn"][n].shape[1:] for n in ("qkv", "out")} | {layer["mlp"]["down"].shape[1:]}
    e, _, m = layer["mlp"]["gate_up"].shape[1:]
    weights |= {(e, m)} if mlp_grad == "fused" else {(e, 2, m)}  # fused: gate and up apart, stacked
    weights |= {params["embedding"].shape[::-1] if tied else params["lm_head"].shape}
    assert bf16_shapes(bf16, "dot_general") == sorted(weights)
    assert bf16_shapes(bf16, "scatter-add") == [params["embedding"].shape]
    np.testing.assert_array_equal(logits_of(bf16, params), logits_of(cfg, params))
    g, g0 = mean_logit_grad(bf16, params), mean_logit_grad(cfg, params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-2 * float(jnp.abs(b).max()))


def test_spread_sums_its_copies_gradients_in_grad_dtype():
    w = jax.random.normal(jax.random.key(0), (8, 16), jnp.float32)
    weights = jax.random.normal(jax.random.key(1), (4, 8, 16), jnp.float32)

    def grad(grad_dtype):
        loss = lambda w: jnp.sum(kernels.spread(w, 4, (None, None), grad_dtype) * weights)  # noqa: E731
        sums = _outputs(jax.make_jaxpr(jax.grad(loss))(w).jaxpr, "reduce_sum")
        return jax.grad(loss)(w), [a for a in sums if a.shape == w.shape]  # the copies' sum

    (g0, (total0,)), (g, (total,)) = grad(""), grad("bfloat16")
    np.testing.assert_allclose(g0, weights.sum(0), rtol=1e-6)
    assert total0.dtype == g0.dtype == g.dtype == jnp.float32 and total.dtype == jnp.bfloat16
    np.testing.assert_allclose(g, g0, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_bfloat16_model_casts_each_weight_where_it_lies(dtype):
    """Under bf16 compute every matrix's bf16 copy is constrained to the weight's own layout
    (transformer.cast_weight), so a weight split over devices is gathered in bf16 whatever dtype
    the compiler would pick; in float32 the weights are used as they are."""
    s = run_setup.setup(small_config(rules="fsdp", mesh="dp=8,mp=1"))
    cfg = ModelConfig(**{**vars(CFG), "dtype": dtype, "tie_embeddings": False})
    params = init(cfg)
    with state_lib.sharding_context(s.mesh, s.rules):
        jaxpr = jax.make_jaxpr(mean_logit(cfg))(params).jaxpr
    constrained = {(a.shape, a.dtype) for a in _outputs(jaxpr, "sharding_constraint")}
    layer = params["layers"] if cfg.scan_layers else params["layers_0"]
    matrices = [w.shape[1:] if cfg.scan_layers else w.shape for w in jax.tree.leaves(layer) if w.ndim > 2]
    matrices.append(params["lm_head"].shape)
    assert len(matrices) == 5  # qkv, out, gate_up, down, the output head
    bf16 = {shape for shape in matrices if (shape, jnp.dtype(jnp.bfloat16)) in constrained}
    assert bf16 == (set(matrices) if dtype == "bfloat16" else set())
