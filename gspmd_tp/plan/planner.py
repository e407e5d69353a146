"""What a run would cost under a rule file and mesh, without running it.

    python -m gspmd_tp.plan --config=configs/tiny.py [--config.KEY=VALUE ...] [--json]
    python -m gspmd_tp.plan --config=configs/tiny.py --compare=megatron_1d,megatron_2d \
        --meshes="dp=8,mp=1 dp=2,mp=4" --chart=plan.png
    python -m gspmd_tp.plan --config=configs/llama_1b.py --target=tpu:v5p:4x4x4 \
        --compare=megatron_1d,megatron_1d_sp --meshes=dp=16,mp=4 --overlaps=auto,collective_matmul
    python -m gspmd_tp.plan --config=configs/llama_1b.py --target=tpu:v5p:4x4x2 \
        --compare=megatron_2d --meshes=dp=8,mp=4 --mlp_slices=1,2,4
    python -m gspmd_tp.plan --config=configs/llama_1b.py --target=tpu:v5p:4x4x4 --config.mesh=dp=-1,mp=4
    python -m gspmd_tp.plan --config=configs/llama_1b.py --target=gpu:h100:8 --config.mesh=dp=-1,mp=8

Per parameter and optimizer-state leaf: shape, logical axes, resolved PartitionSpec, bytes per
device, and a flag where a large leaf is replicated over a mesh axis that could shard it. Per
device: memory of parameters, optimizer state and the compiled step's temporaries against the
ideal. Communication: every collective of the compiled train step (loop trip counts applied) and
the bytes each device sends per step under a ring algorithm, against an analytical model.

With --target=tpu:GENERATION:TOPOLOGY (libtpu installed: `pip install 'jax[tpu]==0.10.2'`) the
step is compiled by the real TPU compiler for a slice that is not attached, on a mesh built from
that slice's devices; plan then also says whether the step fits in the chip's HBM and estimates
the step time from FLOPs / peak and bytes / interconnect bandwidth. With --target=gpu:KIND[:HOSTSxGPUS]
(the CUDA plugin and cuDNN installed: `pip install -e '.[gpu-plan]'`) the same, from XLA's GPU
compiler run without a GPU (no autotuning: its kernel choices are the defaults).

The per-leaf table and the analytical model are in gspmd_tp/analysis.py, the chip figures and
the estimate in gspmd_tp/targets.py; this module compiles, measures, compares and reports. Across
GPU hosts (gpu:h100:2x8) and TPU slices (--slices) the bytes that cross the network are counted
apart and timed at its bandwidth (--network_gbps).
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # before jax is imported: Ctrl-C while importing is one line
    from gspmd_tp.job import entry

    entry.begin()  # main() asks for the config's devices once the flags are read

import contextlib
import copy
import itertools
import json
import os

import jax
import numpy as np

from gspmd_tp.cli import arguments
from gspmd_tp.cli.arguments import no_positional_arguments
from gspmd_tp.job import host_devices
from gspmd_tp.job.errors import UserError, exit_from_main, interrupted
from gspmd_tp.plan import analysis, calibration, hardware
from gspmd_tp.sharding import hlo
from gspmd_tp.sharding.mesh import mesh_file_name, mesh_string, parse_mesh
from gspmd_tp.sharding.rules import (
    IndivisibleError,
    check_distinct,
    column_widths,
    load_rules,
    resolve_path,
    short_names,
)
from gspmd_tp.storage import outputs, paths
from gspmd_tp.train import run_setup
from gspmd_tp.train import step as step_lib


class DoesNotFit(UserError):
    """The compiler ran out of the target's device memory for the step (the TPU compiler says so
    while it compiles); `reason` is its words. --compare reports it as that combination's row."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def plan(
    config,
    dump_hlo: str | None = None,
    target: str | None = None,
    slices: int = 1,
    s: run_setup.Setup | None = None,
    label: str | None = None,
    network_gbps: float | None = None,
    cal: calibration.Calibration | None = None,
    name_overlap: bool = False,
    name_slices: bool = False,
) -> dict:
    """Everything plan reports for one config (rule file and mesh included), as a JSON-able dict.

    With `target` ("tpu:v5p:4x4x4", "gpu:h100:8") the step is compiled for it instead of the local
    devices; `s` is the config's setup where it is already made. With `dump_hlo` the compiled
    step's HLO goes to DIR/LABEL_MESH.hlo.txt, LABEL the rule file's name unless given
    (DIR/LABEL_MESH_OVERLAP.hlo.txt with `name_overlap`, for a compare of several config.overlap;
    ..._slicesK.hlo.txt with `name_slices`, for several model.mlp_slices).
    `network_gbps` is the bandwidth between hosts or slices, per chip, for the target's estimate.
    With `cal` (calibration.load) the step time is estimated from its measurements, which must be
    of the plan's device kind, instead of the chip table.
    """
    if s is None:
        s = run_setup.setup(config, hardware.target_devices(target, slices) if target else None)
    if cal is not None:
        cal.check_kind(s.mesh.devices.flat[0].device_kind)  # before anything compiles
    rows = analysis.leaf_table(s)
    mesh = mesh_string(s.mesh)  # resolved: dp=-1 shows as the size it stands for
    label = label or short_names([s.rules.source])[s.rules.source]
    try:
        with hardware.no_cache_writes() if target else contextlib.nullcontext():
            compiled = step_lib.compile_train_step(s)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        reason = str(e).split("RESOURCE_EXHAUSTED:", 1)[1].strip().splitlines()[0].rstrip(".")
        raise DoesNotFit(
            f"{label} on mesh {mesh} does not fit {s.mesh.devices.flat[0].device_kind}: the compiler "
            f"stopped: {reason} (a smaller batch or sequence, config.grad_accum, model.remat, or "
            "another rule file or mesh: --compare ranks them)",
            reason,
        ) from None
    text = compiled.as_text()
    if dump_hlo:
        name = f"{label}_{mesh_file_name(mesh)}{'_' + s.config.overlap if name_overlap else ''}"
        name += f"_slices{s.model_cfg.mlp_slices}.hlo.txt" if name_slices else ".hlo.txt"
        paths.of(dump_hlo).mkdir(parents=True, exist_ok=True)
        (paths.of(dump_hlo) / name).write_text(text)
    n = s.mesh.size
    device = s.mesh.devices.flat[0]
    backend = device.platform
    # A target's GPU hosts are its processes, islands on the network.
    found = hlo.collectives(text, n, hlo.device_islands(s.mesh.devices.flat))
    collectives = hlo.summarize(found)
    largest = sorted(found, key=lambda c: -c.ring_bytes_per_call)[:8]
    stats = compiled.memory_analysis()
    total = {kind: sum(r["bytes"] for r in rows if r["kind"] == kind) for kind in ("params", "opt_state")}
    per_device = {
        kind: sum(r["bytes_per_device"] for r in rows if r["kind"] == kind)
        for kind in ("params", "opt_state")
    }
    analytical = analysis.analytical_bytes(s, rows, backend)
    measured = sum(v["ring_bytes_per_device"] for v in collectives.values())
    asked = hlo.summarize(hlo.as_asked(found))
    estimate = hardware.estimate(s, stats, found, target, network_gbps, text) if target else None
    if cal is not None:  # the measured figures replace the chip table's times; the fit stays
        # A step call allocates its temporaries and its outputs that do not reuse an input's buffer.
        allocations = (stats.temp_size_in_bytes, stats.output_size_in_bytes - stats.alias_size_in_bytes)
        timed = calibration.estimate(cal, found, text, allocations)
        estimate = {**{k: v for k, v in (estimate or {}).items() if not k.startswith("comm_")}, **timed}
    schedule = hlo.exposure(found)
    return {
        "target": target,
        "device_kind": device.device_kind,
        "estimate": estimate,
        "rules": s.rules.source,
        "label": label,  # the rule file's name, or its short_names label in a --compare
        "mesh": mesh,
        # config.overlap, and the compiler options passed for this backend: the platform's own
        # (step.PLATFORM_OPTIONS) and config.overlap's (docs/plan.md#overlap)
        "overlap": s.config.overlap,
        "compiler_options": step_lib.compiler_options(s),
        "mlp_slices": s.model_cfg.mlp_slices,  # the MLP's weight gathers in slices (docs/plan.md#overlap)
        "devices": n,
        "backend": backend,
        "params": [r for r in rows if r["kind"] == "params"],
        "opt_state": [r for r in rows if r["kind"] == "opt_state"],
        "memory": {
            "params": per_device["params"],
            "opt_state": per_device["opt_state"],
            "ideal_params": total["params"] / n,
            "ideal_opt_state": total["opt_state"] / n,
            "arguments": stats.argument_size_in_bytes,
            "outputs": stats.output_size_in_bytes,
            "aliased": stats.alias_size_in_bytes,  # outputs that reuse a (donated) input's buffer
            "temporaries": stats.temp_size_in_bytes,
        },
        "collectives": {
            k: {"count": v["count"], "bytes": v["bytes"], "dtypes": v["dtypes"]}
            for k, v in collectives.items()
        },
        "bytes_per_device": measured,
        "bytes_per_device_by_type": {k: v["ring_bytes_per_device"] for k, v in collectives.items()},
        # In the dtypes the program asked for: less than bytes_per_device where XLA:CPU promoted
        # bf16 all-reduces (config.optim.grad_reduce_dtype=bfloat16) to f32.
        "program_bytes_per_device": sum(v["ring_bytes_per_device"] for v in asked.values()),
        # Of which between GPU hosts or TPU slices.
        "network_bytes_per_device": hlo.network_bytes(found),
        # By the compiled schedule: bytes of collectives with compute between their start and done.
        "exposed_bytes_per_device": schedule["exposed"],
        "hidden_bytes_per_device": schedule["hidden"],
        "analytical_bytes_per_device": analytical["total"],
        "analytical": analytical,
        # No ratio against a total that leaves out some of the sharding (analysis.analytical_bytes).
        "ratio": measured / analytical["total"]
        if analytical["total"] and not analytical["unmodelled"]
        else None,
        "replicated": [r["path"] for r in rows if r["replicated_over"]],
        "largest_collectives": [
            {
                "kind": c.kind,
                "dtype": c.dtype + ("->f32" if c.promoted else ""),
                "group_size": c.group_size,
                "islands": c.islands,
                "executions": c.executions,
                "ring_bytes_per_device": c.ring_bytes_per_call,
                "op_name": c.op_name,
                "overlapped_with": len(c.window),  # compute instructions between its start and done
            }
            for c in largest
        ],
    }


