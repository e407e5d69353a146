"""The training loop: config -> mesh, rules, sharded state -> jit-compiled steps -> metrics, checkpoints.

`train(config, workdir)` is the library entry point that train.py and the tests call.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import jax

from gspmd_tp.checkpoint import step_dirs, store
from gspmd_tp.data import documents, pipeline
from gspmd_tp.job import distributed, output_paths, paths, signals
from gspmd_tp.job.config_keys import changed
from gspmd_tp.job.errors import UserError
from gspmd_tp.model.params import flops_per_token, param_count
from gspmd_tp.sharding.mesh import mesh_string
from gspmd_tp.train import faults, inputs, metrics, optimizer, profiling, run_setup
from gspmd_tp.train import state as state_lib
from gspmd_tp.train import step as step_lib

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


# Keys whose change on resume is reported elsewhere (the resume line, the schedule note, the
# init_from note) or refused (checkpoint.RUN_IDENTITY).
_NOTED_ELSEWHERE = ("rules", "mesh", "init_from", *optimizer.SCHEDULE_KEYS, *store.RUN_IDENTITY)


def _note_config_change(saved_config: dict, config, step: int) -> None:
    """Logs one line naming the settings a resumed run changed since `step` was saved (a larger
    batch, another remat policy, ...): accepted, and in the log of the run they change."""
    diffs = changed(saved_config, config.to_dict(), _NOTED_ELSEWHERE)
    if diffs:
        log(f"note: changed since step {step} was saved: {'; '.join(diffs)}")


def _initial_state(s: Setup, found: list, mngr, imported_params, damaged: dict):
    """(state, data-iterator state or None, start step): the newest checkpoint that restores, else
    init. The steps of `damaged` ({step: warning}) were read already: moved aside unread."""
    c = s.config
    if found:
        start, meta, state, data_state = store.restore_newest(
            mngr, found, s.abstract_state, warn=log, damaged=damaged
        )
        older = max((step for step, _ in found if step < start), default=None)
        faults.check_resumed(start, state, str(mngr.directory), older)
        log(f"resumed from step {start} (saved on mesh {meta['mesh']} with rules {meta['rules']['source']})")
        return state, data_state, start
    state = state_lib.init_state(s.model_cfg, s.tx, s.mesh, s.rules, c.seq_len, c.seed)
    if imported_params is not None:
        state = state.replace(params=imported_params)
        log(f"initial parameters from {c.init_from}")
    return state, None, 0


def _note_corpus_change(saved: dict, now: dict, step: int) -> None:
    """A warning for each token stream whose files changed (in place: config.data is the same run's)
    since checkpoint `step` was saved."""
    for split, (what, consequence) in inputs.CORPUS_SPLITS.items():
        before = saved.get(split)
        if before and before != now[split]:
            log(
                f"warning: the {what} changed since step {step} was saved ({before['tokens']:,} tokens, now "
                f"{now[split]['tokens']:,}; its files were edited): {consequence}"
            )


def _set_aside_rows_after(workdir: str, step: int, note: str) -> None:
    """metrics.set_aside_after on process 0, logged with `note` where rows moved."""
    if jax.process_index() == 0:
        replaced = metrics.set_aside_after(workdir, step)
        if replaced:
            rows = f"{replaced} row{'s' if replaced > 1 else ''}"
            log(f"{metrics.JSONL}: {rows} of steps after {step} moved to {metrics.REPLACED}{note}")


def _evaluation_pending(workdir: str, step: int, meta: dict) -> bool:
    """Whether checkpoint `step`'s evaluation, cut short by a stop, is still to run: its meta says
    so and metrics.jsonl's row of the step has no eval_loss yet (a start that ran it wrote one).
    The same answer on every process (process 0's reading of the file)."""
    if not meta.get("eval_pending"):
        return False
    done = jax.process_index() == 0 and metrics.has_value(workdir, step, "eval_loss")
    return not distributed.from_process_0(done)


def train(config, workdir: str) -> dict:
    """Trains per `config`, resuming from the newest checkpoint in workdir; returns final metrics.

    A SIGTERM/SIGINT saves at the next step boundary and returns with "stopped" set; a second
    exits at once. A NaN/Inf loss or gradient raises UserError (or is skipped, per config).
    """
    # First, on every process: what fails on one process alone fails every process, named on each.
    s = distributed.agreed_setup(config, _checked_setup, config, workdir)
    checkpoint_dir = step_dirs.checkpoint_dir(workdir)
    c = s.config
    workdir = os.path.abspath(workdir)
    # Saved absolute, so that evaluate, generate and a resume find the files from any directory.
    c.data.train_files = documents.absolute_patterns(c.data.train_files)
    c.data.eval_files = documents.absolute_patterns(c.data.eval_files)
    if os.path.isfile(paths.expand(c.rules)):  # a rule file of the user's: found from anywhere
        c.rules = os.path.abspath(paths.expand(c.rules))
    c.init_from = paths.expand(c.init_from)  # bash leaves `--config.init_from=~/p.npz` as it is
    with output_paths.workdir_lock(workdir, log):  # one job at a time on a workdir
        return _train(s, workdir, checkpoint_dir)


def _checked_setup(config, workdir: str) -> Setup:
    """setup(config), once the workdir's paths are found writable."""
    step_dirs.check_workdir_given(workdir)
    output_paths.check_dir(workdir, "--workdir")
    # What a run writes inside it, where it exists already (a resumed run) and is not writable:
    # found now, not when the first save fails in the background minutes later.
    checkpoint_dir = step_dirs.checkpoint_dir(workdir)
    output_paths.check_dir(checkpoint_dir, "--workdir's checkpoints")
    output_paths.check_dir(os.path.join(workdir, metrics.TENSORBOARD), "--workdir's tensorboard")
    output_paths.check_file(os.path.join(workdir, metrics.JSONL), "--workdir's metrics")
    output_paths.check_file(os.path.join(workdir, metrics.REPLACED), "--workdir's replaced metrics")
    s = run_setup.setup(config)
    # Before anything is compiled: a read-ahead without bound fills memory while the run trains. Only
    # training reads ahead, so evaluate and generate read a run saved with a larger read-ahead.
    pipeline.check_prefetch(config.data.prefetch, config.batch_size, config.seq_len)
    return s


def _step_trace(s: Setup, workdir: str, start: int, train_step, mngr) -> profiling.StepTrace:
    """config.profile's window of this start's steps; each process of a job traces its own devices.
    The trace stops once `mngr`'s save in flight (one the window started) has finished."""
    c = s.config.profile
    first = start + 1 + c.skip_steps
    last = min(first + c.steps - 1, s.config.steps)
    directory = os.path.join(workdir, profiling.PROFILE)
    if jax.process_count() > 1:
        directory = os.path.join(directory, f"process_{jax.process_index()}")
    if c.steps and first > s.config.steps:
        log(f"note: config.profile traces from step {first}, after the run's last step {s.config.steps}")
    text = train_step.as_text() if c.steps else ""
    steps = max(last - first + 1, 0)
    return profiling.StepTrace(directory, first, steps, text, log, mngr.wait_until_finished, c.python)


def _train(s: Setup, workdir: str, checkpoint_dir: str) -> dict:
    """train() from the workdir's checkpoints on, with the workdir to itself."""
    c = s.config
    # Read-only look at the workdir: a different model or another run is an error before any write.
    found = store.agreed_checkpoints(workdir, warn=log)  # the same steps on every process
    for step, meta in found:
        store.check_model_matches(meta["model"], s.model_cfg, workdir)
        if step > 0:  # step 0 (convert from-hf) has read no data: any data and seeds may follow it
            store.check_same_run(meta["config"], c, workdir)
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

    # Before compiling (minutes on a large model); an evaluation a stop cut short still runs. The
    # step is read first: a damaged one is left to the resume below, which skips and moves it.
    newest = found[0][0] if found else None
    damaged = {}  # {step: warning} of steps read already and found damaged: not read again below
    if newest is not None and newest >= c.steps and not _evaluation_pending(workdir, newest, found[0][1]):
        warning = store.damage_warning(workdir, newest, s.abstract_state)
        if warning is None:
            log(f"nothing to do: the newest checkpoint is at step {newest} >= config.steps={c.steps}")
            _set_aside_rows_after(workdir, newest, "")
            return {"step": newest}
        damaged[newest] = warning

    t0 = time.perf_counter()
    train_step = step_lib.compile_train_step(s)
    with state_lib.sharding_context(s.mesh, s.rules):
        eval_step = step_lib.make_eval_step(s)
    compile_s = time.perf_counter() - t0
    run_setup.check_memory(train_step.memory_analysis(), s.mesh)

    # The first write: unreadable newest steps move aside so that saving those steps again works.
    step_dirs.move_aside_unreadable(workdir, [step for step, _ in found], warn=log)
    mngr = store.manager(workdir, c.keep_checkpoints)
    state, data_state, start = _initial_state(s, found, mngr, imported, damaged)
    if data_state is not None:
        data_iter.set_state(data_state)
    to_train = f"training steps {start + 1}..{c.steps}" if start < c.steps else "no step left to train"
    log(f"compiled in {compile_s:.1f}s; {to_train}")
    resumed = dict(found).get(start)  # the meta of the checkpoint resumed; None on a fresh start
    if resumed and start:  # step 0 (an import) has read no data
        _note_corpus_change(resumed.get("corpus", {}), corpus, start)
    # Steps skipped for a non-finite loss: the count covers the whole run, before the checkpoint too.
    skipped = resumed.get("skipped_steps", 0) if resumed else 0
    if resumed and 0 < start < c.steps:  # a step-0 checkpoint (an import) trained on no schedule
        optimizer.note_schedule_change(resumed["config"], c, start, start - skipped, log)
    if resumed and start:  # an import's config is from-hf's, not a run's
        _note_config_change(resumed["config"], c, start)
    _set_aside_rows_after(
        workdir, start, f"; steps {start + 1}..{c.steps} train again" if start < c.steps else ""
    )
    writer = metrics.MetricsWriter(workdir, enabled=jax.process_index() == 0, start=start)
    if resumed and _evaluation_pending(workdir, start, resumed):  # a stop cut it short
        with state_lib.sharding_context(s.mesh, s.rules):
            eval_loss = evaluate(s, eval_step, state.params, eval_ds)
        writer.amend(start, {"eval_loss": eval_loss})
        log(f"step {start}'s evaluation, cut short by the stop, done now: eval_loss {eval_loss:.4f}")
    flops = flops_per_token(s.model_cfg, c.seq_len)
    peak = metrics.peak_flops(jax.devices()[0].device_kind, c.peak_flops_per_device)
    tokens_per_step = c.batch_size * c.seq_len
    watch = faults.NonFiniteWatch(c.skip_nonfinite_steps, log, start)
    watch.skipped = skipped
    last_saved = start if start else None
    last_row: dict = {}
    eval_cut = None  # the step whose evaluation a stop signal cut short
    # `data_wait_ms` is what the loop waits for its next batch, read ahead or not.
    depth = c.data.prefetch
    if depth < 0:
        depth = 0 if jax.devices()[0].platform == "cpu" else pipeline.AUTO_PREFETCH
    batches = None
    window = {"start": time.perf_counter(), "data_wait": []}  # one wait per step dispatched
    trace = _step_trace(s, workdir, start, train_step, mngr)

    def report(step: int, stats, steps: int, eval_params=None) -> None:
        """Reads a logged step's stats (the host's only wait) and writes its row. `steps` of the
        window had been dispatched when it was logged; later ones start the next window."""
        nonlocal last_row, eval_cut
        stats = jax.device_get(stats)
        watch.check(last_saved, upto=step)
        now = time.perf_counter()
        elapsed = now - window["start"]
        tps = tokens_per_step * steps / elapsed
        row = {k: float(v) for k, v in stats.items()}
        row.update(
            tokens_per_sec=tps,
            step_time_s=elapsed / steps,
            data_wait_ms=1e3 * sum(window["data_wait"][:steps]) / steps,
            mfu=metrics.mfu(flops, tps, jax.device_count(), peak),
        )
        if watch.skipped:
            row["skipped_steps"] = watch.skipped
        if eval_params is not None:
            eval_loss = evaluate(s, eval_step, eval_params, eval_ds, stop.requested)
            if eval_loss is not None:
                row["eval_loss"] = eval_loss
            else:  # the checkpoint this stop saves says so, and the resumed run evaluates it
                eval_cut = step
        writer.write(step, row)
        log(metrics.progress_line(step, c.steps, row))
        last_row = {"step": step, **row}
        later = window["data_wait"][steps:]
        window.update(start=time.perf_counter(), data_wait=later)

    pending = None  # a logged step whose stats are read once the next step is dispatched
    finish_saves = True
    failed = False  # the loop ended with an error
    # Entered until the run returns: a signal while the last save finishes waits for it too.
    with signals.StopSignal(log) as stop:
        try:
            with state_lib.sharding_context(s.mesh, s.rules):
                # Read ahead only once a stop signal is handled: one that comes while a batch is being
                # read must save and stop, not kill the run.
                place = lambda b: pipeline.global_batch(b, s.batch_sharding, c.batch_size)  # noqa: E731
                batches = pipeline.Prefetcher(data_iter, place, depth)
                for step in range(start + 1, c.steps + 1):
                    t = time.perf_counter()
                    batch = next(batches)
                    window["data_wait"].append(time.perf_counter() - t)
                    trace.before(step)
                    state, stats = train_step(state, batch)
                    window["start"] += trace.after(step, state)  # the trace's writing is no step's time
                    watch.add(step, stats)
                    if pending is not None:  # the device is busy with this step meanwhile
                        report(*pending)
                        pending = None
                    done = step == c.steps
                    evaluating = step % c.eval_every == 0 or done
                    if step % c.log_every == 0 or evaluating or step == start + 1:
                        if evaluating:  # evaluates this step's parameters: now
                            report(step, stats, len(window["data_wait"]), eval_params=state.params)
                        else:
                            pending = (step, stats, len(window["data_wait"]))
                    stopping = stop.requested()
                    if step % c.checkpoint_every == 0 or done or stopping:
                        watch.check(last_saved)  # never save a state that went through a non-finite step
                        since = last_saved if last_saved is not None else start  # the last save or the start
                        if not stopping:  # skipping: an interval that moved nothing is not saved
                            watch.check_diverged(step, since, last_saved)
                        # An update may overflow the state from a finite loss: never saved.
                        watch.check_state(step, state, since, last_saved)
                        meta = {**s.meta(), "skipped_steps": watch.skipped, "eval_pending": step == eval_cut}
                        meta["corpus"] = corpus
                        store.save(mngr, step, state, batches.get_state(), meta)
                        last_saved = step
                    if stopping:
                        if pending is not None:
                            report(*pending)
                            pending = None
                        mngr.wait_until_finished()  # synchronous: the process may be killed soon after
                        log(
                            f"stopped by {stop.stopped_by} after step {step}: checkpoint saved; "
                            "run again to resume"
                        )
                        last_row = {**last_row, "step": step, "stopped": True}
                        break
                if pending is not None:
                    report(*pending)
        except Exception as e:
            # A failed step of a multi-process job: a peer is almost surely gone, and a save in flight
            # would wait for it in its own collectives until the coordination service aborts. The
            # caller exits instead; the next start removes the unfinished save.
            finish_saves = jax.process_count() == 1 or isinstance(e, UserError)
            failed = True
            raise
        finally:
            stop.finishing(failed)  # a first signal from here on waits for the save in flight
            trace.close(settle=finish_saves)
            if batches is not None:
                batches.close()
            # Also on an error: let a save in flight finish, so the newest checkpoint on disk is complete.
            if finish_saves:
                mngr.wait_until_finished()
                mngr.close()
            writer.close()
        traced = f", profile in {os.path.join(workdir, profiling.PROFILE)}" if trace.written else ""
        log(
            f"done: metrics in {os.path.join(workdir, metrics.JSONL)}, TensorBoard events in "
            f"{os.path.join(workdir, metrics.TENSORBOARD)}, checkpoints in {checkpoint_dir}{traced}"
        )
    return last_row
