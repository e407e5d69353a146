"""Rule files (rules/*.yaml): logical axis names -> mesh axes.

Rules are ordered; for each dimension of a tensor the first rule naming its logical axis whose
mesh axis is still free in that tensor wins (flax Linen's resolver). So `[embed, mp]` followed by
`[embed, dp]` shards `embed` over `mp` where it can and over `dp` where `mp` is already taken.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from pathlib import Path

import flax.linen as nn
import yaml
from jax.sharding import PartitionSpec

from gspmd_tp.axes import VOCABULARY
from gspmd_tp.errors import UserError

RULES_DIR = Path(__file__).resolve().parent.parent / "rules"
_KEYS = {"description", "mesh_axes", "rules"}

MeshAxes = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True)
class Rules:
    """A validated rule file."""

    source: str  # the path (or label) it was read from, used in every error message
    description: str
    mesh_axes: tuple[str, ...]
    rules: tuple[tuple[str, MeshAxes], ...]
    text: str  # the file's contents, saved with checkpoints

    def spec(self, logical: Iterable[str | None]) -> PartitionSpec:
        """The mesh PartitionSpec of a tensor whose dimensions have these logical names."""
        return nn.logical_to_mesh_axes(tuple(logical), self.rules)

    @property
    def covered(self) -> set[str]:
        return {name for name, _ in self.rules}


def axes_of(spec_entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry: None, an axis name, or a tuple of them."""
    if spec_entry is None:
        return ()
    return (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


def resolve_path(name_or_path: str) -> Path:
    """A path as given if it exists, else rules/NAME.yaml from the shipped rule files."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = RULES_DIR / (name_or_path if name_or_path.endswith(".yaml") else name_or_path + ".yaml")
    if shipped.is_file():
        return shipped
    names = sorted(p.stem for p in RULES_DIR.glob("*.yaml"))
    raise UserError(f"rule file {name_or_path!r} not found (shipped rule files: {', '.join(names)})")


def load_rules(name_or_path: str) -> Rules:
    """Reads and validates a rule file given by path or by bare name under rules/."""
    path = resolve_path(name_or_path)
    return parse_rules(path.read_text(), str(path))


def parse_rules(text: str, source: str) -> Rules:
    """Validates rule-file text; every error is one line naming `source` and the item."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{source}: malformed YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a mapping with keys {sorted(_KEYS)}")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise UserError(f"{source}: unknown key {unknown[0]!r} (allowed: {sorted(_KEYS)})")
    for key in ("mesh_axes", "rules"):
        if key not in data:
            raise UserError(f"{source}: missing key {key!r}")
    mesh_axes = data["mesh_axes"]
    if (
        not isinstance(mesh_axes, list)
        or not mesh_axes
        or not all(isinstance(a, str) for a in mesh_axes)
        or len(set(mesh_axes)) != len(mesh_axes)
    ):
        raise UserError(f"{source}: mesh_axes must be a list of distinct names, got {mesh_axes!r}")
    if not isinstance(data["rules"], list):
        raise UserError(f"{source}: rules must be a list of [logical_axis, mesh_axes] pairs")
    rules = []
    for i, item in enumerate(data["rules"]):
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
            raise UserError(f"{source}: rule {i} must be [logical_axis, mesh_axes], got {item!r}")
        name, value = item
        if name not in VOCABULARY:
            raise UserError(
                f"{source}: rule {i} names unknown logical axis {name!r} (known: {', '.join(VOCABULARY)})"
            )
        targets = value if isinstance(value, list) else [value]
        if value is not None and not all(isinstance(t, str) for t in targets):
            raise UserError(f"{source}: rule {i} ({name}) must map to a mesh axis, a list or null")
        for t in targets if value is not None else []:
            if t not in mesh_axes:
                raise UserError(
                    f"{source}: rule {i} maps {name!r} to mesh axis {t!r}, "
                    f"which is not in mesh_axes {mesh_axes}"
                )
        rules.append((name, tuple(value) if isinstance(value, list) else value))
    return Rules(
        source=source,
        description=str(data.get("description", "")),
        mesh_axes=tuple(mesh_axes),
        rules=tuple(rules),
        text=text,
    )


def check_coverage(rules: Rules, used: Iterable[str]) -> None:
    """Every logical name the model uses must be covered by some rule (null counts)."""
    missing = sorted(set(used) - rules.covered)
    if missing:
        raise UserError(
            f"{rules.source}: logical axis {missing[0]!r} is used by the model but no rule covers it "
            f"(add [{missing[0]}, null] to replicate it)"
        )


def check_divisible(
    rules: Rules,
    mesh_shape: Mapping[str, int],
    tensors: Mapping[str, tuple[tuple[int, ...], tuple[str | None, ...]]],
) -> None:
    """Each dimension must divide by the product of the mesh axes it is sharded over.

    `tensors` maps a name (a parameter path or an activation) to (shape, logical names).
    """
    for path, (shape, logical) in tensors.items():
        spec = rules.spec(logical)
        for dim, (size, axes) in enumerate(zip(shape, spec, strict=False)):
            if axes is None:
                continue
            axes = (axes,) if isinstance(axes, str) else tuple(axes)
            ways = math.prod(mesh_shape[a] for a in axes)
            if size % ways:
                sizes = ", ".join(f"{a}={mesh_shape[a]}" for a in axes)
                raise UserError(
                    f"{rules.source}: {path} shape {tuple(shape)} dimension {dim} "
                    f"({logical[dim]}={size}) is not divisible by mesh axes {sizes}"
                )
