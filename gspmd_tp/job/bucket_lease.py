"""The lock of a run directory in a bucket: a lease object, gs://.../train.lock (docs/storage.md).

Home-made because a bucket has no flock and orbax takes no lock on its directory. The lease is
created only where none exists (ifGenerationMatch=0: of two jobs starting at once, one wins), names
its holder and when it expires, is renewed every RENEW_S conditional on the generation written last
(a job that took it over is never overwritten) and deleted on exit. An expired lease (its holder was
killed) is deleted, that generation only, and taken.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time

LEASE_S = 300.0  # a holder silent for this long is gone
RENEW_S = 60.0


class Held(Exception):
    """The lease is held by another job; the message says by whom."""


def _split(url: str) -> tuple[str, str]:
    bucket, _, key = url.split("://", 1)[1].partition("/")
    return bucket, key


def _upload(fs, url: str, body: bytes, generation: int) -> int:
    """Writes `body` at `url` only where its generation is `generation` (0: only where absent);
    returns the new generation; FileExistsError where the precondition fails. gcsfs's own
    pipe_file conditions only on absence, not on a generation."""
    bucket, key = _split(url)
    reply = fs.call(
        "POST", f"{fs._location}/upload/storage/v1/b/{{}}/o", bucket, uploadType="media", name=key,
        data=body, json_out=True, ifGenerationMatch=str(generation),
    )  # fmt: skip
    return int(reply.get("generation") or 0)


def _read(fs, url: str) -> tuple[dict, int] | None:
    """(the lease's fields, its generation), None where there is none: one GET, whose
    x-goog-generation header says which generation the body is."""
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
    """The lease at `url`, taken by acquire(), renewed in the background, released by release()."""

    def __init__(self, url: str, job: int, warn=print):
        import gcsfs

        self.url, self.job, self.warn = url, job, warn
        self.token, self.generation = secrets.token_hex(8), 0
        self._stop, self._thread = threading.Event(), None
        self._fs = gcsfs.GCSFileSystem()  # epath's instance: the same endpoint and credentials

    def _body(self) -> bytes:
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        return (
            f"pid {os.getpid()} on {socket.gethostname()} since {since}\njob {self.job}\n"
            f"token {self.token}\nexpires {time.time() + LEASE_S:.0f}\n"
        ).encode()

    def acquire(self) -> None:
        """Takes the lease, or raises Held naming its holder."""
        found = _read(self._fs, self.url)
        if found is not None:
            expires = float(found[0].get("expires", "0") or 0)
            if expires > time.time():
                left = f"its lease runs until {time.strftime('%H:%M:%S', time.localtime(expires))}"
                raise Held(f"{_holder(found)}; {left}")
            try:  # expired: only that generation is removed
                self._fs.call("DELETE", "b/{}/o/{}", *_split(self.url), ifGenerationMatch=str(found[1]))
            except FileNotFoundError:
                pass
            except OSError as e:
                raise Held("a job that renewed or took over the expired lease meanwhile") from e
        try:
            _upload(self._fs, self.url, self._body(), 0)
        except FileExistsError:
            raise Held(_holder(_read(self._fs, self.url))) from None
        # Read back: a store that ignores preconditions still shows which job wrote last.
        found = _read(self._fs, self.url)
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
                self.warn(f"warning: {self.url}: another job took over this run's lease; stop one of them")
                return
            except Exception as e:  # noqa: BLE001 - a network error: try again at the next renewal
                self.warn(f"warning: {self.url}: could not renew the lease ({type(e).__name__}: {e})")

    def release(self) -> None:
        """Stops renewing and deletes the lease, unless another job holds it now."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        found = _read(self._fs, self.url)
        if found is not None and found[0].get("token") == self.token:
            try:
                self._fs.call("DELETE", "b/{}/o/{}", *_split(self.url), ifGenerationMatch=str(found[1]))
            except OSError:
                pass  # renewed or taken over meanwhile: not ours to delete
