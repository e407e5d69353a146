"""The job's one home-made protocol: a plain socket between process 0 and each other process.

JAX lacks two things that it gives. jax.distributed.initialize does not compare the job flags: it
takes another --num_processes without a word, and aborts with a stack trace on an unexpected or
duplicate --process_id (a duplicate aborts the running job too); process 0 compares them here, on
the coordinator's port before JAX binds it. And JAX sees a dead or stopped peer only at its
heartbeat timeout, while its coordination client aborts the process when the service's host exits,
so a stop cannot go through it; here the kernel's close of a dead process's socket is seen at once.

Lines: `stop SIGNUM PROCESS`, `error PROCESS MESSAGE` (before training) and `died PROCESS`, which
process 0 passes on; `training` (the sender's loop began: its stops are the loop's) and `bye` (it
exits on purpose). A close is a death unless the peer said `bye`, or said `training` and this
process's own loop is over too (training_ended).
"""

from __future__ import annotations

import select
import socket
import threading
import time

from gspmd_tp.job.errors import UserError

_HELLO = b"gspmd_tp job flags: "
_OK = b"ok"
_REFUSED = b"error: "
_READ_S = 5  # for a line from a peer that connected: a stray connection must not stall the join
_STOP = b"stop "
_DIED = b"died "
_ERROR = b"error "
_MESSAGE_CHARS = 1000  # of an error's first line: the others print it within a line of their own
_TRAINING = b"training"
_BYE = b"bye"

# This process's connections once the job's flags agreed (process 0: one per other process, else
# one to process 0), each with the process at its other end, and what follow() was given, for a
# thread that starts once the flags agreed.
_peers: dict[socket.socket, int] = {}
_process_id = 0
_telling = threading.Event()  # flags agreed and the loop not begun: stops and errors are told
_began = threading.Event()  # this process's training loop began
_ended = threading.Event()  # this process's training loop is over (training_ended)
_following: tuple | None = None
_death = threading.Event()  # the thread that follows the peers saw one die or fail


def gather(port: int, num_processes: int, address: str) -> None:
    """Process 0: waits on `port` for every other process's flags and answers each. UserError, here
    and on every process that came, naming the first disagreement: another process count, or two
    processes with one id."""
    if socket.has_dualstack_ipv6():  # JAX's service listens on [::]: IPv4 and IPv6 clients alike
        server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    else:
        server = socket.create_server(("", port))
    came: list[tuple[socket.socket, int]] = []  # (connection, process id)
    problem = None
    with server:
        while problem is None and len({pid for _, pid in came}) < num_processes - 1:
            conn, _ = server.accept()
            flags = _read_flags(conn)
            if flags is None:  # not one of ours (a port scan): the job's processes still come
                conn.close()
                continue
            pid, count = flags
            if pid == 0 or pid in {p for _, p in came}:
                problem = (
                    f"two processes of the job at {address} were started with --process_id={pid}: give each "
                    f"its own id, from 0 to {num_processes - 1}"
                )
            elif count != num_processes:
                problem = (
                    f"process {pid} was started with --num_processes={count} and process 0 (the "
                    f"coordinator, {address}) with --num_processes={num_processes}: start every process "
                    "with the same count"
                )
            came.append((conn, pid))
    answer = _OK if problem is None else _REFUSED + problem.encode()
    _send([conn for conn, _ in came], answer + b"\n")  # a peer gone meanwhile: JAX's join names it
    if problem is not None:
        for conn, _ in came:
            conn.close()
        raise UserError(problem)
    _keep(dict(came), 0)  # JAX's service binds the port beside them


