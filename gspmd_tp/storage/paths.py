"""Paths as typed: local or a bucket URL (gs://BUCKET/...), through etils.epath (orbax's, fsspec
below it). A leading `~` is expanded in every path flag: bash leaves `--workdir=~/x` as it is.
Endpoint and credentials are the storage clients' standard variables (docs/storage.md). No jax
import here, so entry points can read their flags first.
"""

from __future__ import annotations

import json
import os

# The URL schemes epath handles, and the fsspec client each needs (gcsfs is a dependency).
CLIENTS = {"gs": "gcsfs", "s3": "s3fs", "az": "adlfs"}
GCS_ENDPOINT = "https://storage.googleapis.com"


def scheme(path: str) -> str | None:
    """The URL scheme of `path` ("gs" for gs://b/x), None for a local path."""
    head, sep, _ = path.partition("://")
    return head.lower() if sep and head and "/" not in head else None


def is_url(path: str | None) -> bool:
    """Whether `path` names a bucket (or any URL) rather than a local file."""
    return bool(path) and scheme(path) is not None


def expand(path: str | None) -> str | None:
    """`path` with a leading `~` or `~USER` made that home directory; a URL, None and "" as they are."""
    return os.path.expanduser(path) if path and not is_url(path) else path


def absolute(path: str) -> str:
    """A local `path` made absolute (`~` expanded); a URL without its trailing slashes."""
    if is_url(path):
        return path.rstrip("/") if path.rstrip("/").count("/") > 2 else path
    return os.path.abspath(os.path.expanduser(path))


def of(path: str):
    """`path` as an epath.Path (local or in a bucket); UserError for a URL scheme it does not handle."""
    from etils import epath

    check_scheme(path)
    return epath.Path(path)


def check_scheme(path: str, flag: str = "") -> None:
    """UserError unless `path` is local or a URL whose scheme epath handles, its client installed."""
    import importlib.util

    from gspmd_tp.job.errors import UserError

    kind = scheme(path)
    if kind is None:
        return
    where = f"{flag}={path}" if flag else path
    if kind not in CLIENTS:
        raise UserError(
            f"{where}: the path library does not handle {kind}:// URLs; give a local path or a bucket "
            "URL (gs://BUCKET/PATH)"
        )
    if importlib.util.find_spec(CLIENTS[kind]) is None:
        raise UserError(f"{where}: {kind}:// needs the Python package {CLIENTS[kind]}; pip install it")
    _configure_gcsfs()


def endpoint() -> str:
    """The GCS endpoint the clients use: STORAGE_EMULATOR_HOST where set, else Google's."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if host and "://" not in host:
        host = f"http://{host}"
    return host or GCS_ENDPOINT


def _configure_gcsfs() -> None:
    """Defaults for gcsfs where the user set none, before its first instance. No cached listings:
    tensorstore and the other hosts write past this process's gcsfs, so a cached listing would miss
    steps. Another endpoint than Google's has no storage-control API: gcsfs's zonal-bucket probe
    would warn on every bucket."""
    import fsspec.config

    fsspec.config.conf.setdefault("gs", {}).setdefault("use_listings_cache", False)
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def bucket_of(path: str) -> str:
    """The bucket a URL names (`b` of gs://b/x)."""
    return path.split("://", 1)[1].split("/", 1)[0]


def check_bucket(path: str, flag: str) -> None:
    """UserError where the bucket of URL `path` cannot be used (scheme, credentials, endpoint,
    refusal, no such bucket), found by reading only. A local path passes."""
    from gspmd_tp.job.errors import UserError

    check_scheme(path, flag)
    if not is_url(path):
        return
    where, bucket = f"{flag}={path}", bucket_of(path)
    if scheme(path) != "gs":
        return  # other schemes are checked by their client on first use
    if not bucket:
        raise UserError(f"{where}: no bucket named (gs://BUCKET/PATH)")
    try:
        token = _access_token()
    except Exception as e:  # noqa: BLE001 - DefaultCredentialsError, RefreshError, a transport error
        raise UserError(
            f"{where}: no usable credentials for {endpoint()} ({_first_line(e)}); run `gcloud auth "
            "application-default login`, set GOOGLE_APPLICATION_CREDENTIALS, or run on a machine with a "
            "service account"
        ) from None
    status, why = _probe(f"{endpoint()}/storage/v1/b/{bucket}", token)
    if status == 404:
        raise UserError(f"{where}: bucket {bucket} does not exist at {endpoint()}")
    if status in (401, 403):
        raise UserError(f"{where}: {endpoint()} refused the credentials for bucket {bucket} ({why})")
    if status != 200:
        raise UserError(f"{where}: cannot reach {endpoint()} for bucket {bucket} ({why})")


def _probe(url: str, token: str) -> tuple[int, str]:
    """(HTTP status, why) of one GET of `url` (0: no answer). Not through gcsfs, which retries a
    refused connection for half a minute."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=15) as reply:
            return reply.status, ""
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        return e.code, f"HTTP {e.code}: {message}"
    except (OSError, ValueError) as e:
        return 0, _first_line(getattr(e, "reason", None) or e)


def _access_token() -> str:
    """The storage clients' bearer token: GOOGLE_AUTH_TOKEN_FOR_TESTING, else Application Default
    Credentials' (refreshed: an expired or revoked one raises)."""
    token = os.environ.get("GOOGLE_AUTH_TOKEN_FOR_TESTING")
    if token:
        return token
    import google.auth
    import google.auth.transport.requests

    credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/devstorage.read_only"])
    credentials.refresh(google.auth.transport.requests.Request())
    return credentials.token


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def move(source: str, target: str) -> None:
    """Moves file or directory `source` to `target` (a bucket's: copied, then removed)."""
    if is_url(source) or is_url(target):
        import fsspec

        fs, _ = fsspec.core.url_to_fs(source if is_url(source) else target)
        fs.mv(source, target, recursive=True)
        return
    import shutil

    shutil.move(source, target)


def cache_root() -> str:
    """The project's local cache: $XDG_CACHE_HOME (or ~/.cache) /gspmd_tp."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gspmd_tp")


def local_copy(path: str) -> str:
    """`path` where a library that opens only local files (tokenizers, safetensors, yaml) can read it:
    a local path as it is; a URL's object, or the objects directly inside a URL's directory, copied
    into cache_root()/copies/SCHEME/BUCKET/PATH, each fetched again only where its size changed.
    A URL that names nothing gives a path that does not exist, for the caller's own message."""
    if not is_url(path):
        return expand(path)
    source = of(path)
    local = os.path.join(cache_root(), "copies", scheme(path), path.split("://", 1)[1].rstrip("/"))
    files = [source] if source.is_file() else []
    if source.is_dir():
        files = [p for p in source.iterdir() if p.is_file()]
    for file in files:
        target = local if file == source else os.path.join(local, file.name)
        if os.path.isfile(target) and os.path.getsize(target) == file.stat().length:
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        file.copy(target + ".partial", overwrite=True)  # a copy cut short is never taken for the file
        os.replace(target + ".partial", target)
    return local
