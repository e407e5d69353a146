"""The TPU target of plan: the compile-only devices of a slice that is not attached, each chip's
HBM, peak FLOP/s and interconnect bandwidth, and the fit and step-time estimate drawn from them."""

from __future__ import annotations

import contextlib
import math
import os

from gspmd_tp import run_setup
from gspmd_tp.errors import UserError

# Per chip, from the Cloud TPU system-architecture pages (cloud.google.com/tpu/docs): HBM
# bytes, dense bf16 FLOP/s, and inter-chip interconnect (ICI) bandwidth in bytes/s
# (v4 2,400 Gbps, v5e 1,600 Gbps, v5p 4,800 Gbps, v6e 3,584 Gbps). Keys are jax device_kind.
TPU_CHIPS = {
    "TPU v4": {"hbm": 32 * 2**30, "flops": 275e12, "ici": 2400e9 / 8},
    "TPU v5 lite": {"hbm": 16 * 2**30, "flops": 197e12, "ici": 1600e9 / 8},
    "TPU v5": {"hbm": 95 * 10**9, "flops": 459e12, "ici": 4800e9 / 8},
    "TPU v6 lite": {"hbm": 32 * 2**30, "flops": 918e12, "ici": 3584e9 / 8},
}


def target_devices(target: str, slices: int = 1) -> list:
    """The compile-only devices of a TPU slice named like "tpu:v5p:4x4x4" (no TPU attached)."""
    platform, _, topology = target.partition(":")
    if platform != "tpu" or ":" not in topology:
        raise UserError(f"--target {target!r}: expected tpu:GENERATION:TOPOLOGY, e.g. tpu:v5p:4x4x4")
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
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"--target {target!r}: cannot describe this TPU topology ({first}); "
            f"is libtpu installed (pip install 'jax[tpu]==0.10.2')?"
        ) from None


@contextlib.contextmanager
def no_cache_writes():
    """While entered, nothing goes to JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR):
    it stores compile-only TPU executables but cannot load them, and warns on every later read."""
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


def estimate(s: run_setup.Setup, stats, bytes_per_device: float, target: str) -> dict:
    """HBM fit and a step-time estimate for a TPU target: compute = FLOPs / peak, communication =
    bytes / ICI bandwidth, added (no overlap assumed). An estimate, not a measurement."""
    from gspmd_tp.model import flops_per_token

    kind = s.mesh.devices.flat[0].device_kind
    chip = _chip(kind)
    topology = target.split(":")[2]
    chips = math.prod(int(d) for d in topology.split("x"))
    per_chip = max(1, round(s.mesh.size / chips / max(1, len({getattr(d, "slice_index", 0)
                                                              for d in s.mesh.devices.flat}))))  # fmt: skip
    # The TPU compiler's temp_size can read 0 where its peak does not (seen for small programs):
    # take the larger of the peak and arguments + temporaries + unaliased outputs.
    needed = max(
        getattr(stats, "peak_memory_in_bytes", 0),
        stats.argument_size_in_bytes + stats.temp_size_in_bytes
        + stats.output_size_in_bytes - stats.alias_size_in_bytes,
    )  # fmt: skip
    out = {"device_kind": kind, "devices_per_chip": per_chip, "hbm_needed": needed}
    if chip is None:
        return out
    hbm, flops, ici = chip["hbm"] / per_chip, chip["flops"] / per_chip, chip["ici"] / per_chip
    step_flops = flops_per_token(s.model_cfg, s.config.seq_len) * s.config.batch_size * s.config.seq_len
    compute_s = step_flops / s.mesh.size / flops
    comm_s = bytes_per_device / ici
    return {
        **out,
        "hbm_per_device": hbm,
        "fits": needed <= hbm,
        "compute_s": compute_s,
        "comm_s": comm_s,
        "step_s_estimate": compute_s + comm_s,
    }
