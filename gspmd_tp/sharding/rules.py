"""Rule files (rules/*.yaml): logical axis names -> mesh axes.

Rules are ordered; for each dimension of a tensor the first rule naming its logical axis whose
mesh axis is still free in that tensor wins (flax Linen's resolver). So `[embed, mp]` followed by
`[embed, dp]` shards `embed` over `mp` where it can and over `dp` where `mp` is already taken.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import flax.linen as nn
import yaml
from jax.sharding import PartitionSpec

from gspmd_tp.job.errors import UserError
from gspmd_tp.sharding.axes import BATCH, VOCABULARY
from gspmd_tp.sharding.mesh import parse_mesh
from gspmd_tp.storage import paths

# The shipped rule files: gspmd_tp/rules, the repository's rules/ (linked) or the wheel's copy of it.
RULES_DIR = (Path(__file__).resolve().parents[1] / "rules").resolve()
# In a tuple of logical names, a dimension left to GSPMD: no rule applies to it and it takes no mesh
# axis away from the others (flax passes it through unchanged).
UNCONSTRAINED = PartitionSpec.UNCONSTRAINED
_KEYS = {"description", "mesh_axes", "rules"}
_AXIS_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")

MeshAxes = str | tuple[str, ...] | None


class IndivisibleError(UserError):
    """A dimension that the mesh axes sharding it do not divide: a property of the model size and
    the mesh together (plan --compare reports it as a row rather than stopping)."""


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

    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is sharded over, in order (() where it is replicated)."""
        return batch_mesh_axes(self.rules)

    @property
    def covered(self) -> set[str]:
        return {name for name, _ in self.rules}


def batch_mesh_axes(rules: Iterable[tuple[str, MeshAxes]] | None = None) -> tuple[str, ...]:
    """The mesh axes the batch is sharded over under the (logical name, mesh axes) pairs `rules`, or,
    where None, under the flax logical axis rules being traced with (in model and step code)."""
    return axes_of(nn.logical_to_mesh_axes((BATCH,), None if rules is None else tuple(rules))[0])


def unsharded(rules: Rules, names: Iterable[str]) -> Rules:
    """`rules` with the logical axes `names` on no mesh axis (their own rules dropped)."""
    names = tuple(names)
    kept = tuple(r for r in rules.rules if r[0] not in names)
    return dataclasses.replace(rules, rules=tuple((n, None) for n in names) + kept)