def _mb(x: float) -> str:
    return f"{x / 2**20:,.3f} MiB"


def _estimate_lines(t: dict | None) -> list[str]:
    if not t:
        return []
    lines = []
    if "hbm_per_device" in t:
        verdict = "fits" if t["fits"] else "DOES NOT FIT"
        share = t.get("memory_fraction")
        of = f" (JAX's {share:.0%} of the GPU; XLA_PYTHON_CLIENT_MEM_FRACTION sets it)" if share else ""
        needed, per_device = _mb(t["hbm_needed"]), _mb(t["hbm_per_device"])
        lines.append(f"  HBM needed / per device {needed:>14} / {per_device}{of}: {verdict}")
    elif "step_s_estimate" not in t:
        return [f"  {t['device_kind']}: no memory/peak figures in the table; no fit or time estimate"]
    if "step_s_estimate" in t and "comm_link_s" not in t:  # from a calibration
        parts = ("step_s_estimate", "compute_s", "fresh_memory_s", "comm_exposed_s", "comm_hidden_s")
        step, compute, fresh, comm, hidden = (t.get(k, 0.0) * 1e3 for k in parts)
        new = f" + {fresh:.2f} ms first writing the memory the step allocates" if fresh else ""
        lines.append(
            f"  step time estimate: {step:.2f} ms (compute {compute:.2f} ms{new} + exposed communication "
            f"{comm:.2f} ms; {hidden:.2f} ms hidden by the schedule) from {t['source']}"
        )
    elif "step_s_estimate" in t:
        step, compute, link = (t[k] * 1e3 for k in ("step_s_estimate", "compute_s", "comm_link_s"))
        comm = f"{link:.2f} ms at {t['link']} bandwidth"
        if t["network_bytes_per_device"]:
            gbps = t["network_bandwidth"] * 8 * t["devices_per_chip"] / 1e9
            per = "GPU" if t.get("memory_fraction") else "chip"
            network = f"{t['comm_network_s'] * 1e3:.2f} ms over the {t['network']}"
            comm += f" + {network} at {gbps:g} Gb/s per {per}"
        hidden = t["comm_hidden_s"] * 1e3
        lines.append(
            f"  step time estimate: {step:.2f} ms (compute {compute:.2f} ms at peak + communication "
            f"{comm}, less {hidden:.2f} ms the schedule hides; {t['source']})"
        )
    else:
        lines.append(
            f"  step time: not estimated: no {t['network']} bandwidth for {t['device_kind']} in the table "
            "(--network_gbps=N gives it, per chip)"
        )
    return lines


