"""Mixture of experts in training: every mesh of the expert rule files equals one device (loss,
gradients, router stats), dense rule files run it too, a checkpoint moves between expert layouts,
the router's metrics reach metrics.jsonl, and bad input is one line before compiling."""

import json

import jax
import numpy as np
import pytest
from conftest import run_steps, small_config, token_batches
from shipped_rules import meshes_of

from gspmd_tp.checkpoint import store
from gspmd_tp.job.errors import UserError
from gspmd_tp.model.transformer import Transformer
from gspmd_tp.sharding import hlo
from gspmd_tp.train import loop, run_setup
from gspmd_tp.train import state as state_lib
from gspmd_tp.train import step as step_lib

# The small test model with 8 experts of width 32, 2 a token, and one shared expert: every expert
# axis up to 8 divides the experts, every tensor axis up to 8 the experts' width.
MOE = {"model.num_experts": 8, "model.expert_mlp_dim": 32, "model.shared_experts": 1}
EXPERT_RULES = ["expert_fsdp", "data_expert_tensor"]
# Every mesh of 8 devices each expert rule file admits, and dense rule files on the MoE model
# (experts replicated; their hidden width over mp under megatron_1d, 2D's weights under megatron_2d).
CASES = [(r, m) for r in EXPERT_RULES for m in meshes_of(r)]
CASES += [
    ("megatron_1d", "dp=2,mp=4"),
    ("megatron_2d", "dp=2,mp=4"),
    ("data_fsdp_tensor", "data=2,fsdp=2,tensor=2"),
]


def moe_config(**overrides):
    return small_config(**{**MOE, **overrides})


def loss_grads_stats(config, devices=None):
    """(loss, gradients, router stats) of the step's accumulated_grads_and_stats on one batch of
    the config's initial parameters."""
    s = run_setup.setup(config, devices)
    state = state_lib.init_state(s.model_cfg, s.tx, s.mesh, s.rules, config.seq_len, config.seed)
    tokens = jax.device_put(token_batches(config, 1)[0], s.batch_sharding)
    model = Transformer(s.model_cfg)
    with state_lib.sharding_context(s.mesh, s.rules):
        fn = jax.jit(
            lambda p, t: step_lib.accumulated_grads_and_stats(
                model, config.grad_accum, s.shardings.params, p, t
            )
        )
        return jax.device_get(fn(state.params, tokens))


@pytest.fixture(scope="module")
def one_device():
    return loss_grads_stats(moe_config(rules="dp", mesh="dp=1,mp=1"), jax.devices()[:1])


@pytest.mark.parametrize("rules, mesh", CASES)
def test_loss_gradients_and_router_stats_equal_one_device(one_device, rules, mesh):
    loss, grads, stats = loss_grads_stats(moe_config(rules=rules, mesh=mesh))
    want_loss, want_grads, want_stats = one_device
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    assert set(stats) == {"router_aux_loss", "router_z_loss", "expert_max_load"}
    for key, value in stats.items():
        assert float(value) == pytest.approx(float(want_stats[key]), rel=1e-5), key
    for path_g, want in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads), strict=True
    ):
        path, got = path_g
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_the_router_losses_are_in_the_gradient_by_their_weights():
    """The router's gradient with the losses weighted 0 differs from the one with them weighted
    1000 (they dominate), while the reported token loss is the same: they enter the objective only."""
    a = loss_grads_stats(moe_config(rules="expert_fsdp", mesh="data=2,expert=4"))
    heavy = {"model.router_aux_loss_coef": 1000.0, "model.router_z_loss_coef": 0.0}
    b = loss_grads_stats(moe_config(rules="expert_fsdp", mesh="data=2,expert=4", **heavy))
    assert float(a[0]) == pytest.approx(float(b[0]), rel=1e-6)
    router_a, router_b = (g["layers"]["moe"]["router"] for g in (a[1], b[1]))
    assert np.abs(router_b).max() > 10 * np.abs(router_a).max()
    # Elsewhere the aux loss moves only what feeds the router: the embedding, attention, norms.
    np.testing.assert_allclose(a[1]["lm_head"], b[1]["lm_head"], rtol=1e-5, atol=1e-8)


def test_gradient_accumulation_of_an_moe_model_equals_one_device_per_microbatch():
    """Two microbatches: the router's losses are per microbatch, so the reference is one device
    with the same two microbatches; under dp the step does not split them per batch shard."""
    ref = loss_grads_stats(
        moe_config(rules="dp", mesh="dp=1,mp=1", batch_size=16, grad_accum=2), jax.devices()[:1]
    )
    got = loss_grads_stats(moe_config(rules="dp", mesh="dp=8,mp=1", batch_size=16, grad_accum=2))
    assert float(got[0]) == pytest.approx(float(ref[0]), rel=1e-5)
    for key in ref[2]:
        assert float(got[2][key]) == pytest.approx(float(ref[2][key]), rel=1e-5)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1]), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


