"""bench: times the real step and reports the documented fields (no speed asserted here)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import small_config, step_flops

from gspmd_tp.bench import benchmark
from gspmd_tp.job.errors import UserError
from gspmd_tp.sharding import hlo

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def quick_matmul_rate(monkeypatch):
    """benchmark.matmul_rate measured on 256 x 256 matrices, once, instead of 2048 x 2048 five times:
    run() measures each dtype before and after the steps (about 3 s a report on a busy 2-core host),
    and these reports need a measured rate, not an accurate one. bench.py's runs below measure at
    full size."""
    original = benchmark.matmul_rate
    monkeypatch.setattr(benchmark, "matmul_rate", lambda dtype: original(dtype, n=256, repeats=1))


def test_report_rows_profiles_and_phases(tmp_path, quick_matmul_rate):
    """A run of two meshes checks the report's documented fields, and one of the second mesh (its
    step compiled once for both), profiled and split into phases, the profile's groups and the phases.

    The three phases are timed apart from the report's steps, so they check one another: the
    forward pass alone is shorter than forward and backward together, the split step takes about
    as long as the steps timed without it (a phase timed before its device work ended would read
    a hundredth of it), and the roofline fractions divide FLOPs counted here from the model's
    parameters (a third forward, two thirds backward). The phases run on the state the profiled
    step hands on (it donates its own)."""
    c = small_config()
    report = benchmark.run(c, ["megatron_1d"], ["dp=2,mp=4", "dp=4,mp=2"], 2, 1)
    # The profile and the phases: on the second mesh, whose step is compiled (cached) already.
    split = benchmark.run(c, ["megatron_1d"], ["dp=4,mp=2"], 3, 1, profile_dir=str(tmp_path), phases=True)
    assert set(report["matmul_flops_per_sec"]) == {"float32", "bfloat16"}
    assert (report["processes"], report["hosts"]) == (1, 1)
    assert [r["mesh"] for r in report["results"]] == ["dp=2,mp=4", "dp=4,mp=2"]
    roof = max(report["matmul_flops_per_sec"].values())
    flops = step_flops(c)
    for r in report["results"]:
        # The documented fields.
        assert {"rules", "mesh", "tokens_per_sec", "step_s", "compile_s", "mfu", "roofline_fraction"} <= set(
            r
        ), r
        assert r["step_s_min"] <= r["step_s"] <= r["step_s_max"], r
        assert r["mfu"] is None  # no published peak for a CPU
        assert abs(r["roofline_fraction"] - r["model_flops_per_sec"] / roof) < 1e-9, r
        assert r["collective_bytes_per_device"] > 0, r
        assert r["network_bytes_per_device"] == 0  # one host
        # CPU time over wall time of the timed steps: the step runs on this machine's cores.
        assert 0 < r["host_cpu_busy_cores"] <= len(os.sched_getaffinity(0)) * 1.05, r
    assert r["profile"] is None and "forward_s" not in r  # neither asked for
    [r] = split["results"]
    roof = max(split["matmul_flops_per_sec"].values())
    table = benchmark.format_table(split)
    # The profile: the step's time split into hlo.GROUPS.
    profile = r["profile"]
    assert set(profile) == set(hlo.GROUPS), profile
    assert sum(g["share"] for g in profile.values()) == pytest.approx(1.0)
    # megatron_1d all-reduces every layer's activations; every step multiplies matrices.
    assert profile["matrix products"]["share"] > 0 and profile["collectives"]["share"] > 0, profile
    # The traced step's own wall time is reported beside the shares (the profiler slows it).
    traced = r["profiled_step_s"]
    assert traced > 0
    assert f"{traced * 1e3:.1f}" in table.split("share of the profiled")[1], (traced, table)
    # The phases.
    assert 0 < r["forward_s"] < r["gradient_s"] and r["backward_s"] > 0, r
    assert r["step_s"] / 3 < r["phase_step_s"] < 3 * r["step_s"], (r["phase_step_s"], r["step_s"])
    assert r["forward_roofline_fraction"] == pytest.approx(flops / 3 / r["forward_s"] / roof, rel=1e-6)
    assert r["backward_roofline_fraction"] == pytest.approx(2 * flops / 3 / r["backward_s"] / roof, rel=1e-6)
    assert "share of the profiled step's device time" in table
    assert "the step split" in table


def test_profiles_stay_under_profile_dir_whatever_path_names_the_rule_file(monkeypatch, tmp_path):
    # An absolute rule path must not take the trace out of --profile_dir (os.path.join would drop
    # profile_dir), and two rule files of one name must not share a trace directory.
    other = tmp_path / "elsewhere" / "megatron_1d.yaml"
    other.parent.mkdir()
    other.write_text((ROOT / "rules" / "megatron_1d.yaml").read_text())
    traced = []

    def fake_bench_one(config, s, steps, warmup, profile_dir="", phases=False, host_of_process=(0,)):
        traced.append(profile_dir)
        return {"model_flops_per_sec": 1.0}

    monkeypatch.setattr(benchmark, "matmul_rate", lambda *a: 1.0)
    monkeypatch.setattr(benchmark, "bench_one", fake_bench_one)
    monkeypatch.chdir(ROOT)  # for the relative rule path
    profiles = tmp_path / "profiles"
    rules = ["megatron_1d", str(other), "rules/megatron_2d.yaml"]
    benchmark.run(small_config(), rules, ["dp=2,mp=4"], 1, 0, profile_dir=str(profiles))
    assert traced == [
        str(profiles / "megatron_1d_dp2_mp4"),
        str(profiles / "megatron_1d_2_dp2_mp4"),
        str(profiles / "megatron_2d_dp2_mp4"),
    ]


def test_classify_goes_by_what_a_fusion_computes():
    text = """HloModule m
