"""How every command starts: begin() first thing under `__main__`, before jax is imported (so
nothing slow here), then run(main) once the imports are done."""

import os
import signal

from gspmd_tp.job import errors


def begin() -> None:
    """Until run(), Ctrl-C exits at once with one line, status 130 (in jax's imports a KeyboardInterrupt
    is a traceback, an ImportError or an abort); JAX_PLATFORMS=cpu on a host without accelerators."""
    signal.signal(signal.SIGINT, lambda *_: os._exit(errors.interrupted("nothing written")))
    from gspmd_tp.job import host_devices

    host_devices.cpu_platform_where_alone()


def start_job(config) -> None:
    """The start of train's and bench's main(): library INFO logs off (orbax's lines per save would bury
    the progress lines); the config's simulated devices asked for before jax's backend starts."""
    from absl import logging

    from gspmd_tp.job import host_devices

    logging.set_verbosity(logging.WARNING)
    host_devices.request(config.host_device_count, config.host_malloc_tuning)


def run(main, flags_parser=None):
    """Runs a tool's main() with Ctrl-C raising KeyboardInterrupt again: absl's app.run(main,
    flags_parser), else main() parses its own flags and returns the exit status."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if flags_parser is None:
        errors.exit_from_main(main())
    from absl import app

    app.run(main, flags_parser=flags_parser)
