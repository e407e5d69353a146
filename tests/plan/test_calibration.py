"""plan's calibration: measuring the devices at hand (tiny sizes), reading the file back, and the
estimate it gives: compute plus the communication the compiled schedule leaves exposed."""

import json
import re
import subprocess
import sys
import time

import jax
import pytest
from conftest import ROOT, child_env, small_config
from test_hlo import SCHEDULED

from gspmd_tp.job.errors import UserError
from gspmd_tp.plan import calibrate, calibration, planner
from gspmd_tp.sharding import hlo, hlo_cost


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """A calibration of the 8 simulated devices at tiny sizes, 2 ms of trips timed per figure, on
    disk."""
    data = calibrate.measure(
        ["dp=2,mp=4"], sizes=(4096,), matmul_sizes=(16, 32), memory_sizes=(1024, 16384), min_time=0.002,
        repeats=1, working_set=65536, fresh_sizes=(2**16, 2**20),
    )  # fmt: skip
    path = tmp_path_factory.mktemp("calibration") / "cpu.json"
    path.write_text(json.dumps(data))
    return str(path), data


def test_calibrate_measures_every_collective_on_every_axis_and_the_compute_rates(measured):
    path, data = measured
    assert data["device_kind"] == jax.devices()[0].device_kind and data["devices"] == 8
    assert data["meshes"] == ["dp=2,mp=4"] and data["date"].endswith("Z")
    series = {(r["kind"], r["axis"], r["group_size"]) for r in data["collectives"]}
    assert series == {(k, a, g) for k in calibration.KINDS for a, g in (("dp", 2), ("mp", 4))}
    for r in data["collectives"]:
        assert r["bytes"] == [4096] and r["seconds"][0] > 0, r
    assert data["matmul"]["flops"] == [2 * 16**3, 2 * 32**3] and data["memory"]["bytes"] == [1024, 16384]
    assert data["fresh"]["bytes"] == [2**16, 2**20] and min(data["fresh"]["seconds"]) >= 0
    # Every figure is a loop trip timed over 2 ms of trips: none is the timer's floor or zero.
    figures = [t for r in data["collectives"] for t in r["seconds"]]
    figures += data["matmul"]["seconds"] + data["memory"]["seconds"]
    assert min(figures) > 1e-7, figures
    cal = calibration.load(path)
    assert cal.collective_seconds("all-gather", 4, 4096) == pytest.approx(
        data["collectives"][4]["seconds"][0]
    )
    assert cal.collective_seconds("all-reduce", 1, 4096) == 0


def test_a_timed_trip_is_raised_to_last_the_minimum_time_and_the_call_overhead_cancels():
    """A "call" of 3 ms plus 0.2 ms a trip: 0.2 ms a trip, timed over at least 20 ms of trips."""
    calls = []

    def fn(trips):
        calls.append(int(trips))
        time.sleep(3e-3 + 2e-4 * int(trips))
        return trips

    assert calibrate._timed(fn, (), min_time=0.02, repeats=2) == pytest.approx(2e-4, rel=0.3)
    assert max(calls) - 1 >= 0.02 / 2e-4


def test_the_curves_are_fitted_non_decreasing_in_size(tmp_path):
    """A figure below its smaller neighbour (noise: an elementwise pass timed at 1 ns) is pooled
    with it, so a larger operation never costs less than a smaller one."""
    assert calibration.monotone([1.0, 3.0, 2.0, 2.0, 5.0]) == pytest.approx([1, 7 / 3, 7 / 3, 7 / 3, 5])
    assert calibration.monotone([2.0, 1.0]) == [1.5, 1.5] and calibration.monotone([1.0, 2.0]) == [1, 2]
    data = _hand_made()
    data["memory"] = {"bytes": [1e3, 1e4, 1e5], "seconds": [2e-6, 1e-9, 4e-6]}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    cal = calibration.load(str(path))
    assert cal.data["memory"]["seconds"] == pytest.approx([1.0005e-6, 1.0005e-6, 4e-6])
    assert cal.compute_seconds(0, 1e4) == pytest.approx(1.0005e-6)
    assert cal.compute_seconds(0, 5e3) <= cal.compute_seconds(0, 1e4) < cal.compute_seconds(0, 2e4)


