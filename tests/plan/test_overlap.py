"""config.overlap: the compiler options it passes, what they do to the TPU compiler's HLO (needs
libtpu), and what a CPU run is told. (The GPU compiler's: test_plan_gpu's plan command.)"""

import importlib.util
import os
import re
import tempfile

import pytest
from conftest import small_config
from tpu_plans import COMPARED, OVERLAPS, compared
from tpu_plans import TARGET as TPU

from gspmd_tp.job.errors import UserError
from gspmd_tp.plan import hardware, planner
from gspmd_tp.sharding import hlo
from gspmd_tp.sharding.mesh import mesh_file_name
from gspmd_tp.train import run_setup
from gspmd_tp.train import step as step_lib

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")


@needs_libtpu
@pytest.mark.parametrize("rules", COMPARED)
def test_collective_matmul_turns_tpu_gathers_and_scatters_into_loops_of_permutes(rules):
    (base, p), files = compared(rules)
    found = hlo.collectives(files[f"{rules}_{mesh_file_name('dp=2,mp=4')}_collective_matmul.hlo.txt"], 8)
    tpu = step_lib.PLATFORM_OPTIONS["tpu"]
    assert p["compiler_options"] == {**tpu, **step_lib.OVERLAP_OPTIONS["collective_matmul"]["tpu"]}
    assert base["compiler_options"] == tpu
    # At this size the compiler's own choice decomposes nothing: every product's all-gather and
    # reduce-scatter is whole, and exposed.
    assert base["collectives"]["collective-permute"]["count"] <= 3
    count = lambda q, kind: q["collectives"][kind]["count"]  # noqa: E731
    # megatron_1d_sp: 10 all-gathers -> 1, 10 reduce-scatters -> 1; megatron_2d: 29 -> 22 (its
    # weights' gathers over dp stay), 12 -> 2.
    assert count(p, "all-gather") <= count(base, "all-gather") - 5
    assert count(p, "reduce-scatter") <= count(base, "reduce-scatter") / 2
    # The permutes run in loops (one step per shard of the mp axis), overlapped with the products.
    looped = [c for c in found if c.kind == "collective-permute" and c.executions > 1]
    assert len(looped) >= 4 and all(c.window for c in looped)
    assert count(p, "collective-permute") >= count(base, "collective-permute") + 16
    assert p["exposed_bytes_per_device"] < 0.5 * base["exposed_bytes_per_device"]
    assert p["hidden_bytes_per_device"] > 2 * base["hidden_bytes_per_device"]


@needs_libtpu
def test_overlap_none_reaches_the_tpu_compiler_and_is_shown_in_the_report():
    config = small_config(rules="megatron_1d_sp", mesh="dp=2,mp=4", overlap="none")
    s = run_setup.setup(config, hardware.target_devices(TPU))
    assert step_lib.compiler_options(s) == {
        "xla_tpu_relayout_group_size_threshold_for_reduce_scatter": 2,
        "xla_tpu_enable_windowed_einsum_for_all_gather": False,
        "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
    }
    report = planner.format_plan(planner.plan(config, target=TPU, s=s))
    assert report.splitlines()[0].endswith("| overlap none")
    assert report.splitlines()[1] == (
        "compiler options (config.overlap=none): "
        "--xla_tpu_relayout_group_size_threshold_for_reduce_scatter=2 "
        "--xla_tpu_enable_windowed_einsum_for_all_gather=false "
        "--xla_tpu_enable_windowed_einsum_for_reduce_scatter=false"
    )


def test_overlap_on_cpu_warns_in_one_line_and_passes_nothing(capsys):
    s = run_setup.setup(small_config(rules="megatron_1d_sp", mesh="dp=2,mp=4", overlap="collective_matmul"))
    warned = [line for line in capsys.readouterr().err.splitlines() if "config.overlap" in line]
    assert warned == [
        "warning: config.overlap=collective_matmul changes nothing on CPU devices: XLA:CPU has no "
        "collective matmul (python -m gspmd_tp.plan --target=tpu:... shows what it does on a TPU)"
    ]
    assert step_lib.compiler_options(s) == {}
    run_setup.setup(small_config(rules="megatron_1d_sp", mesh="dp=2,mp=4"))
    assert "config.overlap" not in capsys.readouterr().err


def test_an_unknown_overlap_is_an_error_naming_the_key():
    with pytest.raises(
        UserError, match=r"^config.overlap='windowed': expected one of auto, none, collective_matmul$"
    ):
        run_setup.setup(small_config(overlap="windowed"))


