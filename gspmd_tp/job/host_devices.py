"""Simulated CPU devices, asked of jax by its option jax_num_cpu_devices: any time before jax's
backend starts (its first jax.devices() or computation), jax imported or not. Before jax is imported
the option is set through its variable, JAX_NUM_CPU_DEVICES, which jax reads as it is imported; so
no import here, and train.py and bench.py import jax only inside their job, under its stop signals.

A device count the caller chose (--xla_force_host_platform_device_count in XLA_FLAGS,
JAX_NUM_CPU_DEVICES, or the option set already) always wins; accelerators ignore the count.

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
_VARIABLE = "JAX_NUM_CPU_DEVICES"  # jax's default for jax_num_cpu_devices, read as jax is imported
# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
# Device nodes of accelerators whose buffers are not host memory; there the tuning is left out.
_ACCELERATOR_NODES = ("/dev/nvidia[0-9]*", "/dev/accel*", "/dev/vfio/[0-9]*", "/dev/kfd")


def request(count: int, tune: bool = True) -> None:
    """Asks jax for `count` host (CPU) devices unless a count is chosen already (`chosen_count`);
    with `tune` and count > 0, also `tune_malloc()`. Also `cpu_platform_where_alone()`. Call it
    before jax's backend starts: a backend started already keeps its devices (and a mesh that
    needs more names --config.host_device_count, in one line)."""
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
    """The CPU device count the caller chose, else None: XLA_FLAGS' --xla_force_host_platform_device_count,
    JAX_NUM_CPU_DEVICES, or (jax imported) jax_num_cpu_devices set in this process (by a request
    before this one, or the caller's jax.config.update)."""
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
    """On a Linux host without accelerator device nodes, sets JAX_PLATFORMS=cpu unless it is set;
    returns whether it set it.

    An installed libtpu (the test extra brings one, for plan --target) otherwise probes for a TPU
    at every start: a second lost and five lines of warnings on stderr, above a one-line error.
    """
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
    """On a host without accelerators, makes glibc's malloc keep and reuse freed memory: one arena
    (so no buffer is too big for its arena's heap), no mmap'd chunks, no trimming (-1: never).
    Call it before jax's backend starts: its threads, which pick their arenas, start then (importing
    jax starts none). The heap grows to its steady size over the first ~15 steps and stays there,
    about twice the untuned peak (bench_cpu dp=2,mp=4: 3.7 GB against 1.9 GB resident). Returns
    whether it was applied."""
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
    """The value of a --config.host_device_count=N argument, else `default`."""
    value = flag_from_argv(argv, "--config.host_device_count")
    # A value that is no integer is left to the flag parser, which names it in one line.
    return int(value) if value is not None and value.strip().lstrip("-").isdigit() else default
