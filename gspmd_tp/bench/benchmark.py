"""Timing the real train step: compile once, warm up, time steps; throughput, MFU, roofline.

On CPU there is no published peak, so the same run measures the rate of a large jit matrix
product in float32 and in bfloat16, and `roofline_fraction` is the model's FLOP/s over the faster
of the two: figures that compare across machines, which a slow dtype cannot flatter.

In a multi-process job (bench.py given train.py's job flags) every process runs the same steps and
process 0 reports its timings; the bytes that the step's collectives move between hosts are counted
apart (GPU hosts; a TPU program names its transfers between slices itself).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import socket
import statistics
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from gspmd_tp.cli import config_keys
from gspmd_tp.job import distributed
from gspmd_tp.job.errors import UserError
from gspmd_tp.model.params import flops_per_token
from gspmd_tp.model.transformer import Transformer
from gspmd_tp.sharding import hlo
from gspmd_tp.sharding import rules as rules_lib
from gspmd_tp.sharding.mesh import mesh_file_name
from gspmd_tp.train import metrics, profiling, run_setup
from gspmd_tp.train import state as state_lib
from gspmd_tp.train import step as step_lib


def _hosts() -> list[int]:
    """Each process's host, numbered from 0 in process order (by a 48-bit digest of its name)."""
    digest = hashlib.sha256(socket.gethostname().encode()).digest()
    rows = distributed.every_process([int.from_bytes(digest[i : i + 3], "little") for i in (0, 3)])
    numbers: dict[tuple[int, ...], int] = {}
    return [numbers.setdefault(tuple(row), len(numbers)) for row in rows]


def matmul_rate(dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n jit matrix product on the first device (best of `repeats`)."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def matmul_rates(dtypes: dict, hosts: int) -> dict[str, float]:
    """{name: matmul_rate(dtype)} of one host: in a multi-process job, measured by process 0 while
    the others wait (idle), and given to all of them; the roofline is that rate times the `hosts`
    (taken to be alike)."""
    if jax.process_count() == 1:
        return {name: matmul_rate(dtype) for name, dtype in dtypes.items()}
    mine = [matmul_rate(dtype) / 1e6 for dtype in dtypes.values()] if jax.process_index() == 0 else []
    shared = distributed.every_process([round(r) for r in mine])[0]  # MFLOP/s, as int32
    return {name: 1e6 * rate for name, rate in zip(dtypes, shared, strict=True)}


def profile_step(step, state, batch, directory: str) -> tuple[dict, float, object]:
    """Traces one step with jax.profiler into `directory`. Returns, per hlo.GROUPS entry, the
    milliseconds per device spent in the compiled step's instructions and their share; the traced
    step's wall time in seconds (the profiler's own threads share the host's cores, so on CPU it is
    slower than an untraced step); and the new state (the step donates the old one)."""
    groups = hlo.classify(step.as_text())
    with jax.profiler.trace(directory, profiler_options=profiling.options()):
        t0 = time.perf_counter()
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        traced_s = time.perf_counter() - t0
    trace = profiling.newest_trace(directory)
    if trace is None:
        return {}, traced_s, state
    shares = profiling.device_time_shares(trace, groups, jax.local_device_count())  # this process's
    return shares, traced_s, state


def time_phases(s, step, state, batch, steps: int) -> tuple[dict, object]:
    """Median seconds of the whole step, of the loss and its gradient, and of the forward pass alone
    (the loss), the latter two compiled on their own under the run's shardings. The three are timed
    in interleaved rounds, so a busy spell of a shared machine lands on all of them, and their
    differences split the step into forward, backward and optimizer update. Returns (times, state)."""
    model = Transformer(s.model_cfg)
    c = s.config
    with state_lib.sharding_context(s.mesh, s.rules):
        forward = step_lib.make_eval_step(s).lower(s.abstract_state.params, batch).compile()
        gradient = (
            jax.jit(
                lambda p, t: step_lib.accumulated_grads(
                    model, c.grad_accum, s.shardings.params, p, t, c.loss_chunk, step_lib.grad_reduce_dtype(s)
                ),
                in_shardings=(s.shardings.params, s.batch_sharding),
                out_shardings=(state_lib.replicated(s.mesh), s.shardings.params),
            )
            .lower(s.abstract_state.params, batch)
            .compile()
        )
    times = {"phase_step_s": [], "gradient_s": [], "forward_s": []}
    for i in range(steps + 1):  # round 0 warms the two new functions up
        t = time.perf_counter()
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        t_step = time.perf_counter() - t
        for name, fn in (("gradient_s", gradient), ("forward_s", forward)):
            t = time.perf_counter()
            jax.block_until_ready(fn(state.params, batch))
            if i:
                times[name].append(time.perf_counter() - t)
        if i:
            times["phase_step_s"].append(t_step)
    return {k: statistics.median(v) for k, v in times.items()}, state


def _compile(s: run_setup.Setup):
    """(compiled train step, compile seconds) of setup `s`, checked to fit (run_setup.check_memory)."""
    t0 = time.perf_counter()
    step = step_lib.compile_train_step(s)
    compile_s = time.perf_counter() - t0
    run_setup.check_memory(step.memory_analysis(), s.mesh)
    return step, compile_s


def _start(config, s: run_setup.Setup, step, warmup: int):
    """(state, batch) of `config` (setup `s`) after `warmup` runs of its compiled `step`."""
    state = state_lib.init_state(s.model_cfg, s.tx, s.mesh, s.rules, config.seq_len, config.seed)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.model.vocab_size, (config.batch_size, config.seq_len + 1), np.int32)
    # Every process made the same tokens (and their segments, where the step takes them) and gives
    # its devices their pieces (one process: all).
    batch = jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, s.batch_sharding, lambda index: x[index]),
        step_lib.host_batch(s, tokens),
    )
    for _ in range(warmup):
        state, _ = step(state, batch)
    jax.block_until_ready(state)
    return state, batch


