"""Simulated CPU devices: requested through XLA_FLAGS, which only works before jax is imported.

No jax import here, so entry points can call this first. A device count the caller already put
in XLA_FLAGS always wins; accelerators ignore the flag.

With simulated devices the train step's temporaries live in host memory, allocated and freed by
glibc's malloc at every step. A buffer over 64 MiB requested from a worker thread's arena is
always mmap'd and munmap'd, so each step faults its pages in afresh; `tune_malloc` keeps freed
memory for reuse instead (docs/benchmarks.md).
"""

import ctypes
import glob
import os
import sys

_FLAG = "xla_force_host_platform_device_count"
# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
# Device nodes of accelerators whose buffers are not host memory; there the tuning is left out.
_ACCELERATOR_NODES = ("/dev/nvidia[0-9]*", "/dev/accel*", "/dev/vfio/[0-9]*", "/dev/kfd")


def request(count: int, tune: bool = True) -> None:
    """Asks XLA for `count` host (CPU) devices unless XLA_FLAGS already names a count; with `tune`
    and count > 0, also `tune_malloc()`. Also `cpu_platform_where_alone()`."""
    cpu_platform_where_alone()
    flags = os.environ.get("XLA_FLAGS", "")
    if count > 0 and _FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --{_FLAG}={count}".strip()
    if count > 0 and tune:
        tune_malloc()


def has_accelerator_nodes() -> bool:
    """Whether this host shows the device node of a GPU or TPU (Linux: /dev/nvidia0, /dev/accel0, ...)."""
    return any(glob.glob(pattern) for pattern in _ACCELERATOR_NODES)


def cpu_platform_where_alone() -> None:
    """On a Linux host without accelerator device nodes, sets JAX_PLATFORMS=cpu unless it is set.

    An installed libtpu (the test extra brings one, for plan --target) otherwise probes for a TPU
    at every start: a second lost and five lines of warnings on stderr, above a one-line error.
    """
    if sys.platform.startswith("linux") and "JAX_PLATFORMS" not in os.environ and not has_accelerator_nodes():
        os.environ["JAX_PLATFORMS"] = "cpu"


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
    """On a host without accelerators, makes glibc's malloc keep and reuse freed memory: one arena
    (so no buffer is too big for its arena's heap), no mmap'd chunks, no trimming (-1: never).
    Call it before jax is imported (its threads pick their arenas then). The heap grows to its
    steady size over the first ~15 steps and stays there, about twice the untuned peak (bench_cpu
    dp=2,mp=4: 3.7 GB against 1.9 GB resident). Returns whether it was applied."""
    libc = _cpu_only_glibc()
    if libc is None:
        return False
    return all(
        libc.mallopt(param, value) == 1
        for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))
    )


def flag_from_argv(argv: list[str], name: str) -> str | None:
    """The value of --name=VALUE or --name VALUE (absl's space form) in argv, the last one given as
    absl takes it, else None: for what must be known before the flags are parsed."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(f"{name}="):
            value = arg.split("=", 1)[1]
        elif arg == name and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def count_from_argv(argv: list[str], default: int) -> int:
    """The value of a --config.host_device_count=N argument, else `default` (read before parsing)."""
    value = flag_from_argv(argv, "--config.host_device_count")
    # A value that is no integer is left to the flag parser, which names it in one line.
    return int(value) if value is not None and value.strip().lstrip("-").isdigit() else default
