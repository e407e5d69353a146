"""The training loop: config -> mesh, rules, sharded state -> jit-compiled steps -> metrics, checkpoints.

`train(config, workdir)` is the library entry point that train.py and the tests call.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import jax

from gspmd_tp.checkpoint import step_dirs, store
from gspmd_tp.data import documents, pipeline, tokenizer
from gspmd_tp.job import distributed, signals
from gspmd_tp.job.errors import UserError
from gspmd_tp.model.params import param_count
from gspmd_tp.sharding.mesh import mesh_string
from gspmd_tp.storage import lock, outputs, paths
from gspmd_tp.train import faults, inputs, metrics, profiling, resume, run_setup
from gspmd_tp.train import state as state_lib
from gspmd_tp.train import step as step_lib
from gspmd_tp.train.report import Reporter

if TYPE_CHECKING:
    from gspmd_tp.train.run_setup import Setup


def log(message: str) -> None:
    """Prints on process 0 only."""
    if jax.process_index() == 0:
        print(message, flush=True)


def eval_batch_count(s: Setup, dataset) -> int:
    """config.eval_batches, at most one pass over the held-out batches (every window counted once)."""
    per_pass = getattr(dataset, "batches_per_pass", None)
    return min(s.config.eval_batches, per_pass) if per_pass else s.config.eval_batches


def held_out_sums(s: Setup, eval_step, params, dataset, stop=lambda: False) -> tuple[float, int] | None:
    """(sum of token losses, tokens counted) over eval_batch_count() held-out batches from the
    first; None if `stop()` cut it short."""
    total, count = 0.0, 0
    it = iter(dataset)
    for _ in range(eval_batch_count(s, dataset)):
        if stop():
            return None
        loss_sum, n = eval_step(
            params, pipeline.global_batch(next(it), s.batch_sharding, s.config.batch_size)
        )
        total, count = total + float(loss_sum), count + int(n)
    return total, count


def evaluate(s: Setup, eval_step, params, dataset, stop=lambda: False) -> float | None:
    """Mean token loss over eval_batch_count() held-out batches; None if `stop()` cut it short."""
    sums = held_out_sums(s, eval_step, params, dataset, stop)
    return None if sums is None else sums[0] / sums[1]


def train(config, workdir: str) -> dict:
    """Trains per `config`, resuming from the newest checkpoint in workdir; returns final metrics.

    A SIGTERM/SIGINT saves at the next step boundary and returns with "stopped" set; a second
    exits at once. A NaN/Inf loss or gradient raises UserError (or is skipped, per config).
    """
    paths.check_bucket(workdir, "--workdir")  # a bucket's first: before anything reads there
    inputs.recorded_tokenizer(config, workdir, log)  # an imported model's, left at the default bytes
    # First, on every process: what fails on one process alone fails every process, named on each.
    s = distributed.agreed_setup(config, _checked_setup, config, workdir)
    checkpoint_dir = step_dirs.checkpoint_dir(workdir)
    c = s.config
    workdir = paths.absolute(workdir)
    # Saved absolute, so that evaluate, generate and a resume find the files from any directory.
    c.data.train_files = documents.absolute_patterns(c.data.train_files)
    c.data.eval_files = documents.absolute_patterns(c.data.eval_files)
    c.data.tokenizer = tokenizer.resolve(c.data.tokenizer)
    c.data.shards = paths.absolute(c.data.shards) if c.data.shards else ""
    if os.path.isfile(paths.expand(c.rules)):  # a rule file of the user's: found from anywhere
        c.rules = os.path.abspath(paths.expand(c.rules))
    c.init_from = paths.expand(c.init_from)  # bash leaves `--config.init_from=~/p.npz` as it is
    with lock.workdir_lock(workdir, log):  # one job at a time on a workdir
        return _train(s, workdir, checkpoint_dir)


def _checked_setup(config, workdir: str) -> Setup:
    """setup(config), once the workdir's paths are found writable."""
    step_dirs.check_workdir_given(workdir)
    outputs.check_dir(workdir, "--workdir")
    # What a run writes inside it, where it exists already (a resumed run) and is not writable:
    # found now, not when the first save fails in the background minutes later.
    checkpoint_dir = step_dirs.checkpoint_dir(workdir)
    outputs.check_dir(checkpoint_dir, "--workdir's checkpoints")
    outputs.check_dir(os.path.join(workdir, metrics.TENSORBOARD), "--workdir's tensorboard")
    outputs.check_file(os.path.join(workdir, metrics.JSONL), "--workdir's metrics")
    outputs.check_file(os.path.join(workdir, metrics.REPLACED), "--workdir's replaced metrics")
    s = run_setup.setup(config)
    # Before anything is compiled: a read-ahead without bound fills memory while the run trains. Only
    # training reads ahead, so evaluate and generate read a run saved with a larger read-ahead.
    pipeline.check_prefetch(
        config.data.prefetch, config.batch_size, config.seq_len, config.data.document_mask
    )
    return s


