"""Joining jax.distributed, and what the job's processes tell each other through its coordination
service: its key-value store and barriers (job flags, a stop or error before training) and its
liveness (a peer dead or hung). Values compared go through jax.experimental.multihost_utils."""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import socket
import sys
import threading
import time

import jax
import numpy as np
from jax._src import distributed as jax_distributed
from jax.experimental import multihost_utils

from gspmd_tp.job.errors import JobError, UserError, first_line


def _port_taken(port: int) -> bool:
    """Whether `port` is taken on some interface: the coordination service binds all of them, and
    its failed bind can crash the process."""
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
    distributed: bool,
    heartbeat_timeout_s: int = 100,
    join_timeout_s: int = 300,
) -> None:
    """Joins the job the job flags give explicitly, or that jax finds on a TPU pod or SLURM with
    `distributed`; neither: a single process. Bad flags: one UserError before joining."""
    if jax.distributed.is_initialized():
        return
    counts = dict(
        num_processes=num_processes, heartbeat_timeout_s=heartbeat_timeout_s, join_timeout_s=join_timeout_s
    )
    for name, value in counts.items():
        if value < 1:
            raise UserError(f"--{name}={value}: must be 1 or more")
    host, _, port = coordinator_address.rpartition(":")
    where = f"--coordinator_address={coordinator_address}"
    if coordinator_address and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise UserError(
            f"--coordinator_address={coordinator_address!r}: expected HOST:PORT, e.g. 10.0.0.1:1234"
        )
    explicit = coordinator_address or num_processes > 1
    given = f"--coordinator_address={coordinator_address!r} --num_processes={num_processes}"
    given += f" --process_id={process_id}"
    if explicit and num_processes <= 1:
        raise UserError(
            f"{given}: a multi-process job has --num_processes of 2 or more (one process needs none)"
        )
    if explicit and not (coordinator_address and 0 <= process_id < num_processes):
        raise UserError(f"{given}: all three are needed, with 0 <= process_id < num_processes")
    if not explicit and not distributed:
        return
    if explicit and process_id == 0 and _port_taken(int(port)):
        raise UserError(
            f"{where}: port {port} is already in use on this host (another job's coordinator?); choose "
            "a free port for process 0"
        )
    # CPU processes exchange collectives over gloo; accelerators bring their own transport.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Without it a peer's death ends every process with a fatal log and stack dump, and the client's
    # missed_heartbeat_callback aborts with std::bad_cast (jaxlib 0.10.2, as measured); with it
    # follow() says the death in one line, and leave() stands in for the shutdown barrier it drops.
    jax.config.update("jax_enable_recoverability", True)
    kwargs = dict(
        heartbeat_timeout_seconds=heartbeat_timeout_s,
        shutdown_timeout_seconds=heartbeat_timeout_s,
        initialization_timeout=join_timeout_s + 60,  # after _join's one line
    )
    if explicit:  # else jax.distributed.initialize finds a TPU pod's or SLURM job's itself
        kwargs.update(
            coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
        )
    try:
        _join(kwargs, join_timeout_s, given if explicit else "--distributed")
    except (ValueError, RuntimeError) as e:  # no cluster found for --distributed, a port taken, ...
        failed = where if explicit else "--distributed (no TPU pod or SLURM job found?)"
        raise UserError(f"{failed}: joining the job failed: {first_line(e)}") from None
    joined = jax_distributed.global_state  # not jax.process_count(): that would make the backend
    if joined.num_processes > 1:
        _job.update(client=joined.client, me=joined.process_id, count=joined.num_processes)
        _job["timeout"] = heartbeat_timeout_s
        _same_process_count(joined, join_timeout_s)
        _telling.set()
    check_device_counts()


