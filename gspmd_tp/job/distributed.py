"""Joining JAX's multi-controller runtime (jax.distributed), and the small exchanges between the
job's processes that the trainer and the tools make: jax.experimental.multihost_utils underneath,
whose device collectives fail as soon as a dead peer's connection closes."""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import socket
import sys
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

from gspmd_tp.job import peer_socket
from gspmd_tp.job.errors import JobError, UserError


def _port_taken(port: int) -> bool:
    """Whether a socket already listens on `port` on some interface: JAX's coordination service
    binds it on all of them, and its failed bind can crash the process."""
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
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    auto: bool,
    heartbeat_timeout_s: int = 100,
    join_timeout_s: int = 300,
) -> None:
    """Joins the job's processes: given explicitly (address, count, id), or found on TPU pods and
    SLURM (`auto`); neither: a single process. A second call is harmless.

    Bad flags are one UserError before anything joins; peer_socket checks that the processes' flags
    agree and tells stops and deaths until training begins; a job not all joined in
    `join_timeout_s` exits with one line, status 1; a peer silent for `heartbeat_timeout_s` ends it."""
    if jax.distributed.is_initialized():
        return
    if num_processes < 1:
        raise UserError(f"--num_processes={num_processes}: must be 1 or more")
    if heartbeat_timeout_s < 1:
        raise UserError(f"--heartbeat_timeout_s={heartbeat_timeout_s}: must be 1 or more")
    if join_timeout_s < 1:
        raise UserError(f"--join_timeout_s={join_timeout_s}: must be 1 or more")
    host, _, port = coordinator_address.rpartition(":")
    if coordinator_address and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise UserError(
            f"--coordinator_address={coordinator_address!r}: expected HOST:PORT, e.g. 10.0.0.1:1234"
        )
    explicit = coordinator_address or num_processes > 1
    given = (
        f"--coordinator_address={coordinator_address!r} --num_processes={num_processes} "
        f"--process_id={process_id}"
    )
    if explicit and num_processes <= 1:
        raise UserError(
            f"{given}: a multi-process job has --num_processes of 2 or more (one process needs none)"
        )
    if explicit and not (coordinator_address and 0 <= process_id < num_processes):
        raise UserError(f"{given}: all three are needed, with 0 <= process_id < num_processes")
    if not explicit and not auto:
        return
    where = f"--coordinator_address={coordinator_address}"  # as the messages name the coordinator
    how = given if explicit else "--distributed"
    local_device_ids = None
    found = None if explicit else cluster_job(join_timeout_s)
    if found is not None:  # a cluster's job goes through the same handshake as one given by flags
        coordinator_address, num_processes, process_id, local_device_ids = found
        host, _, port = coordinator_address.rpartition(":")
        explicit = True
        where = f"--distributed's coordinator {coordinator_address} (JAX_COORDINATOR_PORT sets its port)"
        how = f"--distributed (process {process_id} of {num_processes}, coordinator {coordinator_address})"
    if explicit and process_id == 0 and _port_taken(int(port)):
        peer_socket.ask_the_first_process_0(host, int(port), num_processes)
        raise UserError(
            f"{where}: port {port} is already in use on this host (another job's coordinator?); choose "
            "a free port for process 0"
        )
    # CPU processes exchange collectives over gloo; accelerators bring their own transport.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    timeouts = {
        "heartbeat_timeout_seconds": heartbeat_timeout_s,
        "shutdown_timeout_seconds": heartbeat_timeout_s,
        "initialization_timeout": join_timeout_s + 60,  # after _give_up_unless's one line
    }
    joined = threading.Event()
    threading.Thread(target=_give_up_unless, args=(joined, join_timeout_s, how), daemon=True).start()
    try:
        if explicit:
            if process_id == 0:
                peer_socket.gather(int(port), num_processes, coordinator_address)
            else:
                peer_socket.report(host, int(port), process_id, num_processes, coordinator_address)
            jax.distributed.initialize(
                coordinator_address,
                num_processes=num_processes,
                process_id=process_id,
                local_device_ids=local_device_ids,
                **timeouts,
            )
        else:
            jax.distributed.initialize(**timeouts)
    except UserError:
        raise
    except (ValueError, RuntimeError) as e:  # no cluster found for --distributed, a port taken, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        failed = "--distributed (no TPU pod or SLURM job found?)" if not explicit else where
        raise UserError(f"{failed}: joining the job failed: {first}") from None
    finally:
        joined.set()
    check_device_counts()


def cluster_job(timeout_s: int) -> tuple[str, int, int, list[int] | None] | None:
    """(coordinator address, process count, process id, local device ids) of the cluster job (SLURM,
    a TPU pod) that jax.distributed.initialize() would find; None where it finds no job of two
    processes or more, or this jax has no such lookup (its initialize() then finds the job alone)."""
    try:
        from jax._src.clusters import ClusterEnv

        address, count, process_id, local = ClusterEnv.auto_detect_unset_distributed_params(
            None, None, None, None, None, timeout_s
        )
    except (ImportError, AttributeError, TypeError, ValueError, RuntimeError):
        return None  # a lookup that fails here fails in initialize() too, which says why
    if address is None or count is None or process_id is None or count < 2:
        return None
    return address, count, process_id, None if local is None else list(local)


def _give_up_unless(joined: threading.Event, seconds: int, how: str) -> None:
    # One line instead of JAX's own abort (a stack trace that blames a dead task).
    if not joined.wait(seconds):
        print(
            f"error: {how}: the job's processes did not all join within --join_timeout_s={seconds}: start "
            "every process, each with the same coordinator address and process count and its own process "
            "id from 0",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)


