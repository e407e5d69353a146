"""plan --target=gpu:...: XLA's GPU compiler run without a GPU (the CUDA plugin and cuDNN of the
gpu-plan extra, which the test extra installs), for H100s that are not attached."""

import copy
import functools
import re
import subprocess
import sys
import warnings

import jax
import pytest
from conftest import ROOT, activation_gathers, small_config, step_flops

from configs import llama_1b, tiny
from gspmd_tp.job.errors import UserError
from gspmd_tp.model.params import flops_per_token
from gspmd_tp.plan import hardware, planner
from gspmd_tp.sharding import hlo
from gspmd_tp.train import run_setup

H100 = hardware.GPU_CHIPS["h100"]


# Each test plans one of a few steps, shared through this cache (a GPU compile is most of a test's
# time): megatron_1d dp=2,mp=4 (float32 on four hosts of two, bfloat16 on one host), fsdp dp=2,mp=4
# in bfloat16 on one host, megatron_1d dp=2,mp=8 on two hosts of eight.
@functools.cache
def _planned(target, rules, mesh, **overrides):
    return planner.plan(small_config(rules=rules, mesh=mesh, **overrides), target=target)


def gpu_plan(target="gpu:h100:8", rules="megatron_1d", mesh="dp=2,mp=4", **overrides):
    """plan.plan of small_config on `target`, compiled once per test process; a copy per caller."""
    return copy.deepcopy(_planned(target, rules, mesh, **overrides))


BF16 = {"model.dtype": "bfloat16"}


@functools.cache
def _planned_twice():
    """gpu_plan's step on four hosts of two, then that step planned again with 800 Gb/s between the
    hosts: (first, second, the warnings of both). Planning the same step twice in one process is
    what would read a compile-only executable back from the persistent compilation cache."""
    before = jax.config.jax_persistent_cache_min_compile_time_secs  # restored for later tests
    # Every compile is worth caching (conftest sets the same through the environment, so a first plan
    # made earlier by another test was compiled under it too).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = gpu_plan("gpu:h100:4x2")
            config = small_config(rules="megatron_1d", mesh="dp=2,mp=4")
            second = planner.plan(config, target="gpu:h100:4x2", network_gbps=800)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)
    return first, second, [str(w.message)[:200] for w in caught]


def _wide_config():
    """configs/llama_1b.py (its widths, bf16, attention and mlp_grad auto, unrolled layers, remat) on
    two of its 16 layers, rules dp, at batch 224 x 2048: a step that needs between 75% and 95% of an
    H100, as the ~1B step docs/benchmarks.md times on one does (its two layers compile in a fraction
    of the time of its sixteen)."""
    c = llama_1b.get_config()
    c.rules, c.mesh = "dp", "dp=1,mp=1"
    c.model.num_layers, c.batch_size = 2, 224
    c.data.document_mask = False  # cuDNN's attention, as the benchmark ran: it cannot mask documents
    return c


@pytest.fixture(scope="module")
def wide_planned(tmp_path_factory):
    """_wide_config planned for one H100, with its HLO."""
    hlo_dir = tmp_path_factory.mktemp("hlo")
    p = planner.plan(_wide_config(), dump_hlo=str(hlo_dir), target="gpu:h100")
    (path,) = hlo_dir.iterdir()
    return p, path.read_text()


def test_the_1b_layers_compile_for_an_h100_with_cudnn_attention_and_the_fused_mlp_gradient(wide_planned):
    """auto attention follows the devices compiled for (cuDNN on a GPU in bf16), not the CPU host;
    mlp_grad auto is fused there, and XLA writes SwiGLU's output and its gate and up gradients in
    one kernel per layer: one fusion with three outputs of the hidden activation's shape."""
    p, text = wide_planned
    c = _wide_config()
    layers = c.model.num_layers
    assert p["backend"] == "gpu" and p["device_kind"] == H100["name"] and p["devices"] == 1
    assert len(re.findall(r"custom_call_target=\"__cudnn\$fmhaSoftmax\"", text)) == layers
    assert len(re.findall(r"custom_call_target=\"__cudnn\$fmhaSoftmaxBackward\"", text)) == layers
    hidden = f"bf16[{c.batch_size},{c.seq_len},{c.model.mlp_dim}]"
    entry = text[text.index("\nENTRY") :]
    three = [
        line
        for line in entry.splitlines()
        if f"= ({hidden}{{2,1,0}}, {hidden}" in line and " fusion(" in line
    ]
    assert len(three) == layers and all(line.count(hidden) == 3 for line in three), three[:2]