def _ratio(p: dict) -> str:
    """measured / analytical, or why there is none."""
    if p["ratio"]:
        return f"{p['ratio']:.3f}"
    missing = p["analytical"]["unmodelled"]
    if missing:
        return f"n/a: the analysis does not model this rule file's {', '.join(missing)} sharding"
    return "n/a"


def format_plan(p: dict) -> str:
    """The human-readable report of one plan."""
    where = (
        f"target {p['target']}: {p['devices']} {p['device_kind']}"
        if p["target"]
        else (f"{p['devices']} {p['backend']}")
    )
    rules = os.path.relpath(p["rules"])  # rules/x.yaml when run from the repository
    rules = p["rules"] if rules.startswith("..") else rules
    lines = [f"plan: rules {rules} | mesh {p['mesh']} | {where} devices", ""]
    if p["overlap"] != "auto" or p["compiler_options"]:
        flags = {k: str(v).lower() if isinstance(v, bool) else v for k, v in p["compiler_options"].items()}
        options = " ".join(f"--{k}={v}" for k, v in flags.items()) or "none on this backend"
        asked = ""
        if p["overlap"] != "auto":
            lines[0] += f" | overlap {p['overlap']}"
            asked = f" (config.overlap={p['overlap']})"
        lines.insert(1, f"compiler options{asked}: {options}")
    lines.append(f"{'parameter':<26} {'shape':<20} {'logical':<44} {'spec':<28} {'per device':>12}")
    for r in p["params"]:
        logical = "(" + ", ".join(str(x) for x in r["logical"]) + ")"
        spec = "P(" + ", ".join(str(x) for x in r["spec"]) + ")"
        flag = f"  REPLICATED over {','.join(r['replicated_over'])}" if r["replicated_over"] else ""
        lines.append(
            f"{r['path'].removeprefix('params/'):<26} {str(tuple(r['shape'])):<20} {logical:<44} {spec:<28} "
            f"{_mb(r['bytes_per_device']):>12}{flag}"
        )
    flagged = [r["path"] for r in p["opt_state"] if r["replicated_over"]]
    if flagged:
        lines.append(f"optimizer state replicated where it could shard: {', '.join(flagged)}")
    m = p["memory"]
    lines += [
        "",
        "memory per device            actual        ideal (total / devices)",
        f"  parameters          {_mb(m['params']):>14} {_mb(m['ideal_params']):>14}",
        f"  optimizer state     {_mb(m['opt_state']):>14} {_mb(m['ideal_opt_state']):>14}",
        f"  step arguments      {_mb(m['arguments']):>14}",
        f"  step temporaries    {_mb(m['temporaries']):>14}",
        *_estimate_lines(p["estimate"]),
        "",
        f"collectives per step (compiled HLO, {p['backend']} backend)"
        "   count        bytes   ring bytes/device",
    ]
    for kind, v in p["collectives"].items():
        if v["count"]:
            label = f"{kind} ({', '.join(v['dtypes'])})"
            lines.append(
                f"  {label:<40} {v['count']:>8} {_mb(v['bytes']):>14} "
                f"{_mb(p['bytes_per_device_by_type'][kind]):>14}"
            )
    a = p["analytical"]
    lines.append(f"  {'total':<40} {'':>8} {'':>14} {_mb(p['bytes_per_device']):>14}")
    if p["program_bytes_per_device"] < p["bytes_per_device"]:
        asked = _mb(p["program_bytes_per_device"])
        note = "(XLA:CPU runs bf16 all-reduces in f32)"
        lines.append(f"  {'in the dtypes the program asked for':<40} {'':>8} {'':>14} {asked:>14}  {note}")
    for label, key in (("exposed in the schedule", "exposed"), ("overlapped with compute", "hidden")):
        lines.append(f"  {'of which ' + label:<40} {'':>8} {'':>14} {_mb(p[key + '_bytes_per_device']):>14}")
    if p["network_bytes_per_device"]:
        between = "GPU hosts" if p["backend"] == "gpu" else "slices (DCN)"
        lines.append(f"  {'of which between ' + between:<40} {'':>8} {'':>14} "
                     f"{_mb(p['network_bytes_per_device']):>14}")  # fmt: skip
    lines += [
        "",
        f"analytical bytes/device: {_mb(a['total'])} (tensor parallel {_mb(a['tensor_parallel'])}, "
        f"data parallel {_mb(a['data_parallel'])}, fsdp gather {_mb(a['fsdp_gather'])}, "
        f"fsdp reduce {_mb(a['fsdp_reduce'])}"
        + (f", expert dispatch {_mb(a['expert_dispatch'])}" if a.get("expert_dispatch") else "")
        + (
            f", context K/V {_mb(a['context_kv'])}, context gradients {_mb(a['context_grad'])})"
            if a.get("context_kv") or a.get("context_grad")
            else ")"
        ),
        f"measured / analytical: {_ratio(p)}",
        "",
        "largest collectives (ring bytes/device per step, the jax op they come from):",
    ]
    for c in p["largest_collectives"]:
        islands = f"[across {c['islands']} {'hosts' if p['backend'] == 'gpu' else 'slices'}]"
        where = " ".join(filter(None, [_short_op(c["op_name"]), islands if c["islands"] > 1 else ""]))
        lines.append(
            f"  {c['kind']:<18} {c['dtype']:<9} group {c['group_size']:<3} x{c['executions']:<4} "
            f"{_mb(c['ring_bytes_per_device']):>12}  {where}"
        )
    return "\n".join(lines)


