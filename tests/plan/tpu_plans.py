"""The TPU-target plans of small_config that test_plan_tpu and test_overlap read, each compiled once
per test process (the TPU compiler's executables are not cached; tests/conftest.py runs the two
modules in one xdist group so that one process compiles them)."""

import copy
import functools
import tempfile
from pathlib import Path

from conftest import small_config
from shipped_rules import mesh_for

from gspmd_tp.plan import planner

TARGET = "tpu:v5e:2x4"
OVERLAPS = ["auto", "collective_matmul"]
COMPARED = ("megatron_1d_sp", "megatron_2d")  # the rule files test_overlap compares over OVERLAPS


@functools.cache
def compared(rules: str) -> tuple[list[dict], dict[str, str]]:
    """planner.compare of small_config(rules) on dp=2,mp=4 for TARGET under overlap auto and
    collective_matmul: its rows and the HLO files it wrote, by name. Callers must not change them."""
    with tempfile.TemporaryDirectory() as hlo_dir:
        rows = planner.compare(
            small_config(rules=rules), [rules], ["dp=2,mp=4"], TARGET, dump_hlo=hlo_dir, overlaps=OVERLAPS
        )
        return rows, {p.name: p.read_text() for p in Path(hlo_dir).iterdir()}


@functools.cache
def _planned(rules: str, **overrides) -> dict:
    if rules in COMPARED and not overrides:  # compare's row under overlap auto is this very plan
        return compared(rules)[0][0]
    return planner.plan(small_config(rules=rules, mesh=mesh_for(rules), **overrides), target=TARGET)


def tpu_plan(rules: str, **overrides) -> dict:
    """planner.plan of small_config(rules) on dp=2,mp=4 (2x2x2 for three mesh axes) for TARGET: a
    copy of the one compiled in this process."""
    return copy.deepcopy(_planned(rules, **overrides))