def _train(s: Setup, workdir: str, checkpoint_dir: str) -> dict:
    """train() from the workdir's checkpoints on, with the workdir to itself: checks what it resumes
    from, reads its inputs, compiles, restores, then runs the steps left."""
    c = s.config
    # Read-only look at the workdir: a different model or another run is an error before any write.
    found = resume.read_checkpoints(s, workdir, log)
    n_params = param_count(s.model_cfg)
    log(
        f"gspmd_tp: {n_params['total'] / 1e6:.2f}M parameters | mesh {mesh_string(s.mesh)} on "
        f"{jax.device_count()} {jax.devices()[0].device_kind} devices | rules {s.rules.source}"
    )

    # A file one host lacks or reads otherwise stops every process (one line each), not that one alone.
    corpus, train_ds, eval_ds, imported, init_digest = distributed.agreed(
        inputs.read, s, bool(found), workdir, log
    )
    inputs.check_same(corpus, c.init_from, init_digest)
    if eval_batch_count(s, eval_ds) < c.eval_batches:
        log(
            f"config.eval_batches={c.eval_batches} is more than the held-out split's "
            f"{eval_ds.batches_per_pass} batches; evaluating those"
        )
    data_iter = iter(train_ds)

    if found and c.init_from:
        log(f"note: config.init_from={c.init_from} is not read: the run resumes from its checkpoints")

    # Before compiling (minutes on a large model); an evaluation a stop cut short still runs.
    damaged = {}  # {step: warning} of steps read already and found damaged: not read again
    if resume.nothing_left(s, workdir, found, damaged, log):
        return {"step": found[0][0]}

    t0 = time.perf_counter()
    train_step = step_lib.compile_train_step(s)
    with state_lib.sharding_context(s.mesh, s.rules):
        eval_step = step_lib.make_eval_step(s)
    compile_s = time.perf_counter() - t0
    run_setup.check_memory(train_step.memory_analysis(), s.mesh)

    # The first write: unreadable newest steps move aside so that saving those steps again works.
    step_dirs.move_aside_unreadable(workdir, [step for step, _ in found], warn=log)
    mngr = store.manager(workdir, c.keep_checkpoints)
    run = resume.restore(s, found, mngr, imported, damaged, log)
    if run.data_state is not None:
        data_iter.set_state(run.data_state)
    to_train = (
        f"training steps {run.start + 1}..{c.steps}" if run.start < c.steps else "no step left to train"
    )
    log(f"compiled in {compile_s:.1f}s; {to_train}")
    resume.note_changes(s, run, corpus, workdir, log)
    writer = metrics.MetricsWriter(workdir, enabled=jax.process_index() == 0, start=run.start)

    def held_out_loss(params, stop=lambda: False) -> float | None:
        """evaluate() of `params` on this run's held-out batches."""
        return evaluate(s, eval_step, params, eval_ds, stop)

    resume.finish_cut_evaluation(s, run, workdir, writer, held_out_loss, log)
    trace = _step_trace(s, workdir, run.start, train_step, mngr)
    last_row = _loop(s, run, data_iter, train_step, held_out_loss, mngr, writer, trace, corpus)
    traced = f", profile in {os.path.join(workdir, profiling.PROFILE)}" if trace.written else ""
    log(
        f"done: metrics in {os.path.join(workdir, metrics.JSONL)}, TensorBoard events in "
        f"{os.path.join(workdir, metrics.TENSORBOARD)}, checkpoints in {checkpoint_dir}{traced}"
    )
    return last_row


