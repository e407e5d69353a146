"""The model's weight products, each with a hand-written gradient that XLA:CPU runs faster than
autodiff's (BENCHMARKS.md): the same values, the operands laid out for its product kernels.

Logical names only, as in model.py: a rule file decides where each operand lives.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from gspmd_tp.sharding.rules import axes_of

# The output of every weight projection (project): a hand-written gradient hides its product from
# the dot-based policies, so they keep it by this name.
PROJECTION = "projection"


def _local_size(shape, names) -> int:
    """Elements of one device's shard of an array of `shape` with logical axis `names`, under the
    logical rules and mesh being traced with (the whole array where there are none)."""
    mesh = dict(jax.sharding.get_abstract_mesh().shape)
    size = 1
    for dim, axis in zip(shape, nn.logical_to_mesh_axes(names), strict=True):
        shards = math.prod(mesh.get(a, 1) for a in axes_of(axis))
        size *= max(dim // shards, 1)
    return size


def _merges(shape, names, n_in: int) -> bool:
    """Whether a weight of `shape` (logical axis `names`, the first n_in of them its input axes)
    can be read as a matrix (inputs, outputs) under the rules and mesh being traced with: where
    only the first axis of each group is split across devices, each device holds a contiguous
    block of the merged axis, and the merge is a reshape that moves nothing."""
    whole = [_local_size((dim,), (name,)) == dim for dim, name in zip(shape, names, strict=True)]
    return len(shape) > 2 and all(whole[1:n_in]) and all(whole[n_in + 1 :])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _project(x, w, n_in, transpose_input, merge):
    return jnp.tensordot(x, w, axes=n_in)


def _project_fwd(x, w, n_in, transpose_input, merge):
    return _project(x, w, n_in, transpose_input, merge), (x, w)


def _project_bwd(n_in, transpose_input, merge, res, g):
    # The weight gradient contracts the tokens, the leading axes of both x and g. XLA:CPU's
    # product kernels want them minor on the left operand, so one operand is transposed first: x
    # when its share of the weight's axes is the smaller, else g (and the small result after).
    # The barrier keeps the transpose from being folded back into the product, which XLA:CPU
    # would then hand to Eigen's slower transposed-operand path.
    x, w = res
    g = g.astype(x.dtype)
    x_shape, w_shape = x.shape, w.shape
    if merge:
        # The products on two-dimensional operands: XLA rewrites a product over several axes into
        # one over two and transposes the weight (all of it, every step) to do so.
        x = x.reshape(x_shape[:2] + (-1,))
        g = g.reshape(g.shape[:2] + (-1,))
        w = w.reshape(x.shape[2], g.shape[2])
        n_in = 1
    n_out = w.ndim - n_in
    tokens = (0, 1)
    dx = jnp.tensordot(g, w, axes=(tuple(range(2, 2 + n_out)), tuple(range(n_in, n_in + n_out))))
    if transpose_input:  # (in, tokens) @ (tokens, out)
        x_t = jax.lax.optimization_barrier(jnp.transpose(x, tuple(range(2, 2 + n_in)) + tokens))
        dw = jnp.tensordot(x_t, g, axes=((n_in, n_in + 1), tokens))
    else:  # ((out, tokens) @ (tokens, in))^T
        g_t = jax.lax.optimization_barrier(jnp.transpose(g, tuple(range(2, 2 + n_out)) + tokens))
        dw_t = jnp.tensordot(g_t, x, axes=((n_out, n_out + 1), tokens))
        # And the result's: XLA would otherwise fold its transpose into the product, whose left
        # operand it would then read transposed.
        dw_t = jax.lax.optimization_barrier(dw_t)
        dw = jnp.transpose(dw_t, tuple(range(n_out, n_out + n_in)) + tuple(range(n_out)))
    return dx.reshape(x_shape), dw.reshape(w_shape).astype(w.dtype)


_project.defvjp(_project_fwd, _project_bwd)


def explicit_projection_grad(setting: str, platform: str | None = None) -> bool:
    """Whether ModelConfig.projection_grad `setting` means the hand-written weight gradient on
    `platform` (by default JAX's default backend): "auto" means it on CPU only."""
    return setting == "explicit" or (setting == "auto" and (platform or jax.default_backend()) == "cpu")


def project(x, w, w_names, n_in: int = 1, explicit_grad: bool = False):
    """x (batch, length, *in) @ w (*in, *out) -> (batch, length, *out), `in` being w's first n_in
    axes (logical names `w_names`). With explicit_grad, the weight gradient transposes whichever
    of x and the output gradient is the smaller on each device (see _project_bwd), the backward
    products read a weight of more than two axes as a matrix where the rules allow (_merges), and
    the output is named PROJECTION so that the remat policies keep it as they keep a product."""
    if not explicit_grad:
        return jnp.tensordot(x, w, axes=n_in)
    w_in = _local_size(w.shape[:n_in], w_names[:n_in])
    w_out = _local_size(w.shape[n_in:], w_names[n_in:])
    merge = _merges(w.shape, w_names, n_in)
    return checkpoint_name(_project(x, w, n_in, w_in < w_out, merge), PROJECTION)


@jax.custom_vjp
def output_projection(x_ble, head_ev):
    """Logits: x (batch, length, embed) @ head (embed, vocab), with a hand-written gradient.

    Autodiff takes the head's gradient as (g^T x)^T: XLA:CPU then transposes the (tokens, vocab)
    output gradient for the product and the (vocab, embed) result again where the optimizer reads
    it. Written as x^T g, only the small (tokens, embed) operand is transposed and the gradient
    comes out in the head's own layout (BENCHMARKS.md). The same values either way.
    """
    return jnp.einsum("ble,ev->blv", x_ble, head_ev)


def _output_projection_fwd(x_ble, head_ev):
    return output_projection(x_ble, head_ev), (x_ble, head_ev)


def _output_projection_bwd(res, g_blv):
    x_ble, head_ev = res
    g_blv = g_blv.astype(x_ble.dtype)
    return jnp.einsum("blv,ev->ble", g_blv, head_ev), jnp.einsum("ble,blv->ev", x_ble, g_blv)


output_projection.defvjp(_output_projection_fwd, _output_projection_bwd)
