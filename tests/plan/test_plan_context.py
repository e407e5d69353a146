"""plan under context parallelism, all-gather K/V (rules/context_dp.yaml, rules/fsdp_context_tensor.yaml):
the analysis counts the keys' and values' gathers over the context axis and their gradients' reductions,
the parameters' gradients summed over the context axis, and every other term at a device's share of the
sequence; against the compiled step on XLA:CPU in float32 and on the TPU compiler in bfloat16."""

import copy
import functools
import tempfile
from pathlib import Path

import pytest
from conftest import ROOT, small_config

from gspmd_tp.plan import analysis, planner
from gspmd_tp.sharding import hlo
from gspmd_tp.train import run_setup

CASES = [
    ("context_dp", "data=2,context=4"),
    ("context_dp", "data=1,context=8"),
    ("fsdp_context_tensor", "fsdp=2,context=2,tensor=2"),
]


@functools.cache
def _planned(rules: str, mesh: str, **overrides) -> tuple[dict, list]:
    c = small_config(rules=rules, mesh=mesh, **overrides)
    with tempfile.TemporaryDirectory() as d:
        p = planner.plan(c, dump_hlo=d)
        (path,) = Path(d).iterdir()
        return p, hlo.collectives(path.read_text(), p["devices"])


def planned(rules: str, mesh: str, **overrides) -> tuple[dict, list]:
    """(plan, the compiled step's collectives) of small_config under `rules` on `mesh`, compiled once."""
    return copy.deepcopy(_planned(rules, mesh, **overrides))


def kv_gathers(found: list, context: int) -> float:
    """Ring bytes per step of the compiled step's float32 all-gathers over `context` devices inside the
    attention (the keys and values; the segment ids are int32)."""
    return sum(
        c.ring_bytes_per_call
        for c in found
        if c.kind == "all-gather" and c.group_size == context and c.dtype == "f32" and "/attn/" in c.op_name
    )


RING = {"model.context_parallel": "ring"}
STRATEGIES = [{}, RING, {**RING, "model.context_load_balance": True}]


@pytest.mark.parametrize("rules, mesh", CASES)
def test_context_rule_files_within_5_percent_of_the_analysis(rules, mesh):
    p, _ = planned(rules, mesh)
    a = p["analytical"]
    assert a["context_kv"] > 0 and a["context_grad"] > 0 and a["unmodelled"] == []
    assert p["ratio"] == pytest.approx(1.0, abs=0.05), (p["bytes_per_device"], a)


@pytest.mark.parametrize("strategy", STRATEGIES[1:], ids=["ring", "ring_balanced"])
@pytest.mark.parametrize("rules, mesh", [CASES[0], CASES[-1]])
def test_the_ring_within_5_percent_of_the_analysis(rules, mesh, strategy):
    p, found = planned(rules, mesh, **strategy)
    a = p["analytical"]
    assert a["context_kv"] > 0 and a["unmodelled"] == []
    assert any(c.kind == "collective-permute" for c in found) and kv_gathers(found, 4) == 0
    assert p["ratio"] == pytest.approx(1.0, abs=0.05), (p["bytes_per_device"], a)


def test_the_keys_and_values_move_as_worked_by_hand():
    """context_dp on data=2,context=4: a device's keys of the whole sequence are 4 rows x 32 positions x
    8 kv heads x 8 float32 (32 KiB), and so are its values. Per layer each is all-gathered forward (3/4
    of it received) and its gradient reduced back, an all-reduce on XLA:CPU (2 x 3/4 of it)."""
    p, found = planned("context_dp", "data=2,context=4")
    c = small_config()
    whole = 4 * 32 * 8 * 8 * 4
    forward = c.model.num_layers * 2 * 3 / 4 * whole
    assert kv_gathers(found, 4) == pytest.approx(forward, rel=1e-9)
    backward = c.model.num_layers * 2 * 2 * 3 / 4 * whole
    assert p["analytical"]["context_kv"] == pytest.approx(forward + backward, rel=1e-9)


def test_the_gradients_are_summed_over_the_context_axis_as_worked_by_hand():
    """context_dp on data=1,context=8: no batch axis to reduce over, yet every parameter's gradient is a
    sum over each device's positions, all-reduced over the 8 context devices (2 x 7/8 of the float32
    parameters, whose bytes the plan's leaf table adds up)."""
    p, _ = planned("context_dp", "data=1,context=8")
    params = sum(r["bytes"] for r in p["params"])
    assert p["analytical"]["data_parallel"] == 0
    assert p["analytical"]["context_grad"] == pytest.approx(2 * 7 / 8 * params, rel=1e-9)


