"""The SwiGLU MLP's activation and its hand-written gradients (model.mlp_grad).

`swiglu` is silu(gate) * up of a stacked gate/up activation, with autodiff's gradient or one
elementwise pass; `fused_mlp` is the whole MLP (gate/up product, SwiGLU, down product) with its
backward written out. Logical axis names only, as in model.py.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from gspmd_tp.sharding.axes import BATCH, LENGTH, MLP


def swiglu(gate_up, one_pass_gradient: bool = False):
    """silu(gate) * up of gate_up (..., 2, mlp), gate first. With `one_pass_gradient` its gradient is
    one elementwise pass that writes the stacked array: autodiff of the two slices adds two
    zero-padded halves instead, more memory traffic on the largest activations (on an H100 the
    llama_1b step is 1.017x faster in one pass; on CPU it was slower, BENCHMARKS.md). Which one a
    run takes is model.mlp_implementation's choice."""
    return _swiglu_one_pass(gate_up) if one_pass_gradient else _swiglu(gate_up)


def _swiglu(gate_up):
    return nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]


def _swiglu_grads(gate_up, d_hidden):
    """(d gate, d up), each shaped like d_hidden, computed in float32 and returned in gate_up's dtype."""
    x = gate_up.astype(jnp.float32)
    gate, up = x[..., 0, :], x[..., 1, :]
    d = d_hidden.astype(jnp.float32)
    sigmoid = jax.nn.sigmoid(gate)
    d_gate = d * up * sigmoid * (1 + gate * (1 - sigmoid))
    d_up = d * gate * sigmoid
    return d_gate.astype(gate_up.dtype), d_up.astype(gate_up.dtype)


@jax.custom_vjp
def _swiglu_one_pass(gate_up):
    return _swiglu(gate_up)


def _swiglu_forward(gate_up):
    return _swiglu(gate_up), gate_up


def _swiglu_backward(gate_up, d_hidden):
    # Each element takes the gate's or the up's derivative by its index on the stacked axis
    # (no concatenate, no zero-padded halves).
    d_gate, d_up = _swiglu_grads(gate_up, d_hidden)
    is_gate = jax.lax.broadcasted_iota(jnp.int32, gate_up.shape, gate_up.ndim - 2) == 0
    return (jnp.where(is_gate, d_gate[..., None, :], d_up[..., None, :]),)


_swiglu_one_pass.defvjp(_swiglu_forward, _swiglu_backward)


def _mlp_forward(x_ble, w_in, w_out):
    gate_up = nn.with_logical_constraint(jnp.tensordot(x_ble, w_in, axes=1), (BATCH, LENGTH, None, MLP))
    hidden = nn.with_logical_constraint(_swiglu(gate_up), (BATCH, LENGTH, MLP))
    return jnp.tensordot(hidden, w_out, axes=1), gate_up


@jax.custom_vjp
def fused_mlp(x_ble, w_in, w_out):
    """down(silu(gate) * up) of x (batch, length, embed), w_in (embed, 2, mlp), w_out (mlp, embed),
    with its backward written out: SwiGLU's output, which the down projection's weight gradient
    needs, is recomputed in the same elementwise pass that computes SwiGLU's gradient (both read
    gate_up and write three arrays of one shape), where autodiff under remat recomputes it in a pass
    of its own; the gate and up gradients stay apart, so the input gradient is two products
    accumulated and the weight gradient two products stacked. Under remat the residuals are what
    autodiff keeps: the input, the weights and the gate_up product."""
    return _mlp_forward(x_ble, w_in, w_out)[0]


def _fused_mlp_fwd(x_ble, w_in, w_out):
    y, gate_up = _mlp_forward(x_ble, w_in, w_out)
    return y, (x_ble, w_in, w_out, gate_up)


def _fused_mlp_bwd(res, dy):
    x_ble, w_in, w_out, gate_up = res
    names = (BATCH, LENGTH, MLP)
    d_hidden = nn.with_logical_constraint(jnp.einsum("ble,me->blm", dy, w_out), names)
    hidden = nn.with_logical_constraint(_swiglu(gate_up), names)
    d_gate, d_up = (nn.with_logical_constraint(d, names) for d in _swiglu_grads(gate_up, d_hidden))
    dx = jnp.einsum("blm,em->ble", d_gate, w_in[:, 0]) + jnp.einsum("blm,em->ble", d_up, w_in[:, 1])
    d_w_in = jnp.stack([jnp.einsum("ble,blm->em", x_ble, d) for d in (d_gate, d_up)], axis=1)
    d_w_out = jnp.einsum("blm,ble->me", hidden, dy)
    return dx, d_w_in, d_w_out


fused_mlp.defvjp(_fused_mlp_fwd, _fused_mlp_bwd)
