"""plan: per-leaf specs, memory, and collectives of the compiled step against the analysis."""

import copy
import functools
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import activation_gathers, small_config

from gspmd_tp.job.errors import UserError
from gspmd_tp.plan import analysis, planner
from gspmd_tp.sharding import hlo
from gspmd_tp.sharding.rules import RULES_DIR
from gspmd_tp.train import run_setup
from gspmd_tp.train import step as step_lib

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _planned(rules, mesh, **overrides):
    """plan.plan of small_config(rules, mesh, overrides) and the HLO text of the step it compiled."""
    with tempfile.TemporaryDirectory() as hlo_dir:
        p = planner.plan(small_config(rules=rules, mesh=mesh, **overrides), dump_hlo=hlo_dir)
        (path,) = Path(hlo_dir).iterdir()
        return p, path.read_text()


def planned(rules, mesh, **overrides):
    """plan.plan of small_config(rules, mesh, overrides), computed once per test process (several
    tests read the same plan); each caller gets its own copy."""
    return copy.deepcopy(_planned(rules, mesh, **overrides)[0])


def compiled_text(rules, mesh, **overrides):
    """The HLO text of the train step planned() compiled for the same arguments."""
    return _planned(rules, mesh, **overrides)[1]


@pytest.fixture(scope="module")
def megatron_1d():
    return planned("megatron_1d", "dp=2,mp=4")


def test_megatron_1d_only_all_reduces_within_5_percent(megatron_1d):
    c = megatron_1d["collectives"]
    assert c["all-gather"]["count"] == 0 and c["reduce-scatter"]["count"] == 0
    assert c["all-reduce"]["count"] > 0
    assert megatron_1d["ratio"] == pytest.approx(1.0, abs=0.05)


SHIPPED = ["dp", "fsdp", "megatron_1d", "megatron_1d_sp", "megatron_2d"]


@pytest.mark.parametrize("rules, mesh", [(r, "dp=2,mp=4") for r in SHIPPED] + [("megatron_2d", "dp=4,mp=2")])
def test_every_shipped_rule_file_within_10_percent_of_the_analysis(rules, mesh):
    p = planned(rules, mesh)
    assert p["ratio"] == pytest.approx(1.0, abs=0.10), (p["bytes_per_device"], p["analytical"])


def test_fsdp_tp_within_5_percent_of_the_analysis():
    """FSDP x tensor parallel: Megatron's all-reduces over mp, each layer's weights gathered over dp
    forward and backward and their gradients reduced over dp (a whole all-reduce on XLA:CPU), the
    embedding's rows exchanged over dp."""
    p = planned("fsdp_tp", "dp=2,mp=4")
    a = p["analytical"]
    assert a["tensor_parallel"] and a["fsdp_gather"] and a["fsdp_reduce"] and not a["data_parallel"]
    assert p["ratio"] == pytest.approx(1.0, abs=0.05), (p["bytes_per_device"], a)


def test_three_axes_plan_has_every_term_and_names_the_lookup_gap():
    """data_fsdp_tensor on 2x2x2: tensor parallelism over tensor, the gradients all-reduced over
    data, each layer's weights gathered and their gradients reduced over fsdp, the embedding's rows
    exchanged over fsdp (one all-to-all each way; gathered whole before the lookup's constraint,
    1.19 of the analysis), the table's gradient reduced shard by shard over data (scattered into
    the whole table, it was all-reduced over data and tensor: 1.08). Above the analysis the step
    moves two things it has no term for: the output projection's weight gathered over fsdp again
    for the backward pass (the analysis keeps its forward copy), and, at most, the token rows
    gathered once more before the exchange (with the norm scales' and the loss's few hundred bytes)."""
    c = small_config(rules="data_fsdp_tensor", mesh="data=2,fsdp=2,tensor=2")
    p = planned("data_fsdp_tensor", "data=2,fsdp=2,tensor=2")
    a = p["analytical"]
    assert all(a[k] for k in ("tensor_parallel", "data_parallel", "fsdp_gather", "fsdp_reduce"))
    assert p["collectives"]["all-to-all"]["count"] == 2
    fsdp = tensor = 2
    d, v = c.model.d_model, c.model.vocab_size
    head_again = (fsdp - 1) / fsdp * d * v * 4 / tensor  # f32 (embed, vocab), vocab over tensor
    rows = c.batch_size // (2 * fsdp) * c.seq_len * d * 4  # a device's token rows (data x fsdp)
    assert a["total"] + head_again <= p["bytes_per_device"] <= a["total"] + head_again + rows, (
        p["bytes_per_device"], a, head_again, rows,
    )  # fmt: skip


