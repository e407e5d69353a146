"""Simulated CPU devices through jax's option jax_num_cpu_devices (before jax is imported, its
variable JAX_NUM_CPU_DEVICES), any time before the backend starts; a count the caller chose
(XLA_FLAGS, the variable, the option) wins. No jax import here: train.py and bench.py import jax
under their stop signals.

With simulated devices the step's temporaries are host memory: a buffer over 64 MiB from a worker
thread's arena is mmap'd and munmap'd at every step, its pages faulted in afresh; `tune_malloc`
keeps freed memory for reuse instead (measured: docs/benchmarks.md).
"""

import ctypes
import glob
import os
import sys

_FLAG = "xla_force_host_platform_device_count"
_VARIABLE = "JAX_NUM_CPU_DEVICES"  # jax's default for jax_num_cpu_devices, read as jax is imported
# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
# Device nodes of accelerators whose buffers are not host memory; there the tuning is left out.
_ACCELERATOR_NODES = ("/dev/nvidia[0-9]*", "/dev/accel*", "/dev/vfio/[0-9]*", "/dev/kfd")


def request(count: int, tune: bool = True) -> None:
    """Asks jax for `count` CPU devices unless a count is chosen already; with `tune`, also
    tune_malloc(); and cpu_platform_where_alone(). A backend started already keeps its devices."""
    jax = sys.modules.get("jax")  # imported by the caller, or not yet: then jax reads the variables
    if cpu_platform_where_alone() and jax:
        jax.config.update("jax_platforms", "cpu")
    if count > 0 and chosen_count() is None:
        if jax is None:
            os.environ[_VARIABLE] = str(count)
        else:
            try:
                jax.config.update("jax_num_cpu_devices", count)
            except RuntimeError:  # the backend started already (jax work in this process)
                pass
    if count > 0 and tune:
        tune_malloc()


def chosen_count() -> int | None:
    """The CPU device count the caller chose (XLA_FLAGS, which jax_num_cpu_devices would override;
    JAX_NUM_CPU_DEVICES; the option set in this process), else None."""
    for flag in os.environ.get("XLA_FLAGS", "").split():
        if flag.startswith(f"--{_FLAG}=") and flag.split("=", 1)[1].isdigit():
            return int(flag.split("=", 1)[1])
    if os.environ.get(_VARIABLE, "").isdigit():
        return int(os.environ[_VARIABLE])
    count = sys.modules["jax"].config.jax_num_cpu_devices if "jax" in sys.modules else -1
    return count if count >= 0 else None


def has_accelerator_nodes() -> bool:
    """Whether this host shows the device node of a GPU or TPU (Linux: /dev/nvidia0, /dev/accel0, ...)."""
    return any(glob.glob(pattern) for pattern in _ACCELERATOR_NODES)


def cpu_platform_where_alone() -> bool:
    """On a Linux host without accelerator device nodes, sets JAX_PLATFORMS=cpu unless set (an installed
    libtpu would probe for a TPU at every start, with five lines of warnings); whether it did."""
    if sys.platform.startswith("linux") and "JAX_PLATFORMS" not in os.environ and not has_accelerator_nodes():
        os.environ["JAX_PLATFORMS"] = "cpu"
        return True
    return False


def _cpu_only_glibc() -> ctypes.CDLL | None:
    """libc, where this host has no accelerator and libc is glibc; else None."""
    if has_accelerator_nodes():
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018 (glibc has it; musl and others do not)
    except (OSError, AttributeError):
        return None
    return libc


def tune_malloc() -> bool:
    """On a host without accelerators, before the backend's threads pick their arenas: glibc's malloc
    keeps freed memory (one arena, no mmap'd chunks, no trimming); whether it applied."""
    libc = _cpu_only_glibc()
    if libc is None:
        return False
    return all(
        libc.mallopt(param, value) == 1
        for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
    )
