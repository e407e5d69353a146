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


def test_the_count_chosen_is_read_from_xla_flags_then_from_jax(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1 --xla_force_host_platform_device_count=3")
    assert host_devices.chosen_count() == 3
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1")
    assert host_devices.chosen_count() is None  # conftest chose its count through XLA_FLAGS alone


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
