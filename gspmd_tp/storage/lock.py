"""A run directory's lock, WORKDIR/train.lock, held by the training job that runs on it: orbax
locks nothing, and a second job would take the first's checkpoints in progress for damaged ones.

On disk a flock taken by process 0. In a bucket, which has no flock, a lease object
(docs/storage.md): created only where none exists (ifGenerationMatch=0: of two jobs starting at
once, one wins), naming its holder and its expiry, renewed every RENEW_S on condition of the
generation written last (a job that took it over is never overwritten), deleted on exit; an expired
lease (its holder was killed) is deleted, that generation only, and taken. No jax import at module
level.
"""

import contextlib
import fcntl
import os
import secrets
import socket
import threading
import time

from gspmd_tp.job import signals
from gspmd_tp.job.errors import JobError
from gspmd_tp.storage import paths
from gspmd_tp.storage.outputs import write_refused

LOCK = "train.lock"
_JOB = "job "  # the lock's second line: a number drawn by process 0 of the job
LEASE_S = 300.0  # a lease its holder has not renewed for this long is free
RENEW_S = 60.0
_created: list[str] = []  # workdirs that a workdir_lock of this process created and still holds


class Held(Exception):
    """The lock is held by another job; the message says by whom."""


@contextlib.contextmanager
def workdir_lock(workdir: str, warn=print):
    """Holds the lock while the body runs. Another job holding it is a JobError on every process
    before any reads or writes there; a filesystem without locks: a warning. A workdir this call
    created and left holding only the lock is removed.

    Every process then reads the number process 0 wrote in the lock: one given another --workdir, or
    storage process 0 does not write to, would save its shards elsewhere and wait in the save's
    barriers; a JobError on every process instead, naming the first."""
    import jax

    from gspmd_tp.job import distributed

    url = paths.is_url(workdir)
    path = f"{workdir}/{LOCK}" if url else os.path.join(workdir, LOCK)
    held_by, unwritable, job, release = None, None, 0, lambda: None
    if jax.process_index() == 0:
        job = secrets.randbelow(2**31 - 1) + 1  # int32, never 0 (0: none written)
        try:
            release, job = _lease(path, job, warn) if url else _flock(workdir, path, job, warn)
        except Held as e:
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
            minutes = f"{LEASE_S / 60:.0f} minutes"
            expiry = f"; a lease its holder no longer renews expires {minutes} after its last renewal"
            raise JobError(
                f"--workdir={workdir} is in use by another job ({held_by or process_0}; {path}): let it "
                f"finish or stop it (SIGTERM saves and exits), then run again{expiry if url else ''}"
            )
        if jax.process_count() > 1:
            _check_one_workdir(workdir, path, distributed.from_process_0(job))
        yield
    finally:
        release()


def _flock(workdir: str, path: str, job: int, warn):
    """(release, `job` or 0 where it could not be written) of the flock on `path`, `workdir` created
    where missing; Held where another job holds it, OSError where the workdir cannot be written."""
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
        _created.append(workdir)  # from here an exit through signals removes it too

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
        raise Held(held_by) from None
    except OSError as e:
        warn(f"warning: {path}: cannot lock it ({e.strerror}); nothing stops a second run on this workdir")
    try:
        lock.seek(0)
        lock.truncate()
        lock.write(f"{_holder_line()}\n{_JOB}{job}\n")
        lock.flush()
        os.fsync(lock.fileno())  # seen by the other hosts of the job (NFS: close-to-open)
    except OSError:
        job = 0
    return release, job


def _holder_line() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"