def _short_op(name: str, width: int = 90) -> str:
    """A jax op name for the table: without the jit(step)/ every one starts with, and cut at the
    left (marked ...) where still longer than `width`."""
    name = name.removeprefix("jit(step)/")
    return name if len(name) <= width else "..." + name[-(width - 3) :]


def compare(
    config,
    rules_list: list[str],
    meshes: list[str],
    target=None,
    slices: int = 1,
    dump_hlo: str | None = None,
    network_gbps: float | None = None,
    cal: calibration.Calibration | None = None,
    overlaps: list[str] | None = None,
    mlp_slices: list[int] | None = None,
) -> list[dict]:
    """plan() for every rule file x mesh whose axes are the rule file's mesh_axes (rule files with
    other axis names compare with meshes in theirs), under each config.overlap of `overlaps` and
    each model.mlp_slices of `mlp_slices` (default: the config's own). Every combination is set up
    before anything compiles: a rule file, mesh or config the user can fix, a rule file or mesh
    given twice however spelt, or one paired with nothing, raises UserError; a model size the mesh
    cannot divide is reported as that combination's row (`error`)."""
    overlaps = overlaps or [config.overlap]
    mlp_slices = mlp_slices or [config.model.mlp_slices]
    devices = hardware.target_devices(target, slices) if target else None
    count = len(devices) if devices is not None else jax.device_count()
    check_distinct(rules_list, meshes, count, "--compare", "each rule file x mesh is planned once")
    labels = short_names(rules_list)
    axes = {rules: load_rules(rules).mesh_axes for rules in rules_list}
    sizes_of = {mesh: parse_mesh(mesh, count) for mesh in meshes}
    for mesh, sizes in sizes_of.items():
        if not any(set(sizes) == set(a) for a in axes.values()):
            raise UserError(
                f"mesh {mesh!r} names axes {sorted(sizes)}, which no rule file of --compare has as its "
                f"mesh_axes ({'; '.join(f'{labels[r]}: {list(a)}' for r, a in axes.items())})"
            )
    for rules, a in axes.items():
        if not any(set(sizes) == set(a) for sizes in sizes_of.values()):
            raise UserError(
                f"{labels[rules]}: no mesh given names its mesh_axes {list(a)} "
                f"(add one, e.g. {','.join(f'{x}=N' for x in a)})"
            )

    def failed(rules: str, mesh: str, c, error: str) -> dict:
        """The row of a combination that has no figures: which it is, and why."""
        row = {"rules": str(resolve_path(rules)), "label": labels[rules], "mesh": mesh}
        return {**row, "overlap": c.overlap, "mlp_slices": c.model.mlp_slices, "error": error}

    prepared = []
    for rules in rules_list:
        for mesh in meshes:
            sizes = sizes_of[mesh]
            if set(sizes) != set(axes[rules]):
                continue
            for overlap, k in itertools.product(overlaps, mlp_slices):
                c = copy.deepcopy(config)
                c.rules, c.mesh, c.overlap, c.model.mlp_slices = rules, mesh, overlap, k
                try:
                    prepared.append((rules, c, run_setup.setup(c, devices)))
                except IndivisibleError as e:
                    resolved = ",".join(f"{k}={v}" for k, v in sizes.items())
                    prepared.append((rules, failed(rules, resolved, c, str(e)), None))
    if all(s is None for _, _, s in prepared):
        raise UserError(f"no rule file x mesh of --compare fits this model; first: {prepared[0][1]['error']}")
    results = []
    for rules, c, s in prepared:
        if s is None:
            results.append(c)
            continue
        try:
            results.append(
                plan(
                    c,
                    dump_hlo,
                    target,
                    slices,
                    s=s,
                    label=labels[rules],
                    network_gbps=network_gbps,
                    cal=cal,
                    name_overlap=len(overlaps) > 1,
                    name_slices=len(mlp_slices) > 1,
                )
            )
        except DoesNotFit as e:  # a row of its own: the compiler's reason, no figures
            results.append(failed(rules, mesh_string(s.mesh), c, f"does not fit: {e.reason}"))
    return results


