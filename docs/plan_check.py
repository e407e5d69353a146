"""plan's predicted step times against bench.py's measured ones: the table, Spearman's rank
correlation and the median relative error (docs/plan.md, "The step-time estimate").
docs/plan_check.sh runs the commands below, the bench twice (each run times every rule file x mesh in
alternating rounds in one process). A point timed in several bench files is measured by the mean of
their medians.

    RULES=dp,fsdp,megatron_1d,megatron_1d_sp,megatron_2d
    MESHES="dp=8,mp=1 dp=4,mp=2 dp=2,mp=4 dp=1,mp=8"
    python -m gspmd_tp.plan calibrate --out=/tmp/calibration.json --config=configs/bench_cpu.py \
        --rules=$RULES --meshes="$MESHES"
    for i in 1 2; do python bench.py --config=configs/bench_cpu.py --rules=$RULES --meshes="$MESHES" \
        --alternate --rounds=6 --round_steps=2 --warmup=3 --json_out=/tmp/bench_$i.json; done
    python -m gspmd_tp.plan --config=configs/bench_cpu.py --compare=$RULES --meshes="$MESHES" \
        --calibration=/tmp/calibration.json --json > /tmp/plan.json
    python docs/plan_check.py /tmp/plan.json /tmp/bench_1.json /tmp/bench_2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np


def _ranks(values: list[float]) -> np.ndarray:
    """Ranks from 1, ties sharing their mean rank."""
    values = np.asarray(values)
    order = values.argsort()
    ranks = np.empty(len(values))
    ranks[order] = np.arange(1, len(values) + 1)
    for v in np.unique(values):
        ranks[values == v] = ranks[values == v].mean()
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two equally long lists."""
    return float(np.corrcoef(_ranks(a), _ranks(b))[0, 1])


def _predicted(e: dict) -> dict:
    """A table row's predicted seconds from a plan estimate: the step, and its compute, new memory
    and exposed communication."""
    return {
        "predicted": e["step_s_estimate"], "compute": e["compute_s"], "comm": e["comm_exposed_s"],
        "fresh": e.get("fresh_memory_s", 0.0),
    }  # fmt: skip


def rows(plan: dict, bench: dict) -> list[dict]:
    """One row per rule file x mesh timed by both: predicted step seconds, and measured ones (the
    mean of the point's median step over the bench files that time it, each a round)."""
    predicted = {
        (Path(r["rules"]).stem, r["mesh"]): r["estimate"]
        for r in plan["results"]
        if "error" not in r and r.get("estimate")
    }
    rounds: dict[tuple[str, str], list[float]] = {}  # each point's median step, one per bench round
    for r in bench["results"]:
        rounds.setdefault((Path(r["rules"]).stem, r["mesh"]), []).append(r["step_s"])
    out = []
    for key, times in rounds.items():
        if key in predicted:
            e = predicted[key]
            out.append({
                "rules": key[0], "mesh": key[1], "measured": statistics.mean(times), "rounds": times,
                **_predicted(e),
            })  # fmt: skip
    return out


def variant_rows(plan_dir: str, bench_dir: str) -> list[dict]:
    """One row per variant NAME with both plan_dir/NAME.json (one plan --calibration --json) and
    bench_dir/NAME.json (bench.py --json_out), as docs/plan_check_gpu.sh writes them."""
    out = []
    for path in sorted(Path(plan_dir).glob("*.json")):
        bench = Path(bench_dir) / path.name
        e = json.loads(path.read_text()).get("estimate")
        if not bench.exists() or not e:
            continue
        r = json.loads(bench.read_text())["results"][0]
        out.append({
            "rules": path.stem, "mesh": r["mesh"], "measured": r["step_s"], "rounds": [r["step_s"]],
            **_predicted(e),
        })  # fmt: skip
    return out


def main() -> None:
    """Print the table and the two figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", help="plan --compare --calibration --json output (a folder with --variants)")
    ap.add_argument(
        "bench", nargs="+", help="bench.py --json_out files (a point in several: the mean of their medians)"
    )
    ap.add_argument("--variants", action="store_true", help="plan and bench are folders of NAME.json")
    a = ap.parse_args()
    if a.variants:
        table = variant_rows(a.plan, a.bench[0])
    else:
        bench = {"results": [r for f in a.bench for r in json.loads(Path(f).read_text())["results"]]}
        table = rows(json.loads(Path(a.plan).read_text()), bench)
    first = "variant" if a.variants else "rules"
    print(f"| {first} | mesh | predicted ms (compute + new memory + exposed comm) | measured ms | error |")
    print("|---|---|---|---|---|")
    errors = []
    for r in table:
        error = r["predicted"] / r["measured"] - 1
        errors.append(abs(error))
        print(
            f"| {r['rules']} | {r['mesh']} | {r['predicted'] * 1e3:,.0f} ({r['compute'] * 1e3:,.0f} + "
            f"{r['fresh'] * 1e3:,.0f} + {r['comm'] * 1e3:,.0f}) | {r['measured'] * 1e3:,.0f} | "
            f"{100 * error:+.0f}% |"
        )
    measured, predicted = [r["measured"] for r in table], [r["predicted"] for r in table]
    best_measured = min(table, key=lambda r: r["measured"])
    best_predicted = min(table, key=lambda r: r["predicted"])
    above = best_predicted["measured"] / best_measured["measured"] - 1
    spread = [(max(r["rounds"]) - min(r["rounds"])) / r["measured"] for r in table if len(r["rounds"]) > 1]
    if spread:
        n = max(len(r["rounds"]) for r in table)
        print(
            f"\nmeasured: the mean of {n} bench runs' medians; the runs of a point differ by "
            f"{100 * statistics.median(spread):.0f}% (median), {100 * max(spread):.0f}% at most"
        )
    print(f"\n{len(table)} points: Spearman {spearman(predicted, measured):.2f}, median |error| "
          f"{100 * statistics.median(errors):.0f}%; the predicted best ({best_predicted['rules']} "
          f"{best_predicted['mesh']}) measures {100 * above:.0f}% above the measured best "
          f"({best_measured['rules']} {best_measured['mesh']})")  # fmt: skip


if __name__ == "__main__":
    main()