# fmt: off
SLICES = """\
HloModule m, is_scheduled=true

%update (p0: f32[6,256,256], p1: f32[256,256], p2: s32[]) -> f32[6,256,256] {
  %p0 = f32[6,256,256]{2,1,0} parameter(0)
  %p1 = f32[256,256]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %c = s32[] constant(0)
  %b = f32[1,256,256]{2,1,0} bitcast(%p1)
  ROOT %dus = f32[6,256,256]{2,1,0} dynamic-update-slice(%p0, %b, %p2, %c, %c)
}

%read (p0: f32[6,256,256], p1: s32[]) -> f32[256,256] {
  %p0 = f32[6,256,256]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  %ds = f32[1,256,256]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,256,256}
  ROOT %b = f32[256,256]{1,0} bitcast(%ds)
}

%scale (p0: f32[6,256,256]) -> f32[6,256,256] {
  %p0 = f32[6,256,256]{2,1,0} parameter(0)
  ROOT %m = f32[6,256,256]{2,1,0} multiply(%p0, %p0)
}

ENTRY %main (stack: f32[6,256,256], x: f32[256,256], i: s32[]) -> f32[6,256,256] {
  %stack = f32[6,256,256]{2,1,0} parameter(0)
  %x = f32[256,256]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %layer = f32[256,256]{1,0} fusion(%stack, %i), kind=kLoop, calls=%read
  %put = f32[6,256,256]{2,1,0} fusion(%stack, %layer, %i), kind=kLoop, calls=%update
  %plain = f32[6,256,256]{2,1,0} dynamic-update-slice(%put, %b2, %i, %i, %i)
  %b2 = f32[1,256,256]{2,1,0} bitcast(%x)
  ROOT %all = f32[6,256,256]{2,1,0} fusion(%plain), kind=kLoop, calls=%scale
}
"""
# fmt: on


def test_a_slice_read_or_updated_in_place_moves_the_slice_not_the_whole_buffer():
    """A layer read out of a stack of 6 (dynamic-slice), or written into it in place
    (dynamic-update-slice, in a fusion or not), moves one layer's bytes; a pass over the whole
    stack moves all of it."""
    costs = hlo_cost.Costs(SLICES)
    index = {name: i for i, (name, *_) in enumerate(costs.parsed["main"])}
    layer, stack = 256 * 256 * 4, 6 * 256 * 256 * 4
    assert costs.flops_and_bytes("main", index["layer"]) == (0.0, 2 * layer + 4)
    assert costs.flops_and_bytes("main", index["put"]) == (0.0, 2 * layer + 4)
    assert costs.flops_and_bytes("main", index["plain"]) == (0.0, 2 * layer + 3 * 4)
    assert costs.flops_and_bytes("main", index["all"]) == (0.0, 2 * stack)


def test_default_meshes_put_every_group_size_on_each_axis():
    assert calibrate.default_meshes(8) == ["dp=8,mp=1", "dp=4,mp=2", "dp=2,mp=4", "dp=1,mp=8"]


def _hand_made(kind="cpu") -> dict:
    """1 ms per 1000 bytes for every collective over 4 devices, 1 GFLOP/s, 1 GB/s."""
    rows = [
        {"kind": k, "axis": "mp", "mesh": "dp=2,mp=4", "group_size": 4, "bytes": [1000, 2000],
         "seconds": [1e-3, 2e-3]}
        for k in calibration.KINDS
    ]  # fmt: skip
    return {
        "format": 1, "device_kind": kind, "devices": 8, "date": "2026-01-01T00:00Z", "collectives": rows,
        "matmul": {"flops": [1e6, 1e8], "seconds": [1e-3, 1e-1]},
        "memory": {"bytes": [1e3, 1e6], "seconds": [1e-6, 1e-3]},
    }  # fmt: skip


