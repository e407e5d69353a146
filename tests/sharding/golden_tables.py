"""The golden sharding tables (tests/sharding/golden/*.txt) that test_rules compares against, and the
command that rewrites them after an intended change:

    make golden        (or: .venv/bin/python tests/sharding/golden_tables.py)

The tests only read the files; a rewrite is this command's alone, so that it never reads as a pass.
Read `git diff tests/sharding/golden` before committing what it wrote.
"""

import functools
import sys
from pathlib import Path

GOLDEN = Path(__file__).parent / "golden"

if __name__ == "__main__":  # run as a script: the tests' folder and conftest's set-up, as pytest has them
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# conftest first: it sets the platform and device flags before jax is imported.
from conftest import small_config  # noqa: E402, I001

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402

from gspmd_tp.model.params import param_axes  # noqa: E402
from gspmd_tp.sharding.rules import RULES_DIR, load_rules  # noqa: E402
from gspmd_tp.train import run_setup  # noqa: E402

SHIPPED = sorted(p.stem for p in RULES_DIR.glob("*.yaml"))


def _logical(names) -> str:
    return "(" + ", ".join(str(n) for n in names) + ")"


# The small test model as a mixture of experts (8 experts, 2 a token, one shared).
MOE = {"model.num_experts": 8, "model.expert_mlp_dim": 32, "model.shared_experts": 1}


def spec_table(rules_name: str, **overrides) -> str:
    """'path  (logical names)  PartitionSpec' for every parameter of the small test model (with
    `overrides` of its config: MOE for the mixture of experts)."""
    rules = load_rules(rules_name)
    model_cfg = run_setup.model_config(small_config(**overrides))
    what = "small MoE test model" if overrides else "small test model"
    lines = [f"# rules/{rules_name}.yaml: parameter, logical axes, PartitionSpec ({what})"]
    for path, (_, names) in sorted(param_axes(model_cfg).items()):
        lines.append(f"{path:<24} {_logical(names):<42} {rules.spec(names)}")
    return "\n".join(lines) + "\n"


@functools.cache
def activation_names() -> tuple[tuple, ...]:
    """The logical names of every activation constraint the small test model places, forward and
    backward (each distinct tuple once, in the order traced), from an abstract trace of its loss's
    gradient: nothing compiled."""
    import jax.numpy as jnp

    from gspmd_tp.model import transformer

    seen, real = [], transformer._constrain

    def record(x, names):
        if tuple(names) not in seen:
            seen.append(tuple(names))
        return x

    cfg = run_setup.model_config(small_config())
    model = transformer.Transformer(cfg)
    tokens = jnp.zeros((2, 8), jnp.int32)
    transformer._constrain = record
    try:
        params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
        loss = lambda p: model.apply({"params": p}, tokens).astype(jnp.float32).mean()  # noqa: E731
        jax.eval_shape(jax.grad(loss), nn.meta.unbox(params))
    finally:
        transformer._constrain = real
    return tuple(seen)


def activation_table(rules_name: str) -> str:
    """'(logical names)  PartitionSpec' for every activation constraint of the small test model."""
    rules = load_rules(rules_name)
    lines = [f"# rules/{rules_name}.yaml: activation logical axes, PartitionSpec (forward and backward)"]
    lines += [f"{_logical(n):<48} {rules.spec(n)}" for n in activation_names()]
    return "\n".join(lines) + "\n"


TABLES = {
    "specs": spec_table,
    "specs_moe": lambda rules_name: spec_table(rules_name, **MOE),
    "activations": activation_table,
}


def main() -> None:
    """Rewrites every golden table and names the ones that changed."""
    for kind, table in TABLES.items():
        for rules_name in SHIPPED:
            path = GOLDEN / f"{kind}_{rules_name}.txt"
            text = table(rules_name)
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
                print(f"rewrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")


if __name__ == "__main__":
    main()
