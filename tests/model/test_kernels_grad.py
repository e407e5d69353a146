"""The SwiGLU MLP's gradients under every model.mlp_grad setting equal autodiff's of the plain
formula, written out here: with a random output cotangent (a uniform one, as a .mean() loss gives,
could hide a gate/up mix-up), in float32 and bfloat16, under remat, and sharded over 8 devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config
from jax.sharding import NamedSharding

from gspmd_tp.model import kernels
from gspmd_tp.model.transformer import ModelConfig
from gspmd_tp.train import run_setup
from gspmd_tp.train import state as state_lib

SETTINGS = [g for g in kernels.MLP_GRADS if g != "auto"]  # auto picks one of these by platform
# numpy, so that collecting this module (in every pytest process) starts no JAX backend
_RNG = np.random.default_rng(0)
X = _RNG.standard_normal((8, 16, 64), np.float32)  # (batch, length, embed)
W_IN = _RNG.standard_normal((64, 2, 128), np.float32) / 8  # (embed, gate/up, mlp): unit-scale products
W_OUT = _RNG.standard_normal((128, 64), np.float32) / 11  # (mlp, embed)
DY = _RNG.standard_normal((8, 16, 64), np.float32)


def plain_mlp(x, w_in, w_out):
    """down(silu(gate) * up), silu written out: nothing shared with gspmd_tp.model.kernels."""
    gate = jnp.einsum("ble,em->blm", x, w_in[:, 0])
    up = jnp.einsum("ble,em->blm", x, w_in[:, 1])
    return jnp.einsum("blm,me->ble", gate * jax.nn.sigmoid(gate) * up, w_out)


def value_and_vjp(f, *args):
    """(f(*args), the gradients of <f(*args), DY> for each argument)."""
    y, vjp = jax.vjp(f, *args)
    return y, vjp(DY.astype(y.dtype))


def _max_relative(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / np.abs(want).max())


@functools.cache
def _want():
    """The plain formula's output and gradients: (y, (dx, dw_in, dw_out))."""
    return value_and_vjp(plain_mlp, X, W_IN, W_OUT)


def test_the_settings_are_the_ones_the_tests_below_cover():
    assert set(SETTINGS) == {"xla", "one_pass", "fused"}


@pytest.mark.parametrize("remat", [False, True], ids=["saved", "remat"])
@pytest.mark.parametrize("mlp_grad", SETTINGS)
def test_each_mlp_gradient_equals_autodiff_of_the_plain_formula_in_float32(mlp_grad, remat):
    cfg = ModelConfig(mlp_grad=mlp_grad)
    f = lambda *a: kernels.mlp(cfg, *a)
    y, grads = value_and_vjp(jax.checkpoint(f) if remat else f, X, W_IN, W_OUT)
    want_y, wants = _want()
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    for name, got, want in zip(("x", "w_in", "w_out"), grads, wants, strict=True):
        assert got.shape == want.shape and got.dtype == jnp.float32, name
        assert _max_relative(got, want) < 1e-5, name


@pytest.mark.parametrize("mlp_grad", SETTINGS)
def test_each_mlp_gradient_in_bfloat16_is_float32s_to_bfloat16s_precision(mlp_grad):
    """Inputs, products and gradients in bfloat16 (8 bits of mantissa, 2^-8 relative per rounding):
    a gradient goes through about four roundings, so it may miss float32's by a few 2^-8 of its
    largest element; 2^-5 leaves room for that and none for a wrong formula (errors of order 1)."""
    cfg = ModelConfig(mlp_grad=mlp_grad)
    args = [a.astype(jnp.bfloat16) for a in (X, W_IN, W_OUT)]
    y, grads = value_and_vjp(lambda *a: kernels.mlp(cfg, *a), *args)
    # Against float32 of the same rounded inputs: only the kernel's own roundings count.
    want_y, want = value_and_vjp(plain_mlp, *[a.astype(jnp.float32) for a in args])
    assert y.dtype == jnp.bfloat16 and _max_relative(y, want_y) < 2**-5
    for name, got, ref in zip(("x", "w_in", "w_out"), grads, want, strict=True):
        assert got.dtype == jnp.bfloat16, name
        assert _max_relative(got, ref) < 2**-5, name


@pytest.mark.parametrize("mlp_grad", SETTINGS)
def test_swiglus_gradient_is_finite_and_right_where_the_sigmoid_saturates(mlp_grad):
    """Gates of +-40: silu's derivative is 1 and 0 there, its formula's terms cancel at large |gate|
    (gate * sigmoid * (1 - sigmoid)), and no NaN may come of it."""
    cfg = ModelConfig(mlp_grad=mlp_grad)
    w_in = W_IN.copy()
    w_in[:, 0] *= 40.0
    y, grads = value_and_vjp(lambda *a: kernels.mlp(cfg, *a), X, w_in, W_OUT)
    want_y, want = value_and_vjp(plain_mlp, X, w_in, W_OUT)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)
    assert _max_relative(y, want_y) < 1e-5
    for name, got, ref in zip(("x", "w_in", "w_out"), grads, want, strict=True):
        assert _max_relative(got, ref) < 1e-4, name


@pytest.mark.parametrize("rules, mesh", [("megatron_1d", "dp=2,mp=4"), ("fsdp", "dp=8,mp=1")])
@pytest.mark.parametrize("mlp_grad", SETTINGS)
def test_each_mlp_gradient_sharded_over_eight_devices_equals_the_unsharded_one(mlp_grad, rules, mesh):
    """megatron_1d splits the hidden (mlp) axis over mp, so the input gradient is summed across
    devices; fsdp splits the weights over dp and the batch with them. The kernels' logical
    constraints must place every product and gradient without changing a value."""
    s = run_setup.setup(small_config(rules=rules, mesh=mesh))
    names = [("batch", "length", "embed"), ("embed", None, "mlp"), ("mlp", "embed")]
    shardings = [NamedSharding(s.mesh, s.rules.spec(n)) for n in names]
    cfg = ModelConfig(mlp_grad=mlp_grad)
    with state_lib.sharding_context(s.mesh, s.rules):
        f = jax.jit(lambda *a: value_and_vjp(lambda *b: kernels.mlp(cfg, *b), *a), in_shardings=shardings)
        args = [jax.device_put(a, sh) for a, sh in zip((X, W_IN, W_OUT), shardings, strict=True)]
        y, grads = f(*args)
    # The weights really are split: a device holds a quarter (mp=4) or an eighth (dp=8) of each.
    assert all(a.addressable_shards[0].data.size <= a.size // 4 for a in args[1:])
    want_y, wants = _want()
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    for name, got, want in zip(("x", "w_in", "w_out"), grads, wants, strict=True):
        assert _max_relative(got, want) < 1e-5, name