%fused_dot (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  %dot.1 = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %exp.1 = f32[4,4]{1,0} exponential(%dot.1)
}
ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %copy_fusion = f32[4,4]{1,0} fusion(%a), kind=kLoop, calls=%fused_dot
  %all-reduce.3 = f32[4,4]{1,0} all-reduce(%copy_fusion), replica_groups={}, to_apply=%add
  %broadcast.2 = f32[4,4]{1,0} broadcast(%all-reduce.3), dimensions={0,1}
  ROOT %transpose.1 = f32[4,4]{0,1} transpose(%broadcast.2), dimensions={1,0}
}
"""
    groups = hlo.classify(text)
    assert groups["copy_fusion"] == "matrix products"  # a dot inside, whatever the name says
    assert groups["all-reduce.3"] == "collectives"
    assert groups["broadcast.2"] == "broadcasts"
    assert groups["transpose.1"] == "copies, transposes"
    assert groups["exp.1"] == "other elementwise"


def test_a_step_that_cannot_fit_is_one_line_before_any_state_is_made(monkeypatch):
    from gspmd_tp.train import run_setup, state

    monkeypatch.setattr(run_setup, "_host_memory", lambda: 2**20)
    monkeypatch.setattr(state, "init_state", lambda *a, **k: pytest.fail("the state was made"))
    with pytest.raises(
        UserError, match=r"the compiled train step needs 8 CPU devices x .* more than this host"
    ):
        benchmark.run(small_config(), ["megatron_1d"], ["dp=2,mp=4"], steps=1, warmup=0)


def test_steps_are_waited_for_only_once_the_next_is_queued(monkeypatch):
    """Timing like training: step i+1 is dispatched before step i is waited for, and every step's
    time runs from the end of the one before, so the times add up to the whole."""
    events = []

    class Output:
        def __init__(self, name):
            self.name = name

        def block_until_ready(self):
            events.append(f"wait {self.name}")
            return self

    def step(state, batch):
        i = len([e for e in events if e.startswith("step")])
        events.append(f"step {i}")
        return Output(f"state {i}"), Output(f"stats {i}")

    monkeypatch.setattr(benchmark.jax, "block_until_ready", lambda x: x.block_until_ready())
    times = []
    t0 = benchmark.time.perf_counter()
    benchmark._time_steps(step, None, None, 3, times)
    wall = benchmark.time.perf_counter() - t0
    assert events == ["step 0", "step 1", "wait stats 0", "step 2", "wait stats 1", "wait state 2"]
    assert len(times) == 3 and all(t >= 0 for t in times) and sum(times) <= wall


def test_parse_variants():
    assert benchmark.parse_variants("model.remat=none;model.attention_block=128,model.dtype=bfloat16") == [
        {"model.remat": "none"},
        {"model.attention_block": "128", "model.dtype": "bfloat16"},
    ]
    # A list value keeps its commas: an item with no "=" continues the value before it.
    assert benchmark.parse_variants(
        "model.remat_save=attn_in,mlp_in,model.remat=full;model.remat_save=key"
    ) == [
        {"model.remat_save": "attn_in,mlp_in", "model.remat": "full"},
        {"model.remat_save": "key"},
    ]
    with pytest.raises(UserError, match="'model.remat' in 'model.remat' is not KEY=VALUE"):
        benchmark.parse_variants("model.remat")
    with pytest.raises(UserError, match=r"--variants: mesh is chosen by --meshes, not by a variant"):
        benchmark.parse_variants("model.remat=none;mesh=dp=8,mp=1")
    with pytest.raises(UserError, match=r"--variants: rules is chosen by --rules"):
        benchmark.parse_variants("rules=fsdp")


def test_variants_are_timed_against_the_configured_step(quick_matmul_rate):
    # Another seed: the configured step's program, so one compile (cached) for both rows.
    variants = [{"seed": "1"}]
    report = benchmark.run(
        small_config(), ["megatron_1d"], ["dp=4,mp=2"], 1, 1, variants=variants, rounds=2, round_steps=1
    )
    rows = report["results"]
    assert [r["variant"] for r in rows] == ["(as configured)", "seed=1"]
    assert rows[0]["change"] == 0.0
    roof = max(report["matmul_flops_per_sec"].values())
    for r in rows:
        assert r["mesh"] == "dp=4,mp=2" and r["step_s_min"] <= r["step_s"] <= r["step_s_max"]
        assert r["change"] == pytest.approx(r["step_s"] / rows[0]["step_s"] - 1)
        assert r["roofline_fraction"] == pytest.approx(r["model_flops_per_sec"] / roof)
    table = benchmark.format_table(report)
    assert "change" in table and "seed=1" in table


@pytest.mark.parametrize(
    "variant, message",
    [
        ({"model.remat_policy": "none"}, "has no key 'model.remat_policy'"),
        ({"model.attention_block": "many"}, "expected int"),
        ({"model.remat": "sometimes"}, "remat"),
    ],
)
def test_a_bad_variant_stops_the_comparison_before_anything_compiles(monkeypatch, variant, message):
    monkeypatch.setattr(benchmark, "matmul_rate", lambda *a: pytest.fail("measured before checking"))
    monkeypatch.setattr(benchmark, "_compiled", lambda *a: pytest.fail("compiled before checking"))
    with pytest.raises(UserError, match=message) as info:
        benchmark.run(small_config(), ["megatron_1d"], ["dp=4,mp=2"], 1, 0, variants=[variant])
    assert str(info.value).startswith("--variants: ")


def test_variants_refuse_profiles_and_phases():
    with pytest.raises(UserError, match="--variants"):
        benchmark.run(small_config(), ["megatron_1d"], ["dp=4,mp=2"], 1, 0, phases=True, variants=[{}])


def test_alternate_times_the_rule_files_x_meshes_in_rounds(monkeypatch, quick_matmul_rate):
    """--alternate: every point compiled, then all timed round by round (each round a step of every
    point, in order), each row as one timed alone would be, with every round's steps."""
    timed = []
    original = benchmark._time_steps

    def time_steps(step, state, batch, n, times):
        timed.append((step, n))
        return original(step, state, batch, n, times)

    monkeypatch.setattr(benchmark, "_time_steps", time_steps)
    report = benchmark.run(
        small_config(),
        ["megatron_1d", "fsdp"],
        ["dp=4,mp=2"],
        1,
        0,
        rounds=3,
        round_steps=2,
        alternate_points=True,
    )
    rows = report["results"]
    assert [(r["rules"], r["mesh"]) for r in rows] == [("megatron_1d", "dp=4,mp=2"), ("fsdp", "dp=4,mp=2")]
    assert report["timing"] == {"rounds": 3, "round_steps": 2}
    first, second = timed[0][0], timed[1][0]
    assert first is not second and timed == [(first, 2), (second, 2)] * 3
    for r in rows:
        assert r["step_s_min"] <= r["step_s"] <= r["step_s_max"] and r["collective_bytes_per_device"] > 0, r
        assert 0 < r["host_cpu_busy_cores"] <= len(os.sched_getaffinity(0)) * 1.05, r
        assert np.isfinite(r["loss"]) and "variant" not in r and r["profile"] is None
    table = benchmark.format_table(report)
    assert "timed in 3 alternating rounds of 2 steps" in table and "compile s" in table


