"""Output paths, checked before any work: a command that computes for minutes must not fail when it
comes to write its result. The checks write nothing; `make_parent` creates a file's directory at
write time.

No jax import here, so entry points can check their flags first.
"""

import os

from gspmd_tp.errors import UserError


def _not_creatable(directory: str) -> str | None:
    """Why directory `directory` could not be written to or created, or None where it could: the
    nearest existing path at or above it must be a writable directory."""
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return (
            f"{existing} is not writable"
            if existing == directory
            else f"cannot create it: {existing} is not writable"
        )
    return None


def check_dir(path: str, flag: str) -> None:
    """Raises UserError ("FLAG=PATH: why") unless directory `path` exists and is writable, or can be
    created (its nearest existing ancestor is a writable directory)."""
    if not path:
        raise UserError(f"{flag} is empty")  # an unset shell variable, say: not the current directory
    reason = _not_creatable(os.path.abspath(path))
    if reason:
        raise UserError(f"{flag}={path}: {reason}")


def check_file(path: str, flag: str) -> None:
    """Raises UserError ("FLAG=PATH: why") unless file `path` can be written: not a directory, not
    a read-only file, and in a directory that exists and is writable or can be created."""
    if not path:
        raise UserError(f"{flag} is empty")
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise UserError(f"{flag}={path}: is a directory, not a file")
    if os.path.exists(full) and not os.access(full, os.W_OK):
        raise UserError(f"{flag}={path}: the file is not writable")
    reason = _not_creatable(os.path.dirname(full))
    if reason:
        raise UserError(f"{flag}={path}: {reason}")


def check_image(path: str, flag: str) -> None:
    """check_file, and the extension must name an image format matplotlib writes: a name without one
    would be written as NAME.png, one it does not know would fail after the work is done."""
    from matplotlib.backend_bases import FigureCanvasBase

    check_file(path, flag)
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    if extension not in FigureCanvasBase.get_supported_filetypes():
        what = f"the extension .{extension} is not an image format" if extension else "no file extension"
        raise UserError(f"{flag}={path}: {what}; name it *.png, *.svg or *.pdf")


def make_parent(path: str) -> None:
    """Creates the directory that file `path` goes in, where it is missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
