"""python -m gspmd_tp.plan: what a run would cost under a rule file and mesh (planner.py)."""

import runpy

if __name__ == "__main__":  # the tool runs as its own __main__: its pre-jax set-up and flags as they are
    runpy.run_module("gspmd_tp.plan.planner", run_name="__main__", alter_sys=True)