def _several_overlaps(results: list[dict]) -> bool:
    """Whether the rows are of more than one config.overlap (plan --compare --overlaps=A,B)."""
    return len({r.get("overlap") for r in results}) > 1


def _several_slices(results: list[dict]) -> bool:
    """Whether the rows are of more than one model.mlp_slices (plan --compare --mlp_slices=1,4)."""
    return len({r.get("mlp_slices") for r in results}) > 1


def _variant(r: dict, several_overlaps: bool, several_slices: bool) -> list[str]:
    """What sets a row apart beside its rule file and mesh: its overlap and its MLP slices, each
    where the rows compare several."""
    return [r["overlap"]] * several_overlaps + [f"mlp_slices={r.get('mlp_slices')}"] * several_slices


def _choice(timed: list[dict], several_overlaps: bool, several_slices: bool = False) -> str:
    """The line naming the fastest timed row and its margin to the runner-up."""
    best, runner_up = sorted(timed, key=lambda r: r["estimate"]["step_s_estimate"])[:2]
    t0, t1 = (r["estimate"]["step_s_estimate"] for r in (best, runner_up))
    margin = 1 - t0 / t1 if t1 else 0.0  # the share of the runner-up's step time the choice saves
    chosen, other = (_variant(r, several_overlaps, several_slices) for r in (best, runner_up))
    if several_overlaps:
        chosen[0] = f"overlap {chosen[0]}"
    chosen = f" with {', '.join(chosen)}" if chosen else ""
    other = "".join(f", {v}" for v in other)
    return (
        f"choice: {best['label']} on {best['mesh']}{chosen}: {t0 * 1e3:.2f} ms, {margin:.1%} faster "
        f"than the runner-up ({runner_up['label']} on {runner_up['mesh']}{other}: {t1 * 1e3:.2f} ms)"
    )


