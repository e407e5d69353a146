"""Measure the devices at hand for plan's estimate (plan --calibration=FILE reads what it writes).

    python -m gspmd_tp.plan calibrate --out=calibration.json [--meshes="dp=4,mp=2 dp=2,mp=4"] \
        [--sizes=4096,65536,1048576,16777216] [--matmul_sizes=512,2048,8192] [--repeats=3 --min_time=0.01] \
        [--config=configs/bench_cpu.py --rules=dp,megatron_1d]

For every mesh axis of every mesh (each axis and group size once): all-gather, reduce-scatter,
all-reduce and collective-permute over message sizes (the bytes of the result on one device), with
every device taking part; then, on all devices at once, the rate of a square matrix product at
several sizes and of an elementwise pass over arrays of several sizes (the memory-bound parts; from
1 KiB, where the pass costs what any instruction costs to run). Each figure is one trip of a loop
that repeats the operation, the call's own overhead taken out: a call of 1 + n trips less a call of
1, the best of `repeats` calls each, over n, where n is raised until the n trips last at least
`min_time` seconds (far above the timer's and the call's jitter, so no figure is noise or zero). The
elementwise pass walks a working set of at least MEMORY_WORKING_SET bytes (ACCELERATOR_WORKING_SET
on a GPU or TPU), a different part each trip, so that it reads from memory as a step's instructions
do, not what its last trip left in the cache. It also measures what writing a buffer the call has
just allocated costs beyond writing one already held (FRESH_SIZES per device), since a step call
allocates its temporaries: XLA:CPU's come from malloc, under whatever settings this process runs
with (host_devices.tune_malloc keeps freed memory; glibc's defaults map large buffers afresh, and
each page then faults once a call). With --config, every matrix product that config's train step
computes under each rule file (--rules, default the config's) x mesh is also timed by its own shape,
all devices at once (a thin product runs far below a square one's rate, and plan then prices each
product it finds in the file at its own time). The file names the device kind, the meshes and the
date; plan refuses it for devices of another kind.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # before jax is imported: Ctrl-C while importing is one line
    from gspmd_tp.job import entry

    entry.begin()  # main() asks for the devices once the flags are read

import datetime
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gspmd_tp.cli import arguments
from gspmd_tp.cli.arguments import loaded_config, no_positional_arguments
from gspmd_tp.job import host_devices
from gspmd_tp.job.errors import UserError, exit_from_main, interrupted
from gspmd_tp.plan import calibration
from gspmd_tp.sharding import hlo, hlo_cost
from gspmd_tp.sharding.mesh import make_mesh, parse_mesh
from gspmd_tp.storage import outputs

SIZES = tuple(4**k * 4096 for k in range(8))  # 4 KiB to 64 MiB
MATMUL_SIZES = (64, 128, 256, 512, 1024)
MEMORY_SIZES = tuple(4**k * 1024 for k in range(9))  # 1 KiB to 64 MiB read and written
MEMORY_WORKING_SET = 32 * 2**20  # bytes per device: with 8 of them, more than a host's caches hold
ACCELERATOR_WORKING_SET = 2**30  # a GPU's or TPU's: far more than its on-chip cache (an H100's L2: 50 MB)
FRESH_SIZES = tuple(4**k * 2**20 for k in range(5))  # 1 MiB to 256 MiB per device
MIN_TIME = 0.01  # seconds of loop per timed call
# A product of a step lasts up to ~100 ms on CPU: at MIN_TIME one trip is timed, and its figure
# moves by 20-30% from call to call; several trips a call steady it.
PRODUCT_MIN_TIME = 0.2
MAX_TRIPS = 1 << 20


def default_meshes(count: int) -> list[str]:
    """Every split of `count` devices into dp x mp by powers of two: each group size on each axis."""
    return [f"dp={count // k},mp={k}" for k in (2**i for i in range(count.bit_length())) if count % k == 0]


def _timed(fn, args, min_time: float, repeats: int) -> float:
    """Seconds of one trip of fn's loop: fn(*args, trips) for 1 and 1 + n trips, the best of `repeats`
    calls each, the difference over n (the call's own overhead cancels); n is raised until the n
    trips take at least `min_time`, so that the difference stands well above the calls' jitter."""
    jax.block_until_ready(fn(*args, np.int32(1)))  # compiles

    def best(trips: int) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args, np.int32(trips)))
            times.append(time.perf_counter() - t0)
        return min(times)

    base, n = best(1), 1
    while True:
        full = best(1 + n)
        if full - base >= min_time or n >= MAX_TRIPS:
            break
        # The next n from this one's rate, with room for its error; 8x where the loop did not show.
        loop = full - base
        n = min(MAX_TRIPS, n * 8 if loop <= min_time / 8 else int(n * 1.5 * min_time / loop) + 1)
    full, base = min(full, best(1 + n)), min(base, best(1))
    # Positive: where even MAX_TRIPS trips do not show above the call, the call's time bounds them.
    return (full - base) / n if full > base else full / (1 + n)


