"""Per-device attention work under context parallelism, with and without model.context_load_balance.

    python docs/context_balance.py [--length=1024] [--mesh=data=1,context=8]

For rules/context_dp.yaml on 8 simulated CPU devices: the query-key pairs the causal mask lets
through for each device's queries (useful pairs, counted from the layout: context.useful_pairs),
and the pairs each device computes, read from the dot FLOPs of the compiled attention (4 x head_dim
FLOPs a pair, per head and row: its score and its share of the output) for the ring and the
all-gather strategies. The compiled program is one per device (SPMD): its FLOPs are every
device's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from gspmd_tp.configs import tiny  # noqa: E402
from gspmd_tp.model import context, kernels  # noqa: E402
from gspmd_tp.model.transformer import ModelConfig  # noqa: E402
from gspmd_tp.sharding import hlo_cost  # noqa: E402
from gspmd_tp.train import run_setup  # noqa: E402
from gspmd_tp.train import state as state_lib  # noqa: E402

HEADS, HEAD_DIM = 2, 8


def computed_pairs(s, strategy: str, zigzag: bool, rows: int, length: int) -> float:
    """The query-key pairs one device computes in the compiled attention forward."""
    cfg = ModelConfig(context_parallel=strategy, context_load_balance=zigzag)
    names = {
        "q": ("batch", "length", "heads", "head_dim"),
        "kv": ("batch", "length", "kv_heads", "head_dim"),
        "rows": ("batch", "length"),
    }
    sh = {k: NamedSharding(s.mesh, s.rules.spec(v)) for k, v in names.items()}
    qkv = jax.ShapeDtypeStruct((rows, length, HEADS, HEAD_DIM), jnp.float32)
    ints = jax.ShapeDtypeStruct((rows, length), jnp.int32)
    fn = jax.jit(
        lambda q, k, v, p: kernels.attention(cfg, q, k, v, positions=p, zigzag=zigzag),
        in_shardings=(sh["q"], sh["kv"], sh["kv"], sh["rows"]),
    )
    with state_lib.sharding_context(s.mesh, s.rules):
        text = fn.lower(qkv, qkv, qkv, ints).compile().as_text()
    flops = hlo_cost.Costs(text).seconds(lambda f, _: f)[0]
    batch_ways = np.prod([s.mesh.shape[a] for a in s.rules.batch_axes()])
    return flops / (4 * HEAD_DIM * HEADS * rows / batch_ways)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--mesh", default="data=1,context=8")
    args = parser.parse_args()
    config = tiny.get_config()
    config.rules, config.mesh, config.seq_len = "context_dp", args.mesh, args.length
    config.batch_size = 8
    s = run_setup.setup(config)
    n = s.mesh.shape["context"]
    total = args.length * (args.length + 1) // 2
    print(f"context_dp on {args.mesh}, {args.length} positions: {total:,} useful pairs in all")
    for zigzag in (False, True):
        order = context.zigzag_order(args.length, n) if zigzag else np.arange(args.length)
        useful = context.useful_pairs(order, n)
        shares = ", ".join(f"{u / total:.3f}" for u in useful)
        print(
            f"  {'zigzag' if zigzag else 'plain '} useful pairs per device: {list(map(int, useful))} "
            f"(shares {shares})"
        )
        for strategy in ("ring", "all_gather"):
            pairs = computed_pairs(s, strategy, zigzag, config.batch_size, args.length)
            print(
                f"    {strategy:10s} computes {pairs:,.0f} pairs a device: the busiest device's useful "
                f"pairs are {useful.max() / pairs:.3f} of it"
            )


if __name__ == "__main__":
    main()
