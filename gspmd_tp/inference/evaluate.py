"""Held-out loss of a trained run, and a chart of its loss curves.

    python -m gspmd_tp.evaluate --workdir=DIR [--step=N] [--eval_batches=N|all] [--json] [--plot=loss.png]
        [--config.rules=NAME --config.mesh=dp=4,mp=2 ...]
    python -m gspmd_tp.evaluate --workdir=DIR --plot=loss.png --plot_only   # no checkpoint read

The newest checkpoint's parameters are evaluated on the held-out split of the run's own data
config (config.data: the hash-chosen held-out documents, or config.data.eval_files) with the
trainer's own eval step, so the loss equals the eval_loss that training logs for those parameters.

As one process of a job of several (a pod, a cluster), with train.py's job flags:
--coordinator_address=HOST:PORT --num_processes=N --process_id=I, or --distributed; process 0 prints.
"""

from __future__ import annotations

if __name__ == "__main__":  # before jax is imported: Ctrl-C while importing is one line
    from gspmd_tp.job import entry

    entry.begin()  # main() asks for the devices once the flags are read

import json
import math
import os
import sys

import jax
from absl import flags

from gspmd_tp.cli import arguments
from gspmd_tp.cli.arguments import no_positional_arguments, parse_command_flags
from gspmd_tp.data import pipeline
from gspmd_tp.inference import saved_run
from gspmd_tp.job import distributed
from gspmd_tp.job.errors import UserError, warn
from gspmd_tp.sharding.mesh import mesh_string
from gspmd_tp.storage import outputs, paths
from gspmd_tp.train import inputs, loop, run_setup
from gspmd_tp.train import state as state_lib
from gspmd_tp.train import step as step_lib


def compiled_eval_step(s: run_setup.Setup):
    """The eval step compiled for `s`; UserError where it cannot fit in memory (before any read)."""
    eval_step = step_lib.compile_eval_step(s)
    fix = "shrink --config.batch_size or --config.seq_len, or read on another --config.mesh"
    run_setup.check_memory(eval_step.memory_analysis(), s.mesh, "evaluation step", fix)
    return eval_step


def held_out_batches(s: run_setup.Setup, workdir: str | None = None) -> tuple[pipeline.BatchStream, dict]:
    """(held-out batches, their tokens' fingerprint) of s.config.data, read from the files now (none
    inside the run's `workdir`, as in training): UserError where they are missing or too short."""
    c = s.config
    eval_tokens, text_bytes = pipeline.held_out(c.data, workdir)
    rows = pipeline.process_rows(s.batch_sharding, c.batch_size)
    eval_ds = pipeline.eval_dataset(
        eval_tokens, c.seq_len, c.batch_size, rows, pipeline.document_separator(c.data)
    )
    eval_ds.bytes_per_token = text_bytes / max(len(eval_tokens), 1)
    return eval_ds, pipeline.fingerprint(eval_tokens)


def note_held_out_change(saved: dict, now: dict, step: int) -> None:
    """A note on stderr where the held-out tokens differ from those checkpoint `step` recorded
    (files edited since): the loss then does not compare with the eval_loss training logged."""
    before = saved.get("held_out")
    if before and before != now:
        warn(
            f"note: the held-out split changed since step {step} was saved ({before['tokens']:,} tokens, "
            f"now {now['tokens']:,}; its files were edited): this loss does not compare with the run's "
            "eval_loss"
        )


def evaluate_params(s: run_setup.Setup, params, eval_step=None, eval_ds=None) -> dict:
    """Loss and perplexities of `params` over config.eval_batches held-out batches (at most one
    pass over them), with `eval_step` (compiled_eval_step) or one compiled on first use, and
    `eval_ds` (held_out_batches) or the batches read now."""
    if eval_ds is None:
        eval_ds = held_out_batches(s)[0]
    with state_lib.sharding_context(s.mesh, s.rules):
        nats, tokens = loop.held_out_sums(s, eval_step or step_lib.make_eval_step(s), params, eval_ds)
    batches = loop.eval_batch_count(s, eval_ds)
    loss = nats / tokens
    # Bytes of text per token, the held-out split's average (byte tokens: 1, the separators
    # counted), so that runs with different tokenizers compare per byte.
    n_bytes = round(tokens * eval_ds.bytes_per_token)
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": tokens,
        "bytes": n_bytes,
        "bits_per_byte": nats / n_bytes / math.log(2),
        "byte_perplexity": math.exp(nats / n_bytes),
        "eval_batches": batches,
    }


def read_metrics(workdir: str) -> list[dict]:
    """The rows of workdir/metrics.jsonl, one per step in step order; UserError if there is none or a
    line is not JSON (but for a last line cut short by a kill, which the next training start moves
    aside too: left out, with a note).

    A run resumed from a checkpoint older than its last logged step logs the steps after it again;
    the later row of a step is the one the run went on from, so it replaces the earlier.
    """
    path = os.path.join(workdir, "metrics.jsonl")
    if not paths.of(path).is_file():
        raise UserError(f"{path}: no such file (train.py writes it)")
    rows = []
    for i, line in enumerate(paths.of(path).read_text().splitlines(keepends=True)):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if not line.endswith("\n"):  # the last line, cut short by a kill mid-write
                    warn(f"note: {path}:{i + 1} was cut short (the run was killed writing it); left out")
                    continue
                raise UserError(f"{path}:{i + 1}: not a JSON object") from None
    if not any("loss" in r for r in rows):
        raise UserError(f"{path}: no row has a loss")
    by_step = {r.get("step"): r for r in rows}
    return [by_step[step] for step in sorted(by_step, key=lambda s: (s is None, s))]