def _loop(body):
    """A function of (x, trips) that applies body(i, x) `trips` times."""
    return lambda x, trips: jax.lax.fori_loop(0, trips, body, x)


def _collective(kind: str, axis: str, g: int, m: int):
    """(loop body on one device's block, its block length) for `kind` over `axis` (g devices), its
    result m float32 elements per device."""
    if kind == "all-reduce":
        return (lambda i, x: jax.lax.psum(x, axis)), m
    if kind == "all-gather":
        piece = m // g

        def gather(i, x):
            y = jax.lax.all_gather(x, axis, tiled=True)
            return jax.lax.dynamic_slice_in_dim(y, (i % g) * piece, piece)

        return gather, piece
    if kind == "reduce-scatter":

        def scatter(i, x):
            r = jax.lax.psum_scatter(x, axis, tiled=True)
            return jax.lax.dynamic_update_slice_in_dim(x, r, (i % g) * m, 0)

        return scatter, m * g
    ring = [(j, (j + 1) % g) for j in range(g)]
    return (lambda i, x: jax.lax.ppermute(x, axis, ring)), m


def _per_device(mesh, block_shape, body, min_time: float, repeats: int, fill=1.0) -> float:
    """Seconds of one trip of `body` run by every device of `mesh` on a block of its own."""
    axes = tuple(mesh.axis_names)
    spec = P(axes)
    shape = (mesh.size * block_shape[0], *block_shape[1:])
    x = jax.device_put(jnp.full(shape, fill, jnp.float32), NamedSharding(mesh, spec))
    mapped = jax.shard_map(_loop(body), mesh=mesh, in_specs=(spec, P()), out_specs=spec, check_vma=False)
    return _timed(jax.jit(mapped), (x,), min_time, repeats)


_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16, "f64": jnp.float64}


def config_products(config, rules_list: list[str], meshes: list[str]) -> set[str]:
    """hlo_cost.product_key of every matrix product the train step of `config` computes under each
    rule file x mesh, compiled for the devices at hand (every one set up, so checked, first)."""
    import copy

    from gspmd_tp.train import run_setup
    from gspmd_tp.train import step as step_lib

    setups = []
    for rules in rules_list:
        for mesh in meshes:
            c = copy.deepcopy(config)
            c.rules, c.mesh = rules, mesh
            setups.append(run_setup.setup(c))
    keys = set()
    for s in setups:
        keys |= hlo_cost.Costs(step_lib.compile_train_step(s).as_text()).all_product_keys()
    return keys


def _product_body(key: str):
    """(loop body, left operand, right operand) of the product `key` names (hlo_cost.product_key),
    or None for a dtype not timed: each trip changes one element of the left operand in place,
    from the last trip's result, so that no trip repeats the last one or can be hoisted out of
    the loop, then multiplies."""
    lhs_dtype, lhs, rhs_dtype, rhs, dims = hlo_cost.parse_product_key(key)
    if lhs_dtype not in _DTYPES or rhs_dtype not in _DTYPES:
        return None
    numbers = ((dims["lhs_contracting"], dims["rhs_contracting"]), (dims["lhs_batch"], dims["rhs_batch"]))

    def body(i, carry):
        x, w, acc = carry
        flat = x.reshape(-1)
        first = flat[:1] + acc.astype(x.dtype)
        x = jax.lax.dynamic_update_slice(flat, first, (0,)).reshape(x.shape)
        y = jax.lax.dot_general(x, w, numbers)
        return x, w, (y.reshape(-1)[0] * 1e-9).astype(acc.dtype)

    return body, jnp.ones(lhs, _DTYPES[lhs_dtype]), jnp.ones(rhs, _DTYPES[rhs_dtype])


