"""How a job stops: SIGTERM and Ctrl-C inside the training loop and around it, and another process's
stop, death or error (distributed.follow); each ends in one line and an exit status.

Inside the loop, StopSignal makes a first signal a checkpoint at the next step boundary, the same on
every process. Around it (joining, compiling, restoring, exiting; bench.py's whole job) run_job's
handlers exit at once. Home-made beside JAX's preemption notifier, which sees SIGTERM only, only
logs it, and cannot tell a second signal that must exit at once. No jax import at module level:
train.py installs the handlers before jax is imported.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

from gspmd_tp.job.errors import JobError, UserError, first_line

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_AT_EXIT: list = []  # what an exit through os._exit, which skips `finally` and atexit, still runs


def at_exit(fn):
    """Registers fn() to run on an exit from here (a stop signal, a peer's death); returns fn."""
    _AT_EXIT.append(fn)
    return fn


class _Deliveries:
    """Counts stop signals as delivered (a byte each on the wakeup fd): the Python handler runs once,
    maybe much later (after a long call into C), however many came. Main thread only."""

    def __init__(self):
        self._read, self._write = os.pipe2(os.O_NONBLOCK)
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)

    def take(self) -> list[signal.Signals]:
        """The stop signals delivered since the last take, in order."""
        try:
            received = os.read(self._read, 4096)
        except BlockingIOError:
            received = b""
        return [signal.Signals(b) for b in received if b in STOP_SIGNALS]

    def close(self) -> None:
        """Gives the wakeup fd back to the one it replaced."""
        signal.set_wakeup_fd(self._previous, warn_on_full_buffer=False)
        os.close(self._read)
        os.close(self._write)


# ---- Around the training loop: run_job's handlers, which exit at once.

_BEFORE_TRAINING = "before training began; no checkpoint was written"
_BEFORE = _OUTSIDE_THE_LOOP = _BEFORE_TRAINING  # what a stop before (outside) the job's end leaves
_ENDED = False  # the job's work is done: what is left is the exit
# One stop prints its line and exits: a signal's handler, the thread that follows the peers, or a
# failed collective. Reentrant: a second signal may run its handler inside the first's.
_STOPPING = threading.RLock()
_own: _Deliveries | None = None  # this process's stop signals, for the thread that follows the peers


def _job():
    """gspmd_tp.job.distributed where imported (this module imports no jax), else None."""
    return sys.modules.get("gspmd_tp.job.distributed")


def follow_the_peers() -> None:
    """Another process stopped, died or failed: this one stops at once too, rather than wait for it
    in a collective."""
    _job().follow(_peer_told, _peer_died)


def _leave(together: bool) -> None:
    if (job := _job()) is not None:
        job.leave(together)


def run_job(job, before: str = "", after: str = "") -> None:
    """Runs job() (join, then train; a job that does not train says what a stop leaves `before` its end
    and `after` it) with this module's stops; every failure is one line and an exit status."""
    global _OUTSIDE_THE_LOOP, _BEFORE, _ENDED, _own
    _BEFORE = _OUTSIDE_THE_LOOP = before or _BEFORE
    take_stop_signals()  # from the start: while the job's processes join, too
    _own = _Deliveries()
    try:
        job()
        _OUTSIDE_THE_LOOP = after or "after the run ended; its checkpoints are written"
        _ENDED = True
        _leave(together=True)  # which waits for the slowest peer
    except JobError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        _leave(together=True)  # each process says its own (distributed.agreed)
        sys.exit(1)
    except UserError as e:
        with _STOPPING:
            print(f"error: {e}", file=sys.stderr, flush=True)
            # This process's alone (a file or a limit of its host): the others are told and stop too.
            if (d := _job()) is not None and d.tell("error", str(e)):
                _exit(None, 1)
            _leave(together=False)
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C where a library put Python's own handler back
        _stopped(signal.SIGINT)
    except Exception as e:
        _failed(e)


def _failed(e: Exception) -> None:
    import jax

    first = first_line(e)
    if jax.process_count() == 1:
        if "RESOURCE_EXHAUSTED" in str(e):  # what check_memory could not foresee (others' use)
            memory = "python -m gspmd_tp.plan shows per-device memory"
            print(f"error: out of memory: {first} ({memory})", file=sys.stderr)
            sys.exit(1)
        raise e
    # A failed collective almost always means a peer died, which gloo sees first: the thread that
    # follows the peers names it (its line, not this guess) within the heartbeat timeout.
    d = _job()
    if d.a_peer_died(d.heartbeat_timeout_s() + 5):
        time.sleep(15)
    with _STOPPING:  # now, alone: leaving together would wait for that peer
        what = f"error: process {jax.process_index()}: {type(e).__name__}: {first}"
        if d.before_training():
            # No peer seen to die: most likely this process's own bug, whose traceback says where;
            # the others are told (they would wait for it in a collective).
            traceback.print_exception(e)
            print(what, file=sys.stderr, flush=True)
            d.tell("error", f"{type(e).__name__}: {first}")
            _exit(None, 1)
        _exit(f"{what} (another process of the job has probably died)", 1)


def take_stop_signals():
    """SIGTERM and Ctrl-C stop the job at once, one line each (again after a library took them)."""
    for sig in STOP_SIGNALS:
        # Exits from the handler itself: an exception raised there is lost where it runs inside a
        # garbage-collection callback, and the process would go on into a collective.
        signal.signal(sig, lambda signum, _: _stopped(signal.Signals(signum)))


