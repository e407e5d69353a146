"""Where a traced CPU step's kernel time went, by who wrote the kernel: XLA's own compiled loops
(its elementwise fusions, whose code `--xla_cpu_prefer_vector_width` changes) or YNNPACK's
(matrix products, and the reductions and elementwise ops it takes by default), for each trace
under each directory.

    python bench.py --config=configs/bench_cpu.py --meshes=dp=4,mp=2 --profile_dir=/tmp/p256
    XLA_FLAGS=--xla_cpu_prefer_vector_width=512 python bench.py ... --profile_dir=/tmp/p512
    python docs/trace_kernels.py /tmp/p256 /tmp/p512

Milliseconds per device, summed over the trace's device threads and divided by `--devices`.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gspmd_tp.train import profiling  # noqa: E402


def kernel_ms(trace: str) -> collections.Counter:
    """Milliseconds of the trace's fusion events, summed by who wrote the kernel."""
    ms = collections.Counter()
    for name, us in profiling.event_durations(trace).items():
        if "fusion" in name:
            ms["YNNPACK fusions" if name.startswith("ynn_fusion") else "XLA loop fusions"] += us / 1e3
    return ms


def main() -> None:
    """Prints one row per trace found under the directories given."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", help="bench.py --profile_dir directories")
    p.add_argument("--devices", type=int, default=8, help="devices traced (8 simulated by default)")
    args = p.parse_args()
    print(f"{'trace (directory, when taken)':44s} {'XLA loop fusions':>17s} {'YNNPACK fusions':>16s}")
    for d in args.dirs:
        for trace in sorted(glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)):
            ms = kernel_ms(trace)
            row = [ms[k] / args.devices for k in ("XLA loop fusions", "YNNPACK fusions")]
            label = f"{d} {os.path.basename(os.path.dirname(trace))}"
            print(f"{label[-44:]:44s} {row[0]:14.1f} ms {row[1]:13.1f} ms")


if __name__ == "__main__":
    main()
