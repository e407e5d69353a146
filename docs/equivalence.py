"""Each rule file against one device: the largest relative error of the loss and of the gradients of
one packed batch, on every mesh of 8 simulated CPU devices that the rule file's axes admit.

    python docs/equivalence.py --rules=expert_fsdp,data_expert_tensor --set model.num_experts=8 \
        --set model.experts_per_token=2 --set model.expert_mlp_dim=32
    python docs/equivalence.py --rules=context_dp,fsdp_context_tensor

The config is configs/tiny.py at the tests' size (2 layers, width 64, 16 heads over 8 key/value
heads, batch 8 x 32 positions; `--set KEY=VALUE` changes any key, values read as Python literals
where they parse). The batch is random tokens with a document separator every 9 positions, so that
documents cross every context chunk. The loss error is |l - l1| / |l1|; a parameter's gradient
error is max|g - g1| / max|g1| over its elements; the table gives the largest over parameters.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import math

SIZES = {
    "batch_size": 8,
    "seq_len": 32,
    "model.d_model": 64,
    "model.num_layers": 2,
    "model.num_heads": 16,
    "model.num_kv_heads": 8,
    "model.head_dim": 8,
    "model.mlp_dim": 128,
}


def _config(settings: dict):
    from gspmd_tp.configs import tiny

    c = tiny.get_config()
    for key, value in {**SIZES, **settings}.items():
        *parents, leaf = key.split(".")
        target = c
        for p in parents:
            target = target[p]
        target[leaf] = value
    return c


def _meshes(axes: tuple[str, ...], devices: int = 8) -> list[str]:
    """Every mesh of `devices` devices on `axes`: each way to factor the count."""
    found = []
    for sizes in itertools.product(range(1, devices + 1), repeat=len(axes)):
        if math.prod(sizes) == devices:
            found.append(",".join(f"{a}={n}" for a, n in zip(axes, sizes, strict=True)))
    return found


def _loss_and_grads(config, batch_np, devices=None):
    import jax

    from gspmd_tp.model.transformer import Transformer
    from gspmd_tp.train import run_setup
    from gspmd_tp.train import state as state_lib
    from gspmd_tp.train import step as step_lib

    s = run_setup.setup(config, devices)
    state = state_lib.init_state(s.model_cfg, s.tx, s.mesh, s.rules, config.seq_len, config.seed)
    batch = jax.device_put(step_lib.host_batch(s, batch_np), s.batch_sharding)
    model = Transformer(s.model_cfg)
    with state_lib.sharding_context(s.mesh, s.rules):
        fn = jax.jit(
            lambda p, b: step_lib.accumulated_grads(model, config.grad_accum, s.shardings.params, p, b)
        )
        return jax.device_get(fn(state.params, batch))


def _errors(got, want) -> tuple[float, float]:
    import jax
    import numpy as np

    (loss, grads), (want_loss, want_grads) = got, want
    worst = max(
        float(np.abs(np.asarray(g, np.float64) - w).max() / max(np.abs(w).max(), 1e-30))
        for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True)
    )
    return abs(float(loss) - float(want_loss)) / abs(float(want_loss)), worst


def main() -> None:
    """Prints the table (rule file, mesh, loss error, gradient error) and, with --json, one JSON row each."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules", required=True, help="comma-separated rule files (names or paths)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config key")
    parser.add_argument("--json", action="store_true", help="one JSON object a row instead of the table")
    args = parser.parse_args()
    settings = {}
    for item in args.set:
        key, _, text = item.partition("=")
        try:
            settings[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            settings[key] = text

    from gspmd_tp.job import host_devices

    host_devices.request(8)
    import jax
    import numpy as np

    from gspmd_tp.data import pipeline
    from gspmd_tp.sharding.rules import load_rules

    base = _config(settings)
    batch = np.random.default_rng(0).integers(0, 256, (base.batch_size, base.seq_len + 1), dtype=np.int32)
    batch[:, 5::9] = pipeline.SEPARATOR
    one = _config({**settings, "rules": "dp", "mesh": "dp=1,mp=1"})
    want = _loss_and_grads(one, batch, jax.devices()[:1])
    if not args.json:
        print(f"{'rules':<22} {'mesh':<28} {'loss rel err':>12} {'grad rel err':>12}")
    for rules in args.rules.split(","):
        for mesh in _meshes(load_rules(rules).mesh_axes):
            loss_err, grad_err = _errors(
                _loss_and_grads(_config({**settings, "rules": rules, "mesh": mesh}), batch), want
            )
            if args.json:
                print(
                    json.dumps(
                        {"rules": rules, "mesh": mesh, "loss_rel_err": loss_err, "grad_rel_err": grad_err}
                    )
                )
            else:
                print(f"{rules:<22} {mesh:<28} {loss_err:12.2e} {grad_err:12.2e}", flush=True)


if __name__ == "__main__":
    main()
