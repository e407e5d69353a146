"""Joining JAX's multi-controller runtime (jax.distributed) before any computation."""

from __future__ import annotations

import errno
import socket

import jax

from gspmd_tp.errors import UserError


def _port_taken(port: int) -> bool:
    """Whether another socket already listens on `port` on some interface: jax's coordination service
    binds it on all of them, and its gRPC server can crash the process when the bind fails."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT is free
                probe.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
    return False


def initialize(
    coordinator_address: str, num_processes: int, process_id: int, auto: bool, heartbeat_timeout_s: int = 100
) -> None:
    """Joins the other processes: explicitly (address, count, id), or auto-detected on TPU pods and
    SLURM (`auto`). No arguments and no `auto`: a single process. A second call is harmless.

    A process whose peer stops answering for `heartbeat_timeout_s` exits with an error instead of
    waiting forever in a collective."""
    if jax.distributed.is_initialized():
        return
    if num_processes < 1:
        raise UserError(f"--num_processes={num_processes}: must be 1 or more")
    if heartbeat_timeout_s < 1:
        raise UserError(f"--heartbeat_timeout_s={heartbeat_timeout_s}: must be 1 or more")
    host, _, port = coordinator_address.rpartition(":")
    if coordinator_address and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise UserError(
            f"--coordinator_address={coordinator_address!r}: expected HOST:PORT, e.g. 10.0.0.1:1234"
        )
    explicit = coordinator_address or num_processes > 1
    if explicit and not (coordinator_address and num_processes > 1 and 0 <= process_id < num_processes):
        raise UserError(
            f"--coordinator_address={coordinator_address!r} --num_processes={num_processes} "
            f"--process_id={process_id}: all three are needed, with 0 <= process_id < num_processes"
        )
    if not explicit and not auto:
        return
    if explicit and process_id == 0 and _port_taken(int(port)):
        raise UserError(
            f"--coordinator_address={coordinator_address}: port {port} is already in use on this host "
            "(another job's coordinator?); choose a free port for process 0"
        )
    # CPU processes exchange collectives over gloo; accelerators bring their own transport.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeouts = {
        "heartbeat_timeout_seconds": heartbeat_timeout_s,
        "shutdown_timeout_seconds": heartbeat_timeout_s,
    }
    try:
        if explicit:
            jax.distributed.initialize(
                coordinator_address, num_processes=num_processes, process_id=process_id, **timeouts
            )
        else:
            jax.distributed.initialize(**timeouts)
    except (ValueError, RuntimeError) as e:
        # No cluster environment for --distributed, a coordinator port already taken, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        how = (
            "--distributed (no TPU pod or SLURM job found?)"
            if not explicit
            else f"--coordinator_address={coordinator_address}"
        )
        raise UserError(f"{how}: joining the job failed: {first}") from None
