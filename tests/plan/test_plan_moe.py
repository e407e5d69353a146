"""plan of a mixture-of-experts model under the expert rule files (XLA:CPU, float32): the analysis
counts the all-gather dispatcher's token traffic and the experts' weights' gathers and gradient
reductions, and each device holds its experts alone."""

import copy
import functools
import tempfile
from pathlib import Path

import pytest
from conftest import small_config

from gspmd_tp.plan import planner
from gspmd_tp.sharding import hlo

# The small test model with 8 experts of width 32, 2 a token, and one shared expert (as
# tests/train/test_moe_training.py): every expert axis up to 8 divides the experts.
MOE = {"model.num_experts": 8, "model.expert_mlp_dim": 32, "model.shared_experts": 1}
MESHES = {"expert_fsdp": "data=2,expert=4", "data_expert_tensor": "data=2,expert=2,tensor=2"}


@functools.cache
def _planned(rules: str, remat: str = "none") -> tuple[dict, list]:
    c = small_config(rules=rules, mesh=MESHES[rules], **MOE, **{"model.remat": remat})
    with tempfile.TemporaryDirectory() as d:
        p = planner.plan(c, dump_hlo=d)
        (path,) = Path(d).iterdir()
        return p, hlo.collectives(path.read_text(), p["devices"])


def planned(rules: str, remat: str = "none") -> tuple[dict, list]:
    """(plan, the compiled step's collectives) of the small MoE model under `rules`, compiled once."""
    return copy.deepcopy(_planned(rules, remat))


def dispatched(found: list, group: int) -> float:
    """Ring bytes per step of the dispatch map's all-gathers and reduce-scatters over `group` devices."""
    return sum(
        c.ring_bytes_per_call
        for c in found
        if "moe/shard_map" in c.op_name
        and c.kind in ("all-gather", "reduce-scatter")
        and c.group_size == group
    )


@pytest.mark.parametrize("rules", list(MESHES))
def test_expert_rule_files_within_5_percent_of_the_analysis(rules):
    p, _ = planned(rules)
    a = p["analytical"]
    assert a["expert_dispatch"] > 0 and not a["unmodelled"]
    assert p["ratio"] == pytest.approx(1.0, abs=0.05), (p["bytes_per_device"], a)


def test_the_dispatch_moves_each_tokens_share_out_and_back_as_worked_by_hand():
    """expert_fsdp on data=2,expert=4: one sequence of 32 tokens a device, each gathered over the 4
    devices of its expert group and its output scattered back, forward; the output gradients
    gathered and the input gradients scattered, backward; the routes (2 float32 weights and 2 int32
    ids a token) gathered forward and the weights' gradient scattered back: each (4 - 1) times a
    device's share, per layer."""
    p, found = planned("expert_fsdp")
    c = small_config(**MOE)
    tokens = c.batch_size // 8 * c.seq_len
    share = tokens * c.model.d_model * 4  # float32
    routes = tokens * c.model.experts_per_token * 4
    expected = c.model.num_layers * (4 - 1) * (4 * share + 3 * routes)
    assert p["analytical"]["expert_dispatch"] == pytest.approx(expected, rel=1e-9)
    assert dispatched(found, 4) == pytest.approx(expected, rel=1e-9)


def test_the_experts_weights_are_gathered_over_data_alone_once_and_their_gradients_scattered():
    """expert_fsdp: gate_up (experts, embed, 2, mlp) and down (experts, mlp, embed), each device's 2
    experts split on embed over data=2, gathered there once a step inside the map (the backward
    reads the forward's copy) and their gradients reduce-scattered back: never gathered over
    expert. Half of the gathered bytes each way."""
    p, found = planned("expert_fsdp")
    m = small_config(**MOE).model
    per_device = m.num_layers * m.num_experts // 4 * m.d_model * 3 * m.expert_mlp_dim * 4 // 2
    gathered = per_device * 2
    assert dispatched(found, 2) == pytest.approx(2 * gathered / 2, rel=1e-9)
    rows = {r["path"]: r for r in p["params"]}
    assert rows["params/layers/moe/gate_up"]["bytes_per_device"] + rows["params/layers/moe/down"][
        "bytes_per_device"
    ] == pytest.approx(per_device)


@pytest.mark.parametrize("rules, ways", [("expert_fsdp", 4 * 2), ("data_expert_tensor", 2 * 2)])
def test_each_device_holds_its_experts_alone(rules, ways):
    """Parameter memory per device: each expert weight's bytes over its expert axis times the axis
    splitting its model width (expert_fsdp: data) or hidden width (data_expert_tensor: tensor);
    under expert_fsdp every parameter is split 8 ways, the ideal."""
    p, _ = planned(rules)
    for row in p["params"]:
        if row["path"].endswith(("moe/gate_up", "moe/down")):
            assert row["bytes_per_device"] * ways == row["bytes"]
    m = p["memory"]
    if rules == "expert_fsdp":
        assert m["params"] == pytest.approx(m["ideal_params"], rel=1e-3)
    else:  # replicated over data=2 (the rule file's data parallelism)
        assert m["params"] == pytest.approx(2 * m["ideal_params"], rel=0.02)


def test_a_remat_policy_gathers_the_tokens_routes_and_expert_weights_again_for_the_backward():
    """Under model.remat full the backward recomputes the forward's gathers inside the map: each
    device's tokens and routes over its expert group of 4 ((4 - 1) times its share), the experts'
    weights over data; the outputs are not scattered again. The step within 5% of the analysis."""
    p, found = planned("expert_fsdp", "full")
    base, plain = planned("expert_fsdp")
    c = small_config(**MOE)
    tokens = c.batch_size // 8 * c.seq_len
    again = (
        c.model.num_layers
        * (4 - 1)
        * (tokens * c.model.d_model * 4 + 2 * tokens * c.model.experts_per_token * 4)
    )
    assert p["analytical"]["expert_dispatch"] - base["analytical"]["expert_dispatch"] == pytest.approx(again)
    gathered = sum(
        x.ring_bytes_per_call for x in found if "moe/shard_map" in x.op_name and x.kind == "all-gather"
    )
    assert gathered - sum(
        x.ring_bytes_per_call for x in plain if "moe/shard_map" in x.op_name and x.kind == "all-gather"
    ) == pytest.approx(again + dispatched(plain, 2) / 2, rel=1e-6)
    assert p["ratio"] == pytest.approx(1.0, abs=0.05), (p["bytes_per_device"], p["analytical"])
