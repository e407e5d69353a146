"""Train a transformer whose sharding is a rule file (gspmd_tp/train/__main__.py).

python train.py --config=configs/tiny.py --workdir=runs/tiny [--config.KEY=VALUE ...]

Installed (pip install .), from any directory: python -m gspmd_tp.train --config=tiny --workdir=runs/tiny
"""

import runpy

if __name__ == "__main__":  # the command runs as its own __main__: its pre-jax set-up and flags as they are
    runpy.run_module("gspmd_tp.train", run_name="__main__", alter_sys=True)