def test_alternate_refuses_points_whose_states_do_not_fit_together_before_making_any(monkeypatch):
    """Each point fits alone, the two states together with the larger step's work do not: one line
    before any state is made."""
    from gspmd_tp.train import run_setup, state
    from gspmd_tp.train import step as step_lib

    c = small_config(rules="dp")
    need = []
    for mesh in ("dp=8,mp=1", "dp=4,mp=2"):
        c.mesh = mesh
        m = step_lib.compile_train_step(run_setup.setup(c)).memory_analysis()
        args = 8 * m.argument_size_in_bytes
        need.append(
            (args, args + 8 * (m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes))
        )
    alone, together = max(n for _, n in need), sum(a for a, _ in need) + max(n - a for a, n in need)
    assert alone < together
    monkeypatch.setattr(run_setup, "_host_memory", lambda: (alone + together) // 2)
    monkeypatch.setattr(state, "init_state", lambda *a, **k: pytest.fail("a state was made"))
    monkeypatch.setattr(benchmark, "matmul_rate", lambda *a: 1.0)
    with pytest.raises(
        UserError, match=r"^the compiled set of 2 train steps held at once needs 8 CPU devices x"
    ):
        benchmark.run(c, ["dp"], ["dp=8,mp=1", "dp=4,mp=2"], 1, 0, alternate_points=True)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"variants": [{"seed": "1"}]}, "--alternate times rule files x meshes against one another"),
        ({"phases": True}, "--alternate times whole steps against each other"),
        ({"rounds": 0}, "--rounds=0 and --round_steps=3 must both be at least 1"),
    ],
)
def test_alternate_mistakes_stop_before_anything_compiles(monkeypatch, kwargs, message):
    monkeypatch.setattr(benchmark, "matmul_rate", lambda *a: pytest.fail("measured before checking"))
    monkeypatch.setattr(benchmark, "_compile", lambda *a: pytest.fail("compiled before checking"))
    with pytest.raises(UserError, match=message):
        benchmark.run(small_config(), ["megatron_1d"], ["dp=4,mp=2"], 1, 0, alternate_points=True, **kwargs)


