"""Simulated CPU devices: requested through XLA_FLAGS, which only works before jax is imported.

No jax import here, so entry points can call this first. A device count the caller already put
in XLA_FLAGS always wins; accelerators ignore the flag.

With simulated devices the train step's temporaries live in host memory, allocated and freed by
glibc's malloc at every step. A buffer over 64 MiB requested from a worker thread's arena is
always mmap'd and munmap'd, so each step faults its pages in afresh (docs/benchmarks.md).
`tune_malloc` keeps freed memory for reuse instead, and `use_huge_pages` has glibc back that heap
with transparent huge pages: the step's arrays are tens of MiB, and with 4 KiB pages its
memory-bound loops miss the TLB.
"""

import ctypes
import glob
import os
import signal
import sys

_FLAG = "xla_force_host_platform_device_count"
# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
# Device nodes of accelerators whose buffers are not host memory; there the tuning is left out.
_ACCELERATOR_NODES = ("/dev/nvidia[0-9]*", "/dev/accel*", "/dev/vfio/[0-9]*", "/dev/kfd")
# glibc >= 2.35 reads this tunable at process start only: malloc then madvises its heap MADV_HUGEPAGE.
_HUGE_PAGES = "glibc.malloc.hugetlb=1"
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
# Set across use_huge_pages' restart, while Ctrl-C is held blocked through it (release_ctrl_c).
_CTRL_C_HELD = "GSPMD_TP_CTRL_C_HELD"


def request(count: int, tune: bool = True) -> None:
    """Asks XLA for `count` host (CPU) devices unless XLA_FLAGS already names a count; with
    `tune` and count > 0, also `use_huge_pages()` (which may restart the process) and `tune_malloc()`.
    Also `cpu_platform_where_alone()`, and `release_ctrl_c()` after a restart."""
    release_ctrl_c()
    cpu_platform_where_alone()
    if count > 0 and tune:
        use_huge_pages()
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


def huge_pages_missing() -> bool:
    """True where glibc's malloc could back its heap with transparent huge pages but was not told to:
    a CPU-only host, glibc >= 2.35, THP not switched off, and no glibc.malloc.hugetlb tunable yet."""
    libc = _cpu_only_glibc()
    if libc is None or "glibc.malloc.hugetlb" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    version = tuple(int(x) for x in libc.gnu_get_libc_version().decode().split(".")[:2])
    try:
        with open(_THP_MODE) as f:
            thp_off = "[never]" in f.read()
    except OSError:
        thp_off = True
    return version >= (2, 35) and not thp_off


def use_huge_pages() -> None:
    """Where `huge_pages_missing()`, runs this same command again (same pid, arguments and
    interpreter options) with the glibc tunable set, since glibc reads it only at process start.
    Call it first thing: nothing before it survives but the environment. A process that is not a
    script run from a file (a notebook, an interactive or `-c` session, stdin) is left as it is."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if not main or not os.path.isfile(main) or sys.flags.interactive or not huge_pages_missing():
        return
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    os.environ["GLIBC_TUNABLES"] = f"{tunables}:{_HUGE_PAGES}" if tunables else _HUGE_PAGES
    sys.stdout.flush()
    sys.stderr.flush()
    # Between exec and the new process's own Ctrl-C handler a SIGINT would kill it by the default
    # action, without a word: it is held blocked instead (the mask and a pending signal survive
    # exec) until request() releases it in the new process, where the handler is in place.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    os.environ[_CTRL_C_HELD] = "1"
    try:
        os.execv(sys.executable, sys.orig_argv)
    except OSError:
        release_ctrl_c()
        raise


def release_ctrl_c() -> None:
    """Unblocks the Ctrl-C that use_huge_pages held blocked across its restart (a pending one is
    then delivered to the handler now in place); nothing where this process was not restarted."""
    if os.environ.pop(_CTRL_C_HELD, None):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


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