def measure_products(keys, min_time: float, repeats: int, devices) -> dict[str, float]:
    """{key: seconds} of one run of each matrix product `keys` name (hlo_cost.product_key), every
    device computing its own at once, as in a step; at least PRODUCT_MIN_TIME of trips a call."""
    flat = make_mesh(f"d={len(devices)}", ["d"], devices)
    each = NamedSharding(flat, P("d"))
    out = {}
    for key in sorted(keys):
        made = _product_body(key)
        if made is None:
            continue
        body, x, w = made

        def loop(x, w, trips, body=body):
            x, w, acc = jax.lax.fori_loop(0, trips, body, (x[0], w[0], jnp.zeros((), jnp.float32)))
            return acc[None]

        mapped = jax.shard_map(
            loop, mesh=flat, in_specs=(P("d"), P("d"), P()), out_specs=P("d"), check_vma=False
        )
        args = [jax.device_put(jnp.broadcast_to(a, (len(devices), *a.shape)), each) for a in (x, w)]
        out[key] = _timed(jax.jit(mapped), args, max(min_time, PRODUCT_MIN_TIME), repeats)
    return out


def measure_fresh(sizes, repeats: int, devices) -> list[tuple[int, float]]:
    """[(bytes, seconds)] per device: what writing a buffer of that many bytes that the call has just
    allocated costs beyond writing one it already holds, every device at once. Each call of a
    compiled step allocates its temporaries (XLA:CPU's from malloc: where it maps them afresh from
    the system, each page faults once a call; where it reuses freed memory, less). The figure is an
    elementwise pass whose output is a new buffer less the same pass donated its input, the best of
    `repeats` calls each (at least 3), never below zero."""
    flat = make_mesh(f"d={len(devices)}", ["d"], devices)
    each = NamedSharding(flat, P("d"))
    scaled = lambda x: x * 0.999 + 0.001  # noqa: E731
    fresh = jax.jit(scaled, out_shardings=each)
    in_place = jax.jit(scaled, out_shardings=each, donate_argnums=0)
    out = []
    for size in sizes:
        n = max(1, size // 4)
        x = jax.device_put(jnp.ones((len(devices) * n,), jnp.float32), each)
        y = jax.block_until_ready(fresh(x))  # compiles
        x = jax.block_until_ready(in_place(x))
        best = {"fresh": float("inf"), "in_place": float("inf")}
        for _ in range(max(3, repeats)):
            del y  # freed, as a step's temporaries are when it ends
            t0 = time.perf_counter()
            y = jax.block_until_ready(fresh(x))
            best["fresh"] = min(best["fresh"], time.perf_counter() - t0)
            t0 = time.perf_counter()
            x = jax.block_until_ready(in_place(x))
            best["in_place"] = min(best["in_place"], time.perf_counter() - t0)
        del x, y
        out.append((4 * n, max(0.0, best["fresh"] - best["in_place"])))
    return out


def measure(
    meshes: list[str],
    sizes=SIZES,
    matmul_sizes=MATMUL_SIZES,
    memory_sizes=MEMORY_SIZES,
    min_time: float = MIN_TIME,
    repeats: int = 3,
    devices=None,
    log=None,
    dtype: str = "float32",
    working_set: int | None = None,
    products=(),
    fresh_sizes=FRESH_SIZES,
) -> dict:
    """The calibration of `devices` (all of them unless given), the matrix products in `dtype`, the
    elementwise pass over `working_set` bytes per device (by default MEMORY_WORKING_SET on CPU,
    ACCELERATOR_WORKING_SET elsewhere), and the products `products` names (config_products' keys)
    each by its own shape: see the module's docstring."""
    devices = list(devices if devices is not None else jax.devices())
    if working_set is None:
        working_set = MEMORY_WORKING_SET if devices[0].platform == "cpu" else ACCELERATOR_WORKING_SET
    rows, seen = [], set()
    for spec in meshes:
        sizes_of = parse_mesh(spec, len(devices))
        mesh = make_mesh(spec, list(sizes_of), devices)
        for axis, g in sizes_of.items():
            if g == 1 or (axis, g) in seen:
                continue
            seen.add((axis, g))
            for kind in calibration.KINDS:
                measured = []
                for size in sizes:
                    m = max(g, size // 4 // g * g)  # float32 elements, divisible by the group
                    body, block = _collective(kind, axis, g, m)
                    measured.append((m * 4, _per_device(mesh, (block,), body, min_time, repeats)))
                c = hlo.Collective(kind, "", "", measured[-1][0], g, 1)
                rows.append({
                    "kind": kind, "axis": axis, "mesh": spec, "group_size": g,
                    "bytes": [b for b, _ in measured], "seconds": [t for _, t in measured],
                    "latency_s": measured[0][1],
                    "bandwidth": c.ring_bytes / measured[-1][1],  # ring bytes/s per device, largest size
                })  # fmt: skip
                if log:
                    log(f"{kind:<18} {axis}={g}: {measured[0][1] * 1e6:,.0f} us at {measured[0][0]:,} B, "
                        f"{rows[-1]['bandwidth'] / 1e9:,.2f} GB/s at {measured[-1][0]:,} B")  # fmt: skip
    flat = make_mesh(f"d={len(devices)}", ["d"], devices)
    matmul = []
    product = jax.shard_map(  # x @ w repeated; w is the identity, so x stays what it was
        lambda x, w, trips: jax.lax.fori_loop(0, trips, lambda i, y: y @ w, x),
        mesh=flat, in_specs=(P("d"), P("d"), P()), out_specs=P("d"), check_vma=False,
    )  # fmt: skip
    for n in matmul_sizes:
        w = jnp.tile(jnp.eye(n, dtype=dtype), (len(devices), 1))
        x = jnp.ones((len(devices) * n, n), dtype)
        args = [jax.device_put(a, NamedSharding(flat, P("d"))) for a in (x, w)]
        matmul.append((2.0 * n**3, _timed(jax.jit(product), args, min_time, repeats)))
    memory = []
    for size in memory_sizes:
        m = max(1, size // 8)  # read and written: 8 bytes an element
        parts = max(1, working_set // (4 * m))  # trip i updates part i % parts in place

        def step(i, x, m=m, parts=parts):
            at = (i % parts) * m
            part = jax.lax.dynamic_slice_in_dim(x, at, m)
            return jax.lax.dynamic_update_slice_in_dim(x, part * 0.999 + 0.001, at, 0)

        memory.append((8.0 * m, _per_device(flat, (parts * m,), step, min_time, repeats)))
    fresh = measure_fresh(fresh_sizes, repeats, devices)
    timed = measure_products(products, min_time, repeats, devices)
    if log:
        (flops, t), (moved, u), (written, v) = matmul[-1], memory[-1], fresh[-1]
        log(f"matmul {matmul_sizes[-1]}^3: {flops / t / 1e9:,.1f} GFLOP/s per device; "
            f"elementwise {moved:,.0f} B: {moved / u / 1e9:,.2f} GB/s per device; "
            f"{written:,.0f} B newly allocated: {v * 1e3:,.2f} ms more per device")  # fmt: skip
    return {
        "format": calibration.FORMAT,
        "device_kind": devices[0].device_kind,
        "platform": devices[0].platform,
        "devices": len(devices),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "meshes": list(meshes),
        "collectives": rows,
        "matmul": {
            "dtype": dtype,
            "flops": [f for f, _ in matmul],
            "seconds": [t for _, t in matmul],
            "flops_per_sec": [f / t for f, t in matmul],
        },
        "memory": {
            "bytes": [b for b, _ in memory],
            "seconds": [t for _, t in memory],
            "bytes_per_sec": [b / t for b, t in memory],
        },
        "fresh": {"bytes": [b for b, _ in fresh], "seconds": [t for _, t in fresh]},
        "products": timed,
    }


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",")})
    except ValueError:
        raise UserError(f"{flag}={text}: expected comma-separated integers") from None
    if not values or values[0] < 1:
        raise UserError(f"{flag}={text}: sizes must be positive")
    return values


def main(argv) -> None:
    """CLI: python -m gspmd_tp.plan calibrate --out=FILE [--meshes=... --sizes=...]."""
    no_positional_arguments(argv)
    config = loaded_config() if flags.FLAGS["config"].present else None
    count, tune = (config.host_device_count, config.host_malloc_tuning) if config else (8, True)  # tiny's
    host_devices.request(count, tune)  # before jax's backend starts
    try:
        out = _OUT.value
        if not out:
            raise UserError("--out=FILE is required: where the calibration is written")
        outputs.check_file(out, "--out", probe=True)
        meshes = _MESHES.value.split() if _MESHES.value else default_meshes(jax.device_count())
        for spec in meshes:
            parse_mesh(spec, jax.device_count())  # a bad mesh is one line before anything runs
        if not _MIN_TIME.value > 0 or _REPEATS.value < 1:
            raise UserError(
                f"--min_time={_MIN_TIME.value} must be positive and --repeats={_REPEATS.value} at least 1"
            )
        sizes = _ints(_SIZES.value, "--sizes") if _SIZES.value else SIZES
        # The products in the dtype steps compute in: float32 on CPU (bf16 is slower there), else bf16.
        dtype = _DTYPE.value or ("float32" if jax.devices()[0].platform == "cpu" else "bfloat16")
        log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        matmul = _ints(_MATMUL_SIZES.value, "--matmul_sizes") if _MATMUL_SIZES.value else MATMUL_SIZES
        memory = _ints(_MEMORY_SIZES.value, "--memory_sizes") if _MEMORY_SIZES.value else MEMORY_SIZES
        products = set()
        if config is not None:
            rules = [r.strip() for r in _RULES.value.split(",")] if _RULES.value else [config.rules]
            products = config_products(config, rules, meshes)
            points = f"{len(rules)} rule files x {len(meshes)} meshes"
            log(f"products: {len(products)} shapes in the steps of {points}")
        elif _RULES.value:
            raise UserError(
                "--rules: the rule files of --config's steps whose products are timed; no --config"
            )
        data = measure(meshes, sizes, matmul, memory, _MIN_TIME.value, _REPEATS.value, log=log, dtype=dtype,
                       products=products)  # fmt: skip
        with outputs.whole_file(out) as partial, open(partial, "w") as f:
            json.dump(data, f, indent=1)
        where = f"{data['devices']} {data['device_kind']} devices"
        series = f"{len(data['collectives'])} collective series, {len(data['products'])} products"
        print(f"calibration: {out} ({where}, {series})")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        exit_from_main(interrupted(f"--out={_OUT.value} is as it was"))


if __name__ == "__main__":
    import functools

    from absl import flags

    from gspmd_tp.cli.arguments import define_config, parse_flags

    _OUT = arguments.define_path("out", "", "Write the calibration (JSON) here.")
    _CONFIG = define_config(
        None, "Also time every matrix product of this config's train step, by shape (configs/*.py)."
    )
    _RULES = flags.DEFINE_string(
        "rules", "", "With --config: the comma-separated rule files whose steps' products are timed."
    )
    _MESHES = flags.DEFINE_string(
        "meshes", "", "Space-separated meshes whose axes are measured (default: every dp x mp split)."
    )
    _SIZES = flags.DEFINE_string(
        "sizes", "", "Comma-separated message sizes in bytes (default 4 KiB to 64 MiB)."
    )
    _MIN_TIME = flags.DEFINE_float(
        "min_time", MIN_TIME, "Seconds of loop trips per timed call, at least (their count is raised to it)."
    )
    _MATMUL_SIZES = flags.DEFINE_string(
        "matmul_sizes", "", "Comma-separated sides of the square products (default 64 to 1024)."
    )
    _MEMORY_SIZES = flags.DEFINE_string(
        "memory_sizes",
        "",
        "Comma-separated bytes an elementwise pass reads and writes (default 1 KiB to 64 MiB).",
    )
    _DTYPE = flags.DEFINE_enum(
        "dtype",
        "",
        ["", "float32", "bfloat16"],
        "The matrix products' dtype (default: float32 on CPU, else bfloat16).",
    )
    _REPEATS = flags.DEFINE_integer("repeats", 3, "Calls timed per figure (the best is kept).")
    # --config is optional here: loaded (loaded_config) only where given.
    entry.run(main, flags_parser=functools.partial(parse_flags, load=False))
