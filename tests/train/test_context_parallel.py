"""Context parallelism (rules/context_dp.yaml, rules/fsdp_context_tensor.yaml), all-gather K/V and
the ring (model.context_parallel), each with and without the zigzag load balance
(model.context_load_balance): every mesh of 8 devices each admits equals one device (loss and
gradients, packed documents masked apart; the held-out loss too), the compiled step gathers the keys
and values over the context axis and never the queries (the ring: passes them, gathers nothing), a
checkpoint moves to and from rule files without context parallelism with the uninterrupted losses,
and what cannot run is one line before compiling."""

import jax
import numpy as np
import pytest
from conftest import run_steps, small_config, token_batches
from shipped_rules import mesh_for, meshes_of

from gspmd_tp.checkpoint import store
from gspmd_tp.data import pipeline
from gspmd_tp.job.errors import UserError
from gspmd_tp.model.transformer import Transformer
from gspmd_tp.sharding import hlo
from gspmd_tp.train import run_setup
from gspmd_tp.train import state as state_lib
from gspmd_tp.train import step as step_lib

CP_RULES = ["context_dp", "fsdp_context_tensor"]
CASES = [(r, m) for r in CP_RULES for m in meshes_of(r)]
# model.context_parallel x model.context_load_balance, beyond the default (all_gather, False).
STRATEGIES = [("all_gather", True), ("ring", False), ("ring", True)]
TWO_MESHES = [("context_dp", "data=2,context=4"), ("fsdp_context_tensor", "fsdp=2,context=2,tensor=2")]


def strategy(strategy: str, balance: bool) -> dict:
    """small_config overrides for a context-parallel strategy and load balance."""
    return {"model.context_parallel": strategy, "model.context_load_balance": balance}


def documents(config, count):
    """token_batches with a separator every 9 positions from position 5: four documents a row, so
    most of them cross the boundaries of the context axis's chunks (8 positions on context=4)."""
    batches = token_batches(config, count)
    for b in batches:
        b[:, 5::9] = pipeline.SEPARATOR
    return batches


def loss_and_grads(config, devices=None):
    """(loss, gradients) of the step's accumulated_grads_and_stats on the first `documents` batch,
    from the config's initial parameters."""
    s = run_setup.setup(config, devices)
    state = state_lib.init_state(s.model_cfg, s.tx, s.mesh, s.rules, config.seq_len, config.seed)
    batch = jax.device_put(step_lib.host_batch(s, documents(config, 1)[0]), s.batch_sharding)
    model = Transformer(s.model_cfg)
    with state_lib.sharding_context(s.mesh, s.rules):
        fn = jax.jit(
            lambda p, b: step_lib.accumulated_grads_and_stats(
                model, config.grad_accum, s.shardings.params, p, b
            )[:2]
        )
        return jax.device_get(fn(state.params, batch))


@pytest.fixture(scope="module")
def one_device():
    return loss_and_grads(small_config(rules="dp", mesh="dp=1,mp=1"), jax.devices()[:1])


def _assert_equal(got, want):
    (loss, grads), (want_loss, want_grads) = got, want
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads), strict=True
    ):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("rules, mesh", CASES)
def test_loss_and_gradients_equal_one_device(one_device, rules, mesh):
    _assert_equal(loss_and_grads(small_config(rules=rules, mesh=mesh)), one_device)


@pytest.mark.parametrize("overrides", [{"model.attention_block": 8}, {"model.attention": "xla"}])
def test_query_blocks_and_xla_attention_under_context_parallelism_equal_one_device(one_device, overrides):
    """The other attention paths, queries split over context=4: in blocks of 8 positions (one
    device's chunk each), and jax's dot_product_attention with the segment mask."""
    _assert_equal(
        loss_and_grads(small_config(rules="context_dp", mesh="data=2,context=4", **overrides)), one_device
    )


@pytest.mark.parametrize("rules, mesh", TWO_MESHES)
@pytest.mark.parametrize("name, balance", STRATEGIES)
def test_each_strategy_and_load_balance_equals_one_device(one_device, rules, mesh, name, balance):
    _assert_equal(loss_and_grads(small_config(rules=rules, mesh=mesh, **strategy(name, balance))), one_device)


def test_the_ring_inside_the_steps_per_shard_sums_equals_one_device(one_device):
    """grad_accum=2 under context_dp: the step sums each data shard's microbatches in a shard_map
    manual over data, inside which the ring's shard_map runs over context."""
    c = small_config(rules="context_dp", mesh="data=2,context=4", grad_accum=2, **strategy("ring", True))
    _assert_equal(loss_and_grads(c), one_device)


