"""plan's targets: the compile-only devices of a TPU slice or of GPUs that are not attached, each
chip's memory, peak FLOP/s and interconnect bandwidth, and the fit and step-time estimate drawn
from them."""

from __future__ import annotations

import contextlib
import math
import os

from gspmd_tp.job.errors import UserError
from gspmd_tp.plan import calibration
from gspmd_tp.sharding import hlo, hlo_cost
from gspmd_tp.train import run_setup

# Per chip, from the Cloud TPU system-architecture pages (cloud.google.com/tpu/docs): HBM
# bytes, dense bf16 FLOP/s, and inter-chip interconnect (ICI) bandwidth in bytes/s
# (v4 2,400 Gbps, v5e 1,600 Gbps, v5p 4,800 Gbps, v6e 3,584 Gbps). Keys are jax device_kind.
# Data-center network (DCN) bandwidth per chip where those pages give it: v5p 50 Gbps per chip,
# v5e two 100 Gbps NICs per host of 8 chips; for v4 and v6e plan's --network_gbps supplies it.
TPU_CHIPS = {
    "TPU v4": {"hbm": 32 * 2**30, "flops": 275e12, "ici": 2400e9 / 8},
    "TPU v5 lite": {"hbm": 16 * 2**30, "flops": 197e12, "ici": 1600e9 / 8, "network": 200e9 / 8 / 8},
    "TPU v5": {"hbm": 95 * 10**9, "flops": 459e12, "ici": 4800e9 / 8, "network": 50e9 / 8},
    "TPU v6 lite": {"hbm": 32 * 2**30, "flops": 918e12, "ici": 3584e9 / 8},
}


# Per GPU (the SXM parts), from NVIDIA's data sheets: memory as the device reports it, dense bf16
# FLOP/s, NVLink bandwidth each way in bytes/s, the network between hosts (a DGX/HGX system's one
# NIC per GPU: 400 Gb/s ConnectX-7 with H100 and H200, 200 Gb/s HDR with A100; plan's
# --network_gbps for another cluster), and what the compiler tunes its kernels for:
# streaming multiprocessors, their FP32 lanes, boost clock, memory bandwidth, L2 cache, compute
# capability and shared memory per multiprocessor (and per block, opted in).
GPU_CHIPS = {
    "h100": {"name": "NVIDIA H100 80GB HBM3", "memory": 84_929_347_584, "flops": 989e12, "link": 450e9,
             "network": 400e9 / 8, "sms": 132, "lanes": 128, "clock_ghz": 1.98, "memory_bandwidth": 3.35e12,
             "l2": 50 * 2**20, "capability": (9, 0), "smem": 233_472, "smem_optin": 232_448},
    "h200": {"name": "NVIDIA H200", "memory": 150_754_820_096, "flops": 989e12, "link": 450e9,
             "network": 400e9 / 8, "sms": 132, "lanes": 128, "clock_ghz": 1.98, "memory_bandwidth": 4.8e12,
             "l2": 50 * 2**20, "capability": (9, 0), "smem": 233_472, "smem_optin": 232_448},
    "a100": {"name": "NVIDIA A100-SXM4-80GB", "memory": 85_899_345_920, "flops": 312e12, "link": 300e9,
             "network": 200e9 / 8, "sms": 108, "lanes": 64, "clock_ghz": 1.41, "memory_bandwidth": 2.039e12,
             "l2": 40 * 2**20, "capability": (8, 0), "smem": 167_936, "smem_optin": 166_912},
}  # fmt: skip
GPU_PLAN_EXTRA = "pip install -e '.[gpu-plan]'"
# JAX's allocator takes this share of a GPU's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise.
JAX_GPU_MEMORY_FRACTION = 0.75


def target_devices(target: str, slices: int = 1) -> list:
    """The compile-only devices of a TPU slice named like "tpu:v5p:4x4x4", or of GPUs named like
    "gpu:h100:8" (one host of 8) or "gpu:h100:2x8" (two hosts of 8); nothing attached."""
    platform, _, topology = target.partition(":")
    if platform == "gpu":
        if slices > 1:
            raise UserError(
                f"--slices={slices} is for TPU targets; a GPU target names its hosts: gpu:h100:2x8"
            )
        return _gpu_devices(target, topology)
    if platform != "tpu" or ":" not in topology:
        raise UserError(
            f"--target {target!r}: expected tpu:GENERATION:TOPOLOGY (tpu:v5p:4x4x4) or gpu:KIND[:HOSTSxGPUS] "
            f"(gpu:h100:8, gpu:h100:2x8)"
        )
    # Compile-only use needs no exclusive hold on a TPU: without this a second process planning
    # at the same time fails on libtpu's lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # Nor workers to find: unset, libtpu asks a metadata server that is not there and prints an
    # INVALID_ARGUMENT error with a source trace that reads like a failure.
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # Nor a host to ask what it is: unset, libtpu prints a "could not determine TPU accelerator
    # type" warning. The type named changes nothing in the compiled step.
    accelerator = _accelerator_type(topology)
    if accelerator:
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator)
    from jax.experimental import topologies

    try:
        kwargs = {"num_slices": slices} if slices > 1 else {}
        return list(topologies.get_topology_desc(topology_name=topology, platform="tpu", **kwargs).devices)
    except Exception as e:  # libtpu missing, or a topology it does not know
        raise UserError(
            f"--target {target!r}: cannot describe this TPU topology ({_first_line(e)}); "
            f"is libtpu installed (pip install 'jax[tpu]==0.10.2')?"
        ) from None


