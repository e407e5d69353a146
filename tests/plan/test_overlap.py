"""config.overlap: the compiler options it passes, what they do to the TPU compiler's HLO (needs
libtpu), what the GPU compiler makes of them (needs the CUDA plugin), and what a CPU run is told."""

import importlib.util

import pytest
from conftest import small_config

from gspmd_tp.job.errors import UserError
from gspmd_tp.plan import hardware, planner
from gspmd_tp.sharding import hlo
from gspmd_tp.train import run_setup
from gspmd_tp.train import step as step_lib

TPU = "tpu:v5e:2x4"
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")


def _tpu_plan(tmp_path, rules: str, overlap: str) -> tuple[dict, list[hlo.Collective]]:
    """plan.plan of small_config(rules) on dp=2,mp=4 for a v5e slice, and the collectives of its HLO."""
    out = tmp_path / overlap
    p = planner.plan(small_config(rules=rules, mesh="dp=2,mp=4", overlap=overlap), str(out), target=TPU)
    (path,) = out.iterdir()
    return p, hlo.collectives(path.read_text(), 8)


@needs_libtpu
@pytest.mark.parametrize("rules", ["megatron_1d_sp", "megatron_2d"])
def test_collective_matmul_turns_tpu_gathers_and_scatters_into_loops_of_permutes(tmp_path, rules):
    base, _ = _tpu_plan(tmp_path, rules, "auto")
    p, found = _tpu_plan(tmp_path, rules, "collective_matmul")
    assert p["compiler_options"] == step_lib.OVERLAP_OPTIONS["collective_matmul"]["tpu"]
    assert base["compiler_options"] == {}
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
        "xla_tpu_enable_windowed_einsum_for_all_gather": False,
        "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
    }
    report = planner.format_plan(planner.plan(config, target=TPU, s=s))
    assert report.splitlines()[0].endswith("| overlap none")
    assert report.splitlines()[1] == (
        "compiler options (config.overlap=none): --xla_tpu_enable_windowed_einsum_for_all_gather=false "
        "--xla_tpu_enable_windowed_einsum_for_reduce_scatter=false"
    )


@pytest.mark.skipif(importlib.util.find_spec("jax_cuda13_plugin") is None, reason="needs the CUDA plugin")
def test_the_gpu_compiler_takes_the_windowed_einsum_flags():
    config = small_config(rules="megatron_1d_sp", mesh="dp=2,mp=4", overlap="collective_matmul")
    p = planner.plan(config, target="gpu:h100:8")  # an option it did not know would fail the compile
    assert p["compiler_options"] == {
        "xla_gpu_threshold_for_windowed_einsum_mib": 0,
        "xla_gpu_multi_streamed_windowed_einsum": True,
    }
    assert p["collectives"]["all-gather"]["count"] > 0


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
