"""The absl flags that make a command one process of a job (train.py, bench.py, evaluate, generate),
and joining the job with them. No jax import here: entry points define flags before importing it."""

import contextlib
import os
import sys

from absl import flags

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


def values(flag_values: flags.FlagValues) -> dict:
    """The job flags' values in `flag_values`, by name."""
    return {name: flag_values[name].value for name, _, _ in _JOB}


def join(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Joins the job the flags of `flag_values` name (distributed.initialize), for signals.run_job."""
    from gspmd_tp.job import distributed, signals

    distributed.initialize(**values(flag_values))
    # Again: jax.distributed.initialize's preemption notifier takes SIGTERM over; its sync point
    # (multihost_utils.reached_preemption_sync_point) would see no Ctrl-C, nor a second signal.
    signals.take_stop_signals()
    signals.follow_the_peers()


@contextlib.contextmanager
def stdout_to_stderr():
    """Within it fd 1 goes to stderr (gloo prints its connection lines there), so that stdout holds
    only the report printed after it."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
