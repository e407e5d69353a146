"""How a training job ends outside its training loop: stop signals, a peer's stop, death or error
before training began (a peer's death during training too), and errors, each as one line and an exit
status. bench.py's job, which has no training loop, ends the same way.

The training loop saves and stops on a signal itself (faults.py); around it (joining the job,
compiling, restoring, exiting) this module's handlers take over. No jax import at module level:
train.py installs them before jax is imported, while the job's processes join.
"""

import os
import signal
import sys
import threading
import time
import traceback

from gspmd_tp.job import output_paths, peer_socket
from gspmd_tp.job.errors import JobError, UserError


def run_job(job, before: str = "", after: str = "") -> None:
    """Runs job() (join the job's processes, then train) with the stops of this module in place;
    every failure ends in one line and an exit status. Call before jax is imported. A job that does
    not train (bench.py) says in `before` what a stop before its end leaves ("(nothing written)"),
    and in `after` what one after it does."""
    global _OUTSIDE_THE_LOOP, _BEFORE, _ENDED
    _BEFORE = before or _BEFORE
    _OUTSIDE_THE_LOOP = _BEFORE
    # Until the training loop's own handler takes over (and after it), SIGTERM and Ctrl-C stop the
    # run at once: one line, no traceback; from the start, while the job's processes join, too.
    take_stop_signals()
    _count_own_signals()
    # Another process stopped so, died, or stopped with an error of its own before training began:
    # this one stops too, at once, instead of waiting for it in a collective until the heartbeat
    # timeout. From the moment the job's flags agree, before JAX joins the processes (where one may
    # die too).
    peer_socket.follow(_peer_stopped, _peer_died, _peer_failed)
    try:
        job()
        peer_socket.leave()  # the others do not take this process's exit for a death
        # What is left is the exit, which in a multi-process job waits at jax.distributed's
        # shutdown barrier for the slowest peer.
        _OUTSIDE_THE_LOOP = after or "after the run ended; its checkpoints are written"
        _ENDED = True
    except JobError as e:
        peer_socket.leave()  # each process says its own (distributed.agreed): nothing to tell
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except UserError as e:
        with _STOPPING:
            print(f"error: {e}", file=sys.stderr, flush=True)
            # This process's alone (a file or a limit of its host), before training began: the others
            # are told, and stop too. Then out at once: the normal exit waits at jax.distributed's
            # shutdown barrier for them.
            if peer_socket.tell_error(str(e)):
                output_paths.remove_created_workdirs()
                os._exit(1)
            peer_socket.leave()
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
    # A failed collective in a multi-process job almost always means a peer died. Where it died
    # before training, the thread that follows the peers names it and exits (its line, not this
    # guess); gloo may see the closed connection a moment before it does.
    if peer_socket.a_peer_died(1):
        time.sleep(15)
    # Exit now: the normal exit path would wait at jax.distributed's shutdown barrier for that peer.
    with _STOPPING:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        what = f"error: process {jax.process_index()}: {type(e).__name__}: {first}"
        if peer_socket.before_training():
            # No peer was seen to die (a_peer_died): most likely this process's own error (a
            # bug), whose traceback says where. The others are told: they would wait for this
            # process in a collective.
            traceback.print_exception(e)
            print(what, file=sys.stderr, flush=True)
            peer_socket.tell_error(f"{type(e).__name__}: {first}")
        else:
            print(f"{what} (another process of the job has probably died)", file=sys.stderr, flush=True)
        output_paths.remove_created_workdirs()  # what the lock's exit would have done
        os._exit(1)


# What a stop outside the training loop means, said in the one line it prints.
_TRAINING = "before training began; no checkpoint was written"
_BEFORE = _TRAINING  # run_job's `before`, for a job that does not train
_OUTSIDE_THE_LOOP = _BEFORE
_ENDED = False  # the job's work is done: what is left is the exit
# One stop prints its line and exits: a signal's handler on the main thread, a peer's stop or death
# on the thread that follows them, or a failed collective. Reentrant: a second signal may run its
# handler inside the first's.
_STOPPING = threading.RLock()
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_OWN_SIGNALS = None  # the read end of Python's wakeup fd: a byte per signal, written on delivery