def _loop(
    s: Setup, run: resume.Resumed, data_iter, train_step, held_out_loss, mngr, writer, trace, corpus
) -> dict:
    """Trains steps run.start + 1..config.steps: for each, the next batch, the step, its report when
    due, a save when due or stopping, and the stop when asked. Returns the last row reported."""
    c, state = s.config, run.state
    watch = faults.NonFiniteWatch(c.skip_nonfinite_steps, log, run.start, run.skipped)
    batches = None
    finish_saves = True
    # Entered until the run returns: a signal while the last save finishes waits for it too.
    with signals.StopSignal(log) as stop:
        report = Reporter(
            s, run.start, writer, watch, lambda params: held_out_loss(params, stop.requested), log
        )
        try:
            with state_lib.sharding_context(s.mesh, s.rules):
                # Read ahead only once a stop signal is handled: one that comes while a batch is being
                # read must save and stop, not kill the run.
                batches = _batches(s, data_iter)
                for step in range(run.start + 1, c.steps + 1):
                    batch = report.next_batch(batches)
                    trace.before(step)
                    state, stats = train_step(state, batch)
                    report.exclude(trace.after(step, state))  # the trace's writing is no step's time
                    watch.add(step, stats)
                    report.flush()  # the logged step before: read while the device runs this one
                    report.when_due(step, stats, state.params)
                    stopping = stop.requested()
                    if step % c.checkpoint_every == 0 or step == c.steps or stopping:
                        _save(s, mngr, step, state, batches, watch, stopping, step == report.eval_cut, corpus)
                    if stopping:
                        return _stop(step, report, mngr, stop.stopped_by)
                report.flush()
        except Exception as e:
            # A failed step of a multi-process job: a peer is almost surely gone, and a save in flight
            # would wait for it in its own collectives until the coordination service aborts. The
            # caller exits instead; the next start removes the unfinished save.
            finish_saves = jax.process_count() == 1 or isinstance(e, UserError)
            raise
        finally:
            stop.finishing()  # a first signal from here on waits for the save in flight
            trace.close(settle=finish_saves)
            if batches is not None:
                batches.close()
            # Also on an error: let a save in flight finish, so the newest checkpoint on disk is complete.
            if finish_saves:
                mngr.wait_until_finished()
                mngr.close()
            writer.close()
    return report.last_row


def _batches(s: Setup, data_iter) -> pipeline.Prefetcher:
    """The training batches from `data_iter`, placed on the devices and read ahead config.data.prefetch
    deep (-1: none on CPU, pipeline.AUTO_PREFETCH elsewhere)."""
    depth = s.config.data.prefetch
    if depth < 0:
        depth = 0 if jax.devices()[0].platform == "cpu" else pipeline.AUTO_PREFETCH
    place = lambda b: pipeline.global_batch(b, s.batch_sharding, s.config.batch_size)  # noqa: E731
    return pipeline.Prefetcher(data_iter, place, depth)


def _save(
    s: Setup, mngr, step: int, state, batches, watch, stopping: bool, eval_pending: bool, corpus
) -> None:
    """Starts saving `step`'s state and data position, once `watch` finds it fit to keep (never a
    state that went through a non-finite step, or that a run of skipped steps left unmoved)."""
    watch.check_before_save(step, state, stopping)
    meta = {**s.meta(), "skipped_steps": watch.skipped, "eval_pending": eval_pending, "corpus": corpus}
    store.save(mngr, step, state, batches.get_state(), meta)
    watch.saved(step)


def _stop(step: int, report: Reporter, mngr, stopped_by: str) -> dict:
    """Ends the run after `step` on a stop signal, once its report and save are written; returns
    the last row reported, marked stopped."""
    report.flush()
    mngr.wait_until_finished()  # synchronous: the process may be killed soon after
    log(f"stopped by {stopped_by} after step {step}: checkpoint saved; run again to resume")
    return {**report.last_row, "step": step, "stopped": True}


def _step_trace(s: Setup, workdir: str, start: int, train_step, mngr) -> profiling.StepTrace:
    """config.profile's window of this start's steps; each process of a job traces its own devices.
    The trace stops once `mngr`'s save in flight (one the window started) has finished."""
    c = s.config.profile
    first = start + 1 + c.skip_steps
    last = min(first + c.steps - 1, s.config.steps)
    # The profiler writes local files: a run in a bucket keeps its traces in the local cache.
    directory = os.path.join(
        metrics.cache_dir(workdir) if paths.is_url(workdir) else workdir, profiling.PROFILE
    )
    if jax.process_count() > 1:
        directory = os.path.join(directory, f"process_{jax.process_index()}")
    if c.steps and first > s.config.steps:
        log(f"note: config.profile traces from step {first}, after the run's last step {s.config.steps}")
    text = train_step.as_text() if c.steps else ""
    steps = max(last - first + 1, 0)
    return profiling.StepTrace(directory, first, steps, text, log, mngr.wait_until_finished, c.python)