def _compiled(config, warmup: int, s: run_setup.Setup | None = None):
    """(setup, compiled step, state, batch, compile seconds) for `config` (whose setup `s` may be
    given), after `warmup` steps."""
    s = s or run_setup.setup(config)
    step, compile_s = _compile(s)
    return s, step, *_start(config, s, step, warmup), compile_s


def _time_steps(step, state, batch, n: int, times: list[float]):
    """Runs `n` steps, appending each one's seconds to `times`: from the end of the step before it
    (or the start) to its own end. Each step is waited for only once the next one is queued, so
    the host's dispatch overlaps the device's work, as in training, which never waits for a step.
    Returns (state, last stats)."""
    start, pending = time.perf_counter(), None
    for _ in range(n):
        state, stats = step(state, batch)
        if pending is not None:
            jax.block_until_ready(pending)
            now = time.perf_counter()
            times.append(now - start)
            start = now
        pending = stats
    jax.block_until_ready(state)
    times.append(time.perf_counter() - start)
    return state, stats


def _speed(s, config, times: list[float], compile_s: float) -> dict:
    """The fields every report row has, from the step times of `config` (setup `s`): throughput,
    median / min / max step time, compile time, model FLOP/s and MFU (the roofline left to run)."""
    step_s = statistics.median(times)
    tokens_per_sec = config.batch_size * config.seq_len / step_s
    flops = flops_per_token(s.model_cfg, config.seq_len)
    peak = metrics.peak_flops(s.mesh.devices.flat[0].device_kind, config.peak_flops_per_device)
    return {
        "rules": config.rules,
        "mesh": config.mesh,
        "tokens_per_sec": tokens_per_sec,
        "step_s": step_s,
        "step_s_min": min(times),
        "step_s_max": max(times),
        "compile_s": compile_s,
        "model_flops_per_sec": flops * tokens_per_sec,
        "mfu": metrics.mfu(flops, tokens_per_sec, s.mesh.size, peak),
        "roofline_fraction": None,
    }


