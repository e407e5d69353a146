"""The absl flags that make a command one process of a job (train.py, bench.py, evaluate, generate),
and joining the job with them. No jax import here: entry points define flags before importing it."""

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
    """Defines the job flags in `flag_values`: absl's FLAGS, or a reader command's own."""
    for name, default, text in _JOB:
        _DEFINE[type(default)](name, default, text, flag_values=flag_values)


def _values(flag_values: flags.FlagValues) -> dict:
    return {name: flag_values[name].value for name, _, _ in _JOB}


def join(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Joins the job the flags of `flag_values` name (distributed.initialize), for signals.run_job."""
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
    # Again: jax.distributed.initialize's preemption notifier takes SIGTERM over; its sync point
    # (multihost_utils.reached_preemption_sync_point) would see no Ctrl-C, nor a second signal.
    signals.take_stop_signals()
    signals.follow_the_peers()


def _asks_for_a_job(flag_values: flags.FlagValues) -> bool:
    """Whether the job flags of `flag_values` name a job of several processes (or --distributed)."""
    v = _values(flag_values)
    return v["num_processes"] != 1 or v["distributed"] or bool(v["coordinator_address"])


def run_reader(work, flag_values: flags.FlagValues, left: str) -> int:
    """Runs work() -> text for stdout (or None) as a reader of a trained run; returns the exit status.
    Alone: a UserError is one line (status 1), Ctrl-C one line saying what it `left` (130). In a job:
    joined and run under signals.run_job; stdout holds process 0's text alone (gloo prints there)."""
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
