"""The lock of a run directory in a bucket: a lease object, gs://.../train.lock.

A bucket has no flock. The lease is an object created only where none exists (the upload's
ifGenerationMatch=0 precondition: of two jobs starting at once, the bucket lets one create it), that
names its holder and the time it expires. The holder renews it every RENEW_S from a thread, each
write conditional on the generation it wrote last, so a job that took it over is never overwritten;
it deletes it on exit. A job that finds an unexpired lease stops before it reads or writes; one that
finds an expired lease (its holder was killed, or lost its host) deletes that generation and
creates its own. docs/storage.md says what this protects and what not.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time

LEASE_S = 300.0  # a holder silent for this long is gone
RENEW_S = 60.0


class Held(Exception):
    """The lease is held by another job; the message says by whom."""


def _fs():
    import gcsfs

    return gcsfs.GCSFileSystem()  # epath's instance: the same endpoint and credentials


def _split(url: str) -> tuple[str, str]:
    bucket, _, key = url.split("://", 1)[1].partition("/")
    return bucket, key


def _upload(fs, url: str, body: bytes, generation: int) -> int:
    """Writes `body` at `url` only where its generation is `generation` (0: only where absent);
    returns the new generation. FileExistsError where the precondition fails."""
    bucket, key = _split(url)
    boundary = "==gspmd_tp=="
    meta = json.dumps({"name": key})
    data = (
        (
            f"--{boundary}\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n--{boundary}\n"
            f"Content-Type: text/plain\n\n"
        ).encode()
        + body
        + f"\n--{boundary}--".encode()
    )
    reply = fs.call(
        "POST",
        f"{fs._location}/upload/storage/v1/b/{{}}/o",
        bucket,
        uploadType="multipart",
        headers={"Content-Type": f'multipart/related; boundary="{boundary}"'},
        data=data,
        json_out=True,
        ifGenerationMatch=str(generation),
    )
    return int(reply.get("generation") or 0)


def _read(fs, url: str) -> tuple[dict, int] | None:
    """(the lease's fields, its generation), None where there is none."""
    bucket, key = _split(url)
    try:  # one request: the body and the generation it is of (GCS sends it in x-goog-generation)
        headers, body = fs.call("GET", "b/{}/o/{}", bucket, key, alt="media")
    except FileNotFoundError:
        return None
    fields = dict(line.split(" ", 1) for line in body.decode(errors="replace").splitlines() if " " in line)
    return fields, int(headers.get("x-goog-generation") or 0)


def _delete(fs, url: str, generation: int) -> None:
    bucket, key = _split(url)
    kw = {"ifGenerationMatch": str(generation)} if generation else {}
    fs.call("DELETE", "b/{}/o/{}", bucket, key, **kw)


def _holder(fields: dict) -> str:
    return f"pid {fields['pid']}" if "pid" in fields else "a job that has not said which"


class Lease:
    """The lease at `url`, taken by acquire(), renewed in the background, released by release()."""

    def __init__(self, url: str, job: int, warn=print):
        self.url, self.job, self.warn = url, job, warn
        self.token = secrets.token_hex(8)
        self.generation = 0
        self._stop = threading.Event()
        self._thread = None
        self._fs = _fs()

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
            fields, generation = found
            expires = float(fields.get("expires", "0") or 0)
            if expires > time.time():
                left = f"its lease runs until {time.strftime('%H:%M:%S', time.localtime(expires))}"
                raise Held(f"{_holder(fields)}; {left}")
            try:  # expired: its holder is gone; only that generation is removed
                _delete(self._fs, self.url, generation)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise Held("a job that renewed or took over the expired lease meanwhile") from e
        try:
            self.generation = _upload(self._fs, self.url, self._body(), 0)
        except FileExistsError:
            found = _read(self._fs, self.url)
            raise Held(_holder(found[0]) if found else "a job that started at the same moment") from None
        # Read back: a store that ignores preconditions still shows which job wrote last.
        found = _read(self._fs, self.url)
        if found is None or found[0].get("token") != self.token:
            raise Held(_holder(found[0]) if found else "a job that started at the same moment")
        self.generation = found[1] or self.generation
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
                _delete(self._fs, self.url, found[1])
            except OSError:
                pass  # renewed or taken over meanwhile: not ours to delete