def bench_one(
    config,
    s: run_setup.Setup,
    steps: int,
    warmup: int,
    profile_dir: str = "",
    phases: bool = False,
    host_of_process=(0,),
) -> dict:
    """One rule file x mesh (`config` and its setup `s`): compile, warm up, time `steps` steps (each
    waited for); with `profile_dir`, then trace one more step there (in a multi-process job, each
    process under process_N); with `phases`, also time the forward pass and the gradient alone
    (time_phases). `host_of_process` (distributed.hosts) places the devices on hosts, for the bytes
    that cross between them. The roofline fraction is left to `run`."""
    s, step, state, batch, compile_s = _compiled(config, warmup, s)
    times = []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    state, stats = _time_steps(step, state, batch, steps, times)
    # Cores this process kept busy over the timed steps (on CPU: how much of the machine the
    # simulated devices use; below the core count, devices wait on one another).
    cpu_busy = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    profile = traced_s = None
    if profile_dir:
        if jax.process_count() > 1:
            profile_dir = os.path.join(profile_dir, f"process_{jax.process_index()}")
        profile, traced_s, state = profile_step(step, state, batch, profile_dir)
    split = {}
    if phases:
        split, state = time_phases(s, step, state, batch, steps)
    return {
        **_row(s, config, step, times, compile_s, cpu_busy, stats, host_of_process),
        "profile": profile,
        "profiled_step_s": traced_s,
        **split,
    }


def _row(s, config, step, times: list[float], compile_s: float, cpu_busy: float, stats, host_of_process):
    """A report row of `config` (setup `s`, compiled `step`) from its step `times`: _speed's fields,
    the compiled step's memory per device and collective bytes, this host's busy cores over the
    timed steps (`cpu_busy`, this process's; in a multi-process job summed over the processes of
    process 0's host, every process calling), and the last step's loss (`stats`)."""
    if jax.process_count() > 1:  # every process on process 0's host
        busy = distributed.every_process([round(1000 * cpu_busy)])
        mine = host_of_process[0]
        cpu_busy = sum(b / 1000 for (b,), h in zip(busy, host_of_process, strict=True) if h == mine)
    text = step.as_text()
    found = hlo.collectives(text, s.mesh.size, hlo.device_islands(s.mesh.devices.flat, host_of_process))
    comm = hlo.summarize(found)
    mem = step.memory_analysis()
    return {
        **_speed(s, config, times, compile_s),
        "memory_per_device": {
            "arguments": mem.argument_size_in_bytes,
            "temporaries": mem.temp_size_in_bytes,
        },
        "collective_bytes_per_device": sum(v["ring_bytes_per_device"] for v in comm.values()),
        # Of which between hosts (GPU) or slices (TPU).
        "network_bytes_per_device": hlo.network_bytes(found),
        "host_cpu_busy_cores": cpu_busy,
        "loss": float(stats["loss"]),
        "profile": None,
        "profiled_step_s": None,
    }


@dataclasses.dataclass
class _Held:
    """One compiled step held in memory with its state, timed in rounds among others."""

    config: object
    setup: run_setup.Setup
    step: object
    compile_s: float
    state: object = None
    batch: object = None
    stats: object = None
    times: list[float] = dataclasses.field(default_factory=list)
    cpu_s: float = 0.0
    wall_s: float = 0.0


def _timed_in_rounds(prepared: list[tuple], rounds: int, round_steps: int, warmup: int) -> list[_Held]:
    """The steps of `prepared`'s (config, setup) pairs, each compiled in this process, then all of
    them (checked to fit in memory together) warmed up and timed in alternating rounds of
    `round_steps` steps: a busy spell of a shared machine lands on all of them alike."""
    held = [_Held(c, s, *_compile(s)) for c, s in prepared]
    if len(held) > 1:
        _check_held_memory(held)
    for h in held:
        h.state, h.batch = _start(h.config, h.setup, h.step, warmup)
    for _ in range(rounds):
        for h in held:
            cpu0, wall0 = time.process_time(), time.perf_counter()
            h.state, h.stats = _time_steps(h.step, h.state, h.batch, round_steps, h.times)
            h.cpu_s += time.process_time() - cpu0
            h.wall_s += time.perf_counter() - wall0
    return held


