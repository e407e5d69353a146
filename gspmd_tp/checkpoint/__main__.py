"""python -m gspmd_tp.checkpoint info DIR | export DIR OUT.npz: a run's checkpoints (tool.py)."""

from gspmd_tp.job import entry

entry.begin()  # before jax is imported: no TPU probe on a host without one
from gspmd_tp.checkpoint import tool  # noqa: E402

entry.run(tool.main)
