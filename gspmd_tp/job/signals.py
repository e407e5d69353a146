"""How a job stops: SIGTERM and Ctrl-C, inside the training loop and around it, and another
process's stop, death or error (told through JAX's coordination service: distributed.follow); each
ends in one line and an exit status.

Inside the loop, StopSignal makes a first signal a checkpoint at the next step boundary, the same
one on every process. Around it (joining the job, compiling, restoring, exiting), and in bench.py's
job, which has no loop, run_job's handlers exit at once. No jax import at module level: train.py
installs the handlers before jax is imported, while the job's processes join.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

from gspmd_tp.job import output_paths
from gspmd_tp.job.errors import JobError, UserError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _Deliveries:
    """Counts stop signals as the kernel delivers them: Python's C handler writes a byte per signal
    to the wakeup fd at once, while the Python handler may run much later (after a long call into
    C), once however many came. Main thread only."""

    def __init__(self):
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
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

# What a stop outside the training loop means, said in the one line it prints.
_BEFORE_TRAINING = "before training began; no checkpoint was written"
_BEFORE = _BEFORE_TRAINING  # run_job's `before`, for a job that does not train
_OUTSIDE_THE_LOOP = _BEFORE
_ENDED = False  # the job's work is done: what is left is the exit
# One stop prints its line and exits: a signal's handler on the main thread, a peer's stop or death
# on the thread that follows them, or a failed collective. Reentrant: a second signal may run its
# handler inside the first's.
_STOPPING = threading.RLock()
_own: _Deliveries | None = None  # this process's stop signals, for the thread that follows the peers


def _job():
    """gspmd_tp.job.distributed where this process imported it (and may have joined a job), else
    None: this module imports no jax."""
    return sys.modules.get("gspmd_tp.job.distributed")


def follow_the_peers() -> None:
    """Another process stopped, died or failed before training: this one stops at once too, rather
    than wait for it in a collective. After it died during training: at once as well."""
    _job().follow(_peer_told, _peer_died)


def _leave(together: bool) -> None:
    if (job := _job()) is not None:
        job.leave(together)


def run_job(job, before: str = "", after: str = "") -> None:
    """Runs job() (join the job's processes, then train) with this module's stops in place; every
    failure ends in one line and an exit status. Call before jax is imported. A job that does not
    train (bench.py) says what a stop leaves `before` its end and `after` it."""
    global _OUTSIDE_THE_LOOP, _BEFORE, _ENDED, _own
    _BEFORE = before or _BEFORE
    _OUTSIDE_THE_LOOP = _BEFORE
    take_stop_signals()  # from the start: while the job's processes join, too
    _own = _Deliveries()
    try:
        job()
        # What is left is the exit, which in a multi-process job waits for the slowest peer.
        _OUTSIDE_THE_LOOP = after or "after the run ended; its checkpoints are written"
        _ENDED = True
        _leave(together=True)
    except JobError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        _leave(together=True)  # each process says its own (distributed.agreed): nothing to tell
        sys.exit(1)
    except UserError as e:
        with _STOPPING:
            print(f"error: {e}", file=sys.stderr, flush=True)
            # This process's alone (a file or a limit of its host), before training: the others are
            # told and stop too.
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

    if jax.process_count() == 1:
        if "RESOURCE_EXHAUSTED" in str(e):  # what check_memory could not foresee (others' use)
            first = str(e).strip().splitlines()[0]
            print(
                f"error: out of memory: {first} (python -m gspmd_tp.plan shows per-device memory)",
                file=sys.stderr,
            )
            sys.exit(1)
        raise e
    # A failed collective in a multi-process job almost always means a peer died: the thread that
    # follows the peers names it and exits (its line, not this guess) once the coordination service
    # sees it gone, within the heartbeat timeout; gloo sees the closed connection first.
    d = _job()
    if d.a_peer_died(d.heartbeat_timeout_s() + 5):
        time.sleep(15)
    # Exit now, alone: leaving together would wait at the job's last barrier for that peer.
    with _STOPPING:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        what = f"error: process {jax.process_index()}: {type(e).__name__}: {first}"
        if d.before_training():
            # No peer was seen to die: most likely this process's own error (a bug), whose traceback
            # says where. The others are told: they would wait for this process in a collective.
            traceback.print_exception(e)
            print(what, file=sys.stderr, flush=True)
            d.tell("error", f"{type(e).__name__}: {first}")
            _exit(None, 1)
        _exit(f"{what} (another process of the job has probably died)", 1)


def take_stop_signals():
    """SIGTERM and Ctrl-C stop the job at once, one line each (again after a library took them over)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop_outside_the_loop)


def _stop_outside_the_loop(signum, frame):
    # Exits from the handler itself: an exception raised here is lost where the handler runs inside
    # a garbage-collection callback, and the process would go on into a collective its peers,
    # stopped, never join.
    _stopped(signal.Signals(signum))


def _stopped(sig: signal.Signals, process: int | None = None):
    """One line, and out at once: a normal exit while XLA's compiler threads run can segfault.
    Before training, the other processes are told (distributed.tell); `process`: the one signalled,
    where it is another."""
    with _STOPPING:
        name = "Ctrl-C" if sig == signal.SIGINT else sig.name
        if process is None and not _ENDED and (d := _job()) is not None:
            d.tell("stop", str(int(sig)))
        where = "" if process is None else f" on process {process}"
        _exit(f"stopped by {name}{where} {_OUTSIDE_THE_LOOP}", 128 + sig)