def _check_held_memory(held: list[_Held]) -> None:
    """UserError (run_setup.check_memory's) where the states of all `held` steps and their working
    memory do not fit together, before any state is made: on an accelerator the largest step's (its
    allocator hands each step's freed temporaries to the next), on CPU all of them (the tuned heap,
    host_devices.tune_malloc, keeps freed blocks: the process held up to 2.3x one long-sequence
    step's compiled memory, and four such steps, the largest needing 7.5 GiB, were killed for memory
    on a 23.5 GiB host)."""
    stats = [h.step.memory_analysis() for h in held]
    work = [m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes for m in stats]
    on_cpu = held[0].setup.mesh.devices.flat[0].platform == "cpu"
    together = types.SimpleNamespace(
        argument_size_in_bytes=sum(m.argument_size_in_bytes for m in stats),
        output_size_in_bytes=sum(work) if on_cpu else max(work),
        temp_size_in_bytes=0,
        alias_size_in_bytes=0,
    )
    run_setup.check_memory(
        together,
        held[0].setup.mesh,
        f"set of {len(held)} train steps held at once",
        "time fewer of them at once",
    )


def alternate(prepared: list[tuple], rounds: int, round_steps: int, warmup: int, host_of_process) -> list:
    """Rule files x meshes (`prepared`'s (config, setup) pairs) timed against one another in
    alternating rounds (_timed_in_rounds): one report row each, as bench_one's, from all its
    rounds' steps."""
    return [
        _row(h.setup, h.config, h.step, h.times, h.compile_s, h.cpu_s / h.wall_s, h.stats, host_of_process)
        for h in _timed_in_rounds(prepared, rounds, round_steps, warmup)
    ]


def parse_variants(text: str) -> list[dict[str, str]]:
    """[{"model.remat": "none"}, {"model.attention_block": "128", "model.dtype": "bfloat16"}] from
    "model.remat=none;model.attention_block=128,model.dtype=bfloat16": sets of config overrides,
    `;` between sets and `,` inside one. An item with no `=` continues the value before it, so
    list values read as written: "model.remat_save=attn_in,mlp_in"."""
    variants = []
    for part in text.split(";"):
        overrides = {}
        for item in part.split(","):
            key, eq, value = item.strip().partition("=")
            if not eq and key and overrides:  # "a,b" in a list value: the last key's value goes on
                last = next(reversed(overrides))
                overrides[last] += "," + key
                continue
            if key in ("mesh", "rules"):  # its "," would split a mesh; and every row has its own
                flag = "--meshes" if key == "mesh" else "--rules"
                raise UserError(
                    f"--variants: {key} is chosen by {flag}, not by a variant "
                    "(each mesh and rule file is timed with every variant)"
                )
            if not eq or not key:
                raise UserError(f"--variants: {item.strip()!r} in {part.strip()!r} is not KEY=VALUE")
            overrides[key] = value
        variants.append(overrides)
    return variants


def variant_name(overrides: dict[str, str]) -> str:
    """How a variant is shown: its overrides as KEY=VALUE,..., or "(as configured)"."""
    return ",".join(f"{k}={v}" for k, v in overrides.items()) or "(as configured)"


def variant_setups(config, variants: list[dict[str, str]]) -> list[tuple]:
    """(name, config, setup) of `config` as given and of each variant of it (a set of config
    overrides): every override and setup checked, nothing compiled yet."""
    try:
        configs = [config_keys.apply_overrides(copy.deepcopy(config), o) for o in [{}, *variants]]
        setups = [run_setup.setup(c) for c in configs]
    except UserError as e:
        raise UserError(f"--variants: {e}") from None
    return list(zip([variant_name(o) for o in [{}, *variants]], configs, setups, strict=True))