def plot_losses(rows: list[dict], path: str, title: str, evaluated: dict | None = None) -> None:
    """A PNG of training loss and held-out loss against step (and the point just evaluated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    held = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*train, strict=True), label="training loss", linewidth=1)
    if held:
        ax.plot(*zip(*held, strict=True), "o-", label="held-out loss (during training)")
    if evaluated is not None:
        ax.plot([evaluated["step"]], [evaluated["loss"]], "r*", markersize=12, label="evaluate")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        with outputs.whole_file(path) as partial:  # a bucket's is uploaded once written
            fig.savefig(partial, dpi=110, format=os.path.splitext(path)[1].lstrip(".").lower())
    except OSError as e:
        raise UserError(f"--plot={path}: {e}") from None
    finally:
        plt.close(fig)


def _report(r: dict, workdir: str) -> str:
    return (
        f"step {r['step']} of {workdir} | mesh {r['mesh']} | rules {r['rules']}\n"
        f"held-out: {r['eval_batches']} batches, {r['tokens']:,} tokens ({r['bytes']:,} bytes)\n"
        f"loss {r['loss']:.4f} nats/token | perplexity {r['perplexity']:.3f} per token | "
        f"{r['bits_per_byte']:.4f} bits/byte | perplexity {r['byte_perplexity']:.3f} per byte"
    )


def _batch_count(text: str) -> int:
    """--eval_batches as a count; `all` is more than any held-out split holds (capped to one pass)."""
    if text == "all":
        return 2**31 - 1
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count <= 0:
        raise UserError(f"--eval_batches must be a positive integer or all, got {text!r}")
    return count


FLAGS = saved_run.reader_flags()  # the command's own: generate's share some names
flags.DEFINE_string(
    "eval_batches",
    None,
    "N, or all: one pass over the held-out split (default: the run's).",
    flag_values=FLAGS,
)
flags.DEFINE_bool("json", False, "Print one JSON object.", flag_values=FLAGS)
arguments.define_path("plot", None, "Write the loss curves of metrics.jsonl to this PNG.", flag_values=FLAGS)
flags.DEFINE_bool("plot_only", False, "With --plot: skip the evaluation.", flag_values=FLAGS)


def main(argv: list[str] | None = None) -> int:
    """python -m gspmd_tp.evaluate --workdir=DIR [--eval_batches=N|all] [--json] [--plot=PNG]; `argv`
    is the command's arguments (default: sys.argv[1:]). Returns the exit status."""
    config_args, argv = saved_run.config_arguments(sys.argv[1:] if argv is None else argv)
    no_positional_arguments(parse_command_flags(FLAGS, ["python -m gspmd_tp.evaluate", *argv], __doc__))
    saved_run.request_devices([*argv, *config_args])  # before jax's backend starts
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # orbax logs every read at INFO
    return saved_run.run_reader(lambda: _evaluate(config_args), FLAGS, "nothing in the workdir was written")


def _evaluate(config_args: list[str]) -> str | None:
    """The evaluation main() asked for, as the text for stdout (process 0's); UserError for bad input."""
    overrides = saved_run.split_overrides(config_args)
    if FLAGS.eval_batches is not None:
        overrides["eval_batches"] = str(_batch_count(FLAGS.eval_batches))
    if FLAGS.plot_only and not FLAGS.plot:
        raise UserError("--plot_only needs --plot=PNG")
    # Every process of a job reads the same checkpoint the same way (--eval_batches is a config key).
    distributed.check_same_everywhere(None, flags={"--step": FLAGS.step, "--plot_only": FLAGS.plot_only})
    first = jax.process_index() == 0  # the plot, and the report, are process 0's

    def plotted_rows():
        if first:
            outputs.check_image(FLAGS.plot, "--plot")
        return read_metrics(FLAGS.workdir)

    rows = distributed.agreed(plotted_rows) if FLAGS.plot else None
    result = None
    if not FLAGS.plot_only:
        step, meta, s = saved_run.load_setup(FLAGS.workdir, overrides, FLAGS.step)
        # The data files first: one that is gone or too short is found before the compile and the read.
        eval_ds, held_out = distributed.agreed(held_out_batches, s, FLAGS.workdir)
        inputs.check_same({"held_out": held_out})  # each process reads only its rows
        if first and not any(key.startswith("data.") for key in overrides):  # not other data asked for
            note_held_out_change(meta.get("corpus", {}), held_out, step)
        eval_step = distributed.agreed(compiled_eval_step, s)
        step, params = saved_run.params_for(FLAGS.workdir, step, s, exact=FLAGS.step is not None)
        result = {"step": step, "mesh": mesh_string(s.mesh), "rules": s.rules.source}
        result.update(evaluate_params(s, params, eval_step, eval_ds))
    if not first:
        return None
    if FLAGS.plot:
        plot_losses(rows, FLAGS.plot, f"{paths.absolute(FLAGS.workdir)}", result)
    lines = [] if result is None else [json.dumps(result) if FLAGS.json else _report(result, FLAGS.workdir)]
    if FLAGS.plot and not FLAGS.json:
        lines.append(f"plot: {FLAGS.plot}")
    return "\n".join(lines)


if __name__ == "__main__":
    entry.run(main)