def test_2d_gathers_each_activation_once_and_each_output_gradient_once():
    """Per layer: one all-gather in front of each sublayer forward; in the backward pass each
    sublayer's output gradient is gathered once (its cotangent constraint: without it XLA:CPU
    gathers the attention's once per consumer, 2 per layer) and no projection input is gathered
    again."""
    c = small_config(rules="megatron_2d", mesh="dp=2,mp=4")
    found = hlo.collectives(compiled_text("megatron_2d", "dp=2,mp=4"), 8)
    activation = (c.batch_size // 2) * c.seq_len * c.model.d_model * 4

    def gathers(where):
        return activation_gathers(found, activation, where)

    layers = c.model.num_layers
    assert gathers("jvp(Transformer)/while/body/closed_call/layers/sharding_constraint") == 2 * layers
    assert gathers("transpose(jvp(Transformer))/while/body/closed_call/layers/mlp/") == layers
    assert gathers("transpose(jvp(Transformer))/while/body/closed_call/layers/attn/") == layers
    # The above, plus the output projection forward and the embedding backward; nothing else.
    assert gathers("") == 4 * layers + 2


def test_fsdp_and_dp_use_every_device_whatever_the_mesh_shape():
    for rules in ("dp", "fsdp"):
        flat = planned(rules, "dp=8,mp=1")
        square = planned(rules, "dp=2,mp=4")
        assert square["memory"]["params"] == flat["memory"]["params"]
        assert square["bytes_per_device"] == pytest.approx(flat["bytes_per_device"], rel=1e-6)


def test_plan_json_has_the_documented_keys(megatron_1d):
    p = json.loads(json.dumps(megatron_1d))
    assert {"params", "memory", "collectives", "bytes_per_device", "analytical_bytes_per_device"} <= set(p)
    assert {"params", "opt_state", "temporaries"} <= set(p["memory"])
    row = next(r for r in p["params"] if r["path"] == "params/layers/mlp/down")
    assert row["logical"] == ["layers", "mlp", "embed"]
    assert row["spec"] == [None, "mp", None]
    assert row["bytes_per_device"] == row["bytes"] // 4


def test_memory_per_device_against_ideal():
    p = planned("fsdp", "dp=8,mp=1")
    m = p["memory"]
    assert m["params"] == pytest.approx(m["ideal_params"], rel=0.01)  # everything sharded 8 ways
    assert m["opt_state"] == pytest.approx(m["ideal_opt_state"], rel=0.01)
    assert m["temporaries"] > 0


@pytest.mark.parametrize("rules, mesh", [("fsdp", "dp=8,mp=1"), ("megatron_2d", "dp=2,mp=4")])
def test_no_large_leaf_replicated_under_fsdp_and_2d(rules, mesh):
    s = run_setup.setup(small_config(rules=rules, mesh=mesh))
    flagged = [r["path"] for r in analysis.leaf_table(s, threshold=16 << 10) if r["replicated_over"]]
    assert flagged == []


def test_replicated_leaves_are_flagged_under_dp():
    s = run_setup.setup(small_config(rules="dp", mesh="dp=8,mp=1"))
    flagged = {r["path"] for r in analysis.leaf_table(s, threshold=16 << 10) if r["replicated_over"]}
    assert "params/layers/mlp/gate_up" in flagged
    assert any(p.startswith("opt_state/") for p in flagged)  # the moments too


@pytest.mark.parametrize("rules", ["megatron_1d_sp", "megatron_2d"])
def test_remat_that_keeps_collective_outputs_repeats_no_communication(rules):
    """dots_no_batch recomputes the sublayer inputs in the backward pass, and with them their
    all-gathers; dots_no_batch_comm keeps what the collectives produced and moves the bytes of no
    remat at all. The analysis counts the repeated gathers: each plan stays at the ratio of the
    plan without remat."""

    def plan(remat):
        return planned(rules, "dp=2,mp=4", **{"model.remat": remat})

    # small_config's remat is none: the plan other tests of this process may have made already.
    assert small_config().model.remat == "none"
    none = planned(rules, "dp=2,mp=4")
    assert plan("dots_no_batch")["bytes_per_device"] > 1.05 * none["bytes_per_device"]
    assert plan("dots_no_batch_comm")["bytes_per_device"] == pytest.approx(none["bytes_per_device"], rel=0.01)
    for remat in ("dots_no_batch", "dots_no_batch_comm"):
        assert plan(remat)["ratio"] == pytest.approx(none["ratio"], abs=0.01), remat


@pytest.mark.parametrize("rules", ["megatron_1d", "megatron_1d_sp"])
def test_full_remat_repeats_the_attention_outputs_reduction_as_analysed(rules):
    """remat=full recomputes the whole block: the attention output's reduction runs again in the
    backward pass (and under sequence parallelism the sublayer inputs' gathers too); the analysis
    counts them, so the ratio stays that of no remat."""
    none = planned(rules, "dp=2,mp=4")
    full = planned(rules, "dp=2,mp=4", **{"model.remat": "full"})
    assert full["bytes_per_device"] > 1.1 * none["bytes_per_device"]
    assert full["ratio"] == pytest.approx(none["ratio"], abs=0.01)


@pytest.mark.parametrize("rules", ["fsdp", "megatron_1d_sp", "megatron_2d"])
def test_the_chunked_loss_moves_what_the_whole_loss_moves(rules):
    """The output projection's gradient is reduced over the batch's devices once per step, not once
    per loss block (it was: fsdp 1.57 -> 2.14 MB per device with 4 blocks). The rest is each block's
    recomputed softmax max and sum over the vocabulary shards (< 2 KB here). The rule files: the
    output weight gathered (fsdp), split on vocab (megatron_1d_sp, whose loss is megatron_1d's) and
    on both axes (megatron_2d)."""
    whole = planned(rules, "dp=2,mp=4")
    chunked = planned(rules, "dp=2,mp=4", loss_chunk=8)  # 4 blocks of the 32 positions
    assert chunked["bytes_per_device"] == pytest.approx(whole["bytes_per_device"], rel=0.005)
    assert chunked["bytes_per_device"] - whole["bytes_per_device"] < 2048


def test_data_parallel_matches_analysis():
    p = planned("dp", "dp=8,mp=1")
    assert p["ratio"] == pytest.approx(1.0, abs=0.05)
    assert p["collectives"]["all-reduce"]["dtypes"] == ["f32"]


def test_a_bfloat16_gradient_reduction_halves_the_data_parallel_bytes():
    """optim.grad_reduce_dtype=bfloat16 at dp=8: the one all-reduce asks for bf16 and carries half
    the bytes in the program's dtype (XLA:CPU runs it in f32: what it moves, as the analysis has it)."""
    f32 = planned("dp", "dp=8,mp=1")
    p = planned("dp", "dp=8,mp=1", **{"optim.grad_reduce_dtype": "bfloat16"})
    assert p["collectives"]["all-reduce"]["dtypes"] == ["bf16"]
    assert p["program_bytes_per_device"] <= 0.55 * f32["program_bytes_per_device"]
    assert p["bytes_per_device"] == pytest.approx(f32["bytes_per_device"], rel=0.01)
    assert p["ratio"] == pytest.approx(1.0, abs=0.05)
    assert "bf16->f32" in planner.format_plan(p)


def test_a_bfloat16_gradient_reduction_under_fsdp_asks_for_bf16_where_gspmd_reduces():
    """Under fsdp the reductions GSPMD places (XLA:CPU: all-reduces) ask for bf16, all but the norm
    scales'; XLA:CPU runs them in f32, so what moves is float32's, as the analysis has it."""
    f32 = planned("fsdp", "dp=8,mp=1")
    p = planned("fsdp", "dp=8,mp=1", **{"optim.grad_reduce_dtype": "bfloat16"})
    assert p["collectives"]["all-reduce"]["dtypes"] == ["bf16", "f32"]
    reduced = f32["bytes_per_device_by_type"]["all-reduce"]
    assert p["program_bytes_per_device"] < p["bytes_per_device"] - 0.45 * reduced
    assert p["ratio"] == pytest.approx(1.0, abs=0.01) and f32["ratio"] == pytest.approx(1.0, abs=0.01)


def test_unrolled_fsdp_layers_within_10_percent_of_the_analysis():
    """Unrolled under a remat policy, each layer's weights are gathered forward and again backward,
    as the analysis has them. With no remat every forward value is kept, the gathered weights too,
    and the backward reads those copies: it moves less than the analysis, gathering nothing again."""
    p = planned("fsdp", "dp=2,mp=4", **{"model.scan_layers": False, "model.remat": "dots_no_batch"})
    assert p["ratio"] == pytest.approx(1.0, abs=0.10), (p["bytes_per_device"], p["analytical"])
    kept = planned("fsdp", "dp=2,mp=4", **{"model.scan_layers": False})
    assert kept["bytes_per_device"] < 0.9 * p["bytes_per_device"]


def test_scan_and_unrolled_layers_move_the_same_bytes():
    scanned = planned("megatron_1d", "dp=2,mp=4")
    unrolled = planned("megatron_1d", "dp=2,mp=4", **{"model.scan_layers": False})
    assert unrolled["bytes_per_device"] == pytest.approx(scanned["bytes_per_device"], rel=0.01)


def test_cli_compare_chart_and_hlo_dump(tmp_path):
    """Through the command, on one layer: a compare of two rule files on the mesh -1 stands for, with
    its chart and HLO files. (A single plan through the command: test_plan_gpu's report, test_plan_tpu's
    --json.)"""
    small = ["--config.batch_size=8", "--config.seq_len=32", "--config.model.num_layers=1"]
    chart = tmp_path / "plan.png"
    run = subprocess.run(
        [sys.executable, "-m", "gspmd_tp.plan", "--config=configs/tiny.py", *small,
         "--compare=megatron_1d,megatron_2d", "--meshes=dp=-1,mp=4", f"--chart={chart}",
         f"--dump_hlo={tmp_path / 'compare_hlo'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("megatron_") == 2
    assert run.stdout.count(" dp=2,mp=4 ") == 2  # the mesh -1 stands for, not dp=-1
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"chart: {chart}" in run.stdout
    dumped = sorted(p.name for p in (tmp_path / "compare_hlo").glob("*.hlo.txt"))
    assert dumped == ["megatron_1d_dp2_mp4.hlo.txt", "megatron_2d_dp2_mp4.hlo.txt"]


def _plan_cli_error(flags: list[str]) -> str:
    """The one error line of a plan CLI run that must stop on user input, before printing anything."""
    run = subprocess.run(
        [sys.executable, "-m", "gspmd_tp.plan", "--config=configs/tiny.py", *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and run.stdout == "", (flags, run.stderr[-2000:])
    return errors[0]


def test_cli_mistakes_are_one_line_errors_before_compiling(tmp_path):
    """Through the command: a rule file not found (found inside compare) is one error line, and the
    chart is not written. (check_flags' mistakes, which main prints the same way, are tested below.)"""
    chart = tmp_path / "plan.png"
    flags = ["--compare=megatron_1d,megatron_1x", f"--chart={chart}"]
    assert "rule file 'megatron_1x' not found" in _plan_cli_error(flags)
    assert not chart.exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(compare_flag="megatron_1d,"), "--compare=megatron_1d,: an empty rule file name"),
        (dict(meshes="dp=2,mp=4"), "--meshes=dp=2,mp=4 is for --compare"),
        (dict(chart_path="plan.png"), "--chart=plan.png is for --compare"),
        (dict(slices=2), "--slices=2 needs --target"),
        (dict(target="tpu:v5e:2x4", slices=0), "--slices=0: a target has at least 1 slice"),
        (dict(network=100.0), "--network_gbps=100 needs --target"),
        (dict(target="tpu:v5e:2x4", network=0.0), "--network_gbps=0: expected a finite bandwidth"),
        (dict(target="tpu:v5e:2x4", network=float("nan")), "--network_gbps=nan: expected a finite bandwidth"),
        (dict(target="tpu:v5e:2x4", network=float("inf")), "--network_gbps=inf: expected a finite bandwidth"),
        (
            dict(compare_flag="megatron_1d", chart_path="plan.pngx"),
            "the extension .pngx is not an image format",
        ),
        (
            dict(compare_flag="megatron_1d", chart_path="/dev/null/plan.png"),
            "--chart=/dev/null/plan.png: /dev/null is a file, not a directory",
        ),
        (dict(dump_hlo="/dev/null/hlo"), "--dump_hlo=/dev/null/hlo: /dev/null is a file, not a directory"),
    ],
)
def test_flag_mistakes_are_named_before_compiling(flags, message):
    given = dict(
        compare_flag="", meshes="", chart_path="", dump_hlo=None, target=None, slices=1, network=None
    )
    with pytest.raises(UserError, match=re.escape(message)):
        planner.check_flags(**{**given, "network": None, **flags})


def test_sequence_parallel_gathers_and_scatters_instead_of_all_reducing():
    one_d = planned("megatron_1d", "dp=2,mp=4")
    sp = planned("megatron_1d_sp", "dp=2,mp=4")
    assert one_d["collectives"]["all-gather"]["count"] == 0
    # Entering each attention and MLP block (2 per layer, 2 layers) the sequence is all-gathered.
    assert sp["collectives"]["all-gather"]["count"] >= 4
    assert sp["ratio"] == pytest.approx(1.0, abs=0.10)
    assert sp["memory"]["temporaries"] < one_d["memory"]["temporaries"]


@pytest.mark.parametrize("rules", ["megatron_1d_sp", "megatron_2d"])
def test_logits_are_never_gathered_over_the_vocabulary(rules):
    """The loss reduces max and sum-of-exponentials across mp; full [tokens, vocab] never moves
    (megatron_1d's logits are laid out as megatron_1d_sp's)."""
    from gspmd_tp.sharding import hlo

    c = small_config(rules=rules, mesh="dp=2,mp=4", **{"model.vocab_size": 384})
    text = step_lib.compile_train_step(run_setup.setup(c)).as_text()
    for coll in hlo.collectives(text, 8):
        line = next(ln for ln in text.splitlines() if f"%{coll.name} = " in ln)
        result_type = line.split("=", 1)[1].split(coll.kind)[0]
        assert "384]" not in result_type and "384," not in result_type, (rules, line[:200])


def _loop_carried(text, shape):
    """How many arrays of `shape` the layer loops of a compiled step carry (saved activations)."""
    dims = ",".join(str(d) for d in shape)
    loops = [ln for ln in text.splitlines() if " while(" in ln]
    return sum(ln.split(" while(")[0].count(f"f32[{dims}]") for ln in loops)


def test_sequence_parallel_splits_the_saved_residual_stream_over_mp():
    """Per layer, the residual stream and norm activations saved for the backward pass are
    (batch/dp, length/mp, embed) under megatron_1d_sp, (batch/dp, length, embed) under megatron_1d."""
    layers, b, t, d, mp = 2, 8 // 2, 32, 64, 4
    full, split = (layers, b, t, d), (layers, b, t // mp, d)
    text = {r: compiled_text(r, "dp=2,mp=4") for r in ("megatron_1d", "megatron_1d_sp")}
    assert _loop_carried(text["megatron_1d_sp"], split) >= 4
    sp_bytes = _loop_carried(text["megatron_1d_sp"], full) + _loop_carried(text["megatron_1d_sp"], split) / mp
    one_d = _loop_carried(text["megatron_1d"], full) + _loop_carried(text["megatron_1d"], split) / mp
    assert sp_bytes <= 0.6 * one_d, (sp_bytes, one_d)


def _rule_file(tmp_path, name, **changes):
    """rules/megatron_1d.yaml with the rules for some logical axes changed, written to tmp_path."""
    text = (ROOT / "rules" / "megatron_1d.yaml").read_text()
    for axis, value in changes.items():
        lines = [ln for ln in text.splitlines() if ln.strip().startswith(f"- [{axis},")]
        assert lines, axis
        text = text.replace(lines[0].strip(), f"- [{axis}, {value}]")
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return str(path)


def test_fewer_key_value_heads_than_mp_moves_no_attention_score(tmp_path):
    """2 key/value heads on mp=4 (kv_heads -> null, heads -> mp): each device scores its own query
    heads against whole keys and values. The scores were constrained (kv_heads, none) on their head
    axes, which gathered every layer's float32 scores forward and backward (1.54 MB per device per
    step; 0.75 MB without)."""
    rules = _rule_file(tmp_path, "kv_null", kv_heads="null")
    c = small_config(rules=rules, mesh="dp=2,mp=4", **{"model.num_kv_heads": 2})
    text = step_lib.compile_train_step(run_setup.setup(c)).as_text()
    t = c.seq_len
    for coll in hlo.collectives(text, 8):
        line = next(ln for ln in text.splitlines() if f"%{coll.name} = " in ln)
        result_type = line.split("=", 1)[1].split(coll.kind)[0]
        assert f",{t},{t}]" not in result_type, line[:200]  # (batch, kv_heads, group, q, s)
    moved = sum(x.ring_bytes_per_call for x in hlo.collectives(text, 8))
    assert moved < 1.25 * planned("megatron_1d", "dp=2,mp=4")["bytes_per_device"]


def test_attention_only_tensor_parallelism_is_in_the_analysis(tmp_path):
    """Each sublayer is modelled over the axes that shard its own hidden dimension: heads sharded
    and mlp not is half of megatron_1d's per-layer all-reduces, not none."""
    p = planner.plan(small_config(rules=_rule_file(tmp_path, "attn_only", mlp="null"), mesh="dp=2,mp=4"))
    one_d = planned("megatron_1d", "dp=2,mp=4")
    assert p["analytical"]["tensor_parallel"] > 0
    assert p["ratio"] == pytest.approx(1.0, abs=0.05), (p["bytes_per_device"], p["analytical"])
    assert one_d["analytical"]["unmodelled"] == [] and p["analytical"]["unmodelled"] == []


def test_sharding_the_analysis_does_not_model_gets_no_ratio(tmp_path):
    rules = _rule_file(tmp_path, "head_dim_mp", heads="null", kv_heads="null", head_dim="mp")
    p = planner.plan(small_config(rules=rules, mesh="dp=2,mp=4"))
    assert p["analytical"]["unmodelled"] == ["head_dim->mp"]
    assert p["ratio"] is None
    assert "n/a: the analysis does not model this rule file's head_dim->mp sharding" in planner.format_plan(p)


def test_a_rule_no_tensor_takes_is_not_called_unmodelled(tmp_path):
    """head_dim -> mp after heads -> mp: the heads hold mp in every tensor with a head_dim, so the
    step is megatron_1d's and so is the analysis."""
    p = planner.plan(
        small_config(rules=_rule_file(tmp_path, "head_dim_late", head_dim="mp"), mesh="dp=2,mp=4")
    )
    one_d = planned("megatron_1d", "dp=2,mp=4")
    assert p["analytical"]["unmodelled"] == [] and p["ratio"] == pytest.approx(one_d["ratio"], abs=0.01)


@pytest.mark.parametrize(
    "changes, unmodelled",
    [
        # The activation cannot take dp (the batch holds it), so the weight is gathered over mp.
        ({"mlp": "[dp, mp]"}, ["mlp->dp,mp"]),
        # Fewer kv heads than mp: attention scores are computed whole and gathered.
        ({"kv_heads": "null"}, ["heads (not kv_heads)->mp"]),
    ],
)
def test_layouts_the_analysis_has_no_term_for_are_named(tmp_path, changes, unmodelled):
    s = run_setup.setup(small_config(rules=_rule_file(tmp_path, "odd", **changes), mesh="dp=2,mp=4"))
    assert analysis.analytical_bytes(s, analysis.leaf_table(s), "cpu")["unmodelled"] == unmodelled


def test_sequence_parallelism_on_an_axis_of_its_own_is_named_unmodelled(tmp_path):
    """norm_length over a third mesh axis that no sublayer splits: the step gathers the residual
    stream over it (plan read 1.19 of an analysis that had no term for that); megatron_1d_sp's
    norm_length over mp, the sublayers' own axis, stays modelled."""
    text = (RULES_DIR / "megatron_1d_sp.yaml").read_text()
    three = tmp_path / "sp_own_axis.yaml"
    three.write_text(text.replace("mesh_axes: [dp, mp]", "mesh_axes: [dp, mp, sp]").replace(
        "[norm_length, mp]", "[norm_length, sp]"))  # fmt: skip
    s = run_setup.setup(small_config(rules=str(three), mesh="dp=2,mp=2,sp=2"))
    assert analysis.analytical_bytes(s, analysis.leaf_table(s), "cpu")["unmodelled"] == ["norm_length->sp"]
    sp = run_setup.setup(small_config(rules="megatron_1d_sp", mesh="dp=2,mp=4"))
    assert analysis.analytical_bytes(sp, analysis.leaf_table(sp), "cpu")["unmodelled"] == []


def test_compare_labels_two_rule_files_of_one_name_apart(tmp_path, monkeypatch):
    monkeypatch.setattr(step_lib, "compile_train_step", lambda s: _FakeCompiled())
    (tmp_path / "other").mkdir()
    other = _rule_file(tmp_path / "other", "megatron_1d", mlp="null")
    rows = planner.compare(small_config(), ["megatron_1d", other], ["dp=2,mp=4"])
    assert [r["label"] for r in rows] == ["megatron_1d", "megatron_1d_2"]
    table = planner.format_compare(rows)
    assert "megatron_1d    dp=2,mp=4" in table and "megatron_1d_2  dp=2,mp=4" in table


def test_compare_columns_stay_under_their_headings_with_long_labels_and_meshes(tmp_path, monkeypatch):
    monkeypatch.setattr(step_lib, "compile_train_step", lambda s: _FakeCompiled())
    renamed = tmp_path / "megatron_1d_renamed_axes.yaml"
    renamed.write_text(
        (RULES_DIR / "megatron_1d.yaml").read_text().replace("dp", "data").replace("mp", "model")
    )
    rows = planner.compare(small_config(), ["megatron_1d", str(renamed)], ["dp=2,mp=4", "data=2,model=4"])
    head, *table = planner.format_compare(rows).splitlines()
    end = head.index("params+opt/dev") + len("params+opt/dev")
    for line in table:  # each figure ends where its heading does
        assert line.index(" MiB", end - 12) + len(" MiB") == end, line


@pytest.mark.parametrize(
    "rules, meshes, message",
    [
        (["dp", "megatron_1d", "dp"], ["dp=8,mp=1"], r"^--compare: rule file 'dp' is given twice \("),
        (
            ["dp", str(RULES_DIR / "dp.yaml")],
            ["dp=8,mp=1"],
            r"^--compare: rule file '/.*/dp.yaml' is 'dp' again \(each rule file x mesh is planned once\)$",
        ),
        (["dp"], ["dp=8,mp=1", "mp=1,dp=-1"], r"^--meshes: mesh 'mp=1,dp=-1' is 'dp=8,mp=1' again \("),
    ],
)
def test_compare_refuses_a_rule_file_or_mesh_given_twice_before_compiling(
    no_compiling, rules, meshes, message
):
    """As bench.py does (the same check): plan merged them into one row without a word, so a
    report asked for two rows showed one."""
    with pytest.raises(UserError, match=message):
        planner.compare(small_config(), rules, meshes)


def test_compare_pairs_each_rule_file_with_the_meshes_in_its_axes(tmp_path, monkeypatch):
    monkeypatch.setattr(step_lib, "compile_train_step", lambda s: _FakeCompiled())
    renamed = tmp_path / "renamed.yaml"
    text = (RULES_DIR / "megatron_1d.yaml").read_text()
    renamed.write_text(text.replace("dp", "data").replace("mp", "model"))
    rows = planner.compare(small_config(), ["megatron_1d", str(renamed)], ["dp=2,mp=4", "data=4,model=2"])
    assert [(r["label"], r["mesh"]) for r in rows] == [
        ("megatron_1d", "dp=2,mp=4"),
        ("renamed", "data=4,model=2"),
    ]
    with pytest.raises(UserError, match=r"^renamed: no mesh given names its mesh_axes \['data', 'model'\]"):
        planner.compare(small_config(), ["megatron_1d", str(renamed)], ["dp=2,mp=4"])


class _FakeCompiled:
    """Stands in for a compiled step: no collectives, no memory."""

    def as_text(self):
        return ""

    def memory_analysis(self):
        import types

        return types.SimpleNamespace(
            argument_size_in_bytes=0,
            output_size_in_bytes=0,
            alias_size_in_bytes=0,
            temp_size_in_bytes=0,
            generated_code_size_in_bytes=0,
        )


@pytest.fixture
def no_compiling(monkeypatch):
    """Fails a test that compiles the train step."""
    monkeypatch.setattr(step_lib, "compile_train_step", lambda *a: pytest.fail("compiled before checking"))


@pytest.mark.parametrize(
    "rules, meshes, message",
    [
        (["megatron_1d", "megatron_1x"], ["dp=2,mp=4"], "rule file 'megatron_1x' not found"),
        (["megatron_1d"], ["dp=2,mp=4", "dp=3,mp=4"], "mesh 'dp=3,mp=4' has 12 devices but 8 are available"),
        (["megatron_1d"], ["dp=2,", "mp=4"], "mesh 'dp=2,': expected NAME=SIZE"),
        (
            ["megatron_1d", "dp"],
            ["data=2,mp=4"],
            r"mesh 'data=2,mp=4' names axes \['data', 'mp'\], which no rule file of --compare has as its "
            r"mesh_axes \(megatron_1d: \['dp', 'mp'\]; dp: \['dp', 'mp'\]\)$",
        ),
    ],
)
def test_compare_stops_on_input_the_user_can_fix_before_compiling(no_compiling, rules, meshes, message):
    with pytest.raises(UserError, match=message):
        planner.compare(small_config(), rules, meshes)


def test_compare_reports_a_mesh_the_model_cannot_divide_as_a_row(monkeypatch):
    planned = []
    monkeypatch.setattr(planner, "plan", lambda c, *a, **k: planned.append(c.mesh) or {"mesh": c.mesh})
    c = small_config(**{"model.num_heads": 4, "model.num_kv_heads": 4, "model.head_dim": 16})
    rows = planner.compare(c, ["megatron_1d"], ["dp=2,mp=4", "dp=-1,mp=8"])
    assert planned == ["dp=2,mp=4"]
    assert rows[1]["mesh"] == "dp=1,mp=8" and "is not divisible by mesh axes mp=8" in rows[1]["error"]
    with pytest.raises(UserError, match="no rule file x mesh of --compare fits this model; first: .*mp=8"):
        planner.compare(c, ["megatron_1d"], ["dp=1,mp=8"])


def test_op_names_lose_their_common_prefix_and_a_cut_is_marked():
    assert planner._short_op("jit(step)/jvp(Transformer)/layers/attn/dot_general") == (
        "jvp(Transformer)/layers/attn/dot_general"
    )
    long = "jit(step)/" + "/".join(f"scope{i}" for i in range(20)) + "/dot_general"
    short = planner._short_op(long)
    assert len(short) == 90 and short.startswith("...") and short.endswith("scope19/dot_general")