def test_the_estimate_is_compute_plus_what_the_schedule_leaves_exposed():
    """SCHEDULED (tests/sharding/test_hlo.py): an all-gather with a product between its start and
    done, one back to back, one synchronous all-reduce. Only the first is hidden, and only for as
    long as the product lasts."""
    cal = calibration.Calibration("hand.json", _hand_made())
    found = hlo.collectives(SCHEDULED, num_devices=8)
    e = calibration.estimate(cal, found, SCHEDULED)
    _, per = hlo_cost.Costs(SCHEDULED).seconds(cal.compute_seconds)
    times = {c.name: cal.collective_seconds(c.kind, c.group_size, c.result_bytes) for c in found}
    assert times["hid-start"] == pytest.approx(2e-3 + (64 * 128 * 4 - 2000) * 1e-6)
    assert e["comm_s"] == pytest.approx(sum(times.values()))
    assert (
        e["comm_hidden_s"] == pytest.approx(per["main", "mm"]) and 0 < per["main", "mm"] < times["hid-start"]
    )
    assert e["step_s_estimate"] == pytest.approx(e["compute_s"] + e["comm_s"] - per["main", "mm"])
    assert "calibration hand.json (8 cpu devices" in e["source"]


def test_memory_the_step_allocates_costs_its_first_writing_at_the_measured_rate(tmp_path):
    """A file's `fresh` series prices the buffers a step call allocates (fitted non-decreasing,
    interpolated, in proportion below the first size); the estimate adds it to compute and exposed
    communication. A file without the series prices them at nothing."""
    found = hlo.collectives(SCHEDULED, num_devices=8)
    plain = calibration.Calibration("hand.json", _hand_made())
    path = tmp_path / "fresh.json"
    path.write_text(json.dumps({**_hand_made(), "fresh": {"bytes": [2**20, 2**22], "seconds": [2e-3, 1e-3]}}))
    fresh = calibration.load(str(path))
    assert fresh.fresh_seconds(2**21) == pytest.approx(1.5e-3)
    assert fresh.fresh_seconds(2**19) == pytest.approx(7.5e-4)
    assert fresh.fresh_seconds(0) == 0 and plain.fresh_seconds(2**21) == 0
    e = calibration.estimate(fresh, found, SCHEDULED, allocations=(2**21, 2**22))
    assert e["fresh_memory_s"] == pytest.approx(1.5e-3 + 1.5e-3)
    base = calibration.estimate(plain, found, SCHEDULED, allocations=(2**21, 2**22))
    assert base["fresh_memory_s"] == 0 and base["compute_s"] == e["compute_s"]
    assert e["step_s_estimate"] == pytest.approx(base["step_s_estimate"] + 3e-3)


def test_the_cost_of_new_memory_is_what_a_new_buffer_costs_beyond_one_held():
    """measure_fresh times an elementwise pass into a new buffer less the same pass in place, at
    each size asked for: never negative."""
    measured = calibrate.measure_fresh((2**16, 2**22), repeats=3, devices=jax.devices())
    assert [b for b, _ in measured] == [2**16, 2**22] and min(t for _, t in measured) >= 0


def test_a_product_timed_by_shape_replaces_its_flops_at_the_square_products_rate():
    """A file that times SCHEDULED's one product by its shape: that time stands for its FLOPs (the
    bytes it moves still cost what they cost), and the estimate moves by the difference; a product
    the file does not time keeps the FLOP rate."""
    costs = hlo_cost.Costs(SCHEDULED)
    (key,) = costs.all_product_keys()
    assert key.startswith("f32[") and "lhs_contracting=" in key
    assert hlo_cost.parse_product_key(key)[0] == "f32"
    plain = calibration.Calibration("hand.json", _hand_made())
    timed = calibration.Calibration("hand.json", {**_hand_made(), "products": {key: 0.5}})
    other = calibration.Calibration(
        "hand.json", {**_hand_made(), "products": {key.replace("f32", "f16"): 0.5}}
    )
    _, per = costs.seconds(plain.compute_seconds)
    _, per_timed = costs.seconds(timed.compute_seconds, products=timed.product_seconds)
    flops, moved = costs.flops_and_bytes("main", [n for n, *_ in costs.parsed["main"]].index("mm"))
    assert flops > 0 and per["main", "mm"] == pytest.approx(plain.compute_seconds(flops, moved))
    assert per_timed["main", "mm"] == pytest.approx(0.5 + plain.compute_seconds(0.0, moved))
    assert timed.product_seconds([key, "f32[1] f32[1]"]) is None and other.product_seconds([key]) is None
    found = hlo.collectives(SCHEDULED, num_devices=8)
    assert calibration.estimate(other, found, SCHEDULED) == calibration.estimate(plain, found, SCHEDULED)
    e, e_timed = calibration.estimate(plain, found, SCHEDULED), calibration.estimate(timed, found, SCHEDULED)
    assert e_timed["compute_s"] - e["compute_s"] == pytest.approx(per_timed["main", "mm"] - per["main", "mm"])


