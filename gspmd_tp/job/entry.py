"""How every command starts: begin() first thing under `__main__`, before jax is imported (so
nothing slow here), then run(main) once the imports are done."""

from gspmd_tp.job import errors


def begin() -> None:
    """Until run() (train, bench: signals.run_job), Ctrl-C exits at once with one line; and
    JAX_PLATFORMS=cpu on a host without accelerators, before jax reads it."""
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
    """Runs a tool's main(), Ctrl-C raising KeyboardInterrupt again for it to catch: as absl's
    app.run(main) with `flags_parser`, else main() parses its own flags and returns the status."""
    errors.ctrl_c_raises()
    if flags_parser is None:
        errors.exit_from_main(main())
    from absl import app

    app.run(main, flags_parser=flags_parser)