@pytest.mark.parametrize(
    "meshes, steps, warmup, message",
    [
        (["dp=4,mp=2", "dp=3,mp=1"], 1, 0, "mesh 'dp=3,mp=1' has 3 devices but 8 are available"),
        (["dp=4,mp=2"], 0, 0, "--steps=0 must be at least 1"),
        (["dp=4,mp=2"], 1, -1, "--warmup=-1 must be at least 0"),
    ],
)
def test_bad_input_stops_the_benchmark_before_anything_is_measured(
    monkeypatch, meshes, steps, warmup, message
):
    # A bad last mesh must not end the run after the first has been compiled and timed.
    monkeypatch.setattr(benchmark, "matmul_rate", lambda *a: pytest.fail("measured before checking"))
    monkeypatch.setattr(benchmark, "_compiled", lambda *a: pytest.fail("compiled before checking"))
    with pytest.raises(UserError, match=message):
        benchmark.run(small_config(), ["megatron_1d"], meshes, steps, warmup)


@pytest.mark.parametrize(
    "rules, meshes, message",
    [
        (["megatron_1d"], ["dp=8,mp=1", "dp=8,mp=1"], r"^--meshes: mesh 'dp=8,mp=1' is given twice \("),
        (
            ["megatron_1d"],
            ["dp=8,mp=1", "mp=1, dp=-1"],
            r"^--meshes: mesh 'mp=1, dp=-1' is 'dp=8,mp=1' again",
        ),
        (
            ["megatron_1d", "dp", "megatron_1d"],
            ["dp=8,mp=1"],
            r"^--rules: rule file 'megatron_1d' is given twice",
        ),
        (
            ["megatron_1d", str(ROOT / "rules" / "megatron_1d.yaml")],
            ["dp=8,mp=1"],
            r"^--rules: rule file '/.*/rules/megatron_1d.yaml' is 'megatron_1d' again",
        ),
    ],
)
def test_a_rule_file_or_mesh_given_twice_is_an_error_before_anything_is_measured(
    monkeypatch, rules, meshes, message
):
    # Timed twice, the two rows would carry the same rules and mesh and nothing to tell them apart.
    monkeypatch.setattr(benchmark, "matmul_rate", lambda *a: pytest.fail("measured before checking"))
    monkeypatch.setattr(benchmark, "_compiled", lambda *a: pytest.fail("compiled before checking"))
    with pytest.raises(UserError, match=message):
        benchmark.run(small_config(), rules, meshes, 1, 0)


