"""The shipped rule files and the mesh the tests run each on, for the tests that take every one."""

from gspmd_tp.sharding.rules import RULES_DIR, load_rules

SHIPPED = sorted(p.stem for p in RULES_DIR.glob("*.yaml"))


def mesh_for(rules: str, two_axes: str = "dp=2,mp=4") -> str:
    """`two_axes` for a rule file on (dp, mp); 2 and 4 devices on another rule file's two axes (its
    second axis the larger, as mp in dp=2,mp=4); 2 devices on each axis of a rule file on three."""
    axes = load_rules(rules).mesh_axes
    if axes == ("dp", "mp"):
        return two_axes
    if len(axes) == 2:
        return f"{axes[0]}=2,{axes[1]}=4"
    return ",".join(f"{a}=2" for a in axes)


def meshes_of(rules: str, devices: int = 8) -> list[str]:
    """Every mesh of `devices` devices on a rule file's axes: each way to factor the count."""

    def factors(n: int, k: int):
        if k == 1:
            yield (n,)
            return
        for d in range(1, n + 1):
            if n % d == 0:
                for rest in factors(n // d, k - 1):
                    yield (d, *rest)

    axes = load_rules(rules).mesh_axes
    meshes = factors(devices, len(axes))
    return [",".join(f"{a}={n}" for a, n in zip(axes, sizes, strict=True)) for sizes in meshes]