def _join(kwargs: dict, seconds: int, how: str) -> None:
    """jax.distributed.initialize(**kwargs) on a thread: the main thread handles stop signals meanwhile,
    and says in one line a job not joined within `seconds` (JAX's abort blames a dead task)."""
    failed: list[Exception] = []

    def join():
        try:
            jax.distributed.initialize(**kwargs)
        except Exception as e:  # noqa: BLE001 - raised again on the main thread
            failed.append(e)

    thread = threading.Thread(target=join, name="join", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        print(
            f"error: {how}: the job's processes did not all join within --join_timeout_s={seconds}: start "
            "every process, each with the same coordinator address and process count and its own process "
            "id from 0",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
    if failed:
        raise failed[0]


def _same_process_count(joined, seconds: int) -> None:
    """JobError on process 0 and each process given another --num_processes: JAX lets it join
    without a word, to wait for processes that never come."""
    client, process_id, count = joined.client, joined.process_id, joined.num_processes
    address, key = joined.coordinator_address, "gspmd_tp/num_processes/"
    try:
        client.key_value_set(f"{key}{process_id}", str(count))
    except jax.errors.JaxRuntimeError:  # ALREADY_EXISTS: JAX took this process for a restart of one
        raise UserError(
            f"two processes of the job at {address} were started with --process_id={process_id}: give each "
            f"its own id, from 0 to {count - 1}"
        ) from None
    others = range(1, count) if process_id == 0 else [0]
    theirs = {p: int(client.blocking_key_value_get(f"{key}{p}", seconds * 1000)) for p in others}
    client.wait_at_barrier("gspmd_tp/num_processes", seconds * 1000)  # each read before any exits
    for p, n in theirs.items():
        if n != count:
            one, its, zero = (p, n, count) if process_id == 0 else (process_id, count, n)
            raise JobError(
                f"process {one} was started with --num_processes={its} and process 0 (the coordinator, "
                f"{address}) with --num_processes={zero}: start every process with the same count"
            )


# ---- A peer's stop, error or death: one thread per process follows them.

_TOLD = "gspmd_tp/told/"  # + the teller's process id: "stop SIGNUM" or "error MESSAGE"
_ROUND_S = 0.5  # between two liveness rounds: how late a stop or error told is seen
_MESSAGE_CHARS = 1000  # of an error's first line: the others print it within a line of their own
_job: dict = {}  # client, me, count, timeout: in a job of several
_watcher: threading.Thread | None = None
_telling = threading.Event()  # joined, and this process's training loop not begun: stops are told
_done = threading.Event()  # this process leaves: a peer's exit is no more a death
_heard = threading.Event()  # the watcher heard a peer's stop or error, or saw a peer die: its rounds are over
_told_once = threading.Lock()
_others_leave = threading.Event()  # they leave too (leave): process 0 waits for them


def follow(on_told, on_death) -> None:
    """On a thread, on_told(process, "stop" | "error", text) for a stop or error told before training,
    or on_death(process) for one gone or silent for --heartbeat_timeout_s, in a job of several."""
    # Polled: jaxlib 0.10.2's missed-heartbeat callback aborts the process (see initialize).
    global _watcher
    if _job:
        _watcher = threading.Thread(target=_watch, args=(on_told, on_death), name="peers", daemon=True)
        _watcher.start()


def _watch(on_told, on_death) -> None:
    client, me, everyone = _job["client"], _job["me"], list(range(_job["count"]))
    while True:
        try:
            live = client.get_live_nodes(everyone)
            told = client.key_value_dir_get(_TOLD)
        except jax.errors.JaxRuntimeError:  # the service is gone (process 0 died): JAX ends this process
            return
        if _done.is_set():  # leaving: a peer's exit is no more a death
            return
        news = sorted((int(k.rpartition("/")[2]), v) for k, v in told if k.rpartition("/")[2] != str(me))
        if news or len(live) < len(everyone):
            _heard.set()
            if not news:
                return on_death(min(set(everyone) - set(live)))
            _hear_told()
            kind, _, rest = news[0][1].partition(" ")
            return on_told(news[0][0], kind, rest)
        time.sleep(_ROUND_S)


def _hear_told(seconds: float = 10) -> None:
    """Waits, at most `seconds`, until every process read what one told: a teller that exits first
    would be taken for dead, and process 0's exit ends the service."""
    if _told_once.acquire(blocking=False):
        try:
            _job["client"].wait_at_barrier("gspmd_tp/told", int(seconds * 1000))
        except jax.errors.JaxRuntimeError:
            pass  # a process gone or silent meanwhile: its death ends the others


def tell(kind: str, text: str) -> bool:
    """Tells the others this process stops before training ("stop", signal number; "error", message)
    lest its exit read as a death; returns once they read it, and whether it told them."""
    if not before_training():
        return False
    first = (text.strip().splitlines() or [""])[0][:_MESSAGE_CHARS]
    try:
        _job["client"].key_value_set(f"{_TOLD}{_job['me']}", f"{kind} {first}")
    except jax.errors.JaxRuntimeError:
        return False  # told once already (a second signal)
    _hear_told()
    return True


def before_training() -> bool:
    """Whether this process joined a job of several and its training loop has not begun."""
    return _telling.is_set()


def training_began() -> None:
    """From now on stops are the training loop's, which every process sees."""
    _telling.clear()


def a_peer_died(seconds: float) -> bool:
    """Whether follow()'s thread hears of a peer's death, stop or error within `seconds`: a
    collective may fail on a dead peer's closed connection first."""
    return bool(_job and _watcher) and _heard.wait(seconds)


def heartbeat_timeout_s() -> float:
    """The job's --heartbeat_timeout_s: the longest a peer's death goes unseen."""
    return _job.get("timeout", 0)


def leave(together: bool = True) -> None:
    """Leaves the job: every process at this point where `together`, else this one alone. The
    barrier stands in for JAX's shutdown barrier, which recoverability turns off."""
    if not _job or _done.is_set():
        return
    seconds = _job["timeout"]
    if together:
        try:
            _job["client"].wait_at_barrier("gspmd_tp/leave", seconds * 1000)
        except jax.errors.JaxRuntimeError:
            pass  # a peer gone meanwhile: this process leaves all the same
    if together or _heard.is_set() or _told_once.locked():
        _others_leave.set()
    _done.set()
    deadline = time.monotonic() + seconds
    # Until the watcher stops calling the service (a client shut down under its call, or two
    # liveness rounds at once, are not ours to try): it returns after its round.
    while (
        _watcher is not None and _watcher.is_alive() and not _heard.is_set() and time.monotonic() < deadline
    ):
        _watcher.join(0.05)
    # Process 0 hosts the service: it shuts down only once the others have gone (ending the service at
    # once may cut the answer to the last one's disconnection, which aborts it, as measured), and
    # where they stay, its exit ends them anyway. The others disconnect at once: seen gone, not dead.
    if _job["me"] != 0 or (_others_leave.is_set() and _the_others_gone(deadline)):
        jax.distributed.shutdown()


def _the_others_gone(deadline: float) -> bool:
    """Process 0: liveness rounds until the others have gone (True) or `deadline`."""
    while time.monotonic() < deadline:
        try:
            if len(_job["client"].get_live_nodes(list(range(_job["count"])))) == 1:
                return True
        except jax.errors.JaxRuntimeError:
            return False
        time.sleep(0.05)
    return False


def check_device_counts() -> None:
    """JobError on every process (each sees every device) where the processes hold different numbers
    of devices: the batch and every exchange give each the same share."""
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
    """JobError on every process naming the first config key, rule file or flag ({"--name": value})
    some process was given otherwise (multihost_utils.assert_equal says not which)."""
    if jax.process_count() == 1:
        return
    from flax import traverse_util

    items = sorted((f"config.{k}", v) for k, v in traverse_util.flatten_dict(config or {}, sep=".").items())
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
    """(i, p): values[i] is the first value process p holds otherwise (by a 24-bit digest of its
    repr); (len(values), p) where p holds another number of values; None where all agree."""
    rows = every_process(
        [int.from_bytes(hashlib.sha256(repr(v).encode()).digest()[:3], "little") for v in values]
    )
    other = next((p for p, row in enumerate(rows) if len(row) != len(values)), None)
    if other is not None:
        return len(values), other
    differs = np.array(rows) != np.array(rows[0])  # (processes, values)
    column = next((c for c in range(len(values)) if differs[:, c].any()), None)
    return None if column is None else (column, int(np.argmax(differs[:, column])))


def agreed(fn, *args):
    """fn(*args) with one outcome on every process: a UserError on one (a file only its host lacks)
    is raised there and named on every other, which would otherwise wait in a collective."""
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
    """fn(*args), a run_setup.Setup, alike on every process: `config` compared, fn run under
    agreed(), then the rule file's text compared."""
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


def from_process_0(value: int) -> int:
    """Process 0's int32 `value`, on every process."""
    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def barrier() -> None:
    """Returns once every process of the job has called it."""
    multihost_utils.sync_global_devices("gspmd_tp barrier")


def share(values) -> jax.Array:
    """Starts gathering each process's int32 `values` into a (processes, len) array without waiting, unlike
    process_allgather: the stop check reads it one check later, never waiting for the step in flight."""
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
