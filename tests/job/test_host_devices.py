"""host_devices: the device count asked of jax (the caller's wins), and glibc malloc tuning left out
where accelerators are."""

import ctypes
import os
import subprocess
import sys

import pytest
from conftest import child_env

from gspmd_tp.job import host_devices


def _glibc():
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallopt")
    except OSError:
        return False


# Each in a fresh process (a backend starts once): the devices jax gives after host_devices.request(4),
# asked for before jax is imported (as train.py does), once it is imported (as the tools do: plan
# imports jax at its top), or once it has started.
_REQUEST = """
from gspmd_tp.job import host_devices
{before}
host_devices.request(4, tune=False)
import jax
print(jax.device_count(), jax.devices()[0].platform)
"""


@pytest.mark.parametrize(
    "env, before, devices",
    [
        ({}, "", 4),
        ({}, "import jax", 4),
        ({"XLA_FLAGS": "--xla_force_host_platform_device_count=3"}, "import jax", 3),  # the caller's count
        ({"XLA_FLAGS": "--xla_force_host_platform_device_count=3"}, "", 3),
        ({"JAX_NUM_CPU_DEVICES": "5"}, "", 5),
        ({}, "import jax; jax.config.update('jax_num_cpu_devices', 2)", 2),  # set in the process before
        ({}, "import jax; jax.devices()", 1),  # the backend started already: its one device stays, no error
    ],
)
def test_a_request_gives_the_devices_before_or_after_jax_is_imported_unless_a_count_was_chosen(
    env, before, devices
):
    result = subprocess.run(
        [sys.executable, "-c", _REQUEST.format(before=before)],
        env=child_env(JAX_PLATFORMS="cpu", **env), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [str(devices), "cpu"]


def test_malloc_tuning_is_left_out_on_accelerator_hosts(monkeypatch):
    seen = []
    monkeypatch.setattr(host_devices.glob, "glob", lambda p: seen.append(p) or ["/dev/nvidia0"])
    assert host_devices.tune_malloc() is False
    assert "/dev/nvidia[0-9]*" in seen


# In a fresh process, tuned or not: a 256 MiB block malloc'd and freed, and what glibc's mallinfo2
# says of it against before. Untuned, glibc serves a block that large with mmap (one more mmap'd
# region while it lives) and gives it back on free; tuned, it comes from the heap, which keeps it.
_MALLOC_PROBE = """
import ctypes, sys
from gspmd_tp.job import host_devices

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
applied = host_devices.tune_malloc() if sys.argv[1] == "tuned" else False
before = libc.mallinfo2()
block = libc.malloc(256 << 20)
ctypes.memset(block, 1, 256 << 20)
mmapped = libc.mallinfo2().hblks - before.hblks
libc.free(block)
print(applied, mmapped, (libc.mallinfo2().arena - before.arena) >> 20)
"""


@pytest.mark.skipif(not _glibc() or not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"), reason="glibc 2.33+")
@pytest.mark.parametrize("mode", ["untuned", "tuned"])
def test_malloc_tuning_keeps_large_blocks_in_the_heap(mode):
    """What the tuning is for, seen in glibc's own accounting: a block over the mmap threshold comes
    from the heap and stays there once freed, instead of being mmap'd and unmapped each time."""
    if host_devices._cpu_only_glibc() is None:
        pytest.skip("an accelerator host: the tuning is left out")
    out = subprocess.run(
        [sys.executable, "-c", _MALLOC_PROBE, mode],
        env=child_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    applied, mmapped, heap_mib = out[0] == "True", int(out[1]), int(out[2])  # heap_mib: what it kept
    if mode == "untuned":
        assert (applied, mmapped) == (False, 1) and heap_mib < 256
    else:
        assert (applied, mmapped) == (True, 0) and heap_mib >= 256


def test_jax_platforms_is_cpu_only_where_nothing_else_could_run(monkeypatch):
    monkeypatch.setattr(host_devices.sys, "platform", "linux")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(host_devices.glob, "glob", lambda p: ["/dev/accel0"] if "accel" in p else [])
    host_devices.cpu_platform_where_alone()
    assert "JAX_PLATFORMS" not in os.environ  # a TPU host: jax picks the TPU
    monkeypatch.setattr(host_devices.glob, "glob", lambda p: [])
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    host_devices.cpu_platform_where_alone()
    assert os.environ["JAX_PLATFORMS"] == "cuda"  # the caller's choice stays
    monkeypatch.delenv("JAX_PLATFORMS")
    host_devices.cpu_platform_where_alone()
    assert os.environ["JAX_PLATFORMS"] == "cpu"