def _row(**extra):
    """A report row as bench_one makes it, with made-up figures."""
    return {
        "rules": "megatron_1d", "mesh": "dp=2,mp=4", "tokens_per_sec": 2000.0, "step_s": 2.0,
        "step_s_min": 1.9, "step_s_max": 2.1, "compile_s": 3.0, "model_flops_per_sec": 1e10, "mfu": None,
        "roofline_fraction": 0.5, "memory_per_device": {"arguments": 3 * 2**20, "temporaries": 70 * 2**20},
        "collective_bytes_per_device": 5 * 2**20, "host_cpu_busy_cores": 1.5, "loss": 9.0, "profile": None,
        "profiled_step_s": None, **extra,
    }  # fmt: skip


def test_table_shows_the_per_device_memory():
    report = {"devices": 8, "device_kind": "cpu", "matmul_flops_per_sec": {}, "results": [_row()]}
    head, row = benchmark.format_table(report).splitlines()[-2:]
    for name in ("step ms", "compile s", "args MiB", "temp MiB", "comm MiB", "cpu busy"):
        head = head.replace(name, name.replace(" ", "_"))
    columns = dict(zip(head.split(), row.split(), strict=True))
    assert columns["args_MiB"] == "3.00" and columns["temp_MiB"] == "70.00"
    assert columns["comm_MiB"] == "5.00" and columns["MFU"] == "n/a"


