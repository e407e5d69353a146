"""A calibration file (written by `python -m gspmd_tp.plan calibrate`, calibrate.py) read for plan's
estimate: collective times by kind, group size and message size; the matmul rate and a memory-bound
rate by size; and, where calibrate was given a config, the time of each matrix product its steps
compute, by shape (a thin product runs well below a square one's rate); and what writing newly
allocated memory costs beyond writing memory already held, by size. Each series' times are
fitted non-decreasing in size (a larger operation never takes less time; a dip is the measurement's
noise), then interpolated between measured sizes and extended beyond the largest at the last
measured slope.

The estimate of a step: each instruction of the compiled step at these rates (hlo_cost), plus each
collective's time less the compute the schedule places between its start and its done (hlo's
window): compute plus exposed communication, plus what first writing the memory a step call
allocates costs (its temporaries, its outputs not aliased to inputs).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from gspmd_tp.job.errors import UserError
from gspmd_tp.sharding import hlo, hlo_cost
from gspmd_tp.storage import paths

FORMAT = 1
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")


def monotone(ys: list[float]) -> list[float]:
    """The non-decreasing sequence nearest `ys` in least squares (pool adjacent violators: each run
    that decreases is replaced by its mean)."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def _interp(x: float, xs: list[float], ys: list[float], floor: bool = True) -> float:
    """ys at x, linear between points, at the last segment's slope above them, and below the first
    flat (`floor`: a latency) or in proportion."""
    if x <= xs[0]:
        return ys[0] if floor else ys[0] * x / xs[0]
    if len(xs) == 1:
        return ys[-1] * x / xs[-1]
    if x >= xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + max(slope, 0.0) * (x - xs[-1])
    return float(np.interp(x, xs, ys))


@dataclasses.dataclass
class Calibration:
    """A calibration file's figures, checked."""

    path: str
    data: dict

    @property
    def device_kind(self) -> str:
        """The device kind it was measured on."""
        return self.data["device_kind"]

    def label(self) -> str:
        """How reports name it: the file, the device kind, devices and date."""
        d = self.data
        return f"calibration {self.path} ({d['devices']} {d['device_kind']} devices, {d['date']})"

    def check_kind(self, device_kind: str) -> None:
        """A UserError where the plan's devices are of another kind than those measured."""
        if device_kind != self.device_kind:
            raise UserError(
                f"--calibration={self.path}: measured on {self.device_kind!r} devices, "
                f"but this plan is for {device_kind!r}"
            )

    def collective_seconds(self, kind: str, group_size: int, result_bytes: float) -> float:
        """Seconds of one collective moving `result_bytes` per device (its result) in groups of
        `group_size`: the measurement of that kind at the nearest group size (the mean over the
        mesh axes measured at it). An all-to-all is timed as an all-gather."""
        if group_size <= 1:
            return 0.0
        kind = kind if kind in KINDS else "all-gather"
        rows = [r for r in self.data["collectives"] if r["kind"] == kind]
        if not rows:
            raise UserError(f"--calibration={self.path}: measured on one device, no {kind} to time")
        nearest = min({r["group_size"] for r in rows}, key=lambda g: (abs(g - group_size), -g))
        rows = [r for r in rows if r["group_size"] == nearest]
        return float(np.mean([_interp(result_bytes, r["bytes"], r["seconds"]) for r in rows]))

    def product_seconds(self, keys: list[str]) -> float | None:
        """Seconds of the matrix products named by `keys` (hlo_cost.product_key) where the file
        times every one of them (calibrate --config measures a config's own), else None."""
        table = self.data.get("products", {})
        if not keys or any(k not in table for k in keys):
            return None
        return float(sum(table[k] for k in keys))

    def fresh_seconds(self, allocated: float) -> float:
        """Seconds that writing `allocated` bytes a step call has just allocated costs beyond
        writing memory already held; 0 where the file has no `fresh` series."""
        f = self.data.get("fresh")
        if not allocated or not f:
            return 0.0
        return _interp(allocated, f["bytes"], f["seconds"], floor=False)

    def compute_seconds(self, flops: float, moved: float) -> float:
        """Seconds of one instruction: its matrix-product FLOPs at the measured matmul rate for that
        size of product, plus its bytes at the measured memory-bound rate for that size."""
        t = 0.0
        if flops:
            m = self.data["matmul"]
            t += _interp(flops, m["flops"], m["seconds"], floor=False)
        if moved:
            b = self.data["memory"]
            t += _interp(moved, b["bytes"], b["seconds"])
        return t


