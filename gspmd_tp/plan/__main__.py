"""python -m gspmd_tp.plan: what a run would cost under a rule file and mesh (planner.py);
python -m gspmd_tp.plan calibrate: measure the devices at hand for its estimate (calibrate.py)."""

import runpy
import sys

if __name__ == "__main__":  # the tool runs as its own __main__: its pre-jax set-up and flags as they are
    command = "calibrate" if sys.argv[1:2] == ["calibrate"] else "planner"
    if command == "calibrate":
        del sys.argv[1]
    runpy.run_module(f"gspmd_tp.plan.{command}", run_name="__main__", alter_sys=True)
