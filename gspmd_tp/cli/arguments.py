"""The commands' arguments: absl's flags and the ml_collections --config (a file, or a shipped
config's name, and --config.KEY=VALUE overrides), path flags, and argv read before jax is imported;
each mistake one line on stderr and exit 1."""

import contextlib
import os
import re
import sys
from pathlib import Path

from gspmd_tp.storage import paths

# The shipped configs: gspmd_tp/configs, the repository's configs/ (linked) or the wheel's copy of it.
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def no_positional_arguments(argv: list[str]) -> None:
    """One line on stderr and exit 1 where absl left a positional argument (`config.steps=5` without
    its dashes would be dropped silently)."""
    if len(argv) > 1:
        usage = "flags are --NAME=VALUE, config keys --config.KEY=VALUE"
        print(f"error: unexpected argument {argv[1]!r} ({usage})", file=sys.stderr)
        sys.exit(1)


def shipped_config(argument: str) -> str:
    """`--config=NAME[:ARG]` as the shipped configs/NAME.py where NAME is no path and no file here;
    any other argument as it is."""
    name, colon, arg = argument.partition(":")
    if "/" in name or name.endswith(".py") or os.path.exists(name) or not (CONFIGS / f"{name}.py").is_file():
        return argument
    return f"{CONFIGS / name}.py{colon}{arg}"


def shipped_config_names() -> list[str]:
    """The names `--config=NAME` takes."""
    return sorted(p.stem for p in CONFIGS.glob("*.py") if p.stem != "__init__")


def define_config(default: str | None, help_text: str):
    """The ml_collections --config flag: a config file or a shipped one's name (`default` is one),
    plus --config.KEY=VALUE overrides. Without --config the default is loaded right here."""
    from absl import flags
    from ml_collections import config_flags

    with _config_mistakes_exit(default=default):
        holder = config_flags.DEFINE_config_file("config", default and shipped_config(default), help_text)
    parser = flags.FLAGS["config"].parser
    parse = parser.parse  # and --config=~/c.py, which bash leaves as it is
    parser.parse = lambda argument: parse(shipped_config(paths.expand(argument)))
    return holder


def parse_flags(argv: list[str], load: bool = True) -> list[str]:
    """app.run's flags_parser: absl's parsing, with a --config file that does not load (with `load`;
    else at loaded_config) or an override of a key the config lacks as one line on stderr (exit 1)."""
    from absl import flags

    with _config_mistakes_exit(argv), _no_none_warning():
        try:
            args = flags.FLAGS(argv)
        except flags.Error as e:  # absl's own report is two lines and a FATAL
            if raised := _raised_by_get_config(e):
                path = _config_path(argv, None)
                where = _where(raised, path)
                print(
                    f"error: --config={path}: {type(raised).__name__}: {_first_line(raised)}{where}",
                    file=sys.stderr,
                )
                sys.exit(1)
            _flag_mistake(e)
    if load:
        loaded_config()
    return args


_HELP = ("-h", "-?", "--help", "--helpshort", "--helpfull")


def parse_command_flags(flag_values, argv: list[str], usage: str) -> list[str]:
    """absl's parsing of `argv` into a command's own FlagValues (evaluate, generate, checkpoint: flags
    of the same names, run by tests in one process), from the defaults each time. --help prints
    `usage` and the flags; a mistake is one line, exit 1. Returns argv[0] and the positional args."""
    from absl import flags

    if any(arg in _HELP for arg in argv[1:]):
        print(f"{usage.strip()}\n\nflags:\n{flag_values.get_help(include_special_flags=False)}")
        sys.exit(0)
    flag_values.unparse_flags()  # a flag not given takes its default, not what a previous parse gave it
    try:
        return flag_values(argv)
    except flags.Error as e:
        _flag_mistake(e)


def _flag_mistake(e: Exception):
    """absl's report of a flag mistake (two lines and a FATAL) as one line on stderr; exit 1."""
    message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    print(f"error: {message} (--helpshort lists the flags)", file=sys.stderr)
    sys.exit(1)


def loaded_config():
    """The parsed --config, or one line on stderr and exit 1 where its file did not load."""
    from absl import flags
    from ml_collections import ConfigDict

    with _config_mistakes_exit():
        config = flags.FLAGS.config
        if not isinstance(config, ConfigDict):
            getattr(config, "keys", lambda: None)()  # stands in for a file that did not load: raises why
            path = _config_path(sys.argv, None)
            print(
                f"error: --config={path}: get_config() returned a value of type {type(config).__name__} "
                f"({config!r:.40}), not an ml_collections ConfigDict",
                file=sys.stderr,
            )
            sys.exit(1)
        return config