def test_calibrate_times_the_products_of_a_configs_steps_by_their_shapes():
    """config_products finds every product of the compiled steps (each rule file x mesh set up,
    so checked, before any compiles); measure_products times each, thin ones included."""
    from gspmd_tp.train import run_setup
    from gspmd_tp.train import step as step_lib

    c = small_config()
    keys = calibrate.config_products(c, ["megatron_1d", "fsdp"], ["dp=2,mp=4"])
    for rules in ("megatron_1d", "fsdp"):
        c.rules, c.mesh = rules, "dp=2,mp=4"
        text = step_lib.compile_train_step(run_setup.setup(c)).as_text()
        assert hlo_cost.Costs(text).all_product_keys() <= keys
    some = sorted(keys)[:2]
    timed = calibrate.measure_products(some, min_time=0.002, repeats=1, devices=jax.devices())
    assert set(timed) == set(some) and min(timed.values()) > 1e-7
    with pytest.raises(UserError, match="rule file 'nope' not found"):
        calibrate.config_products(small_config(), ["megatron_1d", "nope"], ["dp=2,mp=4"])


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not a calibration file (not JSON"),
        ('{"format": 0}', "not a calibration file of format 1"),
        (json.dumps({**_hand_made(), "matmul": {}}), "incomplete, no 'flops' in it"),
        (
            json.dumps({**_hand_made(), "collectives": _hand_made()["collectives"][:1]}),
            "measures ['all-gather']",
        ),
        (json.dumps({**_hand_made(), "products": {"f32[2,2] f32[2,2]": 0}}), "'products' is not a table"),
        (json.dumps({**_hand_made(), "products": [1.0]}), "'products' is not a table"),
        (json.dumps({**_hand_made(), "fresh": [1.0]}), "'fresh' is not a series of bytes and seconds"),
        (
            json.dumps({**_hand_made(), "fresh": {"bytes": [2, 1], "seconds": [0, 1]}}),
            "'fresh' is empty, unsorted or negative",
        ),
    ],
)
def test_a_file_that_cannot_serve_is_one_line(tmp_path, text, message):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(UserError, match=re.escape(message)) as e:
        calibration.load(str(path))
    assert "\n" not in str(e.value) and str(e.value).startswith(f"--calibration={path}: ")


def test_a_calibrated_plan_on_cpu_times_every_collective_as_exposed(measured):
    """XLA:CPU runs every collective synchronously: nothing is hidden, and the estimate is the
    compute at the measured rates plus every collective at its measured time."""
    p = planner.plan(small_config(rules="megatron_1d", mesh="dp=2,mp=4"), cal=calibration.load(measured[0]))
    e = p["estimate"]
    assert p["hidden_bytes_per_device"] == 0 and p["exposed_bytes_per_device"] == p["bytes_per_device"] > 0
    assert e["comm_hidden_s"] == 0 and e["comm_exposed_s"] == e["comm_s"] > 0 and e["compute_s"] > 0
    assert e["step_s_estimate"] == pytest.approx(e["compute_s"] + e["fresh_memory_s"] + e["comm_s"])
    assert "step time estimate" in planner.format_plan(p) and measured[0] in planner.format_plan(p)
    # The buffers a call allocates, from the compiled step's memory analysis: its temporaries and
    # its outputs not aliased to its (donated) inputs, each at the file's cost of new memory.
    cal = calibration.load(measured[0])
    cal.data["fresh"] = {"bytes": [2**20], "seconds": [1e-3]}
    p = planner.plan(small_config(rules="megatron_1d", mesh="dp=2,mp=4"), cal=cal)
    m = p["memory"]
    assert m["temporaries"] > 0 and p["estimate"]["fresh_memory_s"] == pytest.approx(
        1e-3 * (m["temporaries"] + m["outputs"] - m["aliased"]) / 2**20
    )
    assert "ms first writing the memory the step allocates" in planner.format_plan(p)


