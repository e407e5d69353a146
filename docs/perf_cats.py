"""Sums `perf script` samples (the leaf frame of each) into kinds of work, as docs/benchmarks.md reads them.

python bench.py --config=configs/bench_cpu.py --meshes="dp=4,mp=2" --steps=40 --warmup=10 &
sleep 60; perf record -F 499 -g -p $! -o /tmp/pf.data -- sleep 15
perf script -i /tmp/pf.data -F comm,ip,sym,dso | python3 docs/perf_cats.py
"""

import collections
import re
import sys


def kind(sym: str, dso: str) -> str:
    """The kind of work a leaf frame's symbol and shared object belong to."""
    if "ynn::dot_" in sym:
        return "matrix products (ynn::dot_*)"
    if "JIT" in dso or dso.endswith(".map"):
        return "XLA-compiled loops (fusions)"
    if sym.startswith("ynn::"):
        return "other ynn kernels"
    if re.search("ReduceScatter|AllReduce|AllGather|Collective|Communicator", sym):
        return "collectives"
    if "libc" in dso:
        return "libc (memmove, malloc)"
    if "kernel" in dso:
        return "kernel"
    return "other"


def main() -> None:
    """Reads `perf script` output on stdin and prints each kind's share of the samples."""
    counts, n = collections.Counter(), 0
    for block in sys.stdin.read().split("\n\n"):
        lines = [x.strip() for x in block.splitlines() if x.strip()]
        m = len(lines) > 1 and re.match(r"[0-9a-f]+ (.*) \((.*)\)$", lines[1])
        if not m:
            continue
        n += 1
        counts[kind(*m.groups())] += 1
    print("  ".join(f"{k} {100 * v / n:.1f}%" for k, v in counts.most_common()))


if __name__ == "__main__":
    main()
