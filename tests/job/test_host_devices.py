"""host_devices: the device-count flag, and glibc malloc tuning left out where accelerators are."""

import ctypes
import os
import subprocess
import sys

import pytest

from gspmd_tp.job import host_devices


def _glibc():
    try:
        return hasattr(ctypes.CDLL("libc.so.6"), "mallopt")
    except OSError:
        return False


def test_request_keeps_a_count_the_caller_set(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=3")
    host_devices.request(8, tune=False)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3"
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1")
    host_devices.request(8, tune=False)
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_foo=1 --xla_force_host_platform_device_count=8"


def test_malloc_tuning_is_left_out_on_accelerator_hosts(monkeypatch):
    seen = []
    monkeypatch.setattr(host_devices.glob, "glob", lambda p: seen.append(p) or ["/dev/nvidia0"])
    assert host_devices.tune_malloc() is False
    assert "/dev/nvidia[0-9]*" in seen


@pytest.mark.skipif(not _glibc(), reason="glibc only")
def test_malloc_tuning_applies_on_a_cpu_host(monkeypatch):
    monkeypatch.setattr(host_devices.glob, "glob", lambda p: [])
    calls = []
    real = ctypes.CDLL

    class Libc:
        def __init__(self, name):
            self._lib = real(name)

        def mallopt(self, param, value):
            calls.append((param, value))
            return self._lib.mallopt(param, value)

    monkeypatch.setattr(host_devices.ctypes, "CDLL", Libc)
    assert host_devices.tune_malloc() is True
    assert dict(calls) == {-8: 1, -4: 0, -1: -1}


def test_huge_pages_are_left_out_where_asked_for_already_or_on_accelerator_hosts(monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    assert host_devices.huge_pages_missing() is False
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setattr(host_devices.glob, "glob", lambda p: ["/dev/accel0"])
    assert host_devices.huge_pages_missing() is False


_SCRIPT = """
import os, sys
print("run", os.getpid(), os.environ.get("GLIBC_TUNABLES"), sys.argv[1:], flush=True)
from gspmd_tp.job import host_devices
host_devices.request(8, tune=True)
print("tuned", os.getpid(), os.environ.get("GLIBC_TUNABLES"), flush=True)
"""


@pytest.mark.skipif(not _glibc(), reason="glibc only")
def test_request_restarts_the_process_once_with_huge_pages(tmp_path, monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=7")  # a tunable the caller set stays
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    restarts = host_devices.huge_pages_missing()  # False where glibc is older than 2.35 or THP is off
    script = tmp_path / "s.py"
    script.write_text(_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), "--flag=1"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    runs = [line.split(" ", 3) for line in out if line.startswith("run")]
    (tuned,) = [line.split(" ") for line in out if line.startswith("tuned")]
    assert len(runs) == (2 if restarts else 1)
    assert {r[1] for r in runs} == {tuned[1]}  # the same process throughout
    assert all(r[3] == "['--flag=1']" for r in runs)
    want = "glibc.malloc.tcache_count=7" + (":glibc.malloc.hugetlb=1" if restarts else "")
    assert tuned[2] == want


_CTRL_C_SCRIPT = """
import os, signal, sys
print("run", signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []),
      signal.SIGINT in signal.sigpending(), flush=True)
from gspmd_tp.job.errors import exit_on_ctrl_c_while_importing
exit_on_ctrl_c_while_importing()
from gspmd_tp.job import host_devices
exec_for_real = os.execv
def execv(*args):  # Ctrl-C just as the process restarts
    os.kill(os.getpid(), signal.SIGINT)
    exec_for_real(*args)
os.execv = execv
host_devices.request(8, tune=True)
print("tuned", flush=True)
"""


@pytest.mark.skipif(not _glibc(), reason="glibc only")
def test_ctrl_c_during_the_restart_reaches_the_new_process_handler(tmp_path, monkeypatch):
    """A SIGINT between exec and the new process's handler killed it by the default action (status
    -2, no line): it is held blocked across the restart and delivered once the handler is in place."""
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    if not host_devices.huge_pages_missing():
        pytest.skip("no huge pages on this host: nothing restarts")
    script = tmp_path / "s.py"
    script.write_text(_CTRL_C_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    # The first run: Ctrl-C free; the second: Ctrl-C held blocked and pending, then handled.
    assert proc.stdout.splitlines() == ["run False False", "run True True"]
    assert proc.returncode == 130 and proc.stderr.splitlines() == ["stopped by Ctrl-C (nothing written)"]


def test_a_process_not_run_from_a_script_file_is_not_restarted(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    if not host_devices.huge_pages_missing():
        pytest.skip("no huge pages on this host: nothing would restart a script either")
    code = _SCRIPT.replace("sys.argv[1:]", "[]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.count("run ") == 1 and "tuned" in out and "hugetlb" not in out


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