def test_a_calibration_of_another_device_kind_is_refused_before_compiling(monkeypatch):
    cal = calibration.Calibration("v5e.json", _hand_made("TPU v5 lite"))
    monkeypatch.setattr(planner.step_lib, "compile_train_step", None)  # reached: a TypeError
    with pytest.raises(
        UserError, match=r"^--calibration=v5e.json: measured on 'TPU v5 lite' devices, but this"
    ):
        planner.plan(small_config(rules="megatron_1d", mesh="dp=2,mp=4"), cal=cal)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--meshes=dp=3,mp=2"], "error: mesh 'dp=3,mp=2' has 6 devices but 8 are available"),
        (
            ["--rules=dp"],
            "error: --rules: the rule files of --config's steps whose products are timed; no --config",
        ),
        (["--config=configs/nope.py"], "error: --config=configs/nope.py: no such file"),
    ],
)
def test_the_calibrate_command_is_a_plan_subcommand_with_one_line_errors(tmp_path, flags, message):
    out = tmp_path / "c.json"
    run = subprocess.run(
        [sys.executable, "-m", "gspmd_tp.plan", "calibrate", f"--out={out}", *flags],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1 and not out.exists()
    assert run.stderr.strip().splitlines()[-1].startswith(message)


def test_plan_check_averages_each_points_rounds_and_ranks_by_the_mean(tmp_path):
    """docs/plan_check.py, on the files docs/plan_check.sh writes: a point timed in two bench rounds is
    measured by the mean of their medians, and the ranking, errors and best are taken from that mean."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_check", ROOT / "docs" / "plan_check.py")
    plan_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_check)

    def estimate(s):
        return {"estimate": {"step_s_estimate": s, "compute_s": s, "comm_exposed_s": 0.0}}

    plan = {"results": [
        {"rules": "rules/dp.yaml", "mesh": "dp=8,mp=1", **estimate(1.0)},
        {"rules": "rules/fsdp.yaml", "mesh": "dp=8,mp=1", **estimate(2.0)},
        {"rules": "rules/megatron_1d.yaml", "mesh": "dp=1,mp=8", **estimate(3.0)},
    ]}  # fmt: skip
    # Round 1 alone ranks dp last; the second round's times put it first, by the mean.
    round1 = [("dp", 2.6), ("fsdp", 2.0), ("megatron_1d", 3.0)]
    round2 = [("dp", 0.4), ("fsdp", 2.2), ("megatron_1d", 3.4)]
    mesh = {"dp": "dp=8,mp=1", "fsdp": "dp=8,mp=1", "megatron_1d": "dp=1,mp=8"}
    files = []
    for i, times in enumerate((round1, round2)):
        files.append(tmp_path / f"bench_{i + 1}.json")
        results = [{"rules": f"rules/{r}.yaml", "mesh": mesh[r], "step_s": t} for r, t in times]
        files[-1].write_text(json.dumps({"results": results}))
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    table = plan_check.rows(
        plan, {"results": [r for f in files for r in json.loads(f.read_text())["results"]]}
    )
    assert {r["rules"]: r["measured"] for r in table} == pytest.approx(
        {"dp": 1.5, "fsdp": 2.1, "megatron_1d": 3.2}
    )
    assert plan_check.spearman([1.0, 2.0, 3.0], [1.5, 2.1, 3.2]) == pytest.approx(1.0)
    out = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "plan_check.py"), str(tmp_path / "plan.json"), *map(str, files)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "| dp | dp=8,mp=1 | 1,000 (1,000 + 0 + 0) | 1,500 | -33% |" in out
    assert "the mean of 2 bench runs' medians" in out
    assert "3 points: Spearman 1.00" in out
    assert "the predicted best (dp dp=8,mp=1) measures 0% above the measured best (dp dp=8,mp=1)" in out