def _exit(line: str | None, status: int):
    """Prints `line` and exits at once, removing the workdir this process made where it holds only
    the lock (what the lock's own exit would have done), and leaving the job alone."""
    if line is not None:
        print(line, file=sys.stderr, flush=True)
        # The line stays the last one: what the leaving prints (an async save's commit cancelled on
        # another thread, the coordination client's own farewell) goes nowhere.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stderr.fileno())
    output_paths.remove_created_workdirs()
    _leave(together=False)
    os._exit(status)


def _peer_told(process: int, kind: str, text: str):
    if kind == "stop":
        _peer_stopped(int(text), process)
    _peer_failed(process, text)


def _peer_stopped(signum: int, process: int):
    # Signalled too (a job stopped as a whole) while its handler still waits for the main thread
    # (busy compiling): this process's own line, as where its handler came first.
    own = _own_signal()
    _stopped(own or signal.Signals(signum), None if own else process)


_HOW = "killed, crashed, or silent for --heartbeat_timeout_s"
_HOW_IN_TRAINING = "killed, crashed, exited at once, or silent for --heartbeat_timeout_s"


def _peer_died(process: int):
    if _job().before_training():
        _peer_ended(f"stopped: process {process} died ({_HOW}) {_BEFORE}")
    # During training the peer may also have exited at once (a second stop signal, a failed step),
    # and a save of this process may be in flight (left unfinished: the next start removes it).
    _peer_ended(
        f"stopped: process {process} died during training ({_HOW_IN_TRAINING}); run again to resume "
        "from the newest complete checkpoint"
    )


def _peer_failed(process: int, message: str):
    if _BEFORE != _BEFORE_TRAINING:  # a job that does not train
        _peer_ended(f"stopped: process {process} stopped with an error (error: {message}) {_BEFORE}")
    _peer_ended(
        f"stopped: process {process} stopped with an error before training began (error: {message}); "
        "no checkpoint was written"
    )


def _peer_ended(line: str):
    # At once: a collective that failed on the closed connection waits for this line
    # (distributed.a_peer_died). And no wait for a signal of this process's own still on its way:
    # where process 0 died, JAX's client aborts this process as soon as it sees the service gone.
    with _STOPPING:
        own = _own_signal(waits=(0,))  # a job stopped as a whole: this process's own line
        if own:
            _stopped(own)
        _exit(line, 1)


def _own_signal(waits=(0, 0.2)) -> signal.Signals | None:
    """A stop signal this process received, its handler run or not, or None. On the thread that
    follows the peers."""
    # A signal sent before the peer's stop may not be delivered yet (the kernel hands it to the
    # main thread, which may be waiting for a core): pending, seen where this thread blocks it.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    for wait in waits:  # and a handler that took it may be writing its byte right now
        time.sleep(wait)
        own = _own.take() if _own is not None else []
        own += sorted(signal.sigpending() & set(STOP_SIGNALS))
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
        self.stopped_by: str | None = None  # what stopped the run: this process's signal, or a peer's
        self._previous: dict = {}
        self._deliveries: _Deliveries | None = None
        self._shared = None  # multi-process: every process's signal as of the last check, on device
        self._agreed = False
        self._finishing = False  # the loop is over; the run waits for its last save

    def __enter__(self) -> StopSignal:
        if (d := _job()) is not None:
            d.training_began()  # a stop from here on is seen by every process at a step boundary
        # signal.signal works on the main thread only; elsewhere (a library caller's worker thread)
        # the process keeps its own handlers.
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            self._deliveries = _Deliveries()  # run_job's is given back on exit
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
        # Two signals while the main thread was in one long call run this handler once: counted.
        if self._signum or (self._deliveries is not None and len(self._deliveries.take()) > 1):
            # The user (or the scheduler) insists: no checkpoint, the shell's exit code.
            _exit(f"received {name} again: exiting at once without saving", 128 + signum)
        self._signum = signum
        if self._agreed:  # the job already stops on a peer's signal, which stays the reason
            self._log(
                f"received {name}: already stopping at the next step boundary, by {self.stopped_by} "
                "(send again to exit at once)"
            )
            return
        self.stopped_by = name
        if self._finishing:
            self._log(
                f"received {name} while the run finishes: it exits once its last checkpoint is written "
                "(send again to exit at once)"
            )
            return
        self._log(
            f"received {name}: saving a checkpoint at the next step boundary, then stopping "
            "(send again to exit at once)"
        )

    def finishing(self) -> None:
        """The loop is over: a first signal now only says that the run exits once its last checkpoint
        is written; a second still exits at once."""
        self._finishing = True

    def requested(self) -> bool:
        """True once a stop signal arrived on any process of the job. Every process calls it at the
        same points and stops at the same one (or the collective save deadlocks): each call starts a
        gather of every process's signal and reads the previous call's, so the host never waits for
        the step it just dispatched, and a signal stops every process one call later."""
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