def report(host: str, port: int, process_id: int, num_processes: int, address: str) -> None:
    """Every process but 0: sends its flags to process 0 (waiting for it to listen) and returns once
    process 0 answers that they agree; UserError with process 0's reason where not."""
    unanswered = 0
    while True:
        try:
            conn = socket.create_connection((host.strip("[]"), port), timeout=_READ_S)
        except OSError:  # process 0 not started yet (the join timeout bounds the wait)
            time.sleep(0.2)
            continue
        try:
            conn.sendall(_HELLO + f"{process_id} {num_processes}\n".encode())
            conn.settimeout(None)  # process 0 answers once every process came
            answer = _read_line(conn)
        except OSError:
            answer = b""
        if answer == _OK:
            _keep({conn: 0}, process_id)
            return
        conn.close()
        if answer.startswith(_REFUSED):
            raise UserError(answer.removeprefix(_REFUSED).decode(errors="replace"))
        if answer:  # another protocol answered: JAX's service, up once the job all joined
            break
        # Cut without an answer: process 0 closed its socket with this connection still queued.
        unanswered += 1
        if unanswered == 3:
            break
        time.sleep(0.2)
    raise UserError(
        f"--coordinator_address={address}: process 0 there takes no more processes (its job has all "
        f"joined: is this a second process with --process_id={process_id}?), or another program "
        "listens on that port"
    )


def ask_the_first_process_0(host: str, port: int, num_processes: int) -> None:
    """A process 0 that finds the coordinator's port taken: where another process 0 holds it, still
    waiting for its job (one started twice), both get a line naming the two (UserError here).
    Returns where something else holds the port."""
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=_READ_S) as conn:
            conn.sendall(_HELLO + f"0 {num_processes}\n".encode())
            answer = _read_line(conn)
    except OSError:  # no answer within _READ_S: not a process 0 waiting for its job
        return
    if answer.startswith(_REFUSED):
        raise UserError(answer.removeprefix(_REFUSED).decode(errors="replace"))


def _keep(conns: dict[socket.socket, int], process_id: int) -> None:
    global _process_id
    _peers.clear()
    _peers.update(conns)
    _process_id = process_id
    _telling.set()
    if _following is not None:
        _follow(*_following)


def tell_stop(signum: int) -> None:
    """Tells the other processes that this one stops by signal `signum` before its training loop
    began (they would wait for it in a collective). Nothing where before_training() is False."""
    if _telling.is_set():
        _send(_peers, _STOP + f"{signum} {_process_id}\n".encode())
        _leave_last(_peers)


def tell_error(message: str) -> bool:
    """Tells the other processes that this one stops with an error of its own (the first line of
    `message`) before its training loop began; whether it told them (see before_training)."""
    if not before_training():
        return False
    first = (message.strip().splitlines() or [""])[0][:_MESSAGE_CHARS]
    _send(_peers, _ERROR + f"{_process_id} {first}\n".encode(errors="replace"))
    _leave_last(_peers)
    return True


def before_training() -> bool:
    """Whether this process is in a multi-process job whose flags agreed, and its training loop has
    not begun: where tell_stop and tell_error tell the others."""
    return _telling.is_set()


def training_has_begun() -> bool:
    """Whether this process's training loop began (training_began)."""
    return _began.is_set()


def training_began() -> None:
    """From now on this process's stops are the training loop's, which every process sees; the
    peers are told (`training`)."""
    _telling.clear()
    _ended.clear()  # a library caller's second run in this process
    _began.set()
    _send(_peers, _TRAINING + b"\n")


def training_ended() -> None:
    """This process's training loop is over: a peer that said `training` and closes now exited on
    its own. While the loop runs, such a close is a death (a kill, or an exit at once), which this
    process's next collective would wait for until the heartbeat timeout."""
    _ended.set()


def leave() -> None:
    """This process exits on purpose (the run's end, or an error that every process reports itself):
    the others do not take its socket's close for a death."""
    _send(_peers, _BYE + b"\n")


def follow(on_stop, on_death, on_error) -> None:
    """From the moment the job's flags agree (now, where they did), on a background thread: calls
    on_stop(signum, process), on_error(process, message) or on_death(process) once another process
    told its stop, told its error, or died; process 0 first passes each on to the others."""
    global _following
    _following = (on_stop, on_death, on_error)
    if _peers:
        _follow(on_stop, on_death, on_error)


