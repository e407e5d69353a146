"""Mesh strings: parsing, -1 filling, every parse error, and meshes in the rule file's axis order."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from gspmd_tp.job.errors import UserError
from gspmd_tp.sharding.mesh import DeviceCountError, make_mesh, mesh_string, parse_mesh


@pytest.mark.parametrize(
    "spec, devices, sizes",
    [
        ("dp=2,mp=4", 8, {"dp": 2, "mp": 4}),
        ("dp=-1,mp=4", 8, {"dp": 2, "mp": 4}),
        ("dp=2,mp=-1", 8, {"dp": 2, "mp": 4}),
        (" dp = -1 , mp = 1 ", 8, {"dp": 8, "mp": 1}),
        ("fsdp=2,dp=-1,mp=2", 16, {"fsdp": 2, "dp": 4, "mp": 2}),
        ("mp=-1", 1, {"mp": 1}),
    ],
)
def test_parse_mesh(spec, devices, sizes):
    got = parse_mesh(spec, devices)
    assert got == sizes
    assert list(got) == list(sizes)  # the spec's order is kept


@pytest.mark.parametrize(
    "spec, message",
    [
        ("dp=-1,mp=-1", r"only one axis may be -1, got \['dp', 'mp'\]"),
        ("dp=2,mp=2", r"has 4 devices but 8 are available"),
        ("dp=16", r"has 16 devices but 8 are available"),
        ("dp=-1,mp=3", r"8 devices are not divisible by the fixed axes \(3\)"),
        ("dp=2,mp", r"expected NAME=SIZE items separated by commas, got 'mp'"),
        ("dp=8,", r"expected NAME=SIZE items separated by commas, got ''"),
        ("dp=2 mp=4", r"expected NAME=SIZE items separated by commas, got 'dp=2 mp=4'"),
        ("=8", r"expected NAME=SIZE"),
        ("dp=2,dp=4", r"axis 'dp' appears twice"),
        ("dp=two,mp=4", r"size of axis 'dp' is not an integer: 'two'"),
        ("dp=2.0,mp=4", r"size of axis 'dp' is not an integer: '2.0'"),
        ("dp=0,mp=8", r"size of axis 'dp' must be positive or -1"),
        ("dp=-2,mp=4", r"size of axis 'dp' must be positive or -1"),
    ],
)
def test_parse_mesh_errors(spec, message):
    with pytest.raises(UserError, match=message) as e:
        parse_mesh(spec, 8)
    assert repr(spec) in str(e.value)  # every message quotes the mesh it rejects


def test_make_mesh_follows_rule_file_axis_order():
    mesh = make_mesh("mp=4,dp=2", ("dp", "mp"))  # written in the other order
    assert mesh.axis_names == ("dp", "mp")
    assert dict(mesh.shape) == {"dp": 2, "mp": 4}
    assert mesh.devices.shape == (2, 4)
    assert tuple(mesh.axis_types) == (AxisType.Auto, AxisType.Auto)
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


def test_make_mesh_three_axes_with_fill():
    mesh = make_mesh("dp=-1,fsdp=2,mp=2", ["fsdp", "dp", "mp"])
    assert mesh.axis_names == ("fsdp", "dp", "mp")
    assert mesh.devices.shape == (2, 2, 2)
    assert tuple(mesh.axis_types) == (AxisType.Auto,) * 3


@pytest.mark.parametrize(
    "spec, axes",
    [("data=2,model=4", ("dp", "mp")), ("dp=8", ("dp", "mp")), ("dp=2,mp=2,sp=2", ("dp", "mp"))],
)
def test_make_mesh_axis_names_must_match_rule_file(spec, axes):
    with pytest.raises(UserError, match=r"names axes .* but the rule file's mesh_axes are \['dp', 'mp'\]"):
        make_mesh(spec, axes)


def test_make_mesh_checks_sizes_against_its_devices():
    # On CPU devices the message says how to simulate more.
    message = "has 8 devices but 2 are available; --config.host_device_count=N simulates N CPU devices$"
    with pytest.raises(UserError, match=message):
        make_mesh("dp=2,mp=4", ("dp", "mp"), devices=jax.devices()[:2])


def test_a_device_count_error_names_the_flag_of_the_command_that_reads_it():
    """convert to-hf spells the device-count flag --host_device_count: the error is rebuilt with it,
    not edited as text (a path or mesh in the message is left as it is)."""
    with pytest.raises(DeviceCountError) as e:
        make_mesh("dp=2,mp=4", ("dp", "mp"), devices=jax.devices()[:2])
    assert (e.value.spec, e.value.size, e.value.available) == ("dp=2,mp=4", 8, 2)
    assert str(e.value.naming("--host_device_count")) == (
        "mesh 'dp=2,mp=4' has 8 devices but 2 are available; --host_device_count=N simulates N CPU devices"
    )
    # Not simulated (an accelerator's count is what it is): no flag named, either way.
    with pytest.raises(DeviceCountError) as e:
        parse_mesh("dp=2,mp=4", 2)
    assert (
        str(e.value)
        == str(e.value.naming("--host_device_count"))
        == ("mesh 'dp=2,mp=4' has 8 devices but 2 are available")
    )


@pytest.mark.parametrize("spec", ["dp=2,mp=4", "dp=8,mp=1", "dp=1,mp=8"])
def test_mesh_string_round_trip(spec):
    mesh = make_mesh(spec, ("dp", "mp"))
    assert mesh_string(mesh) == spec
    assert parse_mesh(mesh_string(mesh), 8) == parse_mesh(spec, 8)
    again = make_mesh(mesh_string(mesh), ("dp", "mp"))
    assert again.shape == mesh.shape
    np.testing.assert_array_equal(again.device_ids, mesh.device_ids)


def test_mesh_string_uses_axis_order_and_filled_sizes():
    assert mesh_string(make_mesh("mp=-1,dp=2", ("dp", "mp"))) == "dp=2,mp=4"


def test_make_mesh_on_a_subset_of_devices():
    devices = jax.devices()[:2]
    mesh = make_mesh("dp=2,mp=1", ("dp", "mp"), devices=devices)
    assert dict(mesh.shape) == {"dp": 2, "mp": 1}
    assert mesh.devices.shape == (2, 1)
    assert {d.id for d in mesh.devices.flat} == {d.id for d in devices}
    assert mesh_string(mesh) == "dp=2,mp=1"
