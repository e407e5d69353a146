"""python -m gspmd_tp.convert: Hugging Face Llama checkpoints <-> orbax checkpoints (llama.py)."""

import runpy

if __name__ == "__main__":  # the tool runs as its own __main__: its pre-jax set-up and flags as they are
    runpy.run_module("gspmd_tp.convert.llama", run_name="__main__", alter_sys=True)
