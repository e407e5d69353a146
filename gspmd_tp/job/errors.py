"""The one exception type for mistakes a user can fix (bad rule file, mesh, config), and how a
command stopped by Ctrl-C says so in one line."""

import os
import sys


class UserError(ValueError):
    """A one-line, user-fixable error. Entry points print it to stderr and exit non-zero."""


class JobError(UserError):
    """A UserError that every process of a job raises at the same point, each printing its own line;
    any other UserError before training is this process's alone, which run_job tells the others."""


INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C


def interrupted(left: str = "nothing in the workdir was written") -> int:
    """One line on stderr for a command stopped by Ctrl-C, in place of a traceback, saying what it
    `left`; returns INTERRUPTED."""
    print(f"stopped by Ctrl-C ({left})", file=sys.stderr, flush=True)
    return INTERRUPTED


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, or its type's name where it has none."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def exit_from_main(code: int) -> None:
    """sys.exit(code), but at once after Ctrl-C: a normal exit while XLA's compiler threads run can
    segfault."""
    if code == INTERRUPTED:
        sys.stdout.flush()
        os._exit(code)
    sys.exit(code)


def warn(message: str) -> None:
    """Prints a warning or note on stderr, apart from the output a command prints on stdout."""
    print(message, file=sys.stderr)
