"""SwiGLU's hand-written gradients: each equals autodiff's, and each makes the passes it promises."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from gspmd_tp.model.kernels import fused_mlp, swiglu


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