@needs_libtpu
def test_compare_over_two_overlaps_plans_both_and_names_the_choice_with_its_margin():
    """The compare the collective matmul test above reads, of megatron_1d_sp."""
    overlaps = OVERLAPS
    rows, files = compared("megatron_1d_sp")
    assert [r["overlap"] for r in rows] == overlaps
    tpu = step_lib.PLATFORM_OPTIONS["tpu"]
    assert [r["compiler_options"] for r in rows] == [
        tpu,
        {**tpu, **step_lib.OVERLAP_OPTIONS["collective_matmul"]["tpu"]},
    ]
    # One HLO file each, the overlap in its name.
    mesh = mesh_file_name("dp=2,mp=4")
    assert sorted(files) == [f"megatron_1d_sp_{mesh}_{o}.hlo.txt" for o in overlaps]
    head, *lines = planner.format_compare(rows).splitlines()
    assert head.split()[:4] == ["rules", "mesh", "overlap", "params+opt/dev"]
    assert [line.split()[:3] for line in lines[:2]] == [["megatron_1d_sp", "dp=2,mp=4", o] for o in overlaps]
    # The margin worked out here from the two estimates: the share of the slower one's step saved.
    best, other = sorted(rows, key=lambda r: r["estimate"]["step_s_estimate"])
    t_best, t_other = best["estimate"]["step_s_estimate"], other["estimate"]["step_s_estimate"]
    assert t_best < t_other
    margin = (t_other - t_best) / t_other * 100
    assert lines[-1] == (
        f"choice: megatron_1d_sp on dp=2,mp=4 with overlap {best['overlap']}: {t_best * 1e3:.2f} ms, "
        f"{margin:.1f}% faster than the runner-up (megatron_1d_sp on dp=2,mp=4, {other['overlap']}: "
        f"{t_other * 1e3:.2f} ms)"
    )
    (marked,) = [line for line in lines if line.endswith("<- best")]
    assert marked.split()[2] == best["overlap"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            dict(overlaps="auto,collective_matmul"),
            "--overlaps=auto,collective_matmul needs --target: XLA:CPU has no collective matmul, so on "
            "CPU devices every overlap compiles the same step (--target=tpu:... or gpu:... compares them)",
        ),
        (
            dict(overlaps="auto,windowed", target=TPU),
            "--overlaps=auto,windowed: 'windowed' is not one of auto, none, collective_matmul "
            "(comma-separated)",
        ),
        (
            dict(overlaps="none,auto,none", target=TPU),
            "--overlaps: overlap 'none' is given twice (each rule file x mesh x overlap is planned once)",
        ),
        (
            dict(compare_flag="", overlaps="none"),
            "--overlaps=none is for --compare; a single plan takes --config.overlap",
        ),
        (
            dict(compare_flag="", mlp_slices="1,2"),
            "--mlp_slices=1,2 is for --compare; a single plan takes --config.model.mlp_slices",
        ),
        (dict(mlp_slices="1,x"), "--mlp_slices=1,x: 'x' is not a count of 1 or more (comma-separated)"),
        (dict(mlp_slices="0,2"), "--mlp_slices=0,2: '0' is not a count of 1 or more (comma-separated)"),
        (
            dict(mlp_slices="2,1,2"),
            "--mlp_slices: 2 is given twice (each rule file x mesh x count is planned once)",
        ),
    ],
)
def test_overlaps_flag_mistakes_are_one_line_before_compiling(flags, message):
    given = dict(
        compare_flag="megatron_1d_sp", meshes="", chart_path="", dump_hlo=None, target=None, slices=1
    )
    with pytest.raises(UserError, match=f"^{re.escape(message)}$"):
        planner.check_flags(**{**given, "network": None, **flags})


def test_overlaps_flag_gives_its_values_and_defaults_to_the_config_s_own():
    given = dict(
        compare_flag="megatron_1d_sp", meshes="", chart_path="", dump_hlo=None, slices=1, network=None
    )
    assert planner.check_flags(**given, target=TPU, overlaps="none, collective_matmul") == (
        ["megatron_1d_sp"],
        ["none", "collective_matmul"],
        [],
    )
    assert planner.check_flags(**given, target=None, overlaps="collective_matmul")[1] == ["collective_matmul"]
    assert planner.check_flags(**given, target=None) == (["megatron_1d_sp"], [], [])
    assert planner.check_flags(**given, target=None, mlp_slices="1, 4,2")[2] == [1, 4, 2]


@needs_libtpu
def test_compare_over_mlp_slices_plans_each_count_and_names_the_choice():
    """--mlp_slices=1,2: megatron_2d on the TPU target with the MLP's weights gathered whole and in
    2 slices, a column for the count, an HLO file each, and the choice naming its count."""
    with tempfile.TemporaryDirectory() as hlo_dir:
        rows = planner.compare(
            small_config(rules="megatron_2d"),
            ["megatron_2d"],
            ["dp=2,mp=4"],
            TPU,
            dump_hlo=hlo_dir,
            mlp_slices=[1, 2],
        )
        files = sorted(os.listdir(hlo_dir))
    assert [r["mlp_slices"] for r in rows] == [1, 2]
    mesh = mesh_file_name("dp=2,mp=4")
    assert files == [f"megatron_2d_{mesh}_slices{k}.hlo.txt" for k in (1, 2)]
    head, *lines = planner.format_compare(rows).splitlines()
    assert head.split()[:4] == ["rules", "mesh", "mlp_slices", "params+opt/dev"]
    assert [line.split()[:3] for line in lines[:2]] == [["megatron_2d", "dp=2,mp=4", k] for k in ("1", "2")]
    best = min(rows, key=lambda r: r["estimate"]["step_s_estimate"])
    assert lines[-1].startswith(f"choice: megatron_2d on dp=2,mp=4 with mlp_slices={best['mlp_slices']}: ")
