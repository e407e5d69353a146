"""How every command starts: train.py, bench.py and each `python -m gspmd_tp.X` call begin() first
thing under `__main__`, before jax is imported, and the tools run() their main() once imported.

No jax import here (nor anything slow): begin() must run before it.
"""

import importlib
import sys

from gspmd_tp.job import errors


def begin(devices: int | str | None = None) -> None:
    """Until run() (train.py and bench.py: until signals.run_job), Ctrl-C exits at once with one
    line; then `devices` simulated CPU devices are asked for: a count, or "module:function" naming a
    function of argv that gives one (imported now: a module without jax). --config.host_device_count
    on the command line wins. Without `devices`, none are asked for (the command asks once its flags
    are read), and JAX_PLATFORMS=cpu is set on a host without accelerators."""
    errors.exit_on_ctrl_c_while_importing()
    from gspmd_tp.job import host_devices

    if devices is None:
        host_devices.cpu_platform_where_alone()
        return
    if isinstance(devices, str):
        module, function = devices.split(":")
        devices = getattr(importlib.import_module(module), function)(sys.argv)
    host_devices.request(host_devices.count_from_argv(sys.argv, devices))


def run(main, flags_parser=None):
    """Runs a tool's main() once its imports are done, Ctrl-C raising KeyboardInterrupt again for
    main() to catch. With `flags_parser` (errors.parse_flags), as absl's app.run(main): the flags are
    absl's global ones; without, main() parses the command's own and returns the exit status."""
    errors.ctrl_c_raises()
    if flags_parser is None:
        errors.exit_from_main(main())
    from absl import app

    app.run(main, flags_parser=flags_parser)