def _gpu_devices(target: str, spec: str) -> list:
    """gpu:KIND[:[HOSTSx]GPUS] -> the CUDA plugin's compile-only devices for that many GPUs."""
    kind, _, count = spec.partition(":")
    chip = GPU_CHIPS.get(kind)
    if chip is None:
        raise UserError(f"--target {target!r}: unknown GPU {kind!r}; known: {', '.join(GPU_CHIPS)}")
    hosts, _, per_host = count.rpartition("x") if count else ("", "", "1")
    try:
        hosts, per_host = int(hosts or 1), int(per_host)
    except ValueError:
        hosts = per_host = 0
    if hosts < 1 or per_host < 1:
        raise UserError(
            f"--target {target!r}: expected GPUS or HOSTSxGPUS after the kind, e.g. gpu:{kind}:2x8"
        )
    _memory_fraction()  # a bad XLA_PYTHON_CLIENT_MEM_FRACTION fails here, before anything compiles
    from jax.experimental import topologies

    target_config = _gpu_target_config(chip, *_cuda_versions())
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=target_config, topology=f"1x{hosts}x{per_host}"
        )
    except Exception as e:  # a topology the CUDA plugin cannot describe
        raise UserError(
            f"--target {target!r}: cannot describe these GPUs ({_first_line(e)}); "
            f"is the CUDA plugin installed ({GPU_PLAN_EXTRA})?"
        ) from None
    return list(topology.devices)


def _first_line(e: Exception) -> str:
    """An exception's first line, or its type's name where it says nothing."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _cuda_versions() -> tuple[int, int]:
    """(CUDA runtime, cuDNN) versions as integers (13000, 92801) from the installed CUDA plugin;
    cuDNN's own library builds the fused attention when the step compiles."""
    from jax._src.lib import cuda_versions

    if cuda_versions is None:
        raise UserError(f"plan for a GPU target needs JAX's CUDA plugin: {GPU_PLAN_EXTRA}")
    try:
        return cuda_versions.cuda_runtime_build_version(), cuda_versions.cudnn_get_version()
    except Exception:  # the plugin's cuDNN lookup fails where the library is missing
        raise UserError(f"plan for a GPU target needs cuDNN (nvidia-cudnn-cu13): {GPU_PLAN_EXTRA}") from None


