"""Reporting a run's logged steps: their metrics.jsonl rows and progress lines.

The host reads a logged step's stats (its only wait on the device) once the next step is
dispatched, so that the device stays busy meanwhile; an evaluated step is reported at once, as its
evaluation reads the parameters of that step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import jax

from gspmd_tp.model.params import flops_per_token
from gspmd_tp.train import metrics

if TYPE_CHECKING:
    from gspmd_tp.train.faults import NonFiniteWatch
    from gspmd_tp.train.run_setup import Setup


class Reporter:
    """Writes the row and progress line of each logged step: its stats, tokens/s, step time, MFU,
    the wait for data and, every config.eval_every steps and at the last, the held-out loss.

    Steps are measured in windows, from one report to the next: the steps dispatched in a window
    share its time. `evaluate(params)` is the held-out loss, None where a stop cut it short.
    """

    def __init__(
        self, s: Setup, start: int, writer: metrics.MetricsWriter, watch: NonFiniteWatch, evaluate, log
    ):
        c = s.config
        self._config, self._first = c, start + 1  # the first step of a start is logged
        self._writer, self._watch, self._evaluate, self._log = writer, watch, evaluate, log
        self._flops = flops_per_token(s.model_cfg, c.seq_len)
        self._peak = metrics.peak_flops(jax.devices()[0].device_kind, c.peak_flops_per_device)
        self._tokens_per_step = c.batch_size * c.seq_len
        self._window_start = time.perf_counter()
        self._data_wait: list[float] = []  # one wait per step dispatched in the window
        self._pending = None  # (step, stats, steps) of a logged step not yet read
        self.last_row: dict = {}  # the newest row written, with its step
        self.eval_cut: int | None = None  # the step whose evaluation a stop cut short

    def next_batch(self, batches):
        """The next batch of `batches`, the wait for it counted in data_wait_ms (read ahead or not)."""
        t = time.perf_counter()
        batch = next(batches)
        self._data_wait.append(time.perf_counter() - t)
        return batch

    def exclude(self, seconds: float) -> None:
        """Leaves `seconds` the host spent on something else (writing a trace) out of the step time."""
        self._window_start += seconds

    def when_due(self, step: int, stats, params) -> None:
        """Reports `step` if it is logged: at once where it is evaluated (on `params`, the
        parameters it produced), else once the next step is dispatched (flush)."""
        c = self._config
        if step % c.eval_every == 0 or step == c.steps:
            self._report(step, stats, len(self._data_wait), params)
        elif step % c.log_every == 0 or step == self._first:
            self._pending = (step, stats, len(self._data_wait))

    def flush(self) -> None:
        """Reports the logged step when_due() left for later, if any."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._report(*pending)

    def _report(self, step: int, stats, steps: int, params=None) -> None:
        """Reads a logged step's stats and writes its row. `steps` of the window had been dispatched
        when it was logged; later ones start the next window."""
        stats = jax.device_get(stats)
        self._watch.check(upto=step)
        elapsed = time.perf_counter() - self._window_start
        tps = self._tokens_per_step * steps / elapsed
        row = {k: float(v) for k, v in stats.items()}
        row.update(
            tokens_per_sec=tps,
            step_time_s=elapsed / steps,
            data_wait_ms=1e3 * sum(self._data_wait[:steps]) / steps,
            mfu=metrics.mfu(self._flops, tps, jax.device_count(), self._peak),
        )
        if self._watch.skipped:
            row["skipped_steps"] = self._watch.skipped
        if params is not None:
            eval_loss = self._evaluate(params)
            if eval_loss is not None:
                row["eval_loss"] = eval_loss
            else:  # the checkpoint this stop saves says so, and the resumed run evaluates it
                self.eval_cut = step
        self._writer.write(step, row)
        self._log(metrics.progress_line(step, self._config.steps, row))
        self.last_row = {"step": step, **row}
        self._window_start = time.perf_counter()
        self._data_wait = self._data_wait[steps:]