def _remove_if_only_the_lock(workdir: str) -> None:
    """Removes `workdir` where it holds only the lock and empty directories (orbax makes the
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


@signals.at_exit
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


# ---- In a bucket: the lease.


def _lease(url: str, job: int, warn):
    lease = Lease(url, job, warn)
    lease.acquire()
    return lease.release, job


def _split(url: str) -> tuple[str, str]:
    bucket, _, key = url.split("://", 1)[1].partition("/")
    return bucket, key


def _upload(fs, url: str, body: bytes, generation: int) -> int:
    """Writes `body` at `url` only where its generation is `generation` (0: where none exists);
    returns the new generation; FileExistsError where that fails. gcsfs's pipe_file conditions only
    on absence."""
    bucket, key = _split(url)
    reply = fs.call(
        "POST", f"{fs._location}/upload/storage/v1/b/{{}}/o", bucket, uploadType="media", name=key,
        data=body, json_out=True, ifGenerationMatch=str(generation),
    )  # fmt: skip
    return int(reply.get("generation") or 0)


def _read(fs, url: str) -> tuple[dict, int] | None:
    """(the lease's fields, its generation: the GET's x-goog-generation), None where there is none."""
    try:
        headers, body = fs.call("GET", "b/{}/o/{}", *_split(url), alt="media")
    except FileNotFoundError:
        return None
    fields = dict(line.split(" ", 1) for line in body.decode(errors="replace").splitlines() if " " in line)
    return fields, int(headers.get("x-goog-generation") or 0)


def _holder(found) -> str:
    if found is None:
        return "a job that started at the same moment"
    return f"pid {found[0]['pid']}" if "pid" in found[0] else "a job that has not said which"


class Lease:
    """The lease at `url`, taken by acquire(), renewed on a thread, released by release()."""

    def __init__(self, url: str, job: int, warn=print):
        import gcsfs

        self.url, self.job, self.warn = url, job, warn
        self.token, self.generation = secrets.token_hex(8), 0
        self._stop, self._thread = threading.Event(), None
        self._fs = gcsfs.GCSFileSystem()  # epath's instance: the same endpoint and credentials

    def _body(self) -> bytes:
        expires = f"{time.time() + LEASE_S:.0f}"
        return f"{_holder_line()}\n{_JOB}{self.job}\ntoken {self.token}\nexpires {expires}\n".encode()

    def _delete(self, generation: int) -> None:
        self._fs.call("DELETE", "b/{}/o/{}", *_split(self.url), ifGenerationMatch=str(generation))

    def acquire(self) -> None:
        """Takes the lease, or raises Held naming its holder."""
        found = _read(self._fs, self.url)
        if found is not None:
            expires = float(found[0].get("expires", "0") or 0)
            if expires > time.time():
                until = time.strftime("%H:%M:%S", time.localtime(expires))
                raise Held(f"{_holder(found)}; its lease runs until {until}")
            try:  # expired: only that generation is removed
                self._delete(found[1])
            except FileNotFoundError:
                pass
            except OSError as e:
                raise Held("a job that renewed or took over the expired lease meanwhile") from e
        try:
            _upload(self._fs, self.url, self._body(), 0)
        except FileExistsError:
            raise Held(_holder(_read(self._fs, self.url))) from None
        found = _read(self._fs, self.url)  # a store that ignores preconditions still shows who wrote last
        if found is None or found[0].get("token") != self.token:
            raise Held(_holder(found))
        self.generation = found[1]
        self._thread = threading.Thread(target=self._renew, name="gspmd_tp lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                self.generation = _upload(self._fs, self.url, self._body(), self.generation)
            except FileExistsError:
                return self.warn(
                    f"warning: {self.url}: another job took over this run's lease; stop one of them"
                )
            except Exception as e:  # noqa: BLE001 - a network error: try again at the next renewal
                self.warn(f"warning: {self.url}: could not renew the lease ({type(e).__name__}: {e})")

    def release(self) -> None:
        """Stops renewing and deletes the lease, unless another job holds it now."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        found = _read(self._fs, self.url)
        if found is not None and found[0].get("token") == self.token:
            with contextlib.suppress(OSError):  # renewed or taken over meanwhile: not ours to delete
                self._delete(found[1])
