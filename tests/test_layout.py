"""The package layout: imports point one way, from the tools down to the job plumbing, never back up."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gspmd_tp"

# Lowest first: a package may import those before it, never those after it. The tools at the top
# import the layers, and of each other only what is named here (convert's to-hf reads a saved run).
LAYERS = ["job", "storage", "cli", "sharding", "model", "data", "checkpoint", "train"]
TOOLS = ["plan", "bench", "inference", "convert"]
TOOL_USES = {"convert": {"inference"}}


def _imports(path: Path) -> set[str]:
    """The gspmd_tp packages (or top-level modules) that a file imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gspmd_tp":
            parts = node.module.split(".")
            found.update([parts[1]] if len(parts) > 1 else [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("gspmd_tp."))
    return found


def _allowed(package: str) -> set[str]:
    if package in TOOLS:
        return set(LAYERS) | TOOL_USES.get(package, set())
    return set(LAYERS[: LAYERS.index(package)])


@pytest.mark.parametrize("package", LAYERS + TOOLS)
def test_a_package_imports_only_those_below_it(package):
    wrong = {
        f"{path.relative_to(PACKAGE)} imports gspmd_tp.{imported}"
        for path in (PACKAGE / package).glob("*.py")
        for imported in _imports(path) - {package}
        if imported not in _allowed(package)
    }
    assert not wrong, sorted(wrong)


def test_every_module_lives_in_a_package():
    """Beside the packages only the entry points of `python -m gspmd_tp.evaluate|generate` stand, and
    the links to the repository's configs/ and rules/ (what the wheel ships; no code of the library)."""
    loose = {p.name for p in PACKAGE.glob("*.py")} - {"__init__.py", "evaluate.py", "generate.py"}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists() and not p.is_symlink()}
    assert not loose
    assert packages == set(LAYERS + TOOLS)
    links = {p.name: p.resolve() for p in PACKAGE.iterdir() if p.is_symlink()}
    assert links == {"configs": PACKAGE.parent / "configs", "rules": PACKAGE.parent / "rules"}


def test_make_test_collects_every_file_of_multiprocess_tests():
    """The Makefile's second pass collects only the files it names: a test marked multiprocess in
    any other file would run in neither pass."""
    root = PACKAGE.parent
    marked = {
        str(p.relative_to(root))
        for p in (root / "tests").rglob("test_*.py")
        if re.search(
            r"^(@pytest\.mark\.multiprocess|pytestmark = pytest\.mark\.multiprocess)", p.read_text(), re.M
        )
    }
    (command,) = [line for line in (root / "Makefile").read_text().splitlines() if "-m multiprocess" in line]
    named = {word.rstrip(";") for word in command.split() if word.startswith("tests/")}
    assert marked == named