def test_the_expert_axis_moves_tokens_not_expert_weights():
    """expert_fsdp on data=2,expert=4, from the compiled step: each layer all-gathers its tokens
    over the expert axis (4 rows of 32 x 64 float32, 32 KiB: a data shard's batch) forward and
    again backward, and reduce-scatters the output back (one row's 8 KiB); no gather over the expert
    axis is any larger, so the experts' weights (64 KiB and 128 KiB a layer) never cross it."""
    s = run_setup.setup(moe_config(rules="expert_fsdp", mesh="data=2,expert=4"))
    found = hlo.collectives(step_lib.compile_train_step(s).as_text(), 8)
    over_expert = [c for c in found if c.group_size == 4]
    tokens = 4 * 32 * 64 * 4
    gathers = [c for c in over_expert if c.kind == "all-gather" and "shard_map" in c.op_name]
    assert sum(c.executions for c in gathers if c.result_bytes == tokens) == 2 * 2  # 2 layers, fwd + bwd
    scatters = [c for c in over_expert if c.kind == "reduce-scatter" and c.result_bytes == tokens // 4]
    assert sum(c.executions for c in scatters) >= 2  # the forward outputs (and their gradient)
    assert max(c.result_bytes for c in over_expert if c.kind == "all-gather") == tokens


# --- resharding ---

K = 2  # steps before the save, two after


def test_a_checkpoint_moves_between_expert_layouts_and_gives_the_uninterrupted_losses(tmp_path):
    """Saved under experts 2-way (data=4,expert=2), restored 4-way (data=2,expert=4) and under
    plain fsdp (experts replicated): the two steps after equal the uninterrupted run's."""
    batches = token_batches(moe_config(), K + 2)
    c = moe_config(rules="expert_fsdp", mesh="data=4,expert=2")
    state, _ = run_steps(c, batches[:K])
    mngr = store.manager(str(tmp_path), keep=1)
    store.save(mngr, K, state, {"next_example": K * c.batch_size}, run_setup.setup(c).meta())
    mngr.wait_until_finished()
    want = [loss for loss, _ in run_steps(c, batches[K:], state=state)[1]]
    for rules, mesh in (("expert_fsdp", "data=2,expert=4"), ("fsdp", "dp=2,mp=4")):
        dest = moe_config(rules=rules, mesh=mesh)
        s = run_setup.setup(dest)
        restored, _ = store.restore(mngr, K, s.abstract_state)
        router = restored.params["layers"]["moe"]["gate_up"]
        assert router.sharding.is_equivalent_to(s.shardings.params["layers"]["moe"]["gate_up"], router.ndim)
        got = [loss for loss, _ in run_steps(dest, batches[K:], state=restored)[1]]
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"{rules} {mesh}")


# --- the loop's metrics ---


def test_the_router_metrics_reach_metrics_jsonl_and_the_progress_line(tmp_path, capsys):
    c = moe_config(rules="expert_fsdp", mesh="data=2,expert=4", steps=2, log_every=1, eval_every=2)
    loop.train(c, str(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.5 < r["router_aux_loss"] < 2.0  # about 1 when balanced, E when one expert takes all
        assert 1.0 <= r["expert_max_load"] <= 4.0  # the largest share over the mean, at most E / k
        assert r["router_z_loss"] > 0
    out = capsys.readouterr().out
    assert f"aux {rows[1]['router_aux_loss']:.3f} | max_load {rows[1]['expert_max_load']:.2f}x" in out


# --- bad input ---


def test_experts_not_divisible_by_the_expert_axis_is_one_line():
    c = moe_config(rules="expert_fsdp", mesh="data=2,expert=4", **{"model.num_experts": 6})
    with pytest.raises(UserError) as e:
        run_setup.setup(c)
    assert str(e.value) == (
        f"config.model.num_experts=6 is not divisible by the mesh axes expert=4 that "
        f"{run_setup.load_rules('expert_fsdp').source} splits experts over"
    )


@pytest.mark.parametrize("k", [0, 9])
def test_experts_per_token_out_of_range_is_one_line(k):
    c = moe_config(**{"model.experts_per_token": k})
    with pytest.raises(
        UserError, match=rf"^model.experts_per_token must be in 1..model.num_experts \(8\), got {k}$"
    ):
        run_setup.setup(c)


def test_an_expert_rule_file_on_a_dense_model_is_a_warning_and_changes_nothing(capsys):
    s = run_setup.setup(small_config(rules="expert_fsdp", mesh="data=2,expert=4"))
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        f"warning: {s.rules.source} splits experts over mesh axes expert=4 but config.model.num_experts is 0 "
        "(a dense model): no weight has experts, the file's other rules apply as written"
    )
    run_setup.setup(moe_config(rules="expert_fsdp", mesh="data=2,expert=4"))
    run_setup.setup(moe_config(rules="megatron_1d", mesh="dp=2,mp=4"))  # a dense rule file: no word
    assert capsys.readouterr().err == ""
