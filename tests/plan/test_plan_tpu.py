"""plan --target: the real TPU compiler, for a v5e (and a v4) slice that is not attached (needs libtpu)."""

import json
import os
import subprocess
import sys
import warnings

import jax
import pytest
from conftest import ROOT, small_config, step_flops
from shipped_rules import SHIPPED
from tpu_plans import TARGET, tpu_plan

from gspmd_tp.job.errors import UserError
from gspmd_tp.plan import hardware, planner

pytest.importorskip("libtpu")


# The hybrid rule files compile with a wider model: where a weight's shard on the model width is
# no wider than the TPU's 128 lanes (64 / dp=2 here), the compiler all-reduces its gradient over its
# FSDP axis and slices it rather than reduce-scattering it (fsdp_tp: 1.07 of the analysis at
# d_model 64, 1.003 at 512; data_fsdp_tensor: 1.018 at 512, and configs/bench_cpu.py's in bf16
# 1.026 at d_model 256, 1.001 at 512).
WIDE = {"fsdp_tp": {"model.d_model": 512}, "data_fsdp_tensor": {"model.d_model": 512}}


@pytest.mark.parametrize("rules", SHIPPED)
def test_every_rule_file_compiles_for_a_tpu_slice(rules):
    overrides = WIDE.get(rules, {})
    p = tpu_plan(rules, **overrides)
    assert p["backend"] == "tpu" and p["device_kind"] == "TPU v5 lite" and p["devices"] == 8
    assert p["estimate"]["fits"] and p["estimate"]["hbm_per_device"] == 16 * 2**30
    assert p["bytes_per_device"] > 0
    if rules in WIDE:
        assert p["ratio"] == pytest.approx(1.0, abs=0.05), (p["bytes_per_device"], p["analytical"])
    # Worked out here: the step's FLOPs over 8 chips at a v5e's peak, then every collective's bytes
    # at its ICI bandwidth (one slice, one device per chip), less what the schedule hides, which is
    # never more than the bytes of the collectives it overlaps with compute.
    v5e = hardware.TPU_CHIPS["TPU v5 lite"]
    compute_s = step_flops(small_config(**overrides)) / 8 / v5e["flops"]
    e = p["estimate"]
    assert e["step_s_estimate"] == pytest.approx(
        compute_s + p["bytes_per_device"] / v5e["ici"] - e["comm_hidden_s"], rel=1e-6
    )
    assert p["exposed_bytes_per_device"] + p["hidden_bytes_per_device"] == pytest.approx(
        p["bytes_per_device"]
    )
    assert 0 <= e["comm_hidden_s"] <= p["hidden_bytes_per_device"] / v5e["ici"] * (1 + 1e-9)