def axes_of(spec_entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry: None, an axis name, or a tuple of them."""
    if spec_entry is None:
        return ()
    return (spec_entry,) if isinstance(spec_entry, str) else tuple(spec_entry)


def mesh_ways(mesh_shape: Mapping[str, int], spec_entry) -> tuple[int, str]:
    """How many ways one PartitionSpec entry splits a dimension on a mesh, and its axes as
    "dp=4, mp=2" for messages."""
    names = axes_of(spec_entry)
    return math.prod(mesh_shape[a] for a in names), ", ".join(f"{a}={mesh_shape[a]}" for a in names)


def short_names(names_or_paths: Iterable[str]) -> dict[str, str]:
    """A short label for each rule file as given (a name or a path): its file name without
    .yaml, with _2, _3, ... where two rule files share one (for file and directory names)."""
    names: dict[str, str] = {}
    for given in names_or_paths:
        stem = Path(given).name.removesuffix(".yaml") or "rules"
        name, n = stem, 2
        while given not in names and name in names.values():
            name, n = f"{stem}_{n}", n + 1
        names.setdefault(given, name)
    return names


def column_widths(
    rows: Iterable[Mapping[str, str]], rules_key: str, minimums: tuple[int, int]
) -> tuple[int, int]:
    """The widths of a compare table's rule-file and mesh columns (plan --compare, bench.py): as wide
    as the longest `rules_key` and "mesh" of `rows`, and at least `minimums`, so that the figures
    after them stay under their headings."""
    rows = list(rows)
    return (
        max([minimums[0]] + [len(r[rules_key]) for r in rows]),
        max([minimums[1]] + [len(r["mesh"]) for r in rows]),
    )


def check_distinct(
    rules_list: list[str], meshes: list[str], device_count: int, rules_flag: str, why: str
) -> None:
    """UserError naming a rule file or mesh given twice to a command that runs each rule file x mesh
    (bench.py --rules, plan --compare; --meshes), however spelt (megatron_1d and
    rules/megatron_1d.yaml; dp=8,mp=1 and dp=-1,mp=1 on 8 devices): its rows would come twice or be
    merged, and nothing in the report would say which. `why` ends the message."""

    def first_repeat(items, key):
        seen = {}
        for item in items:
            k = key(item)
            if k is not None and k in seen:
                return item, seen[k]
            seen.setdefault(k, item)
        return None

    def mesh_key(mesh):
        try:
            return frozenset(parse_mesh(mesh, device_count).items())
        except UserError:
            return None  # a bad mesh is reported where the mesh is made, with its hint

    for flag, what, items, key in (
        (rules_flag, "rule file", rules_list, lambda r: resolve_path(r).resolve()),
        ("--meshes", "mesh", meshes, mesh_key),
    ):
        repeat = first_repeat(items, key)
        if repeat:
            again, first = repeat
            how = "given twice" if again == first else f"{first!r} again"
            raise UserError(f"{flag}: {what} {again!r} is {how} ({why})")


def resolve_path(name_or_path: str) -> Path:
    """A path as given if it exists, else rules/NAME.yaml from the shipped rule files."""
    if not name_or_path.strip():
        raise UserError("config.rules is empty: name a rule file (dp, fsdp, megatron_1d, ...) or its path")
    # bash leaves `--config.rules=~/x.yaml` as it is; a bucket's file is read from a local copy
    path = Path(paths.local_copy(name_or_path))
    if path.is_file():
        return path
    if path.is_dir():
        raise UserError(f"rule file {name_or_path!r} is a directory; name a .yaml file in it")
    shipped = RULES_DIR / (name_or_path if name_or_path.endswith(".yaml") else name_or_path + ".yaml")
    if shipped.is_file():
        return shipped
    names = sorted(p.stem for p in RULES_DIR.glob("*.yaml"))
    raise UserError(f"rule file {name_or_path!r} not found (shipped rule files: {', '.join(names)})")


def load_rules(name_or_path: str) -> Rules:
    """Reads and validates a rule file given by path or by bare name under rules/."""
    path = resolve_path(name_or_path)
    try:
        # UTF-8 whatever the locale says, so that a rule file means the same on every machine.
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise UserError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} on line {line})") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read the rule file ({e.strerror or e})") from None
    return parse_rules(text, name_or_path if paths.is_url(name_or_path) else str(path))


def _rule_lines(node) -> list[int]:
    """The 1-based line of each item of the `rules:` list, from the composed YAML node."""
    for key, value in node.value if isinstance(node, yaml.MappingNode) else []:
        if key.value == "rules" and isinstance(value, yaml.SequenceNode):
            return [item.start_mark.line + 1 for item in value.value]
    return []


def _first_duplicate_key(node) -> tuple[str, int] | None:
    """(key, 1-based line) of the first mapping key given twice anywhere under `node`: YAML
    loaders keep the last silently, so a second `rules:` pasted below the first would replace it."""
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                if key.value in seen:
                    return key.value, key.start_mark.line + 1
                seen.add(key.value)
            found = _first_duplicate_key(value)
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            found = _first_duplicate_key(item)
            if found:
                return found
    return None


def parse_rules(text: str, source: str) -> Rules:
    """Validates rule-file text; every error is one line naming `source` and the item."""
    loader = yaml.SafeLoader(text)
    try:  # one parse: the node tree for duplicate keys (which plain loading lets pass), then the data
        node = loader.get_single_node()
        data = None if node is None else loader.construct_document(node)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"{source}: malformed YAML{where}: {problem}") from None
    finally:
        loader.dispose()
    duplicate = _first_duplicate_key(node)
    if duplicate:
        raise UserError(f"{source}: key {duplicate[0]!r} given twice (again at line {duplicate[1]})")
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
    for axis in mesh_axes:
        # The run names each axis's size in a mesh string ("dp=2,mp=4"), where a space, comma or
        # "=" cannot stand in a name: such an axis could never be given a size.
        if not _AXIS_NAME.fullmatch(axis):
            raise UserError(
                f"{source}: mesh axis {axis!r} in mesh_axes cannot be named in a mesh string "
                "(--config.mesh=NAME=SIZE,...); use letters, digits and _, starting with a letter"
            )
    if not isinstance(data["rules"], list):
        raise UserError(f"{source}: rules must be a list of [logical_axis, mesh_axes] pairs")
    rules, labels = [], []
    lines = _rule_lines(node)
    for i, item in enumerate(data["rules"]):
        # Rules are counted from 1, with the line they are on, as YAML errors count lines.
        rule = f"rule {i + 1} (line {lines[i]})" if i < len(lines) else f"rule {i + 1}"
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)):
            raise UserError(f"{source}: {rule} must be [logical_axis, mesh_axes], got {item!r}")
        name, value = item
        if name not in VOCABULARY:
            raise UserError(
                f"{source}: {rule} names unknown logical axis {name!r} (known: {', '.join(VOCABULARY)})"
            )
        targets = value if isinstance(value, list) else [value]
        if value is not None and not all(isinstance(t, str) for t in targets):
            raise UserError(f"{source}: {rule} ({name}) must map to a mesh axis, a list or null")
        for t in targets if value is not None else []:
            if t not in mesh_axes:
                raise UserError(
                    f"{source}: {rule} maps {name!r} to mesh axis {t!r}, "
                    f"which is not in mesh_axes {mesh_axes}"
                )
        repeated = sorted({t for t in targets if targets.count(t) > 1}) if value is not None else []
        if repeated:
            # A tensor dimension can be split over a mesh axis once; JAX rejects the spec later.
            raise UserError(f"{source}: {rule} ({name}) names mesh axis {repeated[0]!r} twice")
        _check_reachable(
            source, rule, name, value, [(r, n) for r, n in zip(rules, labels, strict=True) if r[0] == name]
        )
        rules.append((name, tuple(value) if isinstance(value, list) else value))
        labels.append(rule)
    return Rules(
        source=source,
        description=str(data.get("description", "")),
        mesh_axes=tuple(mesh_axes),
        rules=tuple(rules),
        text=text,
    )


def _show(value) -> str:
    """A rule's mesh axes as a file writes them: null, mp or [dp, mp]."""
    if not value:
        return "null"
    return f"[{', '.join(value)}]" if isinstance(value, list) else value


def _check_reachable(source: str, rule: str, name: str, value, earlier: list) -> None:
    """A rule that can never apply is an error: an earlier rule for the same logical axis whose
    mesh axes are all among this one's (null has none) takes every dimension this one could, since
    a dimension keeps the first rule that applies and a mesh axis once taken in a tensor stays taken.
    [mlp, null] then [mlp, mp] would otherwise leave mlp replicated with no word said."""
    mine = set(axes_of(tuple(value) if isinstance(value, list) else value))
    for (_, before), label in earlier:
        theirs = set(axes_of(before))
        if theirs <= mine:
            how = "applies wherever this one could" if theirs else "always applies"
            raise UserError(
                f"{source}: {rule} [{name}, {_show(value)}] never applies: {label} "
                f"[{name}, {_show(list(before) if isinstance(before, tuple) else before)}] comes first and "
                f"{how} (each dimension takes the first rule that applies)"
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
            ways, sizes = mesh_ways(mesh_shape, axes)
            if size % ways:
                raise IndivisibleError(
                    f"{rules.source}: {path} shape {tuple(shape)} dimension {dim} "
                    f"({logical[dim]}={size}) is not divisible by mesh axes {sizes}"
                )
