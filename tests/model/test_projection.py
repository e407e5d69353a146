"""The weight products' hand-written gradients: equal to autodiff's, laid out as XLA:CPU's product
kernels read them, and merged or transposed only where the rule file allows."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspmd_tp.model import projection
from gspmd_tp.model.projection import output_projection
from gspmd_tp.sharding.mesh import make_mesh
from gspmd_tp.sharding.rules import load_rules
from gspmd_tp.train.state import sharding_context


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_output_projection_gradient_equals_autodiff(dtype):
    kx, kw, kg = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (2, 5, 8), dtype)
    w = jax.random.normal(kw, (8, 12), dtype)
    g = jax.random.normal(kg, (2, 5, 12), dtype)
    plain = jax.vjp(lambda a, b: jnp.einsum("ble,ev->blv", a, b), x, w)
    ours = jax.vjp(output_projection, x, w)
    np.testing.assert_array_equal(ours[0], plain[0])
    for a, b in zip(ours[1](g), plain[1](g), strict=True):
        assert a.dtype == b.dtype == dtype
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=1e-2 if dtype == jnp.bfloat16 else 1e-5)


@pytest.mark.parametrize("n_in", [1, 2])
@pytest.mark.parametrize("transpose_input", [True, False])
@pytest.mark.parametrize("merge", [True, False])
def test_explicit_projection_gradient_equals_autodiff(n_in, transpose_input, merge):
    kx, kw, kg = jax.random.split(jax.random.key(4), 3)
    x = jax.random.normal(kx, (2, 5, 3, 4) if n_in == 2 else (2, 5, 12))
    w = jax.random.normal(kw, (3, 4, 6, 7) if n_in == 2 else (12, 6, 7))
    g = jax.random.normal(kg, (2, 5, 6, 7))
    plain = jax.vjp(lambda a, b: jnp.tensordot(a, b, axes=n_in), x, w)
    ours = jax.vjp(lambda a, b: projection._project(a, b, n_in, transpose_input, merge), x, w)
    np.testing.assert_allclose(ours[0], plain[0], rtol=1e-6)
    for a, b in zip(ours[1](g), plain[1](g), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("merge", [True, False])
def test_merged_axes_keep_the_weight_untransposed(merge):
    """With its axes merged, the input gradient reads the weight as it is stored; unmerged, XLA
    copies all of it transposed (the product has two contracting axes)."""
    x, w, g = jnp.ones((2, 16, 32)), jnp.ones((32, 2, 64)), jnp.ones((2, 16, 2, 64))
    dx = jax.jit(jax.grad(lambda a, b, c: jnp.vdot(projection._project(a, b, 1, True, merge), c)))
    text = dx.lower(x, w, g).compile().as_text()
    assert bool(re.search(r"= \S+ (transpose|copy)\(", text)) != merge


@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("transpose_input", [True, False])
def test_weight_gradient_products_contract_their_left_operands_minor_axis(merge, transpose_input):
    """Every product of the weight gradient reads its left operand as stored: a product that
    contracts the major axis goes to XLA:CPU's slower transposed-operand path."""
    x, w, g = jnp.ones((2, 16, 32)), jnp.ones((32, 2, 4)), jnp.ones((2, 16, 2, 4))

    def loss(a, b, c):
        return jnp.vdot(projection._project(a, b, 1, transpose_input, merge), c)

    text = jax.jit(jax.grad(loss, argnums=1)).lower(x, w, g).compile().as_text()
    dots = re.findall(r" dot\(.*?lhs_contracting_dims=\{(\d+)\}", text)
    assert dots and set(dots) == {"1"}


def test_projection_axes_merge_where_the_rule_file_allows():
    mesh = make_mesh("dp=2,mp=4", ["dp", "mp"])
    qkv = ((256, 8, 3, 32), ("embed", "kv_heads", None, "head_dim"), 1)
    gate_up = ((256, 2, 1024), ("embed", None, "mlp"), 1)
    out = ((8, 32, 256), ("heads", "head_dim", "embed"), 2)
    down = ((1024, 256), ("mlp", "embed"), 1)
    with sharding_context(mesh, load_rules("megatron_1d")):
        # Merging (2, 1024/4) would not leave each device a contiguous block of 2048.
        assert [projection._merges(*w) for w in (qkv, gate_up, out, down)] == [True, False, True, False]
    assert projection._merges(*gate_up)  # nothing sharded


def test_projection_local_sizes_follow_the_rule_file():
    mesh = make_mesh("dp=2,mp=4", ["dp", "mp"])
    with sharding_context(mesh, load_rules("megatron_1d")):
        assert projection._local_size((1024, 256), ("mlp", "embed")) == 256 * 256
        assert projection._local_size((16, 256), ("batch", "length")) == 8 * 256
    assert projection._local_size((1024, 256), ("mlp", "embed")) == 1024 * 256  # no rules: whole
    assert projection.explicit_projection_grad("auto") == (jax.default_backend() == "cpu")
    assert not projection.explicit_projection_grad("xla") and projection.explicit_projection_grad("explicit")