def test_a_step_fits_an_h100_only_with_a_larger_memory_share(wide_planned):
    """docs/benchmarks.md runs the ~1B step with XLA_PYTHON_CLIENT_MEM_FRACTION=0.95: a step that
    needs between 75% and 95% of the GPU does not fit under JAX's default 75%, and plan says so;
    under 95% it would."""
    p, _ = wide_planned
    e = p["estimate"]
    assert e["memory_fraction"] == 0.75 and e["hbm_per_device"] == 0.75 * H100["memory"] and not e["fits"]
    assert 0.75 * H100["memory"] < e["hbm_needed"] < 0.95 * H100["memory"]
    assert "DOES NOT FIT" in planner.format_plan(p)
    # The estimate at the data sheet's peak: the MFU a step of that length would be is 100%.
    assert e["compute_s"] == pytest.approx(step_flops(_wide_config()) / H100["flops"], rel=0.01)
    assert e["comm_s"] == 0 and e["link"] == "NVLink"
    # The whole ~1B model (its sixteen layers, one sequence): what MFU divides by is the products
    # its training program runs (conftest.step_flops counts them; scanned layers trace in a fraction
    # of the time and run the same products).
    c = llama_1b.get_config()
    c.batch_size, c.model.scan_layers = 1, True
    assert flops_per_token(run_setup.model_config(c), c.seq_len) * c.seq_len == pytest.approx(step_flops(c))


def test_megatron_1d_on_eight_gpus_all_reduces_as_analysed():
    """On four hosts of two: the hosts change which collectives cross the network (tested below),
    not the program nor its bytes."""
    p = gpu_plan("gpu:h100:4x2")
    assert p["backend"] == "gpu" and p["devices"] == 8 and p["device_kind"] == H100["name"]
    assert {k for k, v in p["collectives"].items() if v["count"]} == {"all-reduce"}
    assert p["ratio"] == pytest.approx(1.0, abs=0.02)