def _held_out_sums(config, devices=None):
    """The eval step's (loss sum, tokens) on the first `documents` batch with its last two rows and
    the end of the first padding (data.PAD: no target counts)."""
    s = run_setup.setup(config, devices)
    state = state_lib.init_state(s.model_cfg, s.tx, s.mesh, s.rules, config.seq_len, config.seed)
    tokens = documents(config, 1)[0]
    tokens[-2:] = pipeline.PAD
    tokens[0, 20:] = pipeline.PAD
    batch = jax.device_put(step_lib.host_batch(s, tokens), s.batch_sharding)
    with state_lib.sharding_context(s.mesh, s.rules):
        return [float(x) for x in step_lib.make_eval_step(s)(state.params, batch)]


def test_the_held_out_loss_under_the_balanced_ring_equals_one_device():
    want = _held_out_sums(small_config(rules="dp", mesh="dp=1,mp=1"), jax.devices()[:1])
    got = _held_out_sums(small_config(rules="context_dp", mesh="data=2,context=4", **strategy("ring", True)))
    assert got[1] == want[1] == 5 * 32 + 19  # rows 1-5 whole; row 0's targets before token 20
    assert got[0] == pytest.approx(want[0], rel=1e-5)


def test_the_ring_passes_the_keys_and_values_round_context_and_gathers_nothing():
    """context_dp on data=2,context=4, the balanced ring, from the compiled step: no all-gather; each
    layer's keys and values go round the 4 devices in 3 permutes each, forward, and again in the
    backward ring (2 layers x 2 passes x 3 x 2 permutes of one device's block: 4 rows x 8 positions
    x 8 kv heads x 8 float32, 8 KiB), their gradients with them in 4 permutes, the last bringing
    them home, each as its two zigzag chunks (2 layers x 4 x 2 x 2 permutes of 4 KiB)."""
    s = run_setup.setup(small_config(rules="context_dp", mesh="data=2,context=4", **strategy("ring", True)))
    found = hlo.collectives(step_lib.compile_train_step(s).as_text(), 8)
    assert not [c for c in found if c.kind == "all-gather"]
    block = 4 * 8 * 8 * 8 * 4

    def permutes(size):
        return sum(c.executions for c in found if c.kind == "collective-permute" and c.result_bytes == size)

    assert permutes(block) == 2 * 2 * 3 * 2
    assert permutes(block // 2) == 2 * 4 * 2 * 2


def test_the_keys_and_values_are_gathered_over_context_and_the_queries_never():
    """context_dp on data=2,context=4, from the compiled step: each layer all-gathers its keys and
    its values over the 4 context devices, whole sequences of a data shard (4 rows x 32 positions
    x 8 kv heads x 8 float32: 32 KiB), and no larger gather crosses the context axis (a query
    gathered would be 64 KiB: 16 heads)."""
    s = run_setup.setup(small_config(rules="context_dp", mesh="data=2,context=4"))
    found = hlo.collectives(step_lib.compile_train_step(s).as_text(), 8)
    gathers = [c for c in found if c.kind == "all-gather" and c.group_size == 4]
    kv = 4 * 32 * 8 * 8 * 4
    assert sum(c.executions for c in gathers if c.result_bytes == kv) == 2 * 2  # 2 layers, keys + values
    assert max(c.result_bytes for c in gathers) == kv


# --- resharding ---

K = 2  # steps before the save, two after


def _save(workdir, config, state):
    mngr = store.manager(str(workdir), keep=1)
    store.save(mngr, K, state, {"next_example": K * config.batch_size}, run_setup.setup(config).meta())
    mngr.wait_until_finished()
    return mngr


def _restore(config, mngr):
    s = run_setup.setup(config)
    return store.restore(mngr, K, s.abstract_state)[0]


def _losses(config, batches, state):
    return [loss for loss, _ in run_steps(config, batches, state=state)[1]]


def test_a_checkpoint_moves_into_and_out_of_context_parallelism_with_the_uninterrupted_losses(tmp_path):
    """Saved under megatron_1d (dp=2,mp=4) after K steps, restored under context_dp
    (data=2,context=4); that restored state saved again and restored under fsdp_context_tensor
    (2x2x2) and under fsdp (dp=2,mp=4): the two steps after equal the uninterrupted run's."""
    base = small_config(rules="megatron_1d", mesh="dp=2,mp=4")
    batches = documents(base, K + 2)
    state, _ = run_steps(base, batches[:K])
    first = _save(tmp_path / "a", base, state)
    want = _losses(base, batches[K:], state)  # the step donates the state: saved before
    cp = small_config(rules="context_dp", mesh="data=2,context=4")
    again = _save(tmp_path / "b", cp, _restore(cp, first))
    np.testing.assert_allclose(
        _losses(cp, batches[K:], _restore(cp, first)), want, rtol=1e-5, err_msg="context_dp"
    )
    for rules, mesh in (("fsdp_context_tensor", "fsdp=2,context=2,tensor=2"), ("fsdp", "dp=2,mp=4")):
        c = small_config(rules=rules, mesh=mesh)
        np.testing.assert_allclose(
            _losses(c, batches[K:], _restore(c, again)), want, rtol=1e-5, err_msg=rules
        )


def test_a_checkpoint_moves_into_the_balanced_ring_with_the_uninterrupted_losses(tmp_path):
    """Saved under megatron_1d (dp=2,mp=4) after K steps, restored under context_dp (data=2,context=4)
    with the balanced ring: the two steps after equal the uninterrupted run's."""
    base = small_config(rules="megatron_1d", mesh="dp=2,mp=4")
    batches = documents(base, K + 2)
    state, _ = run_steps(base, batches[:K])
    saved = _save(tmp_path, base, state)
    want = _losses(base, batches[K:], state)
    ring = small_config(rules="context_dp", mesh="data=2,context=4", **strategy("ring", True))
    np.testing.assert_allclose(_losses(ring, batches[K:], _restore(ring, saved)), want, rtol=1e-5)


# --- bad input ---


def test_a_sequence_the_context_axis_does_not_divide_is_one_line():
    c = small_config(rules="context_dp", mesh="data=2,context=4", seq_len=30)
    with pytest.raises(UserError) as e:
        run_setup.setup(c)
    assert str(e.value) == (
        f"config.seq_len=30 is not divisible by the mesh axes context=4 that "
        f"{run_setup.load_rules('context_dp').source} splits length over"
    )


@pytest.mark.parametrize("rules", CP_RULES)
def test_the_context_rule_files_set_up_without_a_warning(rules, capsys):
    run_setup.setup(small_config(rules=rules, mesh=mesh_for(rules)))
    assert capsys.readouterr().err == ""


def _one_line(config) -> str:
    with pytest.raises(UserError) as e:
        run_setup.setup(config)
    return str(e.value)


def test_a_sequence_the_zigzag_does_not_divide_is_one_line():
    c = small_config(rules="context_dp", mesh="data=2,context=4", seq_len=36, **strategy("ring", True))
    assert _one_line(c) == (
        f"config.seq_len=36 is not divisible by 8, twice the mesh axes context=4 that "
        f"{run_setup.load_rules('context_dp').source} splits length over: "
        "config.model.context_load_balance gives each device two chunks"
    )


@pytest.mark.parametrize(
    "overrides, names",
    [
        ({**strategy("ring", False), "model.attention": "xla"}, "model.attention='einsum'"),
        ({**strategy("ring", False), "model.attention_block": 8}, "model.attention_block=0"),
        ({**strategy("all_gather", True), "model.attention_block": 8}, "model.attention_block=0"),
    ],
)
def test_a_strategy_the_attention_cannot_run_is_one_line_naming_the_alternative(overrides, names):
    message = _one_line(small_config(rules="context_dp", mesh="data=2,context=4", **overrides))
    assert "\n" not in message and names in message


@pytest.mark.parametrize("rules, mesh", [("megatron_1d", "dp=2,mp=4"), ("context_dp", "data=8,context=1")])
def test_the_ring_or_balance_without_a_context_axis_is_a_warning_and_changes_nothing(rules, mesh, capsys):
    plain = run_setup.setup(small_config(rules=rules, mesh=mesh))
    capsys.readouterr()
    s = run_setup.setup(small_config(rules=rules, mesh=mesh, **strategy("ring", True)))
    err = capsys.readouterr().err
    assert err.startswith(
        "warning: config.model.context_parallel='ring' and config.model.context_load_balance=True changes "
        "nothing"
    )
    assert len(err.splitlines()) == 1
    assert s.model_cfg.attention == plain.model_cfg.attention
    # The same program: the train step lowered under each setup.
    lowered = [_lowered(x) for x in (plain, s)]
    assert lowered[0] == lowered[1]


def _lowered(s) -> str:
    """The train step of setup `s` lowered (not compiled), as text."""
    with state_lib.sharding_context(s.mesh, s.rules):
        batch = step_lib.abstract_batch(s, s.config.batch_size)
        return step_lib.make_train_step(s).lower(s.abstract_state, batch).as_text()