def format_compare(results: list[dict]) -> str:
    """A table: one row per rule file x mesh (x overlap, a column where more than one is compared),
    then, where two or more rows have an estimated step time and fit, the choice and its margin."""
    # Columns as wide as the longest label and mesh (a path's file name, data=2,model=4), at least
    # as wide as the shipped ones need, so that the figures stay under their headings.
    nw, mw = column_widths(results, "label", (14, 12))
    several, sliced = _several_overlaps(results), _several_slices(results)
    ow = max(len("overlap"), *(len(str(r.get("overlap"))) for r in results))

    def place(r: dict) -> str:
        """The mesh column, and the overlap and slices columns where several are compared."""
        text = f"{r['mesh']:<{mw}}" + (f" {r.get('overlap')!s:<{ow}}" if several else "")
        return text + (f" {r.get('mlp_slices')!s:>10}" if sliced else "")

    head = (
        f"{'rules':<{nw}} {place({'mesh': 'mesh', 'overlap': 'overlap', 'mlp_slices': 'mlp_slices'})} "
        f"{'params+opt/dev':>15} "
        f"{'temps/dev':>12} {'comm/dev':>12} {'analytical':>12} {'ratio':>6}"
    )
    # Where some bytes cross GPU hosts or TPU slices, a column of those (part of comm/dev).
    networked = any(r.get("network_bytes_per_device") for r in results)
    if networked:
        head += f" {'of which net':>13}"
    lines = [head]
    timed = [
        r
        for r in results
        if (r.get("estimate") or {}).get("fits", True) and "step_s_estimate" in (r.get("estimate") or {})
    ]
    best = min(timed, key=lambda r: r["estimate"]["step_s_estimate"]) if timed else None
    if timed:
        lines[0] += f" {'est. step':>10} {'fits':>5}"
    for r in results:
        name = r["label"]
        if "error" in r:
            lines.append(f"{name:<{nw}} {place(r)} {r['error']}")
            continue
        m = r["memory"]
        lines.append(
            f"{name:<{nw}} {place(r)} {_mb(m['params'] + m['opt_state']):>15} "
            f"{_mb(m['temporaries']):>12} "
            f"{_mb(r['bytes_per_device']):>12} {_mb(r['analytical_bytes_per_device']):>12} "
            f"{_ratio(r).split(':')[0]:>6}"
        )
        if networked:
            lines[-1] += f" {_mb(r['network_bytes_per_device']):>13}"
        t = r.get("estimate") or {}
        if "step_s_estimate" in t:
            fits = {True: "yes", False: "NO"}.get(t.get("fits"), "-")
            lines[-1] += f" {t['step_s_estimate'] * 1e3:>8.2f}ms {fits:>5}"
            lines[-1] += "  <- best" if r is best else ""
    for r in results:
        if "error" not in r and r["analytical"]["unmodelled"]:
            variant = "".join(f" {v}" for v in _variant(r, several, sliced))
            lines.append(f"{r['label']} {r['mesh']}{variant}: ratio {_ratio(r)}")
    if len(timed) > 1:
        lines.append(_choice(timed, several, sliced))
    return "\n".join(lines)


