"""host_devices: the device-count flag, and glibc malloc tuning left out where accelerators are."""

import ctypes
import os

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