def take_stop_signals():
    """SIGTERM and Ctrl-C stop the job at once, one line each (again after a library took them over)."""
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _stop_outside_the_loop)


def _count_own_signals():
    global _OWN_SIGNALS
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    _OWN_SIGNALS = read


def _stop_outside_the_loop(signum, frame):
    # Exits from the handler itself: an exception raised here is lost where the handler runs inside
    # a garbage-collection callback, and the process would go on into a collective its peers,
    # stopped, never join.
    _stopped(signal.Signals(signum))


def _stopped(sig: signal.Signals, process: int | None = None):
    """Outside the training run (whose signals save and stop): compiling, restoring, exiting. One line,
    and out at once: a normal exit while XLA's compiler threads still run can end in a segfault.

    Before training began, the job's other processes are told (handshake.tell_stop) and stop too;
    `process`: the one signalled, where it is another."""
    with _STOPPING:
        name = "Ctrl-C" if sig == signal.SIGINT else sig.name
        if process is None and not _ENDED:
            peer_socket.tell_stop(sig)
        where = "" if process is None else f" on process {process}"
        print(f"stopped by {name}{where} {_OUTSIDE_THE_LOOP}", file=sys.stderr, flush=True)
        output_paths.remove_created_workdirs()  # a new workdir holding only the lock: gone, as on an error
        os._exit(128 + sig)


def _peer_stopped(signum: int, process: int):
    # Signalled too (a job stopped as a whole) while its handler still waits for the main thread
    # (busy compiling): this process's own line, as where its handler came first.
    own = _own_signal()
    _stopped(own or signal.Signals(signum), None if own else process)


def _peer_died(process: int):
    if not peer_socket.training_has_begun():
        _peer_ended(f"stopped: process {process} died (killed or crashed) {_BEFORE}")
    # During training: the peer may also have exited at once (a second stop signal, a failed step),
    # and a save of this process may be in flight (left unfinished: the next start removes it).
    _peer_ended(
        f"stopped: process {process} died during training (killed or crashed, or exited at once); "
        "run again to resume from the newest complete checkpoint"
    )


def _peer_failed(process: int, message: str):
    if _BEFORE != _TRAINING:  # a job that does not train
        _peer_ended(f"stopped: process {process} stopped with an error (error: {message}) {_BEFORE}")
    _peer_ended(
        f"stopped: process {process} stopped with an error before training began (error: {message}); "
        "no checkpoint was written"
    )


def _peer_ended(line: str):
    # Taken at once: a collective that failed on the closed connection waits for this line
    # (handshake.a_peer_died) rather than print its own guess. And no wait for a signal of this
    # process's own still on its way: where process 0 died, JAX's client aborts this process
    # (with a stack trace) as soon as it sees the coordination service gone.
    with _STOPPING:
        own = _own_signal(waits=(0,))  # a job stopped as a whole: this process's own line
        if own:
            _stopped(own)
        print(line, file=sys.stderr, flush=True)
        output_paths.remove_created_workdirs()
        os._exit(1)


def _own_signal(waits=(0, 0.2)) -> signal.Signals | None:
    """A stop signal this process received, its handler run or not, or None. On the thread that
    follows the peers' stops."""
    # A signal sent before the peer's stop may not be delivered yet (the kernel hands it to the
    # main thread, which may be waiting for a core): pending, seen where this thread blocks it.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    for wait in waits:  # and a handler that took it may be writing its byte right now
        time.sleep(wait)
        try:
            received = os.read(_OWN_SIGNALS, 4096) if _OWN_SIGNALS is not None else b""
        except BlockingIOError:
            received = b""
        own = [signal.Signals(b) for b in received if b in _STOP_SIGNALS]
        own += sorted(signal.sigpending() & set(_STOP_SIGNALS))
        if own:
            return own[0]
    return None
