"""The flags that make a command one process of a multi-process job, and joining the job with them:
absl flags, defined here once for every command that takes them (train.py, bench.py, evaluate,
generate).

No jax import here, so entry points can define their flags before jax is imported. An entry point
that defines them in absl's global FLAGS adopts them (flags.adopt_module_key_flags) so that its
--helpshort lists them.
"""

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


def define(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines the job flags in `flag_values`: absl's global FLAGS (train.py, bench.py), or the
    FlagValues of a command of its own (a reader of a trained run)."""
    for name, default, text in _JOB:
        _DEFINE[type(default)](name, default, text, flag_values=flag_values)


def _values(flag_values: flags.FlagValues) -> dict:
    return {name: flag_values[name].value for name, _, _ in _JOB}


def join(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Joins the job the job flags of `flag_values` name (distributed.initialize); a single process
    without them. For a job that signals.run_job runs: its stop signals stay signals'."""
    from gspmd_tp.job import distributed, signals

    v = _values(flag_values)
    distributed.initialize(
        v["coordinator_address"],
        v["num_processes"],
        v["process_id"],
        v["distributed"],
        v["heartbeat_timeout_s"],
        v["join_timeout_s"],
    )
    # Again: jax.distributed.initialize's preemption notifier takes SIGTERM over (and only logs it; its
    # sync point, multihost_utils.reached_preemption_sync_point, would see no Ctrl-C, nor a second
    # signal that must exit at once): the loop's StopSignal agrees on the step itself.
    signals.take_stop_signals()
    signals.follow_the_peers()


def _asks_for_a_job(flag_values: flags.FlagValues) -> bool:
    """Whether the job flags of `flag_values` name a job of several processes (or one to find:
    --distributed)."""
    v = _values(flag_values)
    return v["num_processes"] != 1 or v["distributed"] or bool(v["coordinator_address"])


def run_reader(work, flag_values: flags.FlagValues, left: str) -> int:
    """Runs work() -> the text for stdout (or None) as a command that reads a trained run, and
    returns its exit status. Alone: a UserError is one line on stderr (status 1), Ctrl-C one line
    saying what it `left` (status 130). Where the job flags of `flag_values` name a job: joined first
    and run under signals.run_job, so that a peer's death, error or stop ends every process at once
    with one line; stdout holds process 0's text alone (gloo prints its own lines there while the
    processes join)."""
    if not _asks_for_a_job(flag_values):
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
            join(flag_values)
            text = work()
        if text is not None and jax.process_index() == 0:
            print(text, flush=True)

    signals.run_job(job, before=f"({left})", after=f"({left})")
    return 0