def a_peer_died(seconds: float) -> bool:
    """Whether the thread that follow() started sees a peer die (or fail before training), waiting
    at most `seconds`: a collective may fail on the closed connection first, and that thread names
    the process."""
    return bool(_following and _peers) and _death.wait(seconds)


def _follow(on_stop, on_death, on_error) -> threading.Thread:
    def run():
        said: dict[socket.socket, bytes] = {}  # a peer's last word: _TRAINING or _BYE
        partial = {conn: b"" for conn in _peers}  # what came of a line not yet ended
        while partial:
            ready, _, _ = select.select(list(partial), [], [])
            for conn in ready:
                try:
                    data = conn.recv(4096)
                except OSError:  # reset: a peer killed with bytes unread
                    data = b""
                if not data:
                    del partial[conn]
                    if said.get(conn) == _BYE or (said.get(conn) == _TRAINING and _ended.is_set()):
                        continue  # that process exited its own way
                    _death.set()
                    _pass_on(conn, _DIED + f"{_peers[conn]}\n".encode())
                    on_death(_peers[conn])
                    return
                *lines, partial[conn] = (partial[conn] + data).split(b"\n")
                for line in lines:
                    if line in (_TRAINING, _BYE):
                        said[conn] = line
                    elif (stop := _numbers(line, _STOP, 2)) is not None:
                        _pass_on(conn, line + b"\n")
                        on_stop(*stop)
                        return
                    elif (died := _numbers(line, _DIED, 1)) is not None:
                        _death.set()
                        on_death(*died)  # from process 0, which passed it on
                        return
                    elif (error := _error(line)) is not None:
                        _death.set()
                        _pass_on(conn, line + b"\n")
                        on_error(*error)
                        return

    thread = threading.Thread(target=run, name="peer-stops", daemon=True)
    thread.start()
    return thread


def _numbers(line: bytes, prefix: bytes, count: int) -> list[int] | None:
    fields = line.removeprefix(prefix).split() if line.startswith(prefix) else []
    if len(fields) != count or not all(f.isdigit() for f in fields):
        return None
    return [int(f) for f in fields]


def _error(line: bytes) -> tuple[int, str] | None:
    process, _, message = line.removeprefix(_ERROR).partition(b" ")
    if not line.startswith(_ERROR) or not process.isdigit():
        return None
    return int(process), message.decode(errors="replace")


def _pass_on(source: socket.socket, message: bytes) -> None:
    """On process 0: tells the other processes what `source`'s process told or did, and returns
    once they closed. Nothing elsewhere: their one connection is `source`."""
    others = [c for c in _peers if c is not source]
    _send(others, message)
    _leave_last(others)


def _leave_last(conns, seconds: float = 10) -> None:
    """On process 0, returns once every one of `conns` closed, or after `seconds`: process 0 hosts
    JAX's coordination service, whose loss aborts the others' JAX clients with a stack trace."""
    waiting, deadline = [c for c in conns if _process_id == 0], time.monotonic() + seconds
    while waiting and (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select(waiting, [], [], left)
        for conn in ready:
            try:
                closed = not conn.recv(4096)  # what a peer still says here no longer matters
            except OSError:
                closed = True
            if closed:
                waiting.remove(conn)


def _send(conns, message: bytes) -> None:
    for conn in conns:
        try:
            conn.sendall(message)
        except OSError:
            pass  # that process is gone already


def _read_flags(conn: socket.socket) -> tuple[int, int] | None:
    conn.settimeout(_READ_S)
    try:
        line = _read_line(conn)
    except OSError:
        return None
    flags = _numbers(line, _HELLO, 2)  # process id, process count
    if flags is None:
        return None
    conn.settimeout(None)
    return flags[0], flags[1]


def _read_line(conn: socket.socket, limit: int = 4096) -> bytes:
    """Bytes up to a newline (without it), or what came before the peer closed. A byte at a time:
    what follows the line (process 0's stop right after its answer) stays for the next read."""
    data = b""
    while len(data) < limit:
        byte = conn.recv(1)
        if byte in (b"", b"\n"):
            break
        data += byte
    return data
