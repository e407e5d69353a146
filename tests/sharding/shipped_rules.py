"""The shipped rule files and the mesh the tests run each on, for the tests that take every one."""

from gspmd_tp.sharding.rules import RULES_DIR, load_rules

SHIPPED = sorted(p.stem for p in RULES_DIR.glob("*.yaml"))


def mesh_for(rules: str, two_axes: str = "dp=2,mp=4") -> str:
    """`two_axes` for a rule file on (dp, mp); 2 devices on each axis of a rule file on three axes."""
    axes = load_rules(rules).mesh_axes
    return two_axes if axes == ("dp", "mp") else ",".join(f"{a}=2" for a in axes)
