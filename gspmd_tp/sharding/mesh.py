"""Device meshes from strings like "dp=2,mp=4"."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from gspmd_tp.job.errors import UserError

# The flag that sets how many CPU devices train.py (and the readers taking --config) simulate.
DEVICE_COUNT_FLAG = "--config.host_device_count"


class DeviceCountError(UserError):
    """A mesh that spans another number of devices than there are. Where they are simulated CPU
    devices, the message names `flag`, the one that sets their count; a command that spells that
    flag otherwise re-raises `naming(its flag)`."""

    def __init__(self, spec: str, size: int, available: int, flag: str = ""):
        self.spec, self.size, self.available, self.flag = spec, size, available, flag
        hint = f"; {flag}=N simulates N CPU devices" if flag else ""
        super().__init__(f"mesh {spec!r} has {size} devices but {available} are available{hint}")

    def __reduce__(self):  # pickled or copied by its fields, not by its message
        return DeviceCountError, (self.spec, self.size, self.available, self.flag)

    def naming(self, flag: str) -> DeviceCountError:
        """The same error naming `flag` for the device count (still none where it named none)."""
        return DeviceCountError(self.spec, self.size, self.available, flag if self.flag else "")


def parse_mesh(spec: str, num_devices: int, device_flag: str = "") -> dict[str, int]:
    """Parses "dp=2,mp=4" into {"dp": 2, "mp": 4}; one size may be -1 and is filled in. A device
    count that does not match raises DeviceCountError naming `device_flag` (none: no hint)."""
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        part = part.strip()  # " dp = 2, mp=4"; but "dp=2 mp=4" is one item, not two
        name, eq, value = (p.strip() for p in part.partition("="))
        if not name or not eq or any(c.isspace() for c in name + value):
            raise UserError(f"mesh {spec!r}: expected NAME=SIZE items separated by commas, got {part!r}")
        if name in sizes:
            raise UserError(f"mesh {spec!r}: axis {name!r} appears twice")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise UserError(f"mesh {spec!r}: size of axis {name!r} is not an integer: {value!r}") from None
        if sizes[name] == 0 or sizes[name] < -1:
            raise UserError(f"mesh {spec!r}: size of axis {name!r} must be positive or -1")
    free = [n for n, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise UserError(f"mesh {spec!r}: only one axis may be -1, got {free}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if num_devices % known:
            raise UserError(
                f"mesh {spec!r}: {num_devices} devices are not divisible by the fixed axes ({known})"
            )
        sizes[free[0]] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        raise DeviceCountError(spec, math.prod(sizes.values()), num_devices, device_flag)
    return sizes


def make_mesh(
    spec: str, mesh_axes: list[str] | tuple[str, ...], devices=None, rules_source: str = "the rule file"
) -> Mesh:
    """Builds a topology-aware Mesh whose axes are exactly `mesh_axes`, sized by `spec`.

    Axes are Auto (not Explicit) so that with_sharding_constraint steers GSPMD.
    """
    devices = jax.devices() if devices is None else devices
    cpu = devices[0].platform == "cpu"
    sizes = parse_mesh(spec, len(devices), DEVICE_COUNT_FLAG if cpu else "")
    if set(sizes) != set(mesh_axes):
        # Name one axis: a three-axis rule file given a two-axis mesh (or the reverse) reads at a glance.
        missing = [a for a in mesh_axes if a not in sizes]
        why = (
            f"no size for axis {missing[0]!r}"
            if missing
            else f"axis {next(a for a in sizes if a not in mesh_axes)!r} is not one of them"
        )
        raise UserError(
            f"mesh {spec!r} names axes {sorted(sizes)} but {rules_source}'s mesh_axes are {list(mesh_axes)} "
            f"({why}); give --config.mesh in those axes ({','.join(f'{a}=N' for a in mesh_axes)})"
        )
    shape = tuple(sizes[a] for a in mesh_axes)
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices > 1:
        device_array = _hybrid(shape, mesh_axes, devices, slices, spec)
    else:
        try:
            device_array = mesh_utils.create_device_mesh(shape, devices=devices)
        except (ValueError, AssertionError, NotImplementedError):
            # Topologies mesh_utils does not know (e.g. odd slices) fall back to device order.
            device_array = np.asarray(devices).reshape(shape)
    return Mesh(device_array, tuple(mesh_axes), axis_types=(AxisType.Auto,) * len(mesh_axes))


def _hybrid(shape, mesh_axes, devices, slices: int, spec: str):
    """Several slices (multi-slice TPU): the first mesh axis spans the slices over the data-center
    network (DCN), every axis also runs inside each slice over the fast interconnect (ICI)."""
    if shape[0] % slices:
        raise UserError(
            f"mesh {spec!r}: the first axis ({mesh_axes[0]}={shape[0]}) must be divisible by the "
            f"{slices} slices it spans"
        )
    ici = (shape[0] // slices,) + tuple(shape[1:])
    dcn = (slices,) + (1,) * (len(shape) - 1)
    try:
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices)
    except (ValueError, AssertionError, NotImplementedError):
        # Slices mesh_utils cannot lay out (a TPU v4's compile-only devices are its TensorCores, two
        # to a chip): each slice's devices in order, the slices one after another on the first axis.
        by_slice = sorted({d.slice_index for d in devices})
        return np.concatenate(
            [np.asarray([d for d in devices if d.slice_index == i]).reshape(ici) for i in by_slice]
        )


def mesh_string(mesh: Mesh) -> str:
    """The inverse of parse_mesh: "dp=2,mp=4"."""
    return ",".join(f"{n}={s}" for n, s in mesh.shape.items())


def mesh_file_name(mesh: str) -> str:
    """A mesh string as part of a file or directory name: "dp=2,mp=4" -> "dp2_mp4"."""
    return mesh.replace(" ", "").replace("=", "").replace(",", "_")
