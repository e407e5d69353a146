"""Output paths checked before any work (a command must not fail minutes later when it writes),
written whole or not at all, and the workdir's lock. Local or bucket URLs; the checks write nothing
but a local probe they remove. No jax import at module level: entry points check flags first.
"""

import contextlib
import fcntl
import os
import pathlib
import secrets
import shutil
import socket
import sys
import tempfile
import time

from gspmd_tp.job import paths
from gspmd_tp.job.errors import JobError, UserError

LOCK = "train.lock"  # in a workdir: held by the training job that runs on it
_JOB = "job "  # the lock file's second line: a number drawn by process 0 of the job
_created: list[str] = []  # workdirs that a workdir_lock of this process created and still holds


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


@contextlib.contextmanager
def stdout_to_stderr():
    """Within it fd 1 goes to stderr (gloo prints its connection lines there), so that stdout holds
    only the report printed after it."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def workdir_lock(workdir: str, warn=print):
    """Holds WORKDIR/train.lock while the body runs (orbax locks nothing): a flock taken by process
    0, or in a bucket a lease (bucket_lease). A second job on the workdir is a JobError on every
    process before it reads or writes there (it would take the running job's checkpoints in progress
    for damaged ones); no locks on the filesystem: a warning. A workdir this call created and left
    holding only the lock is removed.

    Every process then reads the number process 0 wrote in the lock: one given another --workdir, or
    storage process 0 does not write to, would save its shards elsewhere and wait in the save's
    barriers; JobError on every process instead, naming the first."""
    import jax

    from gspmd_tp.job import bucket_lease, distributed

    url = paths.is_url(workdir)
    path = f"{workdir}/{LOCK}" if url else os.path.join(workdir, LOCK)
    held_by, unwritable, job, release = None, None, 0, lambda: None
    if jax.process_index() == 0:
        try:
            release, job = _lease(path, warn) if url else _flock(workdir, path, warn)
        except bucket_lease.Held as e:
            held_by = str(e)
        except Exception as e:  # noqa: BLE001 - OSError, gcsfs's HttpError (a 403 of read-only credentials)
            unwritable = (
                f"{e.strerror}: {e.filename}" if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
            )
    outcome = distributed.from_process_0(1 if held_by is not None else 2 if unwritable else 0)
    process_0 = "as process 0 of this job found"
    try:
        if outcome == 2:
            raise JobError(f"--workdir={workdir}: cannot write there ({unwritable or process_0})")
        if outcome == 1:
            expiry = (
                f"; a lease its holder no longer renews expires {bucket_lease.LEASE_S / 60:.0f} minutes "
                "after its last renewal"
            )
            raise JobError(
                f"--workdir={workdir} is in use by another job ({held_by or process_0}; {path}): let it "
                f"finish or stop it (SIGTERM saves and exits), then run again{expiry if url else ''}"
            )
        if jax.process_count() > 1:
            _check_one_workdir(workdir, path, distributed.from_process_0(job))
        yield
    finally:
        release()


def _new_job() -> int:
    return secrets.randbelow(2**31 - 1) + 1  # int32, never 0 (0: none written)


def _lease(path: str, warn):
    from gspmd_tp.job import bucket_lease

    lease = bucket_lease.Lease(path, _new_job(), warn)
    lease.acquire()
    return lease.release, lease.job


def _flock(workdir: str, path: str, warn):
    """(release, job number written or 0) of the flock on `path`, `workdir` created where missing;
    bucket_lease.Held where another job holds it, OSError where the workdir cannot be written."""
    from gspmd_tp.job import bucket_lease

    created = not os.path.exists(workdir)
    try:
        # Probed first (os.access says yes to root where the filesystem refuses, /proc), so that a
        # refusal leaves no directory that makedirs made on the way to the workdir.
        if refused := write_refused(workdir, directory=True):
            raise refused
        os.makedirs(workdir, exist_ok=True)
        lock = open(path, "a+")
    except OSError:
        if created and os.path.isdir(workdir) and not os.listdir(workdir):
            os.rmdir(workdir)
        raise
    if created:
        _created.append(workdir)  # from here an os._exit removes it too

    def release():
        lock.close()  # releases the flock
        if workdir in _created:
            _remove_if_only_the_lock(workdir)
            _created.remove(workdir)

    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        held_by = lock.readline().strip() or "a process that has not said which"
        release()
        raise bucket_lease.Held(held_by) from None
    except OSError as e:
        warn(f"warning: {path}: cannot lock it ({e.strerror}); nothing stops a second run on this workdir")
    job = _new_job()
    try:
        lock.seek(0)
        lock.truncate()
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        lock.write(f"pid {os.getpid()} on {socket.gethostname()} since {since}\n{_JOB}{job}\n")
        lock.flush()
        os.fsync(lock.fileno())  # seen by the other hosts of the job (NFS: close-to-open)
    except OSError:
        job = 0
    return release, job


def _remove_if_only_the_lock(workdir: str) -> None:
    """Removes `workdir` where it holds only the lock file and empty directories (orbax makes the
    checkpoints directory before the first save): a run stopped before writing anything."""
    if not os.path.isdir(workdir) or LOCK not in (names := os.listdir(workdir)):
        return
    others = [os.path.join(workdir, name) for name in names if name != LOCK]
    if not all(os.path.isdir(p) and not os.path.islink(p) and not os.listdir(p) for p in others):
        return
    with contextlib.suppress(OSError):  # another process of the job wrote there meanwhile: its files stay
        for p in others:
            os.rmdir(p)
        os.remove(os.path.join(workdir, LOCK))
        os.rmdir(workdir)


def remove_created_workdirs() -> None:
    """workdir_lock's exit, for an exit through os._exit that skips it."""
    for workdir in _created:
        _remove_if_only_the_lock(workdir)


def _check_one_workdir(workdir: str, path: str, job: int) -> None:
    """JobError on every process unless each reads `job` (process 0's number; 0: none written) in
    its own lock file `path`. Every process must call it."""
    import jax

    from gspmd_tp.job import distributed

    if not job:
        return
    for _ in range(3):  # a host's cached view of the shared directory may lag a moment
        try:
            sees = f"{_JOB}{job}" in paths.of(path).read_text().splitlines()
        except OSError:
            sees = False
        if sees or jax.process_index() == 0:
            break
        time.sleep(1.0)
    blind = [i for i, [ok] in enumerate(distributed.every_process([int(sees)])) if not ok]
    if blind:
        raise JobError(
            f"--workdir={workdir}: process {blind[0]} of this job does not find the {LOCK} that process 0 "
            f"wrote in its --workdir: start every process with the same --workdir, on storage that every "
            "process sees"
        )