def chart(results: list[dict], path: str) -> None:
    """A PNG with bytes sent and memory per device for each rule file x mesh (x overlap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    several, sliced = _several_overlaps(results), _several_slices(results)
    labels = ["\n".join([r["label"], r["mesh"], *_variant(r, several, sliced)]) for r in ok]
    x = np.arange(len(ok))
    timed = [r for r in ok if (r.get("estimate") or {}).get("step_s_estimate")]
    panels = 3 if timed else 2
    fig, axs = plt.subplots(panels, 1, figsize=(min(16, 4 + 0.8 * len(ok)), 4 * panels))
    ax1, ax2 = axs[0], axs[1]
    ax1.bar(x - 0.2, [r["bytes_per_device"] / 2**20 for r in ok], 0.4, label="measured (HLO)")
    ax1.bar(x + 0.2, [r["analytical_bytes_per_device"] / 2**20 for r in ok], 0.4, label="analytical")
    ax1.set_title("bytes sent per device per step")
    ax1.set_ylabel("MiB")
    ax1.legend()
    mem = [(r["memory"]["params"] + r["memory"]["opt_state"]) / 2**20 for r in ok]
    temps = [r["memory"]["temporaries"] / 2**20 for r in ok]
    ax2.bar(x, mem, 0.6, label="params + optimizer state")
    ax2.bar(x, temps, 0.6, bottom=mem, label="temporaries")
    ax2.set_title("memory per device")
    ax2.set_ylabel("MiB")
    ax2.legend()
    if timed:
        ax3 = axs[2]
        est = [(r.get("estimate") or {}).get("step_s_estimate", 0) * 1e3 for r in ok]
        colors = ["tab:green" if (r.get("estimate") or {}).get("fits") else "tab:red" for r in ok]
        ax3.bar(x, est, 0.6, color=colors)
        ax3.set_title(
            "estimated step time (FLOPs / peak + bytes / interconnect or network; "
            "red: does not fit in memory)"
        )
        ax3.set_ylabel("ms")
    for ax in axs:
        ax.set_xticks(x, labels, fontsize=7, rotation=30, ha="right")
    fig.tight_layout()
    with outputs.whole_file(path) as partial:  # a chart cut short leaves the old one as it was
        fig.savefig(partial, dpi=110, format=os.path.splitext(path)[1].lstrip(".").lower())
    plt.close(fig)


def check_flags(
    compare_flag: str,
    meshes: str,
    chart_path: str,
    dump_hlo: str | None,
    target: str | None,
    slices: int,
    network: float | None,
    overlaps: str = "",
    mlp_slices: str = "",
) -> tuple[list[str], list[str], list[int]]:
    """The CLI's flags checked together before anything compiles (a UserError names the mistake);
    returns the --compare rule files ([] for a single plan), the --overlaps values and the
    --mlp_slices counts ([] for the config's own)."""
    if meshes and not compare_flag:
        raise UserError(f"--meshes={meshes} is for --compare; a single plan takes --config.mesh")
    if chart_path and not compare_flag:
        raise UserError(f"--chart={chart_path} is for --compare")
    if overlaps and not compare_flag:
        raise UserError(f"--overlaps={overlaps} is for --compare; a single plan takes --config.overlap")
    if mlp_slices and not compare_flag:
        raise UserError(
            f"--mlp_slices={mlp_slices} is for --compare; a single plan takes --config.model.mlp_slices"
        )
    if slices != 1 and not target:
        raise UserError(f"--slices={slices} needs --target (slices of a TPU target)")
    if slices < 1:
        raise UserError(f"--slices={slices}: a target has at least 1 slice")
    if network is not None and not target:
        raise UserError(f"--network_gbps={network:g} needs --target (the network of a target's hosts)")
    if network is not None and not 0 < network < float("inf"):
        raise UserError(f"--network_gbps={network:g}: expected a finite bandwidth above 0 (Gb/s)")
    if chart_path:
        outputs.check_image(chart_path, "--chart")
    if dump_hlo:
        outputs.check_dir(dump_hlo, "--dump_hlo", probe=True)
    rules_list = [r.strip() for r in compare_flag.split(",")] if compare_flag else []
    if not all(rules_list):
        raise UserError(f"--compare={compare_flag}: an empty rule file name (comma-separated names)")
    overlap_list = [o.strip() for o in overlaps.split(",")] if overlaps else []
    for i, o in enumerate(overlap_list):
        if o not in step_lib.OVERLAP_OPTIONS:
            expected = ", ".join(step_lib.OVERLAP_OPTIONS)
            raise UserError(f"--overlaps={overlaps}: {o!r} is not one of {expected} (comma-separated)")
        if o in overlap_list[:i]:
            raise UserError(
                f"--overlaps: overlap {o!r} is given twice (each rule file x mesh x overlap is planned once)"
            )
    if len(overlap_list) > 1 and not target:
        raise UserError(
            f"--overlaps={overlaps} needs --target: XLA:CPU has no collective matmul, so on CPU devices "
            "every overlap compiles the same step (--target=tpu:... or gpu:... compares them)"
        )
    slice_list = []
    for k in mlp_slices.split(",") if mlp_slices else []:
        if not k.strip().isdigit() or int(k) < 1:
            raise UserError(
                f"--mlp_slices={mlp_slices}: {k.strip()!r} is not a count of 1 or more (comma-separated)"
            )
        if int(k) in slice_list:
            raise UserError(
                f"--mlp_slices: {int(k)} is given twice (each rule file x mesh x count is planned once)"
            )
        slice_list.append(int(k))
    return rules_list, overlap_list, slice_list


def main(argv) -> None:
    """CLI: python -m gspmd_tp.plan --config=... [--json] [--compare=... --meshes=... --overlaps=...
    --mlp_slices=...]."""
    no_positional_arguments(argv)
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value
    if _TARGET.value and "JAX_PLATFORMS" not in os.environ:
        # Compile for a TPU or GPUs that are not attached: JAX must not try to open one.
        jax.config.update("jax_platforms", "cpu")
    host_devices.request(config.host_device_count, config.host_malloc_tuning)  # before jax's backend starts
    network = _NETWORK_GBPS.value
    try:
        cal = calibration.load(_CALIBRATION.value) if _CALIBRATION.value else None
        rules_list, overlaps, mlp_slices = check_flags(
            _COMPARE.value,
            _MESHES.value,
            _CHART.value,
            _DUMP_HLO.value,
            _TARGET.value,
            _SLICES.value,
            network,
            _OVERLAPS.value,
            _MLP_SLICES.value,
        )
        if rules_list:
            meshes = _MESHES.value.split() if _MESHES.value else [config.mesh]
            results = compare(
                config,
                rules_list,
                meshes,
                _TARGET.value,
                _SLICES.value,
                _DUMP_HLO.value,
                network,
                cal,
                overlaps,
                mlp_slices,
            )
            if _CHART.value:
                chart(results, _CHART.value)
            print(json.dumps({"results": results}) if _JSON.value else format_compare(results))
            if _CHART.value and not _JSON.value:
                print(f"chart: {_CHART.value}")
        else:
            p = plan(config, _DUMP_HLO.value, _TARGET.value, _SLICES.value, network_gbps=network, cal=cal)
            print(json.dumps(p) if _JSON.value else format_plan(p))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        left = [f"--chart={_CHART.value} is as it was"] if _CHART.value else []
        if _DUMP_HLO.value:
            left.append(f"--dump_hlo={_DUMP_HLO.value} holds the HLO of the steps compiled before it")
        exit_from_main(interrupted("; ".join(left) or "nothing written"))


if __name__ == "__main__":
    from absl import flags

    from gspmd_tp.cli.arguments import define_config, parse_flags

    _CONFIG = define_config("tiny", "A config file, or the name of a shipped one (configs/NAME.py).")
    _JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of the report.")
    _COMPARE = flags.DEFINE_string("compare", "", "Comma-separated rule files to compare side by side.")
    _MESHES = flags.DEFINE_string(
        "meshes", "", 'Space-separated meshes for --compare ("dp=8,mp=1 dp=2,mp=4").'
    )
    _OVERLAPS = flags.DEFINE_string(
        "overlaps",
        "",
        "Comma-separated config.overlap values for --compare to plan each rule file x mesh under "
        "(auto,none,collective_matmul; more than one needs --target). Default: config.overlap.",
    )
    _MLP_SLICES = flags.DEFINE_string(
        "mlp_slices",
        "",
        "Comma-separated model.mlp_slices counts for --compare to plan each rule file x mesh under "
        "(1,2,4: the MLP's weight gathers whole, in 2 or in 4 slices). Default: config.model.mlp_slices.",
    )
    _CHART = arguments.define_path("chart", "", "With --compare: write a PNG chart here.")
    _DUMP_HLO = arguments.define_path(
        "dump_hlo", None, "Write the compiled train step's HLO text here (with --compare, one file each)."
    )
    _TARGET = flags.DEFINE_string(
        "target",
        None,
        "Compile for a TPU slice (tpu:v5p:4x4x4; needs libtpu) or GPUs not attached "
        "(gpu:h100:8, gpu:h100:2x8 for 2 hosts of 8; needs the gpu-plan extra).",
    )
    _SLICES = flags.DEFINE_integer("slices", 1, "With --target: that many slices joined over DCN.")
    _NETWORK_GBPS = flags.DEFINE_float(
        "network_gbps",
        None,
        "With --target: the network between GPU hosts or TPU slices, in Gb/s per GPU or chip each way "
        "(default: a DGX's NIC per GPU; the DCN of TPU v5e and v5p).",
    )
    _CALIBRATION = arguments.define_path(
        "calibration",
        None,
        "Estimate the step time from this file's measurements (python -m gspmd_tp.plan calibrate) "
        "instead of the chip table; it must be of the plan's device kind.",
    )
    entry.run(main, flags_parser=parse_flags)
