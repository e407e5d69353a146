"""Peak memory per device of the compiled train step against the sequence length, for context
parallelism (rules/context_dp.yaml, all-gather K/V) over cp = 1, 2, 4, 8 of 8 simulated CPU devices.

    python docs/context_memory.py [--config=configs/tiny.py] [--seq_lens=512,1024,2048,4096] \
        [--cps=1,2,4,8] [--json_out=/tmp/context_memory.json]

Each point is one sequence per data shard: mesh data=8/cp,context=cp, batch_size 8/cp, so each device
holds seq_len/cp positions of one sequence (cp = 1 is plain data parallelism, a whole sequence a
device). Nothing runs: the step is compiled and its memory analysis read, peak = arguments +
temporaries + outputs - the outputs that reuse a donated argument's buffer (plan's `hbm_needed`).
Also printed: the temporaries alone, and the bytes per device the analysis says the step sends.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gspmd_tp.job import host_devices  # noqa: E402

host_devices.request(8)

import importlib.util  # noqa: E402

from gspmd_tp.plan import analysis  # noqa: E402
from gspmd_tp.train import run_setup  # noqa: E402
from gspmd_tp.train import step as step_lib  # noqa: E402


def load_config(path: str):
    """get_config() of the config file at `path`."""
    spec = importlib.util.spec_from_file_location("config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def point(config_path: str, seq_len: int, cp: int) -> dict:
    """The compiled step's memory per device, and the analysis's bytes sent, at one seq_len and cp."""
    c = load_config(config_path)
    c.rules, c.mesh = "context_dp", f"data={8 // cp},context={cp}"
    c.batch_size, c.seq_len = 8 // cp, seq_len
    s = run_setup.setup(c)
    stats = step_lib.compile_train_step(s).memory_analysis()
    peak = (
        stats.argument_size_in_bytes
        + stats.temp_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
    )
    sent = analysis.analytical_bytes(s, analysis.leaf_table(s), "cpu")["total"]
    return {
        "seq_len": seq_len,
        "cp": cp,
        "mesh": c.mesh,
        "batch_size": c.batch_size,
        "peak_bytes": peak,
        "temp_bytes": stats.temp_size_in_bytes,
        "analytical_bytes_sent": sent,
    }


def main() -> None:
    """Prints the table (MiB per device) and writes the points as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.py")
    parser.add_argument("--seq_lens", default="512,1024,2048,4096")
    parser.add_argument("--cps", default="1,2,4,8")
    parser.add_argument("--json_out", default="")
    args = parser.parse_args()
    seq_lens = [int(x) for x in args.seq_lens.split(",")]
    cps = [int(x) for x in args.cps.split(",")]
    if any(8 % cp for cp in cps):
        sys.exit(f"error: --cps={args.cps}: each must divide the 8 devices")
    points = [point(args.config, t, cp) for t in seq_lens for cp in cps]
    mib = 2**20
    print(
        "peak memory per device, MiB (temporaries in brackets); data=8/cp,context=cp, a sequence a data shard"
    )
    print(f"{'seq_len':>8} " + " ".join(f"{'cp=' + str(cp):>18}" for cp in cps))
    for t in seq_lens:
        row = [p for p in points if p["seq_len"] == t]
        cells = [f"{p['peak_bytes'] / mib:8.1f} ({p['temp_bytes'] / mib:6.1f})" for p in row]
        print(f"{t:>8} " + " ".join(f"{x:>18}" for x in cells))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"config": args.config, "points": points}, indent=1))
        print(f"json: {args.json_out}")


if __name__ == "__main__":
    main()
