"""How every command starts: train.py, bench.py and each `python -m gspmd_tp.X` call begin() first
thing under `__main__`, before jax is imported, and the tools run() their main() once imported.

No jax import here (nor anything slow): begin() must run before it. The simulated CPU devices are
no reason to: each command asks for them once its flags are read (host_devices.request), jax
imported or not.
"""

from gspmd_tp.job import errors


def begin() -> None:
    """Until run() (train and bench: until signals.run_job), Ctrl-C exits at once with one line;
    JAX_PLATFORMS=cpu is set on a host without accelerators (before jax reads it, as it is imported)."""
    errors.exit_on_ctrl_c_while_importing()
    from gspmd_tp.job import host_devices

    host_devices.cpu_platform_where_alone()


def start_job(argv: list[str], config) -> None:
    """The start of train's and bench's main(): no positional arguments; library INFO logs off (orbax
    prints several lines per save, which would bury the progress lines); the config's simulated
    devices asked for before jax's backend starts."""
    from absl import logging

    from gspmd_tp.job import host_devices

    errors.no_positional_arguments(argv)
    logging.set_verbosity(logging.WARNING)
    host_devices.request(config.host_device_count, config.host_malloc_tuning)


def run(main, flags_parser=None):
    """Runs a tool's main() once its imports are done, Ctrl-C raising KeyboardInterrupt again for
    main() to catch. With `flags_parser` (errors.parse_flags), as absl's app.run(main): the flags are
    absl's global ones; without, main() parses the command's own and returns the exit status."""
    errors.ctrl_c_raises()
    if flags_parser is None:
        errors.exit_from_main(main())
    from absl import app

    app.run(main, flags_parser=flags_parser)
