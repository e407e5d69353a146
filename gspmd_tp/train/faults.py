"""What the loop does about faults: a stop signal (SIGTERM/SIGINT) and non-finite losses or gradients.

Both are checked at step boundaries by the host. Neither adds a host sync per step: the stop flag is
a Python bool set by the signal handler (shared with a job's other processes by a tiny all-reduce
that is read one check later), and the finiteness flags the jitted step returns are read in one
batch when the loop syncs anyway (logged steps, checkpoints, the end).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

from gspmd_tp.job import distributed, output_paths, peer_socket
from gspmd_tp.job.errors import UserError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """While entered, the first SIGTERM/SIGINT asks for a stop at the next step boundary; a second exits."""

    def __init__(self, log):
        self._log = log
        self._signum = 0  # the signal this process received, 0 for none
        self.stopped_by: str | None = None  # what stopped the run: this process's signal, or a peer's
        self._previous: dict = {}
        self._wakeup: tuple[int, int] | None = None  # a pipe that counts deliveries
        self._previous_wakeup = -1
        self._shared = None  # multi-process: every process's signal as of the last check, on device
        self._agreed = False
        self._finishing = False  # the loop is over; the run waits for its last save

    def __enter__(self) -> StopSignal:
        # signal.signal only works on the main thread; elsewhere (a library caller's worker thread)
        # the process keeps its own handlers and stops the way it always did.
        peer_socket.training_began()  # a stop from here on is seen by every process at a step boundary
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            self._count_deliveries()
        return self

    def _count_deliveries(self) -> None:
        # Python runs a handler between bytecodes: two Ctrl-C while the main thread waits in a
        # step or a save would run it once, and the second would not exit at once. Python's own
        # low-level handler writes one byte per delivery to the wakeup fd, which counts them.
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        # Another's (train.py's, which tells a stop before the loop to the job's other processes)
        # is given back on exit: this handler's count is the one that matters meanwhile.
        self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._wakeup = (read, write)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._wakeup:
            signal.set_wakeup_fd(self._previous_wakeup, warn_on_full_buffer=False)
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None

    def _deliveries(self) -> int:
        """Stop signals delivered since the last call, at least the one being handled."""
        if not self._wakeup:
            return 1
        try:
            received = os.read(self._wakeup[0], 4096)
        except BlockingIOError:
            received = b""
        return max(1, sum(received.count(int(sig)) for sig in STOP_SIGNALS))

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self._signum or self._deliveries() > 1:
            # The user (or the scheduler) insists: no checkpoint, no cleanup, the shell's exit code.
            print(f"received {name} again: exiting at once without saving", file=sys.stderr, flush=True)
            output_paths.remove_created_workdirs()
            os._exit(128 + signum)
        self._signum, self.stopped_by = signum, name
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

    def finishing(self, failed: bool = False) -> None:
        """The loop is over: from now on a first signal only says that the run ends once its last
        checkpoint is written, which it is waiting for anyway; a second still exits at once. And a
        peer's exit from here on is its own (handshake.training_ended), unless the loop `failed`:
        a failed step of a multi-process job most likely saw a peer die, and that peer's socket may
        close only after it (its close is still a death, which the error's line waits for)."""
        self._finishing = True
        if not failed:
            peer_socket.training_ended()

    def requested(self) -> bool:
        """True once a stop signal arrived (on any process, when there are several).

        A job's processes call this at the same points (step boundaries, evaluation batches) and
        must all stop at the same one, or the collective save deadlocks. Each call starts a tiny
        all-reduce of every process's signal and reads the previous call's: the host waits for the
        work dispatched before that call, never for the step it just dispatched, and a signal
        stops every process one call after the one that shared it."""
        if jax.process_count() == 1:
            return bool(self._signum)
        if self._agreed:
            return True
        previous, self._shared = self._shared, distributed.share([self._signum])
        if previous is None:
            return False
        signums = distributed.read(previous)[:, 0]  # 0 where no signal arrived
        senders = np.flatnonzero(signums)
        if senders.size:
            first = int(senders[0])
            self.stopped_by = f"{signal.Signals(int(signums[first])).name} on process {first}"
            self._agreed = True
        return self._agreed


@jax.jit
def _all_finite(tree) -> jax.Array:
    """One replicated bool: every float of `tree` (sharded as it is) is finite."""
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.stack(leaves).all() if leaves else jnp.array(True)


def check_resumed(step: int, state, ckpt_dir: str, older: int | None) -> None:
    """Raises UserError where the state restored from checkpoint `step` holds NaN or Inf (saved
    before check_state refused such states): every step trained from it would be NaN. Names the
    checkpoint before it (`older`, None where there is none) to resume from; moves nothing."""
    if bool(_all_finite((state.params, state.opt_state))):
        return
    step_dir = os.path.join(ckpt_dir, str(step))
    instead = (
        f"move {step_dir} out of {ckpt_dir} to resume from step {older}"
        if older is not None
        else f"no older checkpoint is left in {ckpt_dir}: start the run afresh in another workdir"
    )
    raise UserError(
        f"checkpoint step {step} in {ckpt_dir} holds NaN or Inf parameters or optimizer state; every step "
        f"resumed from it would be NaN: {instead}, with a lower config.optim.lr"
    )


class NonFiniteWatch:
    """Collects the per-step stats of the jitted step and checks them in batches at host syncs.

    skip=False: the first NaN/Inf loss or gradient raises UserError naming the step and quantity.
    skip=True: the step already kept the old state on device; this only logs and counts.
    Either way a state about to be saved is checked whole first (check_before_save).
    """

    def __init__(self, skip: bool, log, start: int = 0, skipped: int = 0):
        self.skip, self._log = skip, log
        self.skipped = skipped  # steps skipped over the whole run, before `start` too
        self.last_finite = start  # the newest step read whose loss and gradient were finite
        self.last_saved = start if start else None  # the newest checkpoint, named in errors; None: none
        self._pending: list[tuple[int, dict]] = []

    def add(self, step: int, stats: dict) -> None:
        """Remembers `step`'s stats (device arrays; nothing is read yet)."""
        self._pending.append((step, stats))

    def saved(self, step: int) -> None:
        """Step `step` was saved: the checkpoint a later error names as the one that survives."""
        self.last_saved = step

    def check(self, upto: int | None = None) -> None:
        """Reads the pending stats (of steps up to `upto`, default all); raises on a non-finite step
        unless skipping."""
        ready = [p for p in self._pending if upto is None or p[0] <= upto]
        self._pending = self._pending[len(ready) :]
        pending = jax.device_get(ready)
        for step, stats in pending:
            loss, grad_norm = float(stats["loss"]), float(stats["grad_norm"])
            if math.isfinite(loss) and math.isfinite(grad_norm):
                self.last_finite = max(self.last_finite, step)
                continue
            quantity = "loss" if not math.isfinite(loss) else "gradient"
            what = f"non-finite {quantity} at step {step} (loss {loss}, grad_norm {grad_norm})"
            if self.skip:
                self.skipped += 1
                self._log(f"skipped step {step}: {what}; parameters and optimizer state left unchanged")
                continue
            raise UserError(
                f"{what}: stopped without saving ({self._kept()}); lower config.optim.lr or set "
                f"config.skip_nonfinite_steps=True to skip such steps"
            )

    def check_before_save(self, step: int, state, stopping: bool) -> None:
        """Raises UserError where the state about to be saved at `step` must not be: it went through
        a non-finite step (unless skipping), every step since the last save was skipped (unless the
        save is a stop's), or it holds NaN or Inf itself."""
        self.check()
        since = self.last_saved if self.last_saved is not None else 0  # the last save, or the start
        if not stopping:  # skipping: an interval that moved nothing is not saved
            self.check_diverged(step, since)
        # An update may overflow the state from a finite loss: never saved.
        self.check_state(step, state, since)

    def check_state(self, step: int, state, since: int) -> None:
        """Raises UserError where the parameters or optimizer state to be saved at `step` hold NaN
        or Inf. The losses and gradients check() reads do not show an update that overflowed them
        from a finite loss and gradient (a learning rate beyond float32, say); saved, that state
        would become the newest checkpoint, the one a resume picks, and every step from it NaN.
        One reduction on device per save, none per step."""
        if bool(_all_finite((state.params, state.opt_state))):
            return
        raise UserError(
            f"non-finite parameters or optimizer state at step {step}: an update since step {since} made "
            f"them NaN or Inf from a finite loss and gradient; stopped without saving ({self._kept()}); "
            "lower config.optim.lr and run again"
        )

    def check_diverged(self, step: int, since: int) -> None:
        """Skipping: raises UserError where every step after `since` (the last save, or the start)
        up to `step` was skipped. The state has not moved since, so a checkpoint would add nothing
        but would prune an older one; a whole interval of them means the run has diverged."""
        if self.skip and step > since and self.last_finite <= since:
            raise UserError(
                f"every step since {'checkpoint ' if self.last_saved is not None else 'step '}{since} "
                f"({since + 1}..{step}) had a non-finite loss or gradient and was skipped: the run has "
                f"diverged; stopped without saving ({self._kept()}); resume from a checkpoint before the "
                "divergence with a lower config.optim.lr"
            )

    def _kept(self) -> str:
        """What survives a stop without saving, for the error's line."""
        if self.last_saved is None:
            return "no checkpoint was written"
        return f"the newest checkpoint is step {self.last_saved}"