def test_table_of_a_job_on_several_hosts_shows_the_bytes_between_them():
    report = {
        "devices": 16, "device_kind": "cpu", "processes": 4, "hosts": 2,
        "matmul_flops_per_sec": {"float32": 4e11},
        "results": [_row(network_bytes_per_device=2**20)],
    }  # fmt: skip
    lines = benchmark.format_table(report).splitlines()
    assert lines[0] == "16 cpu devices in 4 processes on 2 hosts (the timings are process 0's)"
    assert (
        lines[1] == "jit matmul 2048^3 float32: 400.0 GFLOP/s on each of 2 hosts (the roofline: all of them)"
    )
    head, row = (line.replace(" MiB", "_MiB") for line in lines[-2:])
    columns = dict(zip(head.replace("step ms", "step_ms").replace("compile s", "compile_s").replace(
        "cpu busy", "cpu_busy").split(), row.split(), strict=True))  # fmt: skip
    assert columns["comm_MiB"] == "5.00" and columns["net_MiB"] == "1.00"
    # One process: no such column.
    one = {**report, "processes": 1, "hosts": 1, "results": [_row(network_bytes_per_device=0)]}
    assert "net MiB" not in benchmark.format_table(one)


def test_table_columns_stay_under_their_headings_with_a_rule_file_path():
    rows = [_row(rules="/home/me/sharding/mlp_over_both_axes.yaml", mesh="data=2,model=4"), _row()]
    report = {"devices": 8, "device_kind": "cpu", "matmul_flops_per_sec": {}, "results": rows}
    head, *table = benchmark.format_table(report).splitlines()[-3:]
    end = head.index("tokens/s") + len("tokens/s")
    for line in table:  # each figure ends where its heading does
        assert line[:end].endswith("2,000"), line


def _strict_json(text: str) -> dict:
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


# bench.py run as a user runs it, once for each argv in the JSON list argv[1], each run in a process
# of its own: forked from this one, which has imported what bench.py imports (jax too, its backend
# not started), so a run costs what bench.py does and not the ~3 CPU-s of starting Python and
# importing jax again. benchmark.matmul_rate measures as quick_matmul_rate does (bench.py's
# measure at full size: ~15 CPU-s a report). Prints [[exit status, stdout, stderr], ...] as JSON.
BENCH_RUNS = """
import json, os, runpy, sys, tempfile, traceback
import absl.app, jax, ml_collections
from gspmd_tp.bench import benchmark
original = benchmark.matmul_rate
benchmark.matmul_rate = lambda dtype: original(dtype, n=256, repeats=1)
results = []
for argv in json.loads(sys.argv[1]):
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        code = 0
        try:
            sys.argv = ["bench.py", *argv]
            runpy.run_path("bench.py", run_name="__main__")
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    texts = []
    for f in (out, err):
        f.seek(0)
        texts.append(f.read().decode("utf-8", "replace"))
    results.append([os.waitstatus_to_exitcode(status), *texts])
print(json.dumps(results))
"""


