"""python tests/gcs_emulator.py start --in-memory ...: gcp-storage-emulator, made to answer as GCS
does where the code under test relies on it. A download carries the object's generation in
x-goog-generation (tensorstore's OCDBT conditions its next manifest write on it; without it the
write fails with "Malformed StorageGeneration"), and an upload or delete with ifGenerationMatch is
refused with 412 where the object's generation differs (0: where it exists), as GCS refuses it.
An object is moved within its bucket by `POST .../o/SOURCE/moveTo/o/TARGET`, as GCS moves it (gcsfs's
mv calls it first; without it each object's move waits out gcsfs's retries, about a second each)."""

import re
import sys
from http import HTTPStatus

from gcp_storage_emulator import storage as storage_lib
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_condition = {}  # the request being served (the server serves one at a time): its ifGenerationMatch


class _PreconditionFailed(Exception):
    pass


def _generation(storage, bucket, name) -> int:
    try:
        return int(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        return 0


def _check(storage, bucket, name) -> None:
    want = _condition.get("match")
    if want is not None and _generation(storage, bucket, name) != int(want):
        raise _PreconditionFailed


def _conditional(handler):
    def serve(request, response, storage, *args, **kwargs):
        _condition["match"] = (request.query.get("ifGenerationMatch") or [None])[0]
        try:
            return handler(request, response, storage, *args, **kwargs)
        except _PreconditionFailed:
            response.status = HTTPStatus.PRECONDITION_FAILED
        finally:
            _condition.clear()

    return serve


_create_file = storage_lib.Storage.create_file


def _create_checked(self, bucket_name, file_name, content, file_obj, file_id=None):
    _check(self, bucket_name, file_name)
    return _create_file(self, bucket_name, file_name, content, file_obj, file_id)


_download = objects.download


def _download_with_generation(request, response, storage, *args, **kwargs):
    try:
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = str(obj["generation"])
        response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
    except NotFound:
        pass
    return _download(request, response, storage, *args, **kwargs)


_delete = objects.delete


def _delete_checked(request, response, storage, *args, **kwargs):
    _check(storage, request.params["bucket_name"], request.params["object_id"])
    return _delete(request, response, storage, *args, **kwargs)


def _move(request, response, storage, *args, **kwargs):
    """The object moved to its new name in the same bucket: its resource there, as GCS answers."""
    bucket, source = request.params["bucket_name"], request.params["object_id"]
    try:
        moved = objects._copy(
            request.base_url, storage, bucket, source, bucket, request.params["dest_object_id"]
        )
        storage.delete_file(bucket, source)
    except NotFound:
        response.status = HTTPStatus.NOT_FOUND
        return
    response.json(moved)


storage_lib.Storage.create_file = _create_checked
objects.download = _download_with_generation
objects.insert = _conditional(objects.insert)
objects.delete = _conditional(_delete_checked)

# The server's routes hold the handlers as they are when it is imported: after the replacements above.
from gcp_storage_emulator import server, settings  # noqa: E402

_MOVE = r"/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/(?P<dest_object_id>.*[^/]+)$"
server.HANDLERS = (
    *((rf"^{re.escape(prefix)}{_MOVE}", {server.POST: _move}) for prefix in (settings.API_ENDPOINT, "")),
    *server.HANDLERS,
)
from gcp_storage_emulator.__main__ import main  # noqa: E402 - after the handlers are replaced

if __name__ == "__main__":
    sys.exit(main())
