"""What the loop does about non-finite losses, gradients and states (a stop signal: job/signals.py).

The finiteness flags the jitted step returns are read in batches when the loop syncs anyway (logged
steps, checkpoints, the end): no host sync per step.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from gspmd_tp.job.errors import UserError


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
