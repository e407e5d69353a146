"""Tracing compiled steps with jax.profiler, and where a traced step's device time went.

`StepTrace` traces a window of a training run's steps (config.profile); bench.py traces one
step per rule file x mesh. Both sum the trace's device time by kind of instruction (hlo.GROUPS).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import time

import jax

from gspmd_tp.sharding import hlo

PROFILE = "profile"  # in the run directory


def newest_trace(directory: str) -> str | None:
    """The newest `*.trace.json.gz` under `directory` (jax.profiler writes one per trace), or None."""
    traces = glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True)
    return max(traces, key=os.path.getmtime) if traces else None


def event_durations(trace: str) -> collections.Counter:
    """Microseconds that `trace` (a `.trace.json.gz`) spent in each named event, summed over its
    threads (on a CPU, one per simulated device)."""
    with gzip.open(trace) as f:
        events = json.load(f).get("traceEvents", [])
    us = collections.Counter()
    for e in events:
        if e.get("ph") == "X":
            us[e.get("name", "")] += e.get("dur", 0)
    return us


def device_time_shares(trace: str, groups: dict[str, str], devices: int) -> dict:
    """Per hlo.GROUPS entry: the milliseconds per device that `trace` spent in the
    instructions `groups` classifies (hlo.classify of the compiled step), and their share."""
    us = collections.Counter()
    for name, dur in event_durations(trace).items():
        if name in groups:
            us[groups[name]] += dur
    total = sum(us.values()) or 1
    return {k: {"ms_per_device": us[k] / 1e3 / devices, "share": us[k] / total} for k in hlo.GROUPS}


def options(python: bool = False) -> jax.profiler.ProfileOptions:
    """jax.profiler's options for a step's trace: host and device activity, and the Python functions
    every thread calls only when `python` (jax's default traces them, which slows the host's dispatch
    and hooks into each thread as it starts and as the trace stops)."""
    o = jax.profiler.ProfileOptions()
    o.python_tracer_level = int(python)
    return o


def format_shares(shares: dict) -> str:
    """`matrix products 52.1%, collectives 9.8%, ...` for a log line."""
    return ", ".join(f"{k} {v['share']:.1%}" for k, v in shares.items())


class StepTrace:
    """Traces the training steps `first`..`first + steps - 1` into `directory` with jax.profiler
    (ui.perfetto.dev opens its .trace.json.gz; TensorBoard's profile plugin reads the directory),
    then logs the window's wall time and where its device time went. steps=0 traces nothing.
    `settle` runs before the profiler stops: the trainer waits there for a checkpoint save in flight,
    so that no save's threads are running while the profiler collects and detaches from them.
    `python` also traces the Python functions called (see `options`)."""

    def __init__(
        self, directory: str, first: int, steps: int, step_text: str, log, settle=None, python=False
    ):
        self.directory, self.first, self.last = directory, first, first + steps - 1
        self.step_text, self.log = step_text, log
        self.settle, self.python = settle, python
        self.started = None  # perf_counter when tracing began; None while not tracing
        self.dispatched = first  # the last step dispatched while tracing
        self.written = ""  # the trace file (or directory) once a trace has ended

    def before(self, step: int) -> None:
        """Starts tracing before the window's first step is dispatched."""
        self.dispatched = step
        if step == self.first and self.first <= self.last:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory, profiler_options=options(self.python))
            self.started = time.perf_counter()

    def after(self, step: int, state) -> float:
        """Ends the trace once the window's last step has run (waits for it: the trace must hold it).
        Returns the seconds spent writing and reading the trace, which no step should be charged."""
        if self.started is None or step != self.last:
            return 0.0
        jax.block_until_ready(state)
        return self._stop(step, settle=True)

    def close(self, settle: bool = True) -> None:
        """Ends a trace that a stop or an error cut short, at the last step dispatched. settle=False
        stops it without waiting for `settle` (a failed job's save may wait for a peer that is gone)."""
        if self.started is not None:
            self._stop(self.dispatched, settle)

    def _stop(self, last: int, settle: bool) -> float:
        stopping = time.perf_counter()
        elapsed = stopping - self.started
        self.started = None
        if settle and self.settle is not None:
            self.settle()
        jax.profiler.stop_trace()
        self.written = newest_trace(self.directory) or self.directory
        steps = max(last - self.first + 1, 1)
        line = (
            f"profile: steps {self.first}..{last} traced in {elapsed:.2f}s ({elapsed / steps:.3f}s/step, "
            f"the profiler's own work included) to {self.written}"
        )
        if self.written.endswith(".trace.json.gz"):
            shares = device_time_shares(self.written, hlo.classify(self.step_text), jax.local_device_count())
            line += "; device time: " + format_shares(shares)
        self.log(line)
        return time.perf_counter() - stopping