def compare_variants(prepared: list[tuple], rounds: int, round_steps: int, warmup: int) -> list[dict]:
    """The steps of variant_setups' configs, each compiled in this process and warmed up, then
    timed in alternating rounds of `round_steps` steps: a busy spell of a shared machine lands on
    all of them alike (all of them held in memory at once). One row per variant, the configured
    step first, with `change` its median step time over the configured one's, less one."""
    names, configs, setups = zip(*prepared, strict=True)
    held = _timed_in_rounds(list(zip(configs, setups, strict=True)), rounds, round_steps, warmup)
    base = statistics.median(held[0].times)
    return [
        {
            **_speed(h.setup, h.config, h.times, h.compile_s),
            "variant": name,
            "change": statistics.median(h.times) / base - 1,
        }
        for name, h in zip(names, held, strict=True)
    ]


def run(
    config,
    rules_list: list[str],
    meshes: list[str],
    steps: int,
    warmup: int,
    profile_dir: str = "",
    phases: bool = False,
    variants: list[dict[str, str]] | None = None,
    rounds: int = 5,
    round_steps: int = 3,
    alternate_points: bool = False,
) -> dict:
    """Benchmarks every rule file x mesh; on CPU also the matmul roofline, in the same run. With
    `profile_dir`, each is also profiled (a trace per rule file x mesh under it); with `phases`,
    its step is split into forward, backward and optimizer (time_phases). With `variants`, each
    rule file x mesh is instead timed against those variants of the config (compare_variants,
    `rounds` alternating rounds of `round_steps` steps after `warmup`), one row per variant. With
    `alternate_points`, the rule files x meshes are timed against one another in such rounds
    instead of one after another (alternate).

    The matmul rates are measured before and after the steps and the higher of each kept: a
    momentarily busy machine must not lower the roofline and so flatter the fraction.

    In a multi-process job every process must call it with the same arguments and config (a
    difference is a JobError on every process, before anything is compiled); each returns the
    same report, whose timings are process 0's."""
    rounded = "--variants" if variants else "--alternate" if alternate_points else ""
    if variants and alternate_points:
        raise UserError(
            "--alternate times rule files x meshes against one another, --variants a config against "
            "its variants; run one at a time"
        )
    if rounded and (profile_dir or phases):
        raise UserError(
            f"{rounded} times whole steps against each other; run --profile_dir and --phases without it"
        )
    if rounded and min(rounds, round_steps) < 1:
        raise UserError(f"--rounds={rounds} and --round_steps={round_steps} must both be at least 1")
    if not rounded and steps < 1:
        raise UserError(f"--steps={steps} must be at least 1")
    if warmup < 0:
        raise UserError(f"--warmup={warmup} must be at least 0")
    rules_lib.check_distinct(
        rules_list, meshes, jax.device_count(), "--rules", "each rule file x mesh is timed once"
    )
    # Processes that time other steps would wait for one another in collectives.
    distributed.check_same_everywhere(
        config.to_dict(),
        flags={
            "--rules": rules_list,
            "--meshes": meshes,
            "--steps": steps,
            "--warmup": warmup,
            "--profile_dir (given or not)": bool(profile_dir),
            "--phases": phases,
            "--variants": variants,
            "--rounds": rounds,
            "--round_steps": round_steps,
            "--alternate": alternate_points,
        },
    )
    # Every rule file x mesh checked before anything is measured or compiled: a bad last one must
    # not end the run after the others have been timed.
    prepared = distributed.agreed(_prepare, config, rules_list, meshes, variants)
    names = rules_lib.short_names(rules_list)  # trace directories stay under profile_dir
    host_of_process = _hosts()
    hosts = len(set(host_of_process))
    platform = jax.devices()[0].platform
    dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16} if platform == "cpu" else {}
    rates = matmul_rates(dtypes, hosts)
    results = []
    if alternate_points:
        results = alternate(list(prepared.values()), rounds, round_steps, warmup, host_of_process)
    elif variants:
        for prep in prepared.values():
            results.extend(compare_variants(prep, rounds, round_steps, warmup))
    else:
        for (rules, mesh), prep in prepared.items():
            where = os.path.join(profile_dir, f"{names[rules]}_{mesh_file_name(mesh)}") if profile_dir else ""
            results.append(bench_one(*prep, steps, warmup, where, phases, host_of_process))
    after = matmul_rates(dtypes, hosts)
    rates = {name: max(rate, after[name]) for name, rate in rates.items()}
    roofline = hosts * max(rates.values()) if rates else None
    for r in results:
        r["roofline_fraction"] = r["model_flops_per_sec"] / roofline if roofline else None
        if "forward_s" in r:
            # The forward pass is a third of the model FLOPs (2N of 6N, and so the attention term).
            step_flops = r["model_flops_per_sec"] * r["step_s"]
            r["backward_s"] = r["gradient_s"] - r["forward_s"]
            r["optimizer_s"] = r["phase_step_s"] - r["gradient_s"]
            if roofline:
                r["forward_roofline_fraction"] = step_flops / 3 / r["forward_s"] / roofline
                r["backward_roofline_fraction"] = 2 * step_flops / 3 / r["backward_s"] / roofline
    return {
        "device_kind": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "hosts": hosts,
        "matmul_flops_per_sec": rates,  # one host's
        # The steps of a row: timed one row after another, or in alternating rounds.
        "timing": {"rounds": rounds, "round_steps": round_steps} if rounded else {"steps": steps},
        "results": results,
    }


