"""Simulated CPU devices: requested through XLA_FLAGS, which only works before jax is imported.

No jax import here, so entry points can call this first. A device count the caller already put
in XLA_FLAGS always wins; accelerators ignore the flag.

With simulated devices the train step's temporaries live in host memory, allocated and freed by
glibc's malloc at every step. A buffer over 64 MiB requested from a worker thread's arena is
always mmap'd and munmap'd, so each step faults its pages in afresh (2-10% of the CPU time in the
kernel, BENCHMARKS.md). `tune_malloc` keeps freed memory for reuse instead.
"""

import ctypes
import glob
import os

_FLAG = "xla_force_host_platform_device_count"
# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
# Device nodes of accelerators whose buffers are not host memory; there the tuning is left out.
_ACCELERATOR_NODES = ("/dev/nvidia[0-9]*", "/dev/accel*", "/dev/vfio/[0-9]*", "/dev/kfd")


def request(count: int, tune: bool = True) -> None:
    """Asks XLA for `count` host (CPU) devices unless XLA_FLAGS already names a count; with
    `tune` and count > 0, also `tune_malloc()`."""
    flags = os.environ.get("XLA_FLAGS", "")
    if count > 0 and _FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --{_FLAG}={count}".strip()
    if count > 0 and tune:
        tune_malloc()


def tune_malloc() -> bool:
    """On a host without accelerators, makes glibc's malloc keep and reuse freed memory: one arena
    (so no buffer is too big for its arena's heap), no mmap'd chunks, no trimming (-1: never).
    Call it before jax is imported (its threads pick their arenas then). The heap grows to its
    steady size over the first ~15 steps and stays there, about twice the untuned peak (bench_cpu
    dp=2,mp=4: 3.7 GB against 1.9 GB resident). Returns whether it was applied."""
    if any(glob.glob(pattern) for pattern in _ACCELERATOR_NODES):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return all(
        mallopt(param, value) == 1
        for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
    )


def count_from_argv(argv: list[str], default: int) -> int:
    """The value of a --config.host_device_count=N argument, else `default` (read before parsing)."""
    for arg in argv:
        if arg.startswith("--config.host_device_count="):
            return int(arg.split("=", 1)[1])
    return default