@contextlib.contextmanager
def _config_mistakes_exit(argv: list[str] | None = None, default: str | None = None):
    try:
        yield
    except (OSError, KeyError, AttributeError, TypeError, SyntaxError) as e:
        print(f"error: {_config_mistake(sys.argv if argv is None else argv, e, default)}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 - whatever else the config file's own code raised
        path = _config_path(sys.argv if argv is None else argv, default)
        print(
            f"error: --config={path}: {type(e).__name__}: {_first_line(e)}{_where(e, path)}", file=sys.stderr
        )
        sys.exit(1)


@contextlib.contextmanager
def _no_none_warning():
    """Keeps ml_collections' logged warning for a get_config() that returned None off stderr:
    loaded_config() says so in its one line."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return "get_config() returned None" not in record.getMessage()

    logger = logging.getLogger("absl")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _raised_by_get_config(e: BaseException) -> BaseException | None:
    """The TypeError or ValueError the config file's get_config() raised, where absl's error `e` wraps
    one (ml_collections re-raises it with the whole traceback as its message)."""
    wrapped = e.__context__
    if isinstance(wrapped, (TypeError, ValueError)) and "Error whilst parsing config file" in str(wrapped):
        return wrapped.__context__ or wrapped
    return None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _where(e: BaseException, path: str) -> str:
    """ " (line N)" of the config file's own line the exception came through, where it did."""
    import traceback

    target = os.path.abspath(paths.expand(shipped_config(path.split(":", 1)[0].split(" ", 1)[0])))
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if os.path.abspath(f.filename) == target]
    return f" (line {lines[-1]})" if lines else ""


def _config_path(argv: list[str], default: str | None) -> str:
    """The --config file as given, or the default's path marked as such."""
    given = flag_from_argv(argv, "--config")  # --config=FILE or absl's --config FILE
    if given is not None:
        return given
    if default is None:
        from absl import flags

        default = flags.FLAGS["config"].default_as_str.strip("'")
    return f"{default} (the default)"


def _config_mistake(argv: list[str], e: Exception, default: str | None) -> str:
    overrides = [a.split("=", 1)[0] for a in argv if a.startswith("--config.")]
    if isinstance(e, OSError):
        path = _config_path(argv, default)
        given = path.split(":", 1)[0].split(" ", 1)[0]
        if not os.path.isfile(paths.expand(given)):
            shipped = ", ".join(shipped_config_names())
            named = "" if "/" in given or given.endswith(".py") else f", nor a shipped config ({shipped})"
            return f"--config={path}: no such file (cwd {os.getcwd()}){named}"
        return f"--config={path}: {str(e).splitlines()[0]}"
    if isinstance(e, SyntaxError):
        return f"--config={_config_path(argv, default)}: {e.msg} (line {e.lineno}) in {e.filename}"
    if isinstance(e, AttributeError) and "has no attribute 'get_config'" in str(e):
        return f"--config={_config_path(argv, default)}: the file defines no get_config()"
    if isinstance(e, (KeyError, AttributeError)):
        from gspmd_tp.cli.config_keys import ours, refusal_hint  # it imports this module

        message = e
        while isinstance(message, BaseException) and message.args:
            message = message.args[0]  # ml_collections wraps a KeyError in an AttributeError
        lines = str(message).splitlines() or [""]
        if lines[0].startswith("This ConfigDict is locked"):  # the config file deleted a key of tiny's
            path = _config_path(argv, default)
            locked = "deletes a key of tiny's config, whose keys are locked (set its value instead)"
            return f"--config={path}: {locked}{_where(e, path)}"
        # The config file set a key tiny's locked config lacks: ml_collections names it, and may
        # suggest the one meant. (An override of a key the config lacks: below, as config_flags says it.)
        refused = re.match(r'Key "(.+?)" does not exist and cannot be added', lines[0])
        if refused:
            path = _config_path(argv, default)
            key = refused.group(1)
            hint = refusal_hint(key, str(message))
            return f"--config={path}: the config has no key {key!r}{hint}{_where(e, path)}"
        key = lines[0].strip("'\"")
        named = [o for o in overrides if key in o[len("--config.") :].split(".")]
        hint = "".join(f" ({line.strip()})" for line in lines[1:] if line.strip())
        if named_ours := ours(key):
            hint = f" (gspmd_tp calls it {named_ours})"
        return f"{named[0] if named else '--config'}: the config has no key {key!r}{hint}"
    return f"{' '.join(overrides) or '--config'}: {type(e).__name__}: {e}"


def define_path(name: str, default: str | None, help_text: str, flag_values=None):
    """An absl string flag holding a path, its leading `~` expanded, in FLAGS or `flag_values`."""
    from absl import flags

    class _PathParser(flags.ArgumentParser):
        def parse(self, argument: str) -> str:
            return paths.expand(argument)

    flags.disclaim_key_flags()  # the flag is the calling module's: --helpshort lists it there
    return flags.DEFINE(
        _PathParser(),
        name,
        default,
        help_text,
        flag_values=flags.FLAGS if flag_values is None else flag_values,
        serializer=flags.ArgumentSerializer(),
    )


def flag_from_argv(argv: list[str], name: str) -> str | None:
    """The last value of --name=VALUE or --name VALUE in argv (as absl takes it), else None: for what
    must be known before the flags are parsed."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(f"{name}="):
            value = arg.split("=", 1)[1]
        elif arg == name and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def count_from_argv(argv: list[str], default: int) -> int:
    """The value of a --config.host_device_count=N argument, else `default`."""
    value = flag_from_argv(argv, "--config.host_device_count")
    # A value that is no integer is left to the flag parser, which names it in one line.
    return int(value) if value is not None and value.strip().lstrip("-").isdigit() else default
