"""The flags that make a command one process of a multi-process job (train.py, bench.py), and joining
the job with them.

No jax import here, so entry points can define their flags before jax is imported. An entry point
adopts them (flags.adopt_module_key_flags) so that its --helpshort lists them.
"""

from absl import flags

_COORDINATOR = flags.DEFINE_string("coordinator_address", "", "host:port of process 0 (multi-process).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 1, "Processes in the job (multi-process).")
_PROCESS_ID = flags.DEFINE_integer("process_id", 0, "This process's index in [0, num_processes).")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_s", 100, "Multi-process: exit with an error when a peer is silent this long."
)
_JOIN = flags.DEFINE_integer(
    "join_timeout_s", 300, "Multi-process: exit with an error when the job has not all joined in this long."
)
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Let jax.distributed.initialize() find the job itself (TPU pods, SLURM)."
)


def join() -> None:
    """Joins the job the flags name (distributed.initialize); a single process without them. For a
    job that stops.run_job runs: its stop signals stay stops'."""
    from gspmd_tp import distributed, stops

    distributed.initialize(
        _COORDINATOR.value,
        _NUM_PROCESSES.value,
        _PROCESS_ID.value,
        _DISTRIBUTED.value,
        _HEARTBEAT.value,
        _JOIN.value,
    )
    # Again: jax.distributed.initialize's preemption notifier takes SIGTERM over (and only logs it)
    # in a multi-process job.
    stops.take_stop_signals()
