"""Where a GPU train step's device time goes, kernel by kernel (docs/benchmarks.md, "One H100 GPU").

    python docs/gpu_profile.py --out=DIR --config=configs/llama_1b.py [--config.KEY=VALUE ...]

Compiles the step, writes its optimized HLO to DIR/step_hlo.txt, warms it up, traces --steps
steps with jax.profiler into DIR/trace, and sums the device's kernel time per HLO instruction
(DIR/kernels.json; the top rows printed), so that a fusion's time can be read beside what it fuses.
CUDA graphs are switched off (--xla_gpu_enable_command_buffer=, added to XLA_FLAGS): inside one the
trace sees a single command_buffer kernel for the whole step. Without them the H100 step runs at the
same speed (docs/benchmarks.md).
"""

import collections
import glob
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

from absl import app, flags

from gspmd_tp.cli.arguments import define_config, no_positional_arguments, parse_flags

_CONFIG = define_config("configs/llama_1b.py", "A configs/*.py file.")
_OUT = flags.DEFINE_string("out", "", "Output directory.")
_STEPS = flags.DEFINE_integer("steps", 2, "Traced steps (times are per step).")
_TOP = flags.DEFINE_integer("top", 45, "Rows printed.")
_DEVICE = flags.DEFINE_string("device", "GPU", "Trace processes whose name holds this (CPU: /device:CPU).")


def kernel_times(trace_dir: str, steps: int, device: str) -> tuple[list[dict], float]:
    """Per HLO instruction (the kernel name where a kernel names none): milliseconds per step on
    the GPU's streams, and the kernels' total milliseconds per step."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.json.gz"), recursive=True)
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        events = json.load(f)["traceEvents"]
    gpu_pids = {
        e["pid"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and device in str(e["args"].get("name", ""))
    }
    # A GPU's trace has its kernels on "Stream #N" threads, and the same time again as "XLA Ops",
    # "XLA Modules" and "Steps" spans: only the streams count where there are any.
    threads = {
        (e["pid"], e["tid"]): str(e["args"].get("name", ""))
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in gpu_pids
    }
    streams = {key for key, name in threads.items() if "Stream" in name}
    us, kernels = collections.Counter(), collections.defaultdict(collections.Counter)
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpu_pids:
            continue
        if streams and (e["pid"], e.get("tid")) not in streams:
            continue
        op = e.get("args", {}).get("hlo_op") or e["name"]
        us[op] += e.get("dur", 0)
        kernels[op][e["name"]] += 1
    total = sum(us.values())
    rows = [
        {"op": op, "ms": t / 1e3 / steps, "share": t / max(total, 1), "kernels": dict(kernels[op])}
        for op, t in us.most_common()
    ]
    return rows, total / 1e3 / steps


def main(argv):
    no_positional_arguments(argv)
    import jax

    from gspmd_tp.bench import benchmark

    os.makedirs(_OUT.value, exist_ok=True)
    config = _CONFIG.value
    s, step, state, batch, compile_s = benchmark._compiled(config, warmup=3)
    with open(os.path.join(_OUT.value, "step_hlo.txt"), "w") as f:
        f.write(step.as_text())
    trace_dir = os.path.join(_OUT.value, "trace")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(_STEPS.value):
            state, _ = step(state, batch)
        jax.block_until_ready(state)
    rows, total = kernel_times(trace_dir, _STEPS.value, _DEVICE.value)
    with open(os.path.join(_OUT.value, "kernels.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "total_ms": total, "rows": rows}, f, indent=1)
    print(f"{jax.devices()[0].device_kind}: compiled in {compile_s:.1f} s; kernels {total:.1f} ms per step")
    for r in rows[: _TOP.value]:
        names = ",".join(list(r["kernels"])[:2])[:60]
        print(f"{r['ms']:8.2f} ms {100 * r['share']:5.1f}%  {r['op'][:48]:<48} {names}")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)  # flag mistakes in one line, as the commands report them
