"""Throughput, MFU, and the metric writers (metrics.jsonl and TensorBoard, process 0 only).

A run directory in a bucket gets the same files: a bucket object cannot be appended to, so the
writer appends to a copy in a local cache directory (cache_dir) and uploads the file whole after
each write.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time

from gspmd_tp.storage import paths

# Dense bf16 peak FLOP/s per device, from the vendors' data sheets. Matched against
# jax's device_kind as whole words, first match wins. An unknown device logs no MFU.
PEAK_BF16_FLOPS = (
    ("TPU v6 lite", 918e12),  # Trillium (v6e)
    ("TPU v6e", 918e12),
    ("TPU v5 lite", 197e12),  # v5e
    ("TPU v5e", 197e12),
    ("TPU v5p", 459e12),
    ("TPU v5", 459e12),
    ("TPU v4", 275e12),
    ("H200", 989e12),  # SXM, dense
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM, dense
    ("A100", 312e12),
    ("L4", 121e12),
)


JSONL, TENSORBOARD = "metrics.jsonl", "tensorboard"  # in the run directory
# Rows of steps a resumed run trains again (logged after its checkpoint), moved out of JSONL.
REPLACED = "metrics_replaced.jsonl"


def peak_flops(device_kind: str, override: float = 0.0) -> float | None:
    """Dense bf16 peak FLOP/s of one device; `override` > 0 wins; None when unknown."""
    if override > 0:
        return override
    for name, flops in PEAK_BF16_FLOPS:
        # Whole words only: "L4" must not match "L40S", nor "TPU v5" match "TPU v5p".
        if re.search(rf"\b{re.escape(name)}\b", device_kind, re.IGNORECASE):
            return flops
    return None


def mfu(flops_per_token: float, tokens_per_sec: float, num_devices: int, peak: float | None):
    """Model FLOPs utilization in [0, 1], or None where the device peak is unknown."""
    if not peak or not tokens_per_sec:
        return None
    return flops_per_token * tokens_per_sec / (peak * num_devices)


def _json_number(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _json_line(row: dict) -> str:
    """`row` as one line of strict JSON: a None or non-finite value is null (NaN and Infinity are
    not JSON, and strict readers such as jq and JavaScript reject the line)."""
    return json.dumps({k: _json_number(v) for k, v in row.items()}, allow_nan=False) + "\n"


def _row(line: str) -> dict | None:
    """The row a line of JSONL holds, or None where it is not a JSON object with an integer step."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def _lines(path: str) -> list[str] | None:
    """The lines of file `path` (local or in a bucket), None where there is none."""
    file = paths.of(path)
    return file.read_text().splitlines(keepends=True) if file.exists() else None


def cache_dir(workdir: str) -> str:
    """Where the writer keeps its local copies of a run in a bucket: under $XDG_CACHE_HOME (or
    ~/.cache), gspmd_tp/runs/SCHEME/BUCKET/PATH."""
    return os.path.join(paths.cache_root(), "runs", paths.scheme(workdir), workdir.split("://", 1)[1])


def _rewrite(path: str, lines: list[str]) -> None:
    """Replaces file `path` by `lines` at once: a kill leaves the old file or the new one (a bucket's
    object is replaced whole by its upload)."""
    if paths.is_url(path):
        paths.of(path).write_text("".join(lines))
        return
    with open(path + ".tmp", "w") as f:
        f.writelines(lines)
    os.replace(path + ".tmp", path)


def set_aside_after(workdir: str, step: int) -> int:
    """Moves the rows of JSONL logged after `step` to REPLACED (appended there); returns how many.

    A run that resumes from step N trains N+1.. again; their old rows would otherwise stand twice.
    A last line cut short by a kill (no newline) goes too, so that the next row starts a line.
    """
    path = os.path.join(workdir, JSONL)
    lines = _lines(path)
    if lines is None:
        return 0
    keep, later, cut = [], [], []
    for line in lines:
        if not line.endswith("\n"):
            cut.append(line + "\n")
            continue
        row = _row(line)
        (later if row and row["step"] > step else keep).append(line)
    if later or cut:
        replaced = os.path.join(workdir, REPLACED)
        # A kill between this append and the replace below moves the same rows again next time.
        before = _lines(replaced) or []
        there = set(before)
        _rewrite(replaced, before + [line for line in later + cut if line not in there])
        _rewrite(path, keep)
    return len(later)


def has_value(workdir: str, step: int, key: str) -> bool:
    """Whether workdir's metrics.jsonl has a row of `step` with `key` (the later row of a step
    logged twice)."""
    rows = [
        row for row in map(_row, _lines(os.path.join(workdir, JSONL)) or []) if row and row["step"] == step
    ]
    return bool(rows) and key in rows[-1]


def _event_protos():
    """tensorboardX's event writer and protocol buffers (EventsWriter, Event, SessionLog, Summary),
    imported without torch. Where torch is installed (the hf extra) tensorboardX imports it, only to
    accept torch tensors, which this module never passes, and torch takes seconds to import."""

    def load():
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary

        return EventsWriter, Event, SessionLog, Summary

    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        return load()
    sys.modules["torch"] = None  # `import torch` raises ImportError meanwhile: tensorboardX goes on
    try:
        return load()
    finally:
        del sys.modules["torch"]


