"""Output paths checked before any work (a command must not fail minutes later when it writes), and
written whole or not at all. Local or bucket URLs; the checks write nothing but a local probe they
remove. No jax import at module level: entry points check flags first.
"""

import contextlib
import os
import pathlib
import shutil
import tempfile

from gspmd_tp.job.errors import UserError
from gspmd_tp.storage import paths


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _not_creatable(directory: str) -> str | None:
    """Why directory `directory` could not be written or created, else None."""
    existing = _nearest_existing(directory)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return (
            f"{existing} is not writable"
            if existing == directory
            else f"cannot create it: {existing} is not writable"
        )
    return None


def write_refused(path: str, directory: bool = False) -> OSError | None:
    """The error a write at `path` (a directory with `directory`) gets, found by writing and leaving
    nothing behind, else None: os.access says yes to root where the filesystem refuses (/proc)."""
    full = os.path.abspath(path)
    if not directory and os.path.isfile(full):
        try:
            open(full, "a").close()
        except OSError as e:
            return e
        return None
    where = _nearest_existing(full if directory else os.path.dirname(full))
    try:
        tempfile.TemporaryFile(dir=where).close()
    except OSError as e:
        return type(e)(e.errno, e.strerror, where)  # not the temporary file's random name
    return None


def check_dir(path: str, flag: str, probe: bool = False) -> None:
    """UserError ("FLAG=PATH: why") unless directory `path` is writable or creatable; with `probe`,
    found so by writing too."""
    _check(path, flag, probe, directory=True)


def check_file(path: str, flag: str, probe: bool = False) -> None:
    """UserError ("FLAG=PATH: why") unless file `path` can be written; with `probe`, found so by
    writing too."""
    _check(path, flag, probe, directory=False)


def _check(path: str, flag: str, probe: bool, directory: bool) -> None:
    if not path:
        raise UserError(f"{flag} is empty")  # an unset shell variable, say: not the current directory
    where, full, url = f"{flag}={path}", os.path.abspath(path), paths.is_url(path)
    if url:
        paths.check_bucket(path, flag)
    if directory and url and paths.of(path).is_file():
        raise UserError(f"{where}: is an object (a file), not a directory")
    if not directory and (paths.of(path).is_dir() if url else os.path.isdir(full)):
        raise UserError(f"{where}: is a directory, not a file")
    if url:
        return
    if not directory and os.path.exists(full) and not os.access(full, os.W_OK):
        raise UserError(f"{where}: the file is not writable")
    if reason := _not_creatable(full if directory else os.path.dirname(full)):
        raise UserError(f"{where}: {reason}")
    if probe and (refused := write_refused(path, directory)):
        raise UserError(f"{where}: cannot write {'there' if directory else 'it'} ({refused.strerror})")


def check_image(path: str, flag: str) -> None:
    """check_file (probing), and an extension naming an image format matplotlib writes (else it
    writes NAME.png, or fails once the work is done)."""
    from matplotlib.backend_bases import FigureCanvasBase

    check_file(path, flag, probe=True)
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    if extension not in FigureCanvasBase.get_supported_filetypes():
        what = f"the extension .{extension} is not an image format" if extension else "no file extension"
        raise UserError(f"{flag}={path}: {what}; name it *.png, *.svg or *.pdf")


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):  # the exception that cut the write short is the one to report
        if paths.is_url(path):
            target = paths.of(path)
            if target.is_dir():
                target.rmtree()
            else:
                target.unlink()
        elif os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


@contextlib.contextmanager
def whole_file(path: str):
    """Yields a temporary name beside file `path` for the body to write: renamed to `path` when done,
    removed where it raises, so a write cut short leaves the older file as it was. For a bucket URL
    the name is local (a file or directory), uploaded when done: an object appears whole."""
    if paths.is_url(path):
        with _uploaded(path) as partial:
            yield partial
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    try:
        yield partial
        os.replace(partial, path)
    except BaseException:
        _remove(partial)
        raise


@contextlib.contextmanager
def _uploaded(url: str):
    """Yields a local name for the body to write, then uploads it (a directory recursively) to `url`."""
    staging = tempfile.mkdtemp(prefix="gspmd_tp-upload-")
    partial = os.path.join(staging, os.path.basename(url) or "upload")
    try:
        yield partial
        target = paths.of(url)
        if os.path.isdir(partial):
            if target.exists():
                target.rmtree()
            for root, _, files in os.walk(partial):
                for name in files:
                    local = os.path.join(root, name)
                    (target / os.path.relpath(local, partial)).write_bytes(pathlib.Path(local).read_bytes())
        else:
            target.write_bytes(pathlib.Path(partial).read_bytes())
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _names(directory: str) -> set[str] | None:
    """The names in `directory`, None where it does not exist (a bucket's: where nothing is under it)."""
    if paths.is_url(directory):
        found = {p.name for p in paths.of(directory).iterdir()} if paths.of(directory).exists() else set()
        return found or None
    return set(os.listdir(directory)) if os.path.isdir(directory) else None


@contextlib.contextmanager
def removed_if_cut_short(directory: str):
    """Where the body, writing into `directory`, raises (Ctrl-C too), removes what it added (and the
    directory, if new): a write cut short neither looks complete nor stands in the next one's way."""
    names = _names(directory)
    existed, before = names is not None, names or set()
    try:
        yield
    except BaseException:
        now = _names(directory)
        if now is not None:
            for name in now - before:
                _remove(os.path.join(directory, name))
            if not existed and not paths.is_url(directory):
                with contextlib.suppress(OSError):
                    os.rmdir(directory)  # where nothing else has appeared there meanwhile
        raise
