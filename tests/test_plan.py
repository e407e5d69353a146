"""plan: per-leaf specs, memory, and collectives of the compiled step against the analysis."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import small_config

from gspmd_tp import hlo, plan, trainer

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def megatron_1d():
    return plan.plan(small_config(rules="megatron_1d", mesh="dp=2,mp=4"))


def test_megatron_1d_only_all_reduces_within_5_percent(megatron_1d):
    c = megatron_1d["collectives"]
    assert c["all-gather"]["count"] == 0 and c["reduce-scatter"]["count"] == 0
    assert c["all-reduce"]["count"] > 0
    assert megatron_1d["ratio"] == pytest.approx(1.0, abs=0.05)


SHIPPED = ["dp", "fsdp", "megatron_1d", "megatron_1d_sp", "megatron_2d"]


@pytest.mark.parametrize("rules, mesh", [(r, "dp=2,mp=4") for r in SHIPPED] + [("megatron_2d", "dp=4,mp=2")])
def test_every_shipped_rule_file_within_10_percent_of_the_analysis(rules, mesh):
    p = plan.plan(small_config(rules=rules, mesh=mesh))
    assert p["ratio"] == pytest.approx(1.0, abs=0.10), (p["bytes_per_device"], p["analytical"])


def test_2d_gathers_each_activation_once_and_the_mlp_output_gradient_once():
    """Per layer: one all-gather in front of each sublayer forward; in the backward pass the MLP's
    output gradient is gathered once (its cotangent constraint) and no projection input is gathered
    again. XLA:CPU gathers the attention output gradient once per consumer (2 per layer), which the
    TPU compiler does not (test_plan_tpu)."""
    c = small_config(rules="megatron_2d", mesh="dp=2,mp=4")
    s = trainer.setup(c)
    found = hlo.collectives(trainer.compile_train_step(s).as_text(), 8)
    activation = (c.batch_size // 2) * c.seq_len * c.model.d_model * 4

    def gathers(where):
        return sum(
            x.executions
            for x in found
            if x.kind == "all-gather" and x.result_bytes == activation and where in x.op_name
        )

    layers = c.model.num_layers
    assert gathers("jvp(Transformer)/while/body/closed_call/layers/sharding_constraint") == 2 * layers
    assert gathers("transpose(jvp(Transformer))/while/body/closed_call/layers/mlp/") == layers
    assert gathers("transpose(jvp(Transformer))/while/body/closed_call/layers/attn/") == 2 * layers
    # The above, plus the output projection forward and the embedding backward; nothing else.
    assert gathers("") == 5 * layers + 2


def test_fsdp_and_dp_use_every_device_whatever_the_mesh_shape():
    for rules in ("dp", "fsdp"):
        flat = plan.plan(small_config(rules=rules, mesh="dp=8,mp=1"))
        square = plan.plan(small_config(rules=rules, mesh="dp=2,mp=4"))
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
    p = plan.plan(small_config(rules="fsdp", mesh="dp=8,mp=1"))
    m = p["memory"]
    assert m["params"] == pytest.approx(m["ideal_params"], rel=0.01)  # everything sharded 8 ways
    assert m["opt_state"] == pytest.approx(m["ideal_opt_state"], rel=0.01)
    assert m["temporaries"] > 0


@pytest.mark.parametrize("rules, mesh", [("fsdp", "dp=8,mp=1"), ("megatron_2d", "dp=2,mp=4")])
def test_no_large_leaf_replicated_under_fsdp_and_2d(rules, mesh):
    s = trainer.setup(small_config(rules=rules, mesh=mesh))
    flagged = [r["path"] for r in plan.leaf_table(s, threshold=16 << 10) if r["replicated_over"]]
    assert flagged == []


def test_replicated_leaves_are_flagged_under_dp():
    s = trainer.setup(small_config(rules="dp", mesh="dp=8,mp=1"))
    flagged = {r["path"] for r in plan.leaf_table(s, threshold=16 << 10) if r["replicated_over"]}
    assert "params/layers/mlp/gate_up" in flagged
    assert any(p.startswith("opt_state/") for p in flagged)  # the moments too


@pytest.mark.parametrize("rules", ["megatron_1d_sp", "megatron_2d"])
def test_remat_that_keeps_collective_outputs_repeats_no_communication(rules):
    """dots_no_batch recomputes the sublayer inputs in the backward pass, and with them their
    all-gathers; dots_no_batch_comm keeps what the collectives produced and moves the bytes of no
    remat at all."""

    def sent(remat):
        c = small_config(rules=rules, mesh="dp=2,mp=4", **{"model.remat": remat})
        return plan.plan(c)["bytes_per_device"]

    none = sent("none")
    assert sent("dots_no_batch") > 1.05 * none
    assert sent("dots_no_batch_comm") == pytest.approx(none, rel=0.01)


def test_data_parallel_matches_analysis():
    p = plan.plan(small_config(rules="dp", mesh="dp=8,mp=1"))
    assert p["ratio"] == pytest.approx(1.0, abs=0.05)


def test_scan_and_unrolled_layers_move_the_same_bytes():
    scanned = plan.plan(small_config(rules="megatron_1d", mesh="dp=2,mp=4"))
    unrolled = plan.plan(small_config(rules="megatron_1d", mesh="dp=2,mp=4", **{"model.scan_layers": False}))
    assert unrolled["bytes_per_device"] == pytest.approx(scanned["bytes_per_device"], rel=0.01)


def test_cli_json_compare_chart_and_hlo_dump(tmp_path):
    small = ["--config.batch_size=8", "--config.seq_len=32", "--config.model.num_layers=2"]
    run = subprocess.run(
        [sys.executable, "-m", "gspmd_tp.plan", "--config=configs/tiny.py", *small, "--json",
         f"--dump_hlo={tmp_path / 'hlo'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["mesh"] == "dp=2,mp=4"
    assert list((tmp_path / "hlo").glob("*.txt"))
    chart = tmp_path / "plan.png"
    run = subprocess.run(
        [sys.executable, "-m", "gspmd_tp.plan", "--config=configs/tiny.py", *small,
         "--compare=megatron_1d,megatron_2d", "--meshes=dp=4,mp=2 dp=2,mp=4", f"--chart={chart}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("megatron_") == 4
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_unwritable_outputs_are_one_line_errors_before_compiling():
    for flags, message in [
        (["--compare=megatron_1d", "--chart=/dev/null/plan.png"], "--chart=/dev/null/plan.png"),
        (["--dump_hlo=/dev/null/hlo"], "--dump_hlo=/dev/null/hlo"),
    ]:
        run = subprocess.run(
            [sys.executable, "-m", "gspmd_tp.plan", "--config=configs/tiny.py", *flags],
            cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
        last = run.stderr.strip().splitlines()[-1]
        assert last == f"error: {message}: /dev/null is a file, not a directory"
        assert run.stdout == ""


def test_sequence_parallel_gathers_and_scatters_instead_of_all_reducing():
    one_d = plan.plan(small_config(rules="megatron_1d", mesh="dp=2,mp=4"))
    sp = plan.plan(small_config(rules="megatron_1d_sp", mesh="dp=2,mp=4"))
    assert one_d["collectives"]["all-gather"]["count"] == 0
    # Entering each attention and MLP block (2 per layer, 2 layers) the sequence is all-gathered.
    assert sp["collectives"]["all-gather"]["count"] >= 4
    assert sp["ratio"] == pytest.approx(1.0, abs=0.10)
    assert sp["memory"]["temporaries"] < one_d["memory"]["temporaries"]


@pytest.mark.parametrize("rules", ["megatron_1d", "megatron_1d_sp", "megatron_2d"])
def test_logits_are_never_gathered_over_the_vocabulary(rules):
    """The loss reduces max and sum-of-exponentials across mp; full [tokens, vocab] never moves."""
    from gspmd_tp import hlo

    c = small_config(rules=rules, mesh="dp=2,mp=4", **{"model.vocab_size": 384})
    text = trainer.compile_train_step(trainer.setup(c)).as_text()
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
    text = {
        r: trainer.compile_train_step(trainer.setup(small_config(rules=r, mesh="dp=2,mp=4"))).as_text()
        for r in ("megatron_1d", "megatron_1d_sp")
    }
    assert _loop_carried(text["megatron_1d_sp"], split) >= 4
    sp_bytes = _loop_carried(text["megatron_1d_sp"], full) + _loop_carried(text["megatron_1d_sp"], split) / mp
    one_d = _loop_carried(text["megatron_1d"], full) + _loop_carried(text["megatron_1d"], split) / mp
    assert sp_bytes <= 0.6 * one_d, (sp_bytes, one_d)