@pytest.mark.parametrize("remat", ["dots_no_batch", "full"])
def test_a_remat_policy_gathers_the_keys_and_values_again_unless_it_keeps_the_keys(remat):
    """Under a remat policy the backward pass recomputes the attention's inputs and gathers the keys and
    values again; model.remat_save=key keeps the gathered keys, and only the values are gathered again.
    The compiled step's K/V gathers against no remat's: twice them, and one and a half times."""
    none = kv_gathers(planned("context_dp", "data=2,context=4")[1], 4)
    again = planned("context_dp", "data=2,context=4", **{"model.remat": remat})
    kept = planned("context_dp", "data=2,context=4", **{"model.remat": remat, "model.remat_save": "key"})
    assert kv_gathers(again[1], 4) == pytest.approx(2 * none, rel=1e-9)
    assert kv_gathers(kept[1], 4) == pytest.approx(1.5 * none, rel=1e-9)
    for p, _ in (again, kept):
        assert p["ratio"] == pytest.approx(1.0, abs=0.01), (p["bytes_per_device"], p["analytical"])


def test_the_length_split_shrinks_the_tensor_parallel_terms():
    """fsdp_context_tensor on 2x2x2 against the same rule file with length unsplit (length and
    norm_length -> null on a mesh of context=2 that nothing else uses): the Megatron reductions over
    tensor carry a device's half of the sequence, so their term is half as large."""
    text = (ROOT / "rules" / "fsdp_context_tensor.yaml").read_text()
    split = run_setup.setup(small_config(rules="fsdp_context_tensor", mesh="fsdp=2,context=2,tensor=2"))
    whole = run_setup.setup(
        small_config(rules=_written(text.replace("[length, context]", "[length, null]").replace(
            "[norm_length, context]", "[norm_length, null]")), mesh="fsdp=2,context=2,tensor=2")
    )  # fmt: skip
    tp = {
        k: analysis.analytical_bytes(v, analysis.leaf_table(v), "cpu")
        for k, v in (("s", split), ("w", whole))
    }
    assert tp["s"]["tensor_parallel"] == pytest.approx(tp["w"]["tensor_parallel"] / 2, rel=1e-9)
    assert tp["w"]["context_kv"] == 0 and tp["w"]["context_grad"] == 0


def _written(text: str) -> str:
    """`text` as a rule file in a fresh temporary directory; its path."""
    path = Path(tempfile.mkdtemp()) / "context_variant.yaml"
    path.write_text(text)
    return str(path)


def test_keys_split_by_position_under_all_gather_are_named_unmodelled():
    text = (
        (ROOT / "rules" / "context_dp.yaml").read_text().replace("[kv_length, null]", "[kv_length, context]")
    )
    s = run_setup.setup(small_config(rules=_written(text), mesh="data=2,context=4"))
    assert analysis.analytical_bytes(s, analysis.leaf_table(s), "cpu")["unmodelled"] == ["kv_length->context"]


def test_the_strategy_is_all_gather_unless_the_config_names_another():
    """Without model.context_parallel the analysis counts the all-gather strategy; a config that names
    ring gets the ring's terms (worked by hand: 3 steps forward of each device's block of K and of V
    with its positions and segment ids, the blocks again backward, and the float32 dK and dV 4 times),
    a name it does not know is unmodelled."""
    c = small_config(rules="context_dp", mesh="data=2,context=4")
    s = run_setup.setup(c)
    layout = analysis.context_layout(s)
    assert layout["strategy"] == "all_gather" and layout["axes"] == ("context",) and layout["ways"] == 4
    block = 4 * 32 // 4 * 8 * 8 * 4  # a device's own positions of K (or V), float32
    ring = {**layout, "strategy": "ring"}
    ids = 4 * 32 // 4 * 4 * 2  # the block's positions and segment ids, int32
    expected = c.model.num_layers * (2 * 3 * (2 * block + ids) + 4 * 2 * block)
    assert analysis.context_kv_bytes(s, ring, "cpu") == pytest.approx(expected, rel=1e-9)
    assert analysis.context_unmodelled(s, {**layout, "strategy": "zigzag"}) == {
        ("length (context_parallel zigzag)", ("context",))
    }
    assert analysis.context_layout(run_setup.setup(small_config(rules="dp", mesh="dp=8,mp=1"))) is None


# --- the TPU compiler (needs libtpu) ---

# Where a weight's shard on the model width is one 128-lane tile or less the TPU compiler all-reduces
# its gradient rather than reduce-scattering it (test_plan_tpu.WIDE): fsdp_context_tensor's at 512.
TPU_CASES = [
    ("context_dp", "data=2,context=4", {}),
    ("fsdp_context_tensor", "fsdp=2,context=2,tensor=2", {"model.d_model": 512}),
]


@pytest.mark.parametrize("strategy", [{}, RING], ids=["all_gather", "ring"])
@pytest.mark.parametrize("rules, mesh, wide", TPU_CASES)
def test_context_rule_files_on_tpu_in_bfloat16_within_5_percent_of_the_analysis(rules, mesh, wide, strategy):
    pytest.importorskip("libtpu")
    c = small_config(rules=rules, mesh=mesh, **{"model.dtype": "bfloat16", **wide, **strategy})
    p = planner.plan(c, target="tpu:v5e:2x4")
    a = p["analytical"]
    assert a["context_kv"] > 0 and a["unmodelled"] == []
    assert p["ratio"] == pytest.approx(1.0, abs=0.05), (p["bytes_per_device"], a)