def test_gradients_are_reduce_scattered_over_two_devices_where_their_shard_is_one_lane_tile():
    """configs/bench_cpu.py's widths in bf16 under data_fsdp_tensor (2x2x2): the MLP's down weight
    (mlp 1024, embed 256) is split on its minor dimension over fsdp=2, 128 columns each. By default
    the TPU compiler relayouts a gradient for a reduce-scatter only over more than 2 devices, and
    all-reduces this one whole and slices it; the option the steps compile with on the TPU
    (step.PLATFORM_OPTIONS) has it relayout and reduce-scatter. What is left above the analysis is
    the attention's q/k/v and output gradients, still all-reduced over fsdp where a reduce-scatter
    would do: an all-gather's bytes more each (the down weight's, all-reduced too, would add as
    much again as its (mlp, embed) is as large as they are together)."""
    m = {
        "num_heads": 8,
        "num_kv_heads": 8,
        "head_dim": 32,
        "d_model": 256,
        "mlp_dim": 1024,
        "dtype": "bfloat16",
    }
    p = tpu_plan("data_fsdp_tensor", **{f"model.{k}": v for k, v in m.items()})
    assert p["compiler_options"]["xla_tpu_relayout_group_size_threshold_for_reduce_scatter"] == 2
    fsdp = tensor = 2
    qkv = m["d_model"] * m["num_kv_heads"] * (m["num_heads"] // m["num_kv_heads"] + 2) * m["head_dim"]
    out = m["num_heads"] * m["head_dim"] * m["d_model"]
    layers = small_config().model.num_layers
    all_reduced = layers * (fsdp - 1) / fsdp * (qkv + out) * 2 / tensor  # bf16 gradients, a tensor shard
    expected = p["analytical"]["total"] + all_reduced
    assert p["bytes_per_device"] == pytest.approx(expected, rel=0.01), (
        p["bytes_per_device"],
        p["analytical"],
    )


def test_compare_names_the_choice_and_its_margin_to_the_runner_up():
    """format_compare of two plans above (the dicts compare returns): without --overlaps the table has
    no overlap column, and the line after it names the fastest and how much it saves."""
    rows = [tpu_plan("megatron_1d"), tpu_plan("megatron_1d_sp")]
    head, *lines = planner.format_compare(rows).splitlines()
    assert "overlap" not in head and not any(" auto " in line for line in lines)
    fast, slow = sorted(rows, key=lambda r: r["estimate"]["step_s_estimate"])
    t_fast, t_slow = fast["estimate"]["step_s_estimate"], slow["estimate"]["step_s_estimate"]
    margin = (t_slow - t_fast) / t_slow * 100
    assert lines[-1] == (
        f"choice: {fast['label']} on dp=2,mp=4: {t_fast * 1e3:.2f} ms, {margin:.1f}% faster than the "
        f"runner-up ({slow['label']} on dp=2,mp=4: {t_slow * 1e3:.2f} ms)"
    )
    assert planner.format_compare(rows[:1]).splitlines()[-1].startswith("megatron_1d ")  # one: no choice


def test_megatron_1d_on_tpu_only_all_reduces_as_analysed():
    p = tpu_plan("megatron_1d")
    kinds = {k for k, v in p["collectives"].items() if v["count"]}
    assert kinds == {"all-reduce"}
    assert p["ratio"] == pytest.approx(1.0, abs=0.05)


def test_a_bfloat16_model_on_tpu_reduces_the_embeddings_gradient_in_float32_as_analysed():
    """Under bf16 compute the products' gradients are all-reduced in bf16, the embedding's in f32
    (its lookup adds the rows' gradients into a float32 table, kernels.embed): the analysis counts
    each in its dtype."""
    config = small_config(rules="megatron_1d", mesh="dp=8,mp=1", **{"model.dtype": "bfloat16"})
    p = planner.plan(config, target=TARGET)
    assert p["collectives"]["all-reduce"]["dtypes"] == ["bf16", "f32"]
    table = config.model.vocab_size * config.model.d_model * 4  # bytes
    assert p["analytical"]["data_parallel"] > 2 * 7 / 8 * table
    assert p["ratio"] == pytest.approx(1.0, abs=0.01)


def test_a_bfloat16_model_gathers_its_weights_in_bfloat16_as_analysed():
    """Under bf16 compute each weight is cast where it lies (transformer.cast_weight), so FSDP gathers
    the layers' weights in bf16, and the analysis counts its gathers so (0.49 of it when it counted
    float32). Their gradients are reduced in bf16 too; which of them this small model's compiler
    reduce-scatters and which it all-reduces whole is its choice (see WIDE), so only the gathers
    are held to the analysis here."""
    p = tpu_plan("fsdp", **{"model.dtype": "bfloat16"})
    layers = small_config().model.num_layers
    weights = [c for c in p["largest_collectives"] if c["kind"] == "all-gather" and c["executions"] == layers]
    assert weights and {c["dtype"] for c in weights} == {"bf16"}, weights
    assert set(p["collectives"]["reduce-scatter"]["dtypes"]) == {"bf16"}
    gathered = p["bytes_per_device_by_type"]["all-gather"]
    assert gathered == pytest.approx(p["analytical"]["fsdp_gather"], rel=0.05)


def test_scan_and_unrolled_layers_give_the_same_totals_on_tpu():
    scanned = tpu_plan("megatron_1d")
    unrolled = tpu_plan("megatron_1d", **{"model.scan_layers": False})
    assert unrolled["bytes_per_device"] == pytest.approx(scanned["bytes_per_device"], rel=0.01)
    assert unrolled["collectives"]["all-reduce"]["bytes"] == pytest.approx(
        scanned["collectives"]["all-reduce"]["bytes"], rel=0.01
    )


def test_megatron_2d_on_tpu_moves_what_the_analysis_and_its_float32_gather_say():
    """What a float32 model moves beyond the analysis on the TPU, each extra worked out below: the
    compiler all-reduces the gradients of qkv, out and down over dp where a reduce-scatter would do
    (this model's shards are narrower than the TPU's lanes, see WIDE), and the embedding's output
    over mp likewise: an all-reduce is a reduce-scatter and an all-gather, so each moves an
    all-gather's bytes more. And the attention's output gradient, constrained once for both of its
    products (transformer._constrain_cotangent), is gathered in float32 where the analysis counts
    the bf16 the products read. Left over: the norms' and the loss's reductions, under 1%."""
    c = small_config()
    p = tpu_plan("megatron_2d")
    dp, mp, layers = 2, 4, c.model.num_layers
    m = c.model
    activation = c.batch_size // dp * c.seq_len * m.d_model * 4  # float32 (batch/dp, length, embed)
    # A layer's float32 gradients on one mp shard: qkv (embed, kv_heads, group + 2, head_dim), out, down.
    qkv = m.d_model * m.num_kv_heads * (m.num_heads // m.num_kv_heads + 2) * m.head_dim
    weights = (qkv + m.num_heads * m.head_dim * m.d_model + m.mlp_dim * m.d_model) * 4 / mp
    all_reduced_weights = layers * (dp - 1) / dp * weights
    all_reduced_lookup = (mp - 1) / mp * activation
    float32_gather = layers * (mp - 1) / mp * activation / 2  # 4 bytes an element, not 2
    expected = p["analytical"]["total"] + all_reduced_weights + all_reduced_lookup + float32_gather
    assert p["bytes_per_device"] == pytest.approx(expected, rel=0.01), (
        p["bytes_per_device"],
        p["analytical"],
    )
    attention = "transpose(jvp(Transformer))/while/body/closed_call/layers/attn/sharding_constraint"
    assert {c["dtype"] for c in p["largest_collectives"] if c["op_name"].endswith(attention)} == {"f32"}


def test_fsdp_on_tpu_counts_each_gathered_weight_once():
    """The TPU compiler splits each weight's all-gather into start, continuation and done fusions
    that share one channel; counted once each, the step gathers every layer's weights once forward
    and once backward (in bf16) and is within 10% of the analysis (counted per copy: 1.57)."""
    p = tpu_plan("fsdp")
    layers = small_config().model.num_layers
    gathered = [c for c in p["largest_collectives"] if c["kind"] == "all-gather"]
    assert all(c["executions"] == layers for c in gathered), gathered
    assert p["ratio"] == pytest.approx(1.0, abs=0.10)


def test_multi_slice_target_sends_the_gradients_between_slices_over_dcn():
    """The TPU compiler writes the cross-slice half of dp's gradient reduction as sends to the
    megascale runtime, not as all-reduces: counted, every data-parallel byte is there (without
    them the step read 0.95 of the analysis), and they are timed at v5e's DCN, 25 Gb/s a chip."""
    p = planner.plan(small_config(rules="megatron_1d", mesh="dp=4,mp=4"), target="tpu:v5e:2x4", slices=2)
    e = p["estimate"]
    assert p["devices"] == 16 and p["network_bytes_per_device"] > 0
    crossing = [c for c in p["largest_collectives"] if c["islands"] > 1]
    assert crossing and all(c["kind"] == "all-reduce" and c["group_size"] == 2 for c in crossing)
    # Inside each slice the tensor-parallel reductions (all within the slice) and dp's own half.
    assert p["bytes_per_device"] - p["network_bytes_per_device"] > p["analytical"]["tensor_parallel"]
    assert e["comm_network_s"] == pytest.approx(p["network_bytes_per_device"] / (25e9 / 8))
    assert "over the DCN at 25 Gb/s per chip" in planner.format_plan(p)


def test_v4_slices_are_tensorcores_two_to_a_chip_and_get_a_time_only_with_network_gbps():
    """libtpu's compile-only v4 slice has a device per TensorCore (a v4 slice in its default megacore
    mode shows one per chip), so each device gets half the chip's HBM, FLOP/s and bandwidth. Two
    such slices are laid out by hand where mesh_utils refuses them (it raised an AssertionError
    before); with no DCN figure for v4 they get a time only with --network_gbps. The second plan is
    the first's step compiled again: JAX would store the compile-only executable, then warn on
    every later plan that it cannot load it (tests/conftest.py sets a cache directory)."""
    one_slice = hardware.target_devices("tpu:v4:2x2x1")
    assert len(one_slice) == 8 and one_slice[0].device_kind == "TPU v4"
    config = small_config(rules="megatron_1d", mesh="dp=4,mp=4")
    before = jax.config.jax_persistent_cache_min_compile_time_secs  # restored for later tests
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every compile would be stored
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p = planner.plan(config, target="tpu:v4:2x2x1", slices=2)
            timed = planner.plan(config, target="tpu:v4:2x2x1", slices=2, network_gbps=100)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)
    assert not [str(w.message)[:200] for w in caught if "compilation cache" in str(w.message)]
    assert p["devices"] == 16 and p["estimate"]["device_kind"] == "TPU v4"
    assert p["estimate"]["devices_per_chip"] == 2 and p["estimate"]["hbm_per_device"] == 16 * 2**30
    assert p["estimate"]["fits"] and "step_s_estimate" not in p["estimate"]
    assert "no DCN bandwidth for TPU v4 in the table (--network_gbps=N" in planner.format_plan(p)
    per_device = 100e9 / 8 / 2
    assert timed["estimate"]["comm_network_s"] == pytest.approx(
        timed["network_bytes_per_device"] / per_device
    )


def test_slices_that_do_not_divide_the_slice_axis_are_one_line():
    """With --slices the first mesh axis (data in the three-axis rule file) spans the slices."""
    config = small_config(rules="data_fsdp_tensor", mesh="data=1,fsdp=4,tensor=4")
    with pytest.raises(
        UserError, match=r"the first axis \(data=1\) must be divisible by the 2 slices it spans$"
    ) as e:
        planner.plan(config, target=TARGET, slices=2)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("target", ["tpu:v5e", "cpu:8", "v5e:2x4"])
def test_bad_target_is_one_line(target):
    with pytest.raises(
        UserError, match=rf"--target '{target}': expected tpu:GENERATION:TOPOLOGY .* or gpu:KIND"
    ):
        hardware.target_devices(target)


def test_sequence_parallel_on_tpu_reduce_scatters_the_same_bytes():
    """On the TPU compiler the row-parallel all-reduces become reduce-scatters (+ all-gathers): the
    reduce-scatters move the float32 bytes of the all-reduces' reduce half, the all-gathers their
    other half in bf16 (the products' operands, cast before the gather), so less than megatron_1d."""
    one_d = tpu_plan("megatron_1d")
    sp = tpu_plan("megatron_1d_sp")
    assert sp["collectives"]["reduce-scatter"]["count"] >= 8  # 2 per layer forward and backward
    assert sp["collectives"]["all-gather"]["count"] >= 8
    assert sp["ratio"] == pytest.approx(1.0, abs=0.05)
    tensor_parallel = one_d["analytical"]["tensor_parallel"]
    assert sp["bytes_per_device_by_type"]["reduce-scatter"] == pytest.approx(tensor_parallel / 2, rel=0.01)
    assert sp["bytes_per_device"] < one_d["bytes_per_device"]


@pytest.mark.parametrize(
    "topology, name",
    [("v5e:2x4", "v5litepod-8"), ("v4:2x2x2", "v4-16"), ("v5p:4x4x4", "v5p-128"), ("v6e:4x4", "v6e-16"),
     ("v9:2x2", None)],
)  # fmt: skip
def test_the_slice_is_named_to_libtpu_as_cloud_tpu_names_it(topology, name):
    assert hardware._accelerator_type(topology) == name


def test_planning_for_a_slice_prints_no_libtpu_warning_and_json_with_json(tmp_path):
    """Through the command: a single plan for the slice, --json (the config's mesh) and --dump_hlo."""
    env = {k: v for k, v in os.environ.items() if k not in ("TPU_ACCELERATOR_TYPE", "XLA_FLAGS")}
    out = subprocess.run(
        [sys.executable, "-m", "gspmd_tp.plan", "--config=configs/tiny.py", f"--target={TARGET}",
         "--config.model.num_layers=1", "--config.batch_size=8", "--config.seq_len=32", "--json",
         f"--dump_hlo={tmp_path / 'hlo'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "WARNING" not in out.stderr and "could not determine" not in out.stdout + out.stderr
    p = json.loads(out.stdout)
    assert p["mesh"] == "dp=2,mp=4" and p["target"] == TARGET and p["backend"] == "tpu"
    assert [f.name for f in (tmp_path / "hlo").iterdir()] == ["megatron_2d_dp2_mp4.hlo.txt"]


# Per device 128 sequences of 2,048 tokens: their attention scores alone need some 130 GB of a v5e's 16.
TOO_LARGE = {"batch_size": 1024, "seq_len": 2048}


def test_a_step_the_tpu_compiler_finds_too_large_is_one_line():
    """The TPU compiler itself refuses a step that cannot fit its chips' HBM: one line naming the rule
    file, the mesh, the chip and the compiler's reason, not its traceback."""
    with pytest.raises(UserError) as caught:
        planner.plan(small_config(rules="dp", mesh="dp=8,mp=1", **TOO_LARGE), target=TARGET)
    message = str(caught.value)
    assert message.startswith("dp on mesh dp=8,mp=1 does not fit TPU v5 lite: the compiler stopped: Ran out ")
    assert "exceeds available HBM (15.75G)" in message and "\n" not in message


def test_compare_reports_a_combination_that_does_not_fit_as_its_row():
    rows = planner.compare(small_config(**TOO_LARGE), ["dp", "fsdp"], ["dp=8,mp=1"], TARGET)
    assert [(r["label"], r["mesh"]) for r in rows] == [("dp", "dp=8,mp=1"), ("fsdp", "dp=8,mp=1")]
    assert all(r["error"].startswith("does not fit: Ran out of memory on HBM") for r in rows)
    lines = planner.format_compare(rows).splitlines()
    assert all("does not fit: Ran out of memory on HBM" in line for line in lines[1:3])
    assert "<- best" not in "\n".join(lines)


# The small test model with 8 experts of width 32, 2 a token, one shared expert (test_plan_moe.py),
# in bf16 at configs/tiny_moe.py's width.
MOE_BF16 = {"model.num_experts": 8, "model.expert_mlp_dim": 32, "model.shared_experts": 1}
MOE_BF16 |= {"model.dtype": "bfloat16", "model.d_model": 128, "model.moe_dispatch": "gather"}


@pytest.mark.parametrize("rules, gather, fsdp", [("expert_fsdp", 4, 8), ("data_expert_tensor", 2, 1)])
def test_a_bfloat16_mixture_of_experts_on_tpu_moves_what_the_analysis_says(rules, gather, fsdp):
    """The all-gather dispatcher in bf16 on a v5e slice (data=2,expert=4; 2x2x2): the tokens' share
    (one sequence, or two, of 32 tokens at 128 bf16 a device) gathered over the expert group and
    scattered back, forward and backward, the routes (2 float32 weights, 2 int32 ids a token) with
    them, as worked here. The step's total is the analysis's (whose expert_fsdp term has the
    experts' gradients all-reduced over data: gate_up's model width is not its minor dimension,
    down's shard there is 64 lanes) plus, under expert_fsdp, what the analysis knows it leaves out:
    the attention's q/k/v and output gradients, FSDP-split on their minor dimension to 16 lanes
    over 8 devices, all-reduced where a reduce-scatter would do (an all-gather's bytes more each,
    as test_gradients_are_reduce_scattered_over_two_devices_where_their_shard_is_one_lane_tile
    has); data_expert_tensor's attention gradients, over expert=2, are reduce-scattered."""
    p = tpu_plan(rules, **MOE_BF16)
    m = small_config(**MOE_BF16).model
    c = small_config(**MOE_BF16)
    tokens = c.batch_size // (2 * gather) * c.seq_len  # the batch over data and expert
    share, routes = tokens * m.d_model * 2, tokens * m.experts_per_token * 4
    expected = m.num_layers * (gather - 1) * (4 * share + 3 * routes)
    assert p["analytical"]["expert_dispatch"] == pytest.approx(expected, rel=1e-9)
    qkv = m.d_model * m.num_kv_heads * (m.num_heads // m.num_kv_heads + 2) * m.head_dim
    out = m.num_heads * m.head_dim * m.d_model
    all_reduced = m.num_layers * (fsdp - 1) / fsdp * (qkv + out) * 2  # bf16 gradients
    assert p["bytes_per_device"] == pytest.approx(p["analytical"]["total"] + all_reduced, rel=0.05), (
        p["bytes_per_device"],
        p["analytical"],
    )


@pytest.mark.parametrize("rules, experts", [("expert_fsdp", 4), ("data_expert_tensor", 2)])
def test_the_ragged_dispatch_on_tpu_sends_each_assignment_to_its_experts_device_and_back(rules, experts):
    """model.moe_dispatch auto on a TPU is ragged: per layer two ragged-all-to-alls forward (the
    k rows a token out, from the receive buffer back) and their two transposes backward, each over
    the expert axis, and no token gathered there. Their payloads as worked here: a device's 32 or
    64 tokens' k=2 rows of 128 bf16, which the compiler pads to 512 bytes a row, and the receive
    buffer of `experts` times as many rows; the step within 5% of the analysis (expert_fsdp's
    attention gradients all-reduced as in the gather test above)."""
    overrides = {**MOE_BF16, "model.moe_dispatch": "auto"}
    p = tpu_plan(rules, **overrides)
    m, c = small_config(**overrides).model, small_config(**overrides)
    assert p["collectives"]["ragged-all-to-all"]["count"] == 4 * m.num_layers
    ragged = [x for x in p["largest_collectives"] if x["kind"] == "ragged-all-to-all"]
    assert ragged and all(x["group_size"] == experts for x in ragged)
    tokens = c.batch_size // (2 * experts) * c.seq_len
    sent = tokens * m.experts_per_token * 512
    expected = m.num_layers * 2 * (experts - 1) / experts * (sent + experts * sent)
    assert p["bytes_per_device_by_type"]["ragged-all-to-all"] == pytest.approx(expected, rel=1e-9)
    if rules == "expert_fsdp":
        qkv = m.d_model * m.num_kv_heads * (m.num_heads // m.num_kv_heads + 2) * m.head_dim
        extra = m.num_layers * 7 / 8 * (qkv + m.num_heads * m.head_dim * m.d_model) * 2
    else:
        extra = 0
    assert p["bytes_per_device"] == pytest.approx(p["analytical"]["total"] + extra, rel=0.05), (
        p["bytes_per_device"],
        p["analytical"],
    )


def test_a_receive_buffer_of_twice_the_balanced_load_is_what_the_ragged_exchange_sends_back_from():
    """model.moe_buffer_factor=2 under expert_fsdp (data=2,expert=4) with remat full: the same four
    ragged-all-to-alls a layer over the expert axis, and two more where the backward recomputes the
    layer's forward. Worked here: a device's 32 tokens send their 2 rows each (64 rows, padded to
    512 bytes a row), and the exchange back sends from a buffer of 2 * 64 = 128 rows (the worst
    case's is 4 * 64); per layer forward, recomputed and backward, each at the even split (3/4). The
    analysis's dispatch term is that plus the per-expert counts gathered (a few hundred bytes)."""
    overrides = {**MOE_BF16, "model.moe_dispatch": "auto", "model.moe_buffer_factor": 2.0}
    overrides["model.remat"] = "full"
    p = tpu_plan("expert_fsdp", **overrides)
    m = small_config(**overrides).model
    assert p["collectives"]["ragged-all-to-all"]["count"] == 6 * m.num_layers
    ragged = [x for x in p["largest_collectives"] if x["kind"] == "ragged-all-to-all"]
    assert ragged and all(x["group_size"] == 4 for x in ragged)
    sent, back = 32 * 2 * 512, 2 * 32 * 2 * 512
    expected = m.num_layers * 3 * 3 / 4 * (sent + back)
    assert p["bytes_per_device_by_type"]["ragged-all-to-all"] == pytest.approx(expected, rel=1e-9)
    assert p["analytical"]["expert_dispatch"] == pytest.approx(expected, rel=0.01)