def check_device_counts() -> None:
    """JobError, on every process (no collective: each sees every device), where the job's processes
    hold different numbers of devices: the batch and every exchange give each the same share."""
    counts = [0] * jax.process_count()
    for d in jax.devices():
        counts[d.process_index] += 1
    other = next((i for i, n in enumerate(counts) if n != counts[0]), None)
    if other is not None:
        raise JobError(
            f"process {other} of this job has {counts[other]} devices and process 0 has {counts[0]}: "
            "start every process with as many (on CPU: the same --xla_force_host_platform_device_count "
            "in XLA_FLAGS, or config.host_device_count)"
        )


# Every function below is collective: every process of the job must call it at the same point.


def check_same_everywhere(
    config: dict | None, rules_text: str | None = None, flags: dict | None = None
) -> None:
    """JobError, on every process, naming the first config key, the rule file (`rules_text`) or the
    flag of `flags` ({"--name": value}) that some process was given otherwise: processes started
    with other values would train apart."""
    if jax.process_count() == 1:
        return
    items = sorted(_flat(config or {}).items())
    if rules_text is not None:
        items.append(("the rule file's text", rules_text))
    items += (flags or {}).items()
    found = first_disagreement([[k for k, _ in items], *(v for _, v in items)])
    if found is None:
        return
    column, other = found
    if column == len(items) + 1:
        raise JobError("the processes of this job were given configs with different keys; start each alike")
    name = (["the config's keys"] + [k for k, _ in items])[column]
    same = "flags" if name.startswith("--") else "config, rule file and overrides"
    raise JobError(
        f"{name} differs between process 0 and process {other} of this job; "
        f"start every process with the same {same}"
    )


def first_disagreement(values: list) -> tuple[int, int] | None:
    """(i, p): values[i] is the first value that process p holds otherwise (compared by a 24-bit
    digest of its repr); (len(values), p) where p holds another number of values; None where all agree."""
    digests = [int.from_bytes(hashlib.sha256(repr(v).encode()).digest()[:3], "little") for v in values]
    rows = every_process(digests)
    other = next((p for p, row in enumerate(rows) if len(row) != len(digests)), None)
    if other is not None:
        return len(values), other
    everyone = np.array(rows)  # (processes, values)
    for column in range(len(values)):
        differs = everyone[:, column] != everyone[0, column]
        if differs.any():
            return column, int(np.argmax(differs))
    return None


def agreed(fn, *args):
    """fn(*args) with one outcome on every process: where it raises UserError on some process (a file
    only that host lacks), that one raises it and every other names it, instead of waiting in a
    collective that the failed process never joins."""
    if jax.process_count() == 1:
        return fn(*args)
    try:
        result, mine = fn(*args), None
    except UserError as e:
        result, mine = None, e
    failed = [i for i, [bad] in enumerate(every_process([int(mine is not None)])) if bad]
    if mine is not None:
        raise JobError(str(mine)) from None  # every process stops here: none tells the others
    if failed:
        raise JobError(f"process {failed[0]} of this job stopped with an error (its output says which)")
    return result


def agreed_setup(config, fn, *args):
    """fn(*args), a run_setup.Setup, made alike on every process: `config` compared first, fn run
    under agreed(), then the rule file's text that fn read compared."""
    check_same_everywhere(config.to_dict())
    s = agreed(fn, *args)
    check_same_everywhere(None, s.rules.text)
    return s


def every_process(values: list[int]) -> list[list[int]]:
    """Each process's int32 `values` (any number of them), in process order."""
    if jax.process_count() == 1:
        return [list(values)]
    counts = multihost_utils.process_allgather(np.int32(len(values)))
    padded = np.zeros(int(counts.max()), np.int32)
    padded[: len(values)] = values
    rows = multihost_utils.process_allgather(padded) if padded.size else [padded] * counts.size
    return [row[:count].tolist() for row, count in zip(rows, counts, strict=True)]


def hosts() -> list[int]:
    """Each process's host, numbered from 0 in the order the processes first name it (its host name,
    compared by a 48-bit digest)."""
    digest = hashlib.sha256(socket.gethostname().encode()).digest()
    rows = every_process([int.from_bytes(digest[i : i + 3], "little") for i in (0, 3)])
    numbers: dict[tuple[int, ...], int] = {}
    return [numbers.setdefault(tuple(row), len(numbers)) for row in rows]


def from_process_0(value: int) -> int:
    """Process 0's int32 `value`, on every process."""
    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def barrier() -> None:
    """Returns once every process of the job has called it."""
    multihost_utils.sync_global_devices("gspmd_tp barrier")


def share(values) -> jax.Array:
    """Starts gathering each process's int32 `values` (as many on each) into a (processes, len)
    array, and returns it without waiting, unlike multihost_utils.process_allgather: the loop's stop
    check reads it one check later, so the host never waits for the step it just dispatched."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("devices",))
    values = np.asarray(values, np.int32).ravel()
    rows = np.zeros((jax.local_device_count(), jax.process_count(), values.size), np.int32)
    rows[0, jax.process_index()] = values  # on this process's first device; zeros elsewhere
    rows = jax.make_array_from_process_local_data(NamedSharding(mesh, PartitionSpec("devices")), rows)
    with jax.set_mesh(mesh):  # whatever mesh the caller has in force
        return _sum_over_devices(mesh)(rows)


def read(shared: jax.Array) -> np.ndarray:
    """The (processes, len) values of `share`, once they arrived."""
    return np.asarray(shared.addressable_data(0))


@functools.cache
def _sum_over_devices(mesh):
    from jax.sharding import PartitionSpec

    def local(rows):  # (1, processes, len) on each device
        return jax.lax.psum(rows[0], "devices")

    return jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec("devices"), out_specs=PartitionSpec())
    )


def _flat(config: dict, prefix: str = "config.") -> dict:
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat
