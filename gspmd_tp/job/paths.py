"""Paths as a user types them on a command line: a leading `~` is the home directory in every
command's path flags. bash expands it only at the start of a word or after the `=` of a variable
assignment, so `--workdir=~/runs/x` reaches the command as it was typed.

No jax import here, so entry points can read their flags first.
"""

import os


def expand(path: str | None) -> str | None:
    """`path` with a leading `~` or `~USER` made that home directory; None and "" as they are."""
    return os.path.expanduser(path) if path else path


def define_flag(name: str, default: str | None, help_text: str, flag_values=None):
    """An absl string flag holding a path, its leading `~` expanded as it is parsed; in absl's
    global FLAGS, or in a command's own `flag_values`."""
    from absl import flags

    class _PathParser(flags.ArgumentParser):
        def parse(self, argument: str) -> str:
            return expand(argument)

    flags.disclaim_key_flags()  # the flag is the calling module's: --helpshort lists it there
    return flags.DEFINE(
        _PathParser(),
        name,
        default,
        help_text,
        flag_values=flags.FLAGS if flag_values is None else flag_values,
        serializer=flags.ArgumentSerializer(),
    )


def expand_config_flag(name: str = "config") -> None:
    """Makes the ml_collections --config flag `name` (already defined) read `--config=~/c.py` as a
    file under the home directory, as the other path flags do."""
    from absl import flags

    parser = flags.FLAGS[name].parser
    parse = parser.parse
    parser.parse = lambda argument: parse(expand(argument))
