"""python -m gspmd_tp.generate: sampling from a trained run (inference/generate.py)."""

import runpy

if __name__ == "__main__":  # the tool runs as its own __main__: its pre-jax set-up and flags as they are
    runpy.run_module("gspmd_tp.inference.generate", run_name="__main__", alter_sys=True)