class MetricsWriter:
    """Appends one JSON object per logged step to metrics.jsonl and mirrors it to TensorBoard.

    Every process may call it; only the one created with enabled=True (process 0) writes. A run
    that starts at step `start` hides TensorBoard's events of later steps (it trains them again);
    set_aside_after does the same for metrics.jsonl.
    """

    def __init__(self, workdir: str, enabled: bool, start: int = 0):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._remote = workdir if paths.is_url(workdir) else None  # uploaded to after each write
        if enabled:
            local = cache_dir(workdir) if self._remote else workdir
            os.makedirs(local, exist_ok=True)
            if self._remote:  # the bucket's copy is the run's: the cache starts from it
                with open(os.path.join(local, JSONL), "w") as f:
                    f.writelines(_lines(os.path.join(workdir, JSONL)) or [])
            self._jsonl = open(os.path.join(local, JSONL), "a")  # noqa: SIM115
            EventsWriter, self._event, SessionLog, self._summary = _event_protos()  # process 0's

            # Written here, in the caller's thread, and flushed after each step: tensorboardX's
            # SummaryWriter hands events to a thread of its own, which flushes them only every
            # flush_secs and, with flush_secs=0, polls its queue without pause (a core kept busy).
            # The file is named by the second it was opened and the host: a writer opened in the
            # same second would truncate its predecessor's file but for the suffix, in opening order.
            tb_dir = os.path.join(local, TENSORBOARD)
            os.makedirs(tb_dir, exist_ok=True)
            self._tb = EventsWriter(os.path.join(tb_dir, "events"), f".{time.time_ns()}")
            # A session start at step start + 1: TensorBoard drops what earlier files hold of that
            # step and later ones, which this run trains again.
            self._tb.write_event(self._event(step=start + 1, session_log=SessionLog(status=SessionLog.START)))
            self._flush_tb()

    def _upload(self, local: str, name: str) -> None:
        """Replaces the bucket's object `name` (relative to the run) by local file `local`."""
        if self._remote:
            with open(local, "rb") as f:
                paths.of(f"{self._remote}/{name}").write_bytes(f.read())

    def _flush_tb(self) -> None:
        self._tb.flush()
        local = self._tb._file_name  # tensorboardX's EventsWriter: the events file it writes
        self._upload(local, f"{TENSORBOARD}/{os.path.basename(local)}")

    def write(self, step: int, metrics: dict) -> None:
        """Records `metrics` for `step`. A None or non-finite value goes to JSON only, as null."""
        if not self.enabled:
            return
        self._jsonl.write(_json_line({"step": int(step), **metrics}))
        self._jsonl.flush()
        self._upload(self._jsonl.name, JSONL)
        self._to_tensorboard(step, metrics)

    def amend(self, step: int, metrics: dict) -> None:
        """Adds `metrics` to the row of `step` already in metrics.jsonl (a row of its own where
        there is none) and to TensorBoard: figures of a step computed after it was logged."""
        if not self.enabled:
            return
        path = self._jsonl.name
        self._jsonl.close()
        with open(path) as f:
            lines = f.readlines()
        rows = [_row(line) for line in lines]
        at = next((i for i, row in enumerate(rows) if row and row["step"] == step), None)
        if at is None:
            lines.append(_json_line({"step": int(step), **metrics}))
        else:
            lines[at] = _json_line({**rows[at], **metrics})
        _rewrite(path, lines)
        self._jsonl = open(path, "a")  # noqa: SIM115
        self._upload(path, JSONL)
        self._to_tensorboard(step, metrics)

    def _to_tensorboard(self, step: int, metrics: dict) -> None:
        values = [
            self._summary.Value(tag=key, simple_value=value)
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and math.isfinite(value)
        ]
        if values:
            summary = self._summary(value=values)
            self._tb.write_event(self._event(wall_time=time.time(), step=int(step), summary=summary))
            self._flush_tb()

    def close(self) -> None:
        """Flushes and closes the files."""
        if self.enabled:
            self._jsonl.close()
            self._flush_tb()
            self._tb.close()


def progress_line(step: int, total: int, m: dict) -> str:
    """One human-readable line per logged step."""
    parts = [f"step {step:>{len(str(total))}}/{total}", f"loss {m['loss']:.4f}"]
    if "eval_loss" in m:
        parts.append(f"eval_loss {m['eval_loss']:.4f}")
    if "router_aux_loss" in m:  # a mixture of experts: its balance (1 when even) and its largest expert
        parts.append(f"aux {m['router_aux_loss']:.3f}")
        parts.append(f"max_load {m['expert_max_load']:.2f}x")
    if "expert_dropped" in m:  # model.moe_buffer_factor's buffers left assignments out
        parts.append(f"dropped {m['expert_dropped']:.2%}")
    parts += [
        f"grad_norm {m['grad_norm']:.3f}",
        f"lr {m['learning_rate']:.2e}",
        f"{m['tokens_per_sec']:,.0f} tok/s",
        f"{m['step_time_s'] * 1000:.0f} ms/step",
    ]
    if m.get("mfu") is not None:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    return " | ".join(parts)
