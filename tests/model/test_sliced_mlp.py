"""model.mlp_slices: the MLP whose weights' gathers run in slices (kernels.sliced_mlp)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config
from jax.sharding import NamedSharding
from test_kernels import _outputs

from gspmd_tp.job.errors import UserError
from gspmd_tp.model import kernels
from gspmd_tp.model.transformer import ModelConfig
from gspmd_tp.sharding.rules import load_rules
from gspmd_tp.train import run_setup
from gspmd_tp.train import state as state_lib

# Where each shipped rule file lets the MLP gather its weights in slices (None: nothing splits
# them on the model width, so there is nothing to gather).
LAYOUTS = {
    "dp": None,
    "megatron_1d": None,
    "megatron_1d_sp": None,
    "fsdp": {"batch": ("dp", "mp"), "length": (), "gather": ("dp", "mp"), "mlp": (), "scatter": False},
    "megatron_2d": {"batch": ("dp",), "length": (), "gather": ("dp",), "mlp": ("mp",), "scatter": True},
    "fsdp_tp": {"batch": ("dp",), "length": (), "gather": ("dp",), "mlp": ("mp",), "scatter": False},
    "data_fsdp_tensor": {
        "batch": ("data", "fsdp"),
        "length": (),
        "gather": ("fsdp",),
        "mlp": ("tensor",),
        "scatter": False,
    },
}


@pytest.mark.parametrize("rules", LAYOUTS)
def test_the_layout_each_shipped_rule_file_gives_the_sliced_mlp(rules):
    with nn.logical_axis_rules(load_rules(rules).rules):
        assert kernels.sliced_mlp_layout() == LAYOUTS[rules]


def _mlp_and_grads(rules, mesh, slices, grad_dtype=""):
    """kernels.mlp of random operands (the tests' small widths) on 8 devices under `rules`, with
    model.mlp_slices=`slices`: its output, the gradients of a weighted sum of it, and the jaxpr of
    those gradients."""
    s = run_setup.setup(small_config(rules=rules, mesh=mesh))
    cfg = ModelConfig(d_model=64, mlp_dim=128, mlp_slices=slices, mlp_grad="xla", grad_dtype=grad_dtype)
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (8, 16, 64), jnp.float32)
    w_in = jax.random.normal(keys[1], (64, 2, 128), jnp.float32) / 8
    w_out = jax.random.normal(keys[2], (128, 64), jnp.float32) / 11
    weights = jax.random.normal(keys[3], (8, 16, 64), jnp.float32)
    names = (("batch", "length", None), kernels.MLP_IN, kernels.MLP_OUT)
    shardings = [NamedSharding(s.mesh, s.rules.spec(n)) for n in names]
    args = [jax.device_put(a, sh) for a, sh in zip((x, w_in, w_out), shardings, strict=True)]
    with state_lib.sharding_context(s.mesh, s.rules):
        loss = lambda *a: jnp.sum(kernels.mlp(cfg, *a) * weights)  # noqa: E731
        out = jax.jit(lambda *a: kernels.mlp(cfg, *a), in_shardings=shardings)(*args)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=shardings)(*args)
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args).jaxpr
    return out, grads, jaxpr


@pytest.mark.parametrize(
    "rules, mesh, slices, mlp_ways, gather_ways",
    [
        ("megatron_2d", "dp=2,mp=4", 2, 4, 2),
        ("megatron_2d", "dp=4,mp=2", 4, 2, 4),
        ("fsdp_tp", "dp=4,mp=2", 2, 2, 4),
        ("fsdp", "dp=8,mp=1", 4, 1, 8),
        ("data_fsdp_tensor", "data=2,fsdp=2,tensor=2", 2, 2, 2),
    ],
)
def test_the_sliced_mlp_computes_the_mlp_and_its_gradients_gathering_each_weight_in_slices(
    rules, mesh, slices, mlp_ways, gather_ways
):
    """The output and the three gradients of GSPMD's MLP (to float32 rounding), with each weight
    gathered in `slices` pieces of a device's mlp share and each weight gradient reduce-scattered in
    as many (GSPMD's MLP has no such collective in its jaxpr: it places its own after)."""
    want, want_grads, plain = _mlp_and_grads(rules, mesh, 1)
    got, grads, sliced = _mlp_and_grads(rules, mesh, slices)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(jnp.abs(w).max()))
    assert _outputs(plain, "all_gather") == [] and _outputs(plain, "reduce_scatter") == []
    c, e = 128 // mlp_ways // slices, 64
    gathered = [a.shape for a in _outputs(sliced, "all_gather")]
    assert gathered.count((e, 2, c)) == gathered.count((c, e)) == slices, gathered
    scattered = [a.shape for a in _outputs(sliced, "reduce_scatter")]
    shard = e // gather_ways
    assert scattered.count((shard, 2, c)) == scattered.count((c, shard)) == slices, scattered


def test_the_sliced_mlp_reduces_its_weight_gradients_in_grad_dtype():
    """Under optim.grad_reduce_dtype=bfloat16 (model.grad_dtype) each slice's weight gradient is
    reduce-scattered in bf16 and comes back float32, within bf16's rounding of the float32 one."""
    _, want, _ = _mlp_and_grads("megatron_2d", "dp=4,mp=2", 2)
    _, got, jaxpr = _mlp_and_grads("megatron_2d", "dp=4,mp=2", 2, grad_dtype="bfloat16")
    scattered = [a for a in _outputs(jaxpr, "reduce_scatter") if a.ndim in (2, 3) and a.dtype == jnp.bfloat16]
    assert len(scattered) == 4  # gate/up and down, two slices each
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-2 * float(jnp.abs(w).max()))


def test_mlp_slices_that_do_not_divide_a_devices_share_are_refused_in_one_line():
    with pytest.raises(UserError) as e:
        run_setup.setup(small_config(rules="megatron_2d", mesh="dp=2,mp=4", **{"model.mlp_slices": 3}))
    assert str(e.value) == (
        "config.model.mlp_slices=3: model.mlp_dim=128 split 4 ways over mp (32 a device) does not "
        "divide into 3 equal slices"
    )
    with pytest.raises(UserError, match=r"^model.mlp_slices must be 1 \(whole gathers\) or more, got 0$"):
        run_setup.setup(small_config(**{"model.mlp_slices": 0}))
    with pytest.raises(UserError, match=r"^model.mlp_grad 'fused' writes the whole MLP's backward"):
        run_setup.setup(small_config(**{"model.mlp_slices": 2, "model.mlp_grad": "fused"}))


def test_mlp_slices_under_a_rule_file_with_nothing_to_gather_warns_and_changes_nothing(capsys):
    s = run_setup.setup(small_config(rules="megatron_1d", mesh="dp=2,mp=4", **{"model.mlp_slices": 2}))
    warned = [line for line in capsys.readouterr().err.splitlines() if "mlp_slices" in line]
    assert warned == [
        f"warning: config.model.mlp_slices=2 changes nothing: {s.rules.source} splits the MLP's weights "
        "on no mesh axis of the model width (embed), so no gather is sliced"
    ]
