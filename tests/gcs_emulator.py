"""python tests/gcs_emulator.py start --in-memory ...: gcp-storage-emulator, made to answer as GCS
does where the code under test relies on it. A download carries the object's generation in
x-goog-generation (tensorstore's OCDBT conditions its next manifest write on it; without it the
write fails with "Malformed StorageGeneration"), and an upload or delete with ifGenerationMatch is
refused with 412 where the object's generation differs (0: where it exists), as GCS refuses it."""

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


storage_lib.Storage.create_file = _create_checked
objects.download = _download_with_generation
objects.insert = _conditional(objects.insert)
objects.delete = _conditional(_delete_checked)

from gcp_storage_emulator.__main__ import main  # noqa: E402 - after the handlers are replaced

if __name__ == "__main__":
    sys.exit(main())
