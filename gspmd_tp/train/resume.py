"""Resume bookkeeping: what a start finds in its workdir, and how it takes the run up from there.

Before compiling, the checkpoints are checked against the run (read_checkpoints) and a run that is
already done stops (nothing_left). After compiling, restore() gives the state to train from, and
note_changes() and finish_cut_evaluation() log what changed and complete what a stop cut short.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax

from gspmd_tp.checkpoint import store
from gspmd_tp.cli.config_keys import changed
from gspmd_tp.job import distributed
from gspmd_tp.train import faults, inputs, metrics, optimizer
from gspmd_tp.train import state as state_lib

if TYPE_CHECKING:
    from gspmd_tp.train.run_setup import Setup

# Keys whose change on resume is reported elsewhere (the resume line, the schedule note, the
# init_from note) or refused (checkpoint.RUN_IDENTITY).
_NOTED_ELSEWHERE = ("rules", "mesh", "init_from", *optimizer.SCHEDULE_KEYS, *store.RUN_IDENTITY)


@dataclasses.dataclass
class Resumed:
    """Where this start takes the run up: the state and data position to train from."""

    state: Any
    data_state: dict | None  # the data iterator's position; None: its beginning
    start: int  # the step `state` is at: 0 on a fresh start (or an imported step-0 checkpoint)
    skipped: int  # steps skipped for a non-finite loss over the whole run, before the checkpoint too
    meta: dict | None  # the meta of the checkpoint resumed; None on a fresh start


def read_checkpoints(s: Setup, workdir: str, log) -> list[tuple[int, dict]]:
    """The workdir's checkpoints, (step, meta) newest first, the same on every process; raises
    UserError where one holds a different model or another run. Reads only: before any write."""
    found = store.agreed_checkpoints(workdir, warn=log)
    for step, meta in found:
        if step > 0:  # first: another tokenizer also changes the model's vocabulary size
            inputs.check_tokenizer(meta.get("corpus", {}), s.config.data, workdir)
        store.check_model_matches(meta["model"], s.model_cfg, workdir)
        if step > 0:  # step 0 (convert from-hf) has read no data: any data and seeds may follow it
            store.check_same_run(meta["config"], s.config, workdir)
    return found


def nothing_left(s: Setup, workdir: str, found: list, damaged: dict, log) -> bool:
    """Whether the newest checkpoint has reached config.steps with its evaluation done: then says so
    and sets aside later metrics rows. Its step is read first; a damaged one goes into `damaged`
    ({step: warning}) for restore() to move aside, and the run goes on from an older one."""
    if not found:
        return False
    newest, meta = found[0]
    if newest < s.config.steps or _evaluation_pending(workdir, newest, meta):
        return False
    warning = store.damage_warning(workdir, newest, s.abstract_state)
    if warning is not None:
        damaged[newest] = warning
        return False
    log(f"nothing to do: the newest checkpoint is at step {newest} >= config.steps={s.config.steps}")
    _set_aside_rows_after(workdir, newest, "", log)
    return True


def restore(s: Setup, found: list, mngr, imported_params, damaged: dict, log) -> Resumed:
    """The newest checkpoint of `found` that restores, else a fresh init (with `imported_params`
    where config.init_from gave some). The steps of `damaged` were read already: moved aside unread."""
    c = s.config
    if found:
        start, meta, state, data_state = store.restore_newest(
            mngr, found, s.abstract_state, warn=log, damaged=damaged
        )
        older = max((step for step, _ in found if step < start), default=None)
        faults.check_resumed(start, state, str(mngr.directory), older)
        log(f"resumed from step {start} (saved on mesh {meta['mesh']} with rules {meta['rules']['source']})")
        return Resumed(state, data_state, start, meta.get("skipped_steps", 0), meta)
    state = state_lib.init_state(s.model_cfg, s.tx, s.mesh, s.rules, c.seq_len, c.seed)
    if imported_params is not None:
        state = state.replace(params=imported_params)
        log(f"initial parameters from {c.init_from}")
    return Resumed(state, None, 0, 0, None)


def note_changes(s: Setup, run: Resumed, corpus: dict, workdir: str, log) -> None:
    """Logs what changed since the checkpoint resumed (corpus files, schedule, other settings) and
    sets aside the metrics rows of the steps this start trains again."""
    c, start, meta = s.config, run.start, run.meta
    if meta and start:  # step 0 (an import) has read no data, and its config is from-hf's, not a run's
        _note_corpus_change(meta.get("corpus", {}), corpus, start, log)
        if start < c.steps:
            optimizer.note_schedule_change(meta["config"], c, start, start - run.skipped, log)
        _note_config_change(meta["config"], c, start, log)
    _set_aside_rows_after(
        workdir, start, f"; steps {start + 1}..{c.steps} train again" if start < c.steps else "", log
    )


def finish_cut_evaluation(s: Setup, run: Resumed, workdir: str, writer, evaluate, log) -> None:
    """Runs the evaluation of the checkpoint resumed where a stop cut it short, adding its
    eval_loss to that step's metrics row. `evaluate(params)` is the held-out loss."""
    if not run.meta or not _evaluation_pending(workdir, run.start, run.meta):
        return
    with state_lib.sharding_context(s.mesh, s.rules):
        eval_loss = evaluate(run.state.params)
    writer.amend(run.start, {"eval_loss": eval_loss})
    log(f"step {run.start}'s evaluation, cut short by the stop, done now: eval_loss {eval_loss:.4f}")


def _note_config_change(saved_config: dict, config, step: int, log) -> None:
    """Logs one line naming the settings a resumed run changed since `step` was saved (a larger
    batch, another remat policy, ...): accepted, and in the log of the run they change."""
    diffs = changed(saved_config, config.to_dict(), _NOTED_ELSEWHERE)
    if diffs:
        log(f"note: changed since step {step} was saved: {'; '.join(diffs)}")


def _note_corpus_change(saved: dict, now: dict, step: int, log) -> None:
    """A warning for each token stream whose files changed (in place: config.data is the same run's)
    since checkpoint `step` was saved."""
    for split, (what, consequence) in inputs.CORPUS_SPLITS.items():
        before = saved.get(split)
        if before and before != now[split]:
            log(
                f"warning: the {what} changed since step {step} was saved ({before['tokens']:,} tokens, now "
                f"{now[split]['tokens']:,}; its files were edited): {consequence}"
            )


def _set_aside_rows_after(workdir: str, step: int, note: str, log) -> None:
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