def _well_formed(xs, ys, positive: bool = True) -> bool:
    """Whether sizes `xs` and times `ys` make a series: as long as each other, not empty, sizes
    sorted, times positive (or, unless `positive`, not negative)."""
    if not xs or len(xs) != len(ys) or list(xs) != sorted(xs):
        return False
    return min(ys) > 0 if positive else min(ys) >= 0


def load(path: str) -> Calibration:
    """Reads and checks a calibration file; a UserError (one line) where it cannot serve."""
    try:
        data = json.loads(paths.of(path).read_text())  # local, or in a bucket
    except OSError as e:
        raise UserError(f"--calibration={path}: cannot read it ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"--calibration={path}: not a calibration file (not JSON: {e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(
            f"--calibration={path}: not a calibration file of format {FORMAT} "
            "(python -m gspmd_tp.plan calibrate writes one)"
        )
    try:
        for key in ("device_kind", "devices", "date", "collectives", "matmul", "memory"):
            data[key]  # noqa: B018
        series = [(r["bytes"], r["seconds"]) for r in data["collectives"]]
        series += [(data["matmul"]["flops"], data["matmul"]["seconds"])]
        series += [(data["memory"]["bytes"], data["memory"]["seconds"])]
        kinds = {r["kind"] for r in data["collectives"]}
    except (KeyError, TypeError) as e:
        raise UserError(f"--calibration={path}: incomplete, no {e} in it") from None
    fresh = data.get("fresh")
    if fresh is not None:
        try:
            xs, ys = list(fresh["bytes"]), list(fresh["seconds"])
        except (KeyError, TypeError):
            raise UserError(f"--calibration={path}: 'fresh' is not a series of bytes and seconds") from None
        if not _well_formed(xs, ys, positive=False):  # a pooling allocator's new memory costs nothing
            raise UserError(f"--calibration={path}: 'fresh' is empty, unsorted or negative")
    products = data.get("products", {})
    times = products.values() if isinstance(products, dict) else [None]
    if not all(isinstance(s, int | float) and s > 0 for s in times):
        raise UserError(f"--calibration={path}: 'products' is not a table of products and their seconds")
    if kinds and kinds != set(KINDS):  # none where one device was measured
        raise UserError(f"--calibration={path}: measures {sorted(kinds)}, expected all of {list(KINDS)}")
    for xs, ys in series:
        if not _well_formed(xs, ys):
            raise UserError(
                f"--calibration={path}: a series of sizes and times that is empty, unsorted or not positive"
            )
    fitted = [*data["collectives"], data["matmul"], data["memory"]]
    for series in fitted + ([fresh] if fresh is not None else []):
        series["seconds"] = monotone(series["seconds"])
    return Calibration(path, data)


def window_seconds(c: hlo.Collective, per: dict[tuple[str, str], float]) -> float:
    """Seconds of the compute the schedule places between collective `c`'s start and its done."""
    return sum(per.get((c.scheduled_in, name), 0.0) for name in c.window)


def exposed(found: list[hlo.Collective], comm_seconds, per: dict[tuple[str, str], float]) -> dict:
    """{comm_s, comm_exposed_s, comm_hidden_s} per step: each collective's comm_seconds(c) (one
    execution) less what its window's compute can hide, never more than that compute lasts."""
    total = hidden = 0.0
    for c in found:
        t = comm_seconds(c)
        total += t * c.executions
        hidden += min(t, window_seconds(c, per)) * c.executions
    return {"comm_s": total, "comm_exposed_s": total - hidden, "comm_hidden_s": hidden}


def estimate(cal: Calibration, found: list[hlo.Collective], text: str, allocations=()) -> dict:
    """The step time from a calibration: every instruction of the compiled step at the measured
    rates, plus the collectives' measured times where the schedule leaves them exposed, plus the
    first writing of `allocations` (bytes per device of each buffer a step call allocates: its
    temporaries, its outputs not aliased to inputs) at the measured cost of new memory."""
    compute_s, per = hlo_cost.Costs(text).seconds(cal.compute_seconds, products=cal.product_seconds)
    comm = exposed(found, lambda c: cal.collective_seconds(c.kind, c.group_size, c.result_bytes), per)
    fresh_s = sum(cal.fresh_seconds(b) for b in allocations)
    return {
        "source": cal.label(),
        "compute_s": compute_s,
        "fresh_memory_s": fresh_s,
        **comm,
        "step_s_estimate": compute_s + fresh_s + comm["comm_exposed_s"],
    }