def _prepare(config, rules_list: list[str], meshes: list[str], variants) -> dict:
    """{(rules, mesh): (config, setup)}, or variant_setups' list where `variants` are timed."""
    prepared = {}
    for rules in rules_list:
        for mesh in meshes:
            c = copy.deepcopy(config)
            c.rules, c.mesh = rules, mesh
            prepared[rules, mesh] = variant_setups(c, variants) if variants else (c, run_setup.setup(c))
    return prepared


def _finite(value):
    """`value` with every float that is not finite (a diverged step's NaN loss) made None."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def to_json(report: dict, indent: int | None = None) -> str:
    """A run() report as strict JSON: a number that is not finite is written null, not NaN."""
    return json.dumps(_finite(report), indent=indent, allow_nan=False)


def _percent(fraction: float | None) -> str:
    """A fraction as a percentage with one decimal, or "n/a" where there is none."""
    return f"{100 * fraction:.1f}%" if fraction is not None else "n/a"


def _lead(rules: str, mesh: str, widths: tuple[int, int]) -> str:
    """The rules and mesh columns of a table line, `widths` wide (format_table's)."""
    return f"{rules:<{widths[0]}} {mesh:<{widths[1]}}"


def _timing(row: dict, widths: tuple[int, int]) -> str:
    """The columns every table row starts with: rules, mesh, tokens/s, median / min / max step ms."""
    return (
        f"{_lead(row['rules'], row['mesh'], widths)} {row['tokens_per_sec']:>10,.0f} "
        f"{row['step_s'] * 1e3:>9.1f} {row['step_s_min'] * 1e3:>7.1f} {row['step_s_max'] * 1e3:>7.1f}"
    )


def format_table(report: dict) -> str:
    """The human-readable table of a run() report."""
    lines = [f"{report['devices']} {report['device_kind']} devices"]
    processes, hosts = report.get("processes", 1), report.get("hosts", 1)
    if processes > 1:
        on = f"{hosts} host{'s' if hosts > 1 else ''}"
        lines[0] += f" in {processes} processes on {on} (the timings are process 0's)"
    for dtype, rate in report["matmul_flops_per_sec"].items():
        each = f" on each of {hosts} hosts (the roofline: all of them)" if hosts > 1 else ""
        lines.append(f"jit matmul 2048^3 {dtype}: {rate / 1e9:,.1f} GFLOP/s{each}")
    timing = report.get("timing", {})
    if "rounds" in timing and not any("variant" in r for r in report["results"]):
        lines.append(
            f"rule files x meshes timed in {timing['rounds']} alternating rounds of "
            f"{timing['round_steps']} steps (all held in memory at once)"
        )
    # The rules column holds the rule file as given (a path, perhaps) and the mesh one the mesh: as
    # wide as the longest, so that the figures stay under their headings.
    widths = rules_lib.column_widths(report["results"], "rules", (16, 12))
    head = f"{_lead('rules', 'mesh', widths)} {'tokens/s':>10} {'step ms':>9} {'min':>7} {'max':>7}"
    compared = [r for r in report["results"] if "variant" in r]
    if compared:
        lines.append(f"{head} {'change':>7} {'roofline':>8}  variant (alternating rounds)")
        for r in compared:
            roof = _percent(r["roofline_fraction"])
            lines.append(f"{_timing(r, widths)} {100 * r['change']:>+6.1f}% {roof:>8}  {r['variant']}")
        return "\n".join(lines)
    # The bytes between hosts or slices, where any cross.
    network = hosts > 1 or any(r.get("network_bytes_per_device") for r in report["results"])
    lines.append(
        f"{head} {'compile s':>9} {'MFU':>6} {'roofline':>8} {'args MiB':>9} {'temp MiB':>9} {'comm MiB':>9} "
        + (f"{'net MiB':>9} " if network else "")
        + f"{'cpu busy':>8}"
    )
    for r in report["results"]:
        mem = r["memory_per_device"]  # the compiled step's, per device, as plan reports them
        lines.append(
            f"{_timing(r, widths)} {r['compile_s']:>9.2f} {_percent(r['mfu']):>6} "
            f"{_percent(r['roofline_fraction']):>8} {mem['arguments'] / 2**20:>9.2f} "
            f"{mem['temporaries'] / 2**20:>9.2f} {r['collective_bytes_per_device'] / 2**20:>9.2f} "
            + (f"{r['network_bytes_per_device'] / 2**20:>9.2f} " if network else "")
            + f"{r['host_cpu_busy_cores']:>8.2f}"
        )
    split = [r for r in report["results"] if "forward_s" in r]
    if split:
        lines.append("the step split (the step, loss and gradient, forward alone; interleaved medians):")
        lines.append(
            f"{_lead('rules', 'mesh', widths)} {'step ms':>9} {'forward ms':>10} {'roofline':>8} "
            f"{'backward ms':>11} {'roofline':>8} {'optimizer ms':>12}"
        )
        for r in split:
            fwd, bwd = r.get("forward_roofline_fraction"), r.get("backward_roofline_fraction")
            lines.append(
                f"{_lead(r['rules'], r['mesh'], widths)} {r['phase_step_s'] * 1e3:>9.1f} "
                f"{r['forward_s'] * 1e3:>10.1f} {_percent(fwd):>8} {r['backward_s'] * 1e3:>11.1f} "
                f"{_percent(bwd):>8} {r['optimizer_s'] * 1e3:>12.1f}"
            )
    profiled = [r for r in report["results"] if r.get("profile")]
    if profiled:
        lines.append("share of the profiled step's device time (traced ms: that step, profiler included):")
        lines.append(
            f"{_lead('rules', 'mesh', widths)} {'traced ms':>9} " + " ".join(f"{g:>18}" for g in hlo.GROUPS)
        )
        for r in profiled:
            shares = [r["profile"].get(g, {}).get("share", 0.0) for g in hlo.GROUPS]
            traced = r.get("profiled_step_s")
            lines.append(
                f"{_lead(r['rules'], r['mesh'], widths)} "
                + (f"{traced * 1e3:>9.1f} " if traced is not None else f"{'n/a':>9} ")
                + " ".join(f"{100 * x:>17.1f}%" for x in shares)
            )
    return "\n".join(lines)
