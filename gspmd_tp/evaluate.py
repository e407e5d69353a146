"""python -m gspmd_tp.evaluate: held-out loss of a trained run (inference/evaluate.py)."""

import runpy

if __name__ == "__main__":  # the tool runs as its own __main__: its pre-jax set-up and flags as they are
    runpy.run_module("gspmd_tp.inference.evaluate", run_name="__main__", alter_sys=True)