def test_2d_on_gpus_gathers_each_sublayer_output_gradient_once(tmp_path):
    """Under 2D sharding both products of a sublayer's backward pass read its output gradient
    gathered over mp; the GPU compiler gathers it once per product unless the model constrains it
    once (transformer._constrain_cotangent): one all-gather per sublayer and layer."""
    c = small_config(rules="megatron_2d", mesh="dp=2,mp=4", **BF16)
    planner.plan(c, dump_hlo=str(tmp_path), target="gpu:h100:8")
    (path,) = tmp_path.iterdir()
    found = hlo.collectives(path.read_text(), 8)
    activation = (c.batch_size // 2) * c.seq_len * c.model.d_model * 2  # bf16, whole width
    for sublayer in ("attn", "mlp"):
        where = f"transpose(jvp(Transformer))/while/body/closed_call/layers/{sublayer}/"
        assert activation_gathers(found, activation, where) == c.model.num_layers, sublayer


def test_on_one_host_every_collective_runs_at_nvlink_bandwidth():
    p = gpu_plan(**BF16)
    assert p["devices"] == 8 and p["network_bytes_per_device"] == 0
    e = p["estimate"]
    # The estimate, worked out here: the step's FLOPs shared by 8 GPUs at the data sheet's peak,
    # then every collective's bytes at NVLink's bandwidth (one host), added, less what the schedule hides.
    compute_s = step_flops(small_config(**BF16)) / 8 / H100["flops"]
    comm_s = p["bytes_per_device"] / H100["link"]
    assert e["fits"] and e["compute_s"] == pytest.approx(compute_s, rel=1e-6)
    assert e["comm_s"] == pytest.approx(comm_s, rel=1e-6) and comm_s > 0
    assert e["step_s_estimate"] == pytest.approx(compute_s + comm_s - e["comm_hidden_s"], rel=1e-6)
    assert e["comm_exposed_s"] == pytest.approx(comm_s - e["comm_hidden_s"]) and e["comm_hidden_s"] >= 0


def test_a_bf16_model_assembles_its_vocabulary_parallel_lookup_in_bf16():
    """The lookup's all-reduce moves as many bytes as the output projection's input-gradient
    all-reduce of the same (batch, length, embed) shape; looked up in float32 and cast after, it
    would move twice as many."""
    p = gpu_plan(**BF16)
    (lookup,) = [c for c in p["largest_collectives"] if c["op_name"].endswith("jit(_take)/gather")]
    input_gradient = "transpose(jvp(Transformer))/ble,ev->blv/dot_general"
    (gradient,) = [c for c in p["largest_collectives"] if c["op_name"].endswith(input_gradient)]
    assert lookup["ring_bytes_per_device"] == gradient["ring_bytes_per_device"] > 0


def test_fsdp_on_gpus_gathers_and_reduce_scatters_as_analysed():
    """The GPU compiler gathers each weight after its cast to the compute dtype, forward and
    backward, and reduce-scatters its gradient in that dtype. Its reduce-scatter-start returns its
    operands beside its results: counted whole, the ratio read 1.78 on the ~1B config. (fsdp shards
    over dp and mp together: dp=2,mp=4 is 8-way FSDP, the mesh compare plans it on below.)"""
    p = gpu_plan(rules="fsdp", mesh="dp=2,mp=4", **BF16)
    assert p["collectives"]["reduce-scatter"]["count"] > 0 and p["collectives"]["all-gather"]["count"] > 0
    assert p["ratio"] == pytest.approx(1.0, abs=0.01)


def test_fsdp_in_float32_reduce_scatters_in_bfloat16_when_asked():
    """optim.grad_reduce_dtype=bfloat16 under fsdp with float32 compute: the weights' gradients are
    made in bf16 where GSPMD reduce-scatters them, so the reduce-scatters move the bytes a bf16 model
    moves (half of float32's), as the analysis has it; the gathers stay float32."""
    p = gpu_plan(rules="fsdp", mesh="dp=2,mp=4", **{"optim.grad_reduce_dtype": "bfloat16"})
    bf16_model = gpu_plan(rules="fsdp", mesh="dp=2,mp=4", **BF16)
    scattered = p["bytes_per_device_by_type"]["reduce-scatter"]
    assert "bf16" in p["collectives"]["reduce-scatter"]["dtypes"]
    assert scattered == pytest.approx(bf16_model["bytes_per_device_by_type"]["reduce-scatter"], rel=0.01)
    assert scattered == pytest.approx(p["analytical"]["fsdp_reduce"], rel=0.01)
    assert p["collectives"]["all-gather"]["dtypes"][0] == "f32"
    assert p["ratio"] == pytest.approx(1.0, abs=0.01)


def test_across_two_hosts_only_the_data_parallel_reduction_crosses_the_network():
    """On two hosts of eight, dp=2,mp=8 keeps tensor parallelism inside each host (the mesh's last
    axis runs over a host's GPUs) and sends the gradients' all-reduce between the hosts: one GPU of
    each group per host, so it runs at one NIC's 400 Gb/s."""
    p = gpu_plan("gpu:h100:2x8", mesh="dp=2,mp=8")
    e, a = p["estimate"], p["analytical"]
    assert p["devices"] == 16 and e["fits"]
    assert p["network_bytes_per_device"] == pytest.approx(a["data_parallel"], rel=0.01)
    crossing = [c for c in p["largest_collectives"] if c["islands"] > 1]
    assert crossing and all(c["group_size"] == 2 and c["islands"] == 2 for c in crossing)
    network_s = p["network_bytes_per_device"] / H100["network"]
    link_s = (p["bytes_per_device"] - p["network_bytes_per_device"]) / H100["link"]
    compute_s = step_flops(small_config()) / 16 / H100["flops"]
    assert e["comm_network_s"] == pytest.approx(network_s) and e["comm_link_s"] == pytest.approx(link_s)
    hidden = e["comm_hidden_s"]
    assert e["step_s_estimate"] == pytest.approx(compute_s + link_s + network_s - hidden, rel=1e-6)
    report = planner.format_plan(p)
    assert "over the network between hosts at 400 Gb/s per GPU" in report
    assert "of which between GPU hosts" in report and "[across 2 hosts]" in report


def test_tensor_parallelism_across_hosts_runs_at_its_nics_per_host():
    """On four hosts of two, mp=4 spans two hosts with two GPUs of each group on each: its
    all-reduces go through two NICs per host (100 GB/s), dp's through one (50 GB/s). Twice as fast
    a network (--network_gbps=800) halves that time and changes no byte."""
    p, faster, _ = _planned_twice()
    e = p["estimate"]
    assert p["network_bytes_per_device"] == pytest.approx(p["bytes_per_device"])  # every group crosses
    tensor_parallel, data_parallel = p["analytical"]["tensor_parallel"], p["analytical"]["data_parallel"]
    expected = tensor_parallel / (2 * H100["network"]) + data_parallel / H100["network"]
    assert e["comm_network_s"] == pytest.approx(expected, rel=0.02) and e["comm_link_s"] == 0
    assert faster["estimate"]["comm_network_s"] == pytest.approx(e["comm_network_s"] / 2)
    assert faster["bytes_per_device"] == p["bytes_per_device"]


def test_compare_on_gpus_marks_the_best_estimate(monkeypatch):
    """compare sets up each rule file x mesh on the target's devices and plans it there; its plans
    are the ones planned above for the other tests (served from this module's cache, not compiled
    again)."""
    calls = []
    # Planned (or taken from the cache) before plan is replaced, whatever order the tests run in.
    plans = {r: gpu_plan("gpu:h100:8", r, "dp=2,mp=4", **BF16) for r in ("fsdp", "megatron_1d")}

    def planned(config, dump_hlo, target, slices, s, label, **_):
        calls.append((config.rules, config.mesh, target, s.mesh.devices.flat[0].device_kind, label))
        assert config.to_dict() == small_config(rules=config.rules, mesh=config.mesh, **BF16).to_dict()
        return {**plans[config.rules], "label": label}

    monkeypatch.setattr(planner, "plan", planned)
    results = planner.compare(small_config(**BF16), ["fsdp", "megatron_1d"], ["dp=2,mp=4"], "gpu:h100:8")
    assert calls == [
        ("fsdp", "dp=2,mp=4", "gpu:h100:8", H100["name"], "fsdp"),
        ("megatron_1d", "dp=2,mp=4", "gpu:h100:8", H100["name"], "megatron_1d"),
    ]
    table = planner.format_compare(results)
    assert "est. step" in table and table.count("<- best") == 1
    best = min(results, key=lambda r: r["estimate"]["step_s_estimate"])
    (marked,) = [line for line in table.splitlines() if line.endswith("<- best")]
    assert marked.startswith(best["label"] + " ")
    assert "of which net" not in table  # one host: nothing crosses a network


def test_compare_across_hosts_has_a_column_of_the_bytes_between_them():
    """The table of two plans planned above (format_compare reads the dicts compare returns)."""
    results = [gpu_plan("gpu:h100:2x8", mesh="dp=2,mp=8"), gpu_plan("gpu:h100:4x2", mesh="dp=2,mp=4")]
    table = planner.format_compare(results).splitlines()
    assert "of which net" in table[0] and all(r["network_bytes_per_device"] > 0 for r in results)
    for r, line in zip(results, table[1 : 1 + len(results)], strict=True):
        assert f"{r['network_bytes_per_device'] / 2**20:,.3f} MiB" in line


@pytest.mark.parametrize(
    "dtype, document_mask, expected",
    [("bfloat16", False, "cudnn"), ("float32", False, "einsum"), ("bfloat16", True, "einsum")],
)
def test_auto_attention_is_chosen_for_the_devices_compiled_for(dtype, document_mask, expected):
    # Under document masking cuDNN's path cannot keep packed documents apart: einsum on the GPU too.
    overrides = {"model.dtype": dtype, "model.attention": "auto", "data.document_mask": document_mask}
    devices = hardware.target_devices("gpu:h100:8")
    s = run_setup.setup(small_config(rules="megatron_1d", mesh="dp=2,mp=4", **overrides), devices)
    assert s.model_cfg.attention == expected
    assert run_setup.setup(small_config(**overrides)).model_cfg.attention == "einsum"  # on the CPU


def test_cudnn_attention_with_document_masking_is_refused_on_gpus_naming_what_to_use():
    c = small_config(rules="megatron_1d", mesh="dp=2,mp=4", **{"model.attention": "cudnn", **BF16})
    devices = hardware.target_devices("gpu:h100:8")
    with pytest.raises(
        UserError, match=r"^config\.model\.attention 'cudnn' cannot keep packed documents apart .*'auto'"
    ):
        run_setup.setup(c, devices)
    c.data.document_mask = False
    assert run_setup.setup(c, devices).model_cfg.attention == "cudnn"


@pytest.mark.parametrize(
    "target, message",
    [
        ("gpu:h900", r"unknown GPU 'h900'; known: h100, h200, a100"),
        ("gpu:h100:0", r"expected GPUS or HOSTSxGPUS after the kind, e.g. gpu:h100:2x8"),
        ("gpu:h100:2x", r"expected GPUS or HOSTSxGPUS"),
        ("gpu:h100:eight", r"expected GPUS or HOSTSxGPUS"),
    ],
)
def test_bad_gpu_target_is_one_line(target, message):
    with pytest.raises(UserError, match=rf"--target '{re.escape(target)}': {message}"):
        hardware.target_devices(target)


def test_slices_are_for_tpu_targets():
    with pytest.raises(UserError, match=r"--slices=2 is for TPU targets; a GPU target names its hosts"):
        hardware.target_devices("gpu:h100:8", slices=2)


@pytest.mark.parametrize("value", ["1.5", "0", "most"])
def test_a_bad_memory_fraction_is_refused_before_compiling(value, monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", value)
    with pytest.raises(
        UserError, match=rf"XLA_PYTHON_CLIENT_MEM_FRACTION='{value}': expected a number in \(0, 1\]"
    ):
        hardware.target_devices("gpu:h100:8")


def test_planning_for_gpus_twice_reads_nothing_stale_from_the_compilation_cache():
    *_, caught = _planned_twice()
    assert not [message for message in caught if "compilation cache" in message]


def test_plan_cli_for_gpus_prints_the_report():
    """Of megatron_1d_sp under config.overlap=collective_matmul (two layers): the GPU compiler takes
    the windowed einsum's options (one it did not know would fail the compile), the report names
    them, and sequence parallelism's gathers and scatters come out as analysed."""
    r = subprocess.run(
        [sys.executable, "-m", "gspmd_tp.plan", "--config=configs/tiny.py", "--target=gpu:h100:8",
         "--config.mesh=dp=2,mp=4", "--config.rules=megatron_1d_sp", "--config.overlap=collective_matmul",
         "--config.model.num_layers=2", "--config.batch_size=8", "--config.seq_len=32"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "target gpu:h100:8: 8 NVIDIA H100 80GB HBM3 devices | overlap collective_matmul" in r.stdout
    assert (
        "compiler options (config.overlap=collective_matmul): --xla_gpu_threshold_for_windowed_einsum_mib=0 "
        "--xla_gpu_multi_streamed_windowed_einsum=true"
    ) in r.stdout
    assert "JAX's 75% of the GPU" in r.stdout and "at NVLink bandwidth" in r.stdout
    assert "Traceback" not in r.stderr
    # "  all-gather (f32)   10 ...": a kind, its dtypes, its count
    counts = dict(re.findall(r"^  ([a-z-]+) \(f32[^)]*\) +(\d+) ", r.stdout, re.MULTILINE))
    assert int(counts["all-gather"]) > 0 and int(counts["reduce-scatter"]) > 0, r.stdout
    # Above the analysis: in the backward pass the gradient reaching the output projection's input,
    # split over mp on its length, is gathered whole once more: one float32 (batch 8 / dp 2, length
    # 32, embed) all-gather over mp=4 the analysis has no term for. The norm scales' and the loss's
    # reductions add under 0.5%. The windowed einsum changes no byte.
    (analytical,) = re.findall(r"^analytical bytes/device: ([\d.,]+) MiB", r.stdout, re.MULTILINE)
    gathered_again = 3 / 4 * (8 // 2) * 32 * tiny.get_config().model.d_model * 4
    (ratio,) = re.findall(r"^measured / analytical: (\S+)$", r.stdout, re.MULTILINE)
    assert float(ratio) == pytest.approx(
        1 + gathered_again / (float(analytical.replace(",", "")) * 2**20), abs=0.005
    )


def test_without_the_cuda_plugin_a_gpu_target_says_what_to_install(monkeypatch):
    from jax._src import lib

    monkeypatch.setattr(lib, "cuda_versions", None)
    with pytest.raises(UserError, match=r"needs JAX's CUDA plugin: pip install -e '\.\[gpu-plan\]'"):
        hardware.target_devices("gpu:h100:8")


def test_the_ragged_dispatch_compiles_for_gpus_over_the_expert_axis_within_5_percent():
    """A bfloat16 mixture of experts under expert_fsdp (data=2,expert=4) on one host of 8 H100s:
    model.moe_dispatch auto is ragged on a GPU. The step compiles, its ragged-all-to-alls run over
    the 4 devices of the expert axis, and the step's bytes are
    within 5% of the analysis. (The GPU compiler keeps 3 of the 4 exchanges a layer that the TPU
    compiler keeps, so their own bytes sit below the analysis's dispatch term.)"""
    overrides = {"model.num_experts": 8, "model.expert_mlp_dim": 32, "model.shared_experts": 1}
    overrides |= {**BF16, "model.d_model": 128, "model.moe_dispatch": "auto"}
    p = gpu_plan(rules="expert_fsdp", mesh="data=2,expert=4", **overrides)
    m = small_config(**overrides).model
    assert p["collectives"]["ragged-all-to-all"]["count"] >= 2 * m.num_layers
    ragged = [x for x in p["largest_collectives"] if x["kind"] == "ragged-all-to-all"]
    assert ragged and all(x["group_size"] == 4 for x in ragged)
    assert 0 < p["bytes_per_device_by_type"]["ragged-all-to-all"] <= p["analytical"]["expert_dispatch"]
    assert p["ratio"] == pytest.approx(1.0, abs=0.05), (p["bytes_per_device"], p["analytical"])
