"""Benchmark the train step for a config over rule files and meshes (gspmd_tp/bench/__main__.py).

python bench.py --config=configs/bench_cpu.py --rules=megatron_1d --meshes="dp=8,mp=1 dp=2,mp=4"

Installed (pip install .), from any directory: python -m gspmd_tp.bench --config=bench_cpu ...
"""

import runpy

if __name__ == "__main__":  # the command runs as its own __main__: its pre-jax set-up and flags as they are
    runpy.run_module("gspmd_tp.bench", run_name="__main__", alter_sys=True)
