"""The memory traffic of a compiled step's kernels, read from its HLO text (`plan --dump_hlo`).

    python -m gspmd_tp.plan --config=configs/llama_1b.py --target=gpu:h100 --config.rules=dp \
        --config.mesh=dp=1,mp=1 --dump_hlo=/tmp/hlo
    python docs/hlo_bytes.py /tmp/hlo/dp_dp1_mp1.hlo.txt [--bandwidth=3.35e12] [--top=25]

For each fusion, custom call (cuBLAS, cuDNN) and copy of the entry computation: the bytes of its
operands plus its results, summed by kind, and the elementwise fusions (XLA's loop and input
fusions) summed by the jax operation they come from (layer numbers folded), each with the time it
would take at `--bandwidth` bytes/s. An upper bound where a fusion reads a slice of an operand (it
counts the whole operand), and no figure for what a kernel computes: on a GPU the elementwise
kernels are bound by memory, so their bytes are what changes in them cost.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gspmd_tp.sharding.hlo import shape_bytes  # noqa: E402

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*?)\)(?:, |$)")
KINDS = ("fusion", "custom-call", "copy")


def kernels(text: str) -> list[dict]:
    """The entry computation's kernels: name, kind (fusion kind or custom-call target), bytes in and
    out, and the jax op name."""
    entry = text[text.index("\nENTRY") :]
    shapes: dict[str, str] = {}
    rows = []
    for line in entry.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, op, args = m.groups()
        shapes[name] = shape
        if op not in KINDS:
            continue
        kind = re.search(r"kind=(k\w+)|custom_call_target=\"([^\"]+)\"", line)
        operands = [a.strip() for a in args.split(",") if a.strip().startswith("%")]
        op_name = re.search(r'op_name="([^"]+)"', line)
        rows.append(
            {
                "name": name,
                "kind": (kind.group(1) or kind.group(2)) if kind else op,
                "in": sum(shape_bytes(shapes.get(a, "")) for a in operands),
                "out": shape_bytes(shape),
                "op": op_name.group(1) if op_name else "",
            }
        )
    return rows


def main() -> None:
    """Print the two tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hlo", help="an HLO text file (plan --dump_hlo)")
    ap.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s (default: an H100's HBM3)")
    ap.add_argument("--top", type=int, default=25, help="rows of the elementwise table")
    a = ap.parse_args()
    rows = kernels(Path(a.hlo).read_text())
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for r in rows:
        by_kind[r["kind"]][0] += 1
        by_kind[r["kind"]][1] += r["in"] + r["out"]
    print(f"{'kernel kind':<32} {'count':>6} {'GiB':>9} {'ms at bandwidth':>16}")
    for kind, (n, b) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
        print(f"{kind:<32} {n:>6} {b / 2**30:>9.2f} {b / a.bandwidth * 1e3:>16.2f}")
    by_op: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for r in rows:
        if r["kind"] in ("kLoop", "kInput"):
            op = re.sub(r"layers_\d+", "layers_N", r["op"].removeprefix("jit(step)/"))
            by_op[op][0] += 1
            by_op[op][1] += r["in"] + r["out"]
    print(f"\nelementwise fusions by jax op (layers folded){'':>8} {'count':>6} {'GiB':>9} {'ms':>8}")
    for op, (n, b) in sorted(by_op.items(), key=lambda kv: -kv[1][1])[: a.top]:
        shown = op if len(op) <= 54 else "..." + op[-51:]
        print(f"{shown:<54} {n:>6} {b / 2**30:>9.2f} {b / a.bandwidth * 1e3:>8.2f}")


if __name__ == "__main__":
    main()
