"""The flags that make a command one process of a multi-process job, and joining the job with them:
absl flags for train.py and bench.py, argparse arguments for the readers of a trained run
(evaluate, generate).

No jax import here, so entry points can define their flags before jax is imported. An absl entry
point adopts them (flags.adopt_module_key_flags) so that its --helpshort lists them.
"""

import argparse
import sys

from absl import flags

from gspmd_tp.job.errors import UserError, interrupted

# (name, default, help); the type is the default's.
_JOB = (
    ("coordinator_address", "", "host:port of process 0 (multi-process)."),
    ("num_processes", 1, "Processes in the job (multi-process)."),
    ("process_id", 0, "This process's index in [0, num_processes)."),
    ("heartbeat_timeout_s", 100, "Multi-process: exit with an error when a peer is silent this long."),
    (
        "join_timeout_s",
        300,
        "Multi-process: exit with an error when the job has not all joined in this long.",
    ),
    ("distributed", False, "Let jax.distributed.initialize() find the job itself (TPU pods, SLURM)."),
)
_DEFINE = {str: flags.DEFINE_string, int: flags.DEFINE_integer, bool: flags.DEFINE_bool}
_ABSL = {name: _DEFINE[type(default)](name, default, text) for name, default, text in _JOB}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The job flags as arguments of an argparse command (a reader of a trained run)."""
    group = parser.add_argument_group("multi-process job (the same flags as train.py's)")
    for name, default, text in _JOB:
        if isinstance(default, bool):
            group.add_argument(f"--{name}", action="store_true", help=text)
        else:
            group.add_argument(f"--{name}", type=type(default), default=default, help=text)


def _values(args: argparse.Namespace | None) -> dict:
    if args is None:
        return {name: flag.value for name, flag in _ABSL.items()}
    return {name: getattr(args, name) for name, _, _ in _JOB}


def join(args: argparse.Namespace | None = None) -> None:
    """Joins the job the flags name (distributed.initialize), the absl flags or argparse's `args`;
    a single process without them. For a job that stops.run_job runs: its stop signals stay stops'."""
    from gspmd_tp.job import distributed, signals

    v = _values(args)
    distributed.initialize(
        v["coordinator_address"],
        v["num_processes"],
        v["process_id"],
        v["distributed"],
        v["heartbeat_timeout_s"],
        v["join_timeout_s"],
    )
    # Again: jax.distributed.initialize's preemption notifier takes SIGTERM over (and only logs it)
    # in a multi-process job.
    signals.take_stop_signals()


def _asks_for_a_job(args: argparse.Namespace) -> bool:
    """Whether argparse's `args` name a job of several processes (or one to find: --distributed)."""
    v = _values(args)
    return v["num_processes"] != 1 or v["distributed"] or bool(v["coordinator_address"])


def run_reader(work, args: argparse.Namespace, left: str) -> int:
    """Runs work() -> the text for stdout (or None) as a command that reads a trained run, and
    returns its exit status. Alone: a UserError is one line on stderr (status 1), Ctrl-C one line
    saying what it `left` (status 130). Where `args` name a job: joined first and run under
    stops.run_job, so that a peer's death, error or stop ends every process at once with one line;
    stdout holds process 0's text alone (gloo prints its own lines there while the processes join)."""
    if not _asks_for_a_job(args):
        try:
            text = work()
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return interrupted(left)
        if text is not None:
            print(text, flush=True)
        return 0
    from gspmd_tp.job import output_paths, signals

    def job():
        import jax

        with output_paths.stdout_to_stderr():
            join(args)
            text = work()
        if text is not None and jax.process_index() == 0:
            print(text, flush=True)

    signals.run_job(job, before=f"({left})", after=f"({left})")
    return 0
