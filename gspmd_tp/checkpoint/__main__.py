"""python -m gspmd_tp.checkpoint info DIR | export DIR OUT.npz: a run's checkpoints (tool.py)."""

from gspmd_tp.job.errors import exit_on_ctrl_c_while_importing

exit_on_ctrl_c_while_importing()
from gspmd_tp.job import host_devices  # noqa: E402

host_devices.cpu_platform_where_alone()  # before jax is imported: no TPU probe on a host without one

from gspmd_tp.checkpoint import tool  # noqa: E402
from gspmd_tp.job.errors import ctrl_c_raises, exit_from_main  # noqa: E402

ctrl_c_raises()  # the imports are done: main() catches it
exit_from_main(tool.main())