def bench_runs(*argvs: list[str]) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of `python bench.py --config=configs/bench_cpu.py ARGV...` for
    each argv, each a process of its own (BENCH_RUNS)."""
    argvs = [["--config=configs/bench_cpu.py", *argv] for argv in argvs]
    run = subprocess.run(
        [sys.executable, "-c", BENCH_RUNS, json.dumps(argvs)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return [tuple(r) for r in json.loads(run.stdout)]


def test_cli_mistakes_are_one_line_errors_and_the_json_is_strict_when_the_loss_is_not_finite(tmp_path):
    """Each mistake is its own bench.py run: exit status 1, its last stderr line the error, nothing
    measured. A space after a comma in --rules was part of the next name (`rule file ' megatron_1d'
    not found`), where plan --compare strips it. As root os.access says /proc is writable: the file
    write, or the profiler, used to fail with a traceback after every step had been timed.

    In the same process of runs (one start of Python for all), bench.py --json prints the report
    and --json_out writes it. One run checks both on a diverged step, whose loss was written NaN,
    which JSON parsers other than Python's refuse (a run with a finite loss took another 8 s of
    the suite for the same two outputs)."""
    blocker = tmp_path / "results"
    blocker.write_text("a file where the report's directory would go")
    cases = [
        (
            ["--variants=model.remat=none;model.nope=1"],
            "error: --variants: --config.model.nope: the run's config has no key 'model.nope'",
        ),
        (
            ["--rules=megatron_1d, nosuch"],
            "error: rule file 'nosuch' not found (shipped rule files: ",
        ),
        (
            ["--rules=megatron_1d,,dp"],
            "error: --rules=megatron_1d,,dp: an empty rule file name (comma-separated names)",
        ),
        (
            [f"--json_out={blocker}/bench.json"],
            f"error: --json_out={blocker}/bench.json: {blocker} is a file, not a directory",
        ),
    ]
    if os.geteuid() == 0:  # os.access already refuses /proc to a user other than root
        small = ["--config.model.num_layers=1", "--config.seq_len=64", "--config.batch_size=8", "--steps=1"]
        cases += [
            ([*small, "--warmup=0", flag], message)
            for flag, message in [
                ("--json_out=/proc/bench.json", "error: --json_out=/proc/bench.json: cannot write it ("),
                # Its directory does not exist yet: probed in /proc, where it would be created.
                (
                    "--json_out=/proc/gspmd_tp_none/b.json",
                    "error: --json_out=/proc/gspmd_tp_none/b.json: cannot write it (",
                ),
                (
                    "--profile_dir=/proc/bench_profile",
                    "error: --profile_dir=/proc/bench_profile: cannot write there (",
                ),
            ]
        ]
    exact = {cases[0][1], cases[3][1]}  # the whole line; the others start so
    json_out = tmp_path / "bench.json"
    diverged = ["--config.model.num_layers=1", "--config.seq_len=64", "--config.batch_size=8",
         "--config.model.vocab_size=256", "--config.model.d_model=64", "--config.model.mlp_dim=128",
         "--config.optim.lr=1e30", "--config.optim.warmup_steps=1", "--config.optim.clip_norm=0",
         "--steps=1", "--warmup=3", "--json", f"--json_out={json_out}"]  # fmt: skip
    *results, (code, stdout, stderr) = bench_runs(*(argv for argv, _ in cases), diverged)
    assert code == 0, stderr[-2000:]
    for text in (stdout, json_out.read_text()):
        row = _strict_json(text)["results"][0]
        assert row["rules"] == "megatron_1d"  # bench_cpu.py's rule file
        assert row["loss"] is None and row["mfu"] is None and row["tokens_per_sec"] > 0
    for (argv, message), (code, out, err) in zip(cases, results, strict=True):
        assert code == 1, (argv, code, err[-2000:])
        last = err.strip().splitlines()[-1]
        assert last == message if message in exact else last.startswith(message), (argv, err[-2000:])
        assert "matmul" not in out + err and not out.strip(), (argv, out, err[-2000:])  # nothing timed


def test_steps_held_at_once_on_cpu_need_the_working_memory_of_each(monkeypatch):
    """--alternate on simulated CPU devices: two steps that each fit the host alone, but not both
    working sets together, are refused in one line (the tuned heap keeps both); without the second
    step they fit."""
    import types

    from gspmd_tp.sharding import mesh as mesh_lib
    from gspmd_tp.train import run_setup

    work = 2**30
    stats = types.SimpleNamespace(
        argument_size_in_bytes=0, output_size_in_bytes=0, temp_size_in_bytes=work, alias_size_in_bytes=0
    )
    setup = types.SimpleNamespace(mesh=mesh_lib.make_mesh("dp=2,mp=4", ["dp", "mp"]))
    held = [types.SimpleNamespace(step=types.SimpleNamespace(memory_analysis=lambda: stats), setup=setup)] * 2
    monkeypatch.setattr(run_setup, "_host_memory", lambda: int(8 * 1.5 * work))  # 8 devices x 1.5 steps
    benchmark._check_held_memory(held[:1])
    with pytest.raises(
        UserError, match=r"the compiled set of 2 train steps held at once needs 8 CPU devices x 2\.0 GiB"
    ):
        benchmark._check_held_memory(held)