def _stopped(sig: signal.Signals, process: int | None = None):
    """One line and out at once (a normal exit while XLA's compiler threads run can segfault); before
    training the others are told. `process`: the one signalled, where it is another."""
    with _STOPPING:
        if process is None and not _ENDED and (d := _job()) is not None:
            d.tell("stop", str(int(sig)))
        name = "Ctrl-C" if sig == signal.SIGINT else sig.name
        where = "" if process is None else f" on process {process}"
        _exit(f"stopped by {name}{where} {_OUTSIDE_THE_LOOP}", 128 + sig)


def _exit(line: str | None, status: int):
    """Prints `line` and exits at once, removing a workdir this process made that holds only the lock,
    and leaving the job alone."""
    if line is not None:
        print(line, file=sys.stderr, flush=True)
        # The line stays the last: what leaving prints (an async save's commit cancelled on orbax's
        # thread, the coordination client's farewell) goes nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
    for cleanup in _AT_EXIT:
        cleanup()
    _leave(together=False)
    os._exit(status)


def _peer_told(process: int, kind: str, text: str):
    if kind == "stop":
        # Signalled too (a job stopped as a whole) while its handler waits for a busy main thread:
        # this process's own line, as where its handler came first.
        own = _own_signal()
        _stopped(own or signal.Signals(int(text)), None if own else process)
    if _BEFORE != _BEFORE_TRAINING:  # a job that does not train
        _peer_ended(f"stopped: process {process} stopped with an error (error: {text}) {_BEFORE}")
    _peer_ended(
        f"stopped: process {process} stopped with an error before training began (error: {text}); "
        "no checkpoint was written"
    )


_HOW = "killed, crashed, or silent for --heartbeat_timeout_s"
_HOW_IN_TRAINING = "killed, crashed, exited at once, or silent for --heartbeat_timeout_s"


def _peer_died(process: int):
    if _job().before_training():
        _peer_ended(f"stopped: process {process} died ({_HOW}) {_BEFORE}")
    # During training the peer may also have exited at once (a second signal, a failed step), and a
    # save of this process may be in flight (left unfinished: the next start removes it).
    _peer_ended(
        f"stopped: process {process} died during training ({_HOW_IN_TRAINING}); run again to resume from the "
        "newest complete checkpoint"
    )


def _peer_ended(line: str):
    # At once: a failed collective waits for this line (distributed.a_peer_died), and where process 0
    # died, JAX's client aborts this process as soon as it sees the service gone.
    with _STOPPING:
        if own := _own_signal(waits=(0,)):  # a job stopped as a whole: this process's own line
            _stopped(own)
        _exit(line, 1)


def _own_signal(waits=(0, 0.2)) -> signal.Signals | None:
    """A stop signal this process received, its handler run or not, or None; on the thread that
    follows the peers."""
    # One sent before the peer's stop may not be delivered yet (the kernel hands it to the main
    # thread, which may wait for a core): pending, seen where this thread blocks it.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    for wait in waits:  # and a handler that took it may be writing its byte right now
        time.sleep(wait)
        own = (_own.take() if _own is not None else []) + sorted(signal.sigpending() & set(STOP_SIGNALS))
        if own:
            return own[0]
    return None


# ---- Inside the training loop: a stop at the next step boundary, agreed by every process.


class StopSignal:
    """While entered, the first SIGTERM/SIGINT asks for a stop at the next step boundary; a second
    exits at once."""

    def __init__(self, log):
        self._log = log
        self._signum = 0  # the signal this process received, 0 for none
        self.stopped_by: str | None = None  # this process's signal, or a peer's
        self._previous: dict = {}
        self._deliveries: _Deliveries | None = None
        self._shared = None  # multi-process: every process's signal as of the last check, on device
        self._agreed = False
        self._finishing = False  # the loop is over; the run waits for its last save

    def __enter__(self) -> StopSignal:
        if (d := _job()) is not None:
            d.training_began()
        # signal.signal works on the main thread only; elsewhere (a library caller's worker thread)
        # the process keeps its own handlers.
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            self._deliveries = _Deliveries()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._deliveries:
            self._deliveries.close()
            self._deliveries = None

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        # Two signals during one long call into C run this handler once: counted.
        if self._signum or (self._deliveries is not None and len(self._deliveries.take()) > 1):
            _exit(f"received {name} again: exiting at once without saving", 128 + signum)
        self._signum = signum
        again = "(send again to exit at once)"
        if self._agreed:  # the job already stops on a peer's signal, which stays the reason
            self._log(
                f"received {name}: already stopping at the next step boundary, by {self.stopped_by} {again}"
            )
            return
        self.stopped_by = name
        if self._finishing:
            self._log(
                f"received {name} while the run finishes: it exits once its last checkpoint is "
                f"written {again}"
            )
            return
        self._log(f"received {name}: saving a checkpoint at the next step boundary, then stopping {again}")

    def finishing(self) -> None:
        """The loop is over: a first signal now only says the run exits once its last checkpoint is
        written; a second still exits at once."""
        self._finishing = True

    def requested(self) -> bool:
        """True once a stop signal arrived on any process, at the same call on every process (else the
        collective save deadlocks): each call starts a gather of the signals and reads the last one's."""
        import jax

        from gspmd_tp.job import distributed

        if jax.process_count() == 1:
            return bool(self._signum)
        if self._agreed:
            return True
        previous, self._shared = self._shared, distributed.share([self._signum])
        if previous is None:
            return False
        signums = distributed.read(previous)[:, 0]  # 0 where no signal arrived
        senders = [int(p) for p in signums.nonzero()[0]]
        if senders:
            self.stopped_by = f"{signal.Signals(int(signums[senders[0]])).name} on process {senders[0]}"
            self._agreed = True
        return self._agreed