def _gpu_target_config(chip: dict, runtime: int, cudnn: int) -> str:
    """XLA's GpuTargetConfig (text proto) for `chip`: what a GPU compile reads from a device."""
    major, minor = chip["capability"]
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {chip["smem"]}
  threads_per_core_limit: 2048
  core_count: {chip["sms"]}
  fpus_per_core: {chip["lanes"]}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(chip["memory_bandwidth"])}
  l2_cache_size: {chip["l2"]}
  clock_rate_ghz: {chip["clock_ghz"]}
  device_memory_size: {chip["memory"]}
  shared_memory_per_block_optin: {chip["smem_optin"]}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {cudnn // 10000} minor: {cudnn // 100 % 100} patch: {cudnn % 100} }}
runtime_version {{ major: {runtime // 1000} minor: {runtime // 10 % 100} }}
device_description_str: "{chip["name"]}"
"""


@contextlib.contextmanager
def no_cache_writes():
    """While entered, nothing goes to JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR):
    it stores compile-only executables but cannot load them, and warns on every later read."""
    import jax

    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def _accelerator_type(topology: str) -> str | None:
    """Cloud TPU's name for a slice ("v5e:2x4" -> "v5litepod-8"; v4 and v5p count TensorCores,
    two per chip); None for a generation or topology not known here."""
    generation, _, shape = topology.partition(":")
    try:
        chips = math.prod(int(d) for d in shape.split("x"))
    except ValueError:
        return None
    name = {"v4": ("v4", 2), "v5e": ("v5litepod", 1), "v5p": ("v5p", 2), "v6e": ("v6e", 1)}.get(generation)
    return f"{name[0]}-{chips * name[1]}" if name else None


def _chip(device_kind: str) -> dict | None:
    return next((v for k, v in sorted(TPU_CHIPS.items(), key=lambda kv: -len(kv[0]))
                 if device_kind.startswith(k)), None)  # fmt: skip


def estimate(
    s: run_setup.Setup, stats, found: list, target: str, network_gbps: float | None = None, text: str = ""
) -> dict:
    """Memory fit and a step-time estimate for a TPU or GPU target from the chip table: compute =
    FLOPs / peak, communication = each collective's ring bytes / the bandwidth it runs at, less
    what the compute the schedule places between its start and its done (the compiled step's
    `text`, its products at peak) can hide: compute + exposed communication. A collective
    inside one island (a TPU slice, a GPU host) runs at the interconnect's bandwidth (ICI,
    NVLink); one whose groups span islands at the network's (DCN, the hosts' NICs), times the
    fewest devices its group has in one island (each device's share goes through its own NIC, as
    NCCL's rings and the TPU's hierarchical reductions do), at most the interconnect's.
    `network_gbps` (per chip or GPU) overrides the table. On GPUs the memory is JAX's share
    (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 unset). An estimate, not a measurement."""
    from gspmd_tp.model.params import flops_per_token

    kind = s.mesh.devices.flat[0].device_kind
    # The TPU compiler's temp_size can read 0 where its peak does not (seen for small programs):
    # take the larger of the peak and arguments + temporaries + unaliased outputs.
    needed = max(
        getattr(stats, "peak_memory_in_bytes", 0),
        stats.argument_size_in_bytes + stats.temp_size_in_bytes
        + stats.output_size_in_bytes - stats.alias_size_in_bytes,
    )  # fmt: skip
    if target.startswith("gpu:"):
        chip = GPU_CHIPS[target.split(":")[1]]
        fraction = _memory_fraction()
        out = {"device_kind": kind, "devices_per_chip": 1, "hbm_needed": needed, "memory_fraction": fraction}
        out.update(link="NVLink", network="network between hosts")
        memory, flops, link, network = chip["memory"] * fraction, chip["flops"], chip["link"], chip["network"]
        per_chip = 1
    else:
        chip = _chip(kind)
        topology = target.split(":")[2]
        chips = math.prod(int(d) for d in topology.split("x"))
        slices = max(1, len({getattr(d, "slice_index", 0) for d in s.mesh.devices.flat}))
        per_chip = max(1, round(s.mesh.size / chips / slices))
        out = {"device_kind": kind, "devices_per_chip": per_chip, "hbm_needed": needed}
        out.update(link="ICI", network="DCN")
        if chip is None:
            return out
        memory, flops, link = chip["hbm"] / per_chip, chip["flops"] / per_chip, chip["ici"] / per_chip
        network = chip.get("network", 0) / per_chip or None
    if network_gbps is not None:
        network = network_gbps * 1e9 / 8 / per_chip
    out.update(hbm_per_device=memory, fits=needed <= memory)
    near = sum(c.ring_bytes_per_call for c in found if c.islands <= 1)
    far = [c for c in found if c.islands > 1 and c.ring_bytes]
    out.update(network_bytes_per_device=hlo.network_bytes(found))
    if far and network is None:
        return out  # no bandwidth for the bytes between islands: the fit alone
    step_flops = flops_per_token(s.model_cfg, s.config.seq_len) * s.config.batch_size * s.config.seq_len
    compute_s = step_flops / s.mesh.size / flops
    link_s = near / link
    network_s = sum(c.ring_bytes_per_call / min(link, c.per_island * network) for c in far)

    def comm_seconds(c) -> float:  # one execution
        return c.ring_bytes / (min(link, c.per_island * network) if c.islands > 1 else link)

    memory_bandwidth = chip.get("memory_bandwidth")  # GPUs'; the TPU table has none: products alone
    per = hlo_cost.Costs(text).seconds(
        lambda f, b: f / flops + (b / memory_bandwidth if memory_bandwidth else 0.0)
    )[1] if text else {}  # fmt: skip
    comm = calibration.exposed(found, comm_seconds, per)
    return {
        **out,
        "source": "chip table (no calibration)",
        "network_bandwidth": network,
        "compute_s": compute_s,
        "comm_link_s": link_s,
        "comm_network_s": network_s,
        **comm,
        "step_s_estimate": compute_s + comm["comm_exposed_s"],
    }


def _memory_fraction() -> float:
    """The share of a GPU's memory JAX's allocator takes: XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.75."""
    value = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if value is None:
        return JAX_GPU_MEMORY_FRACTION
    try:
        fraction = float(value)
    except ValueError:
        fraction = 0.0
    if not 0 < fraction <= 1:
        raise UserError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={value!r}: expected a number in (0, 1]")
    return fraction
