"""Corpora tokenized once into shards on disk (python -m gspmd_tp.data.prepare writes them), read
back with random access (config.data.shards).

A shards directory holds each split's packed token stream (train, held_out: the streams
pipeline.load_corpus makes from the same files) cut into records of `chunk_tokens` tokens, in
ArrayRecord files written with group_size 1 (each record its own compressed chunk, so one reads
alone) and read through grain's ArrayRecordDataSource; and shards.json, which records the
tokenizer, the token dtype and each split's files, sizes and fingerprint. A window of seq_len + 1
tokens reads only the records it overlaps: each process reads its own rows of each batch, and holds
no more than the records in flight, however large the corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading

import numpy as np

from gspmd_tp.data import tokenizer as tokenizer_lib
from gspmd_tp.job.errors import UserError
from gspmd_tp.storage import paths as paths_lib

META = "shards.json"
FORMAT = 1
SPLITS = ("train", "held_out")
# Each record compressed alone (zstd, ArrayRecord's default): a random read decodes one record.
WRITER_OPTIONS = "group_size:1"


class SplitWriter:
    """Appends a split's documents (token arrays) to ArrayRecord files of `records_per_file` records
    of `chunk_tokens` tokens each (the last one shorter), hashing the stream as pipeline.fingerprint."""

    def __init__(self, directory: str, split: str, dtype, chunk_tokens: int, records_per_file: int):
        self.directory, self.split, self.dtype = directory, split, np.dtype(dtype)
        self.chunk_tokens, self.records_per_file = chunk_tokens, records_per_file
        self.files: list[str] = []
        self.documents = self.tokens = self.records = self.text_bytes = 0
        self._sha = hashlib.sha256()
        self._pending: list[np.ndarray] = []
        self._pending_tokens = 0
        self._writer = None
        self._in_file = 0

    def add(self, ids: np.ndarray, text_bytes: int) -> None:
        """Appends one document's ids (separator included) and counts its `text_bytes`."""
        ids = np.asarray(ids, self.dtype)
        self.documents += 1
        self.text_bytes += text_bytes
        self.tokens += len(ids)
        self._sha.update(ids.tobytes())
        self._pending.append(ids)
        self._pending_tokens += len(ids)
        if self._pending_tokens >= self.chunk_tokens:
            self._flush(final=False)

    def _flush(self, final: bool) -> None:
        stream = np.concatenate(self._pending) if self._pending else np.zeros(0, self.dtype)
        whole = len(stream) if final else len(stream) // self.chunk_tokens * self.chunk_tokens
        for start in range(0, whole, self.chunk_tokens):
            self._write(stream[start : min(start + self.chunk_tokens, whole)].tobytes())
        self._pending = [stream[whole:]] if whole < len(stream) else []
        self._pending_tokens = len(stream) - whole

    def _write(self, record: bytes) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter

        if self._writer is None or self._in_file == self.records_per_file:
            self._close_file()
            name = f"{self.split}-{len(self.files):05d}.array_record"
            self._writer = ArrayRecordWriter(os.path.join(self.directory, name), WRITER_OPTIONS)
            self.files.append(name)
        self._writer.write(record)
        self._in_file += 1
        self.records += 1

    def _close_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer, self._in_file = None, 0

    def close(self) -> dict:
        """Writes what is left and returns the split's entry in shards.json."""
        self._flush(final=True)
        self._close_file()
        return {
            "files": self.files,
            "records": self.records,
            "documents": self.documents,
            "tokens": self.tokens,
            "text_bytes": self.text_bytes,
            "sha256": self._sha.hexdigest()[:16],  # pipeline.fingerprint's digest of the same stream
        }


def read_meta(directory: str) -> dict:
    """shards.json of a shards directory (config.data.shards); UserError, one line, where it is
    missing, unreadable or of another format, or a file it lists is missing."""
    where = f"config.data.shards={directory}"
    paths_lib.check_bucket(directory, "config.data.shards")
    path = os.path.join(directory, META)
    if not paths_lib.of(path).is_file():
        what = "no such directory" if not paths_lib.of(directory).is_dir() else f"no {META} in it"
        raise UserError(f"{where}: {what}; make shards with python -m gspmd_tp.data.prepare")
    try:
        meta = json.loads(paths_lib.of(path).read_text())
        fmt = meta["format"]
        splits = {split: meta["splits"][split] for split in SPLITS}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{where}: {META} does not read ({type(e).__name__}: {e})") from None
    if fmt != FORMAT:
        raise UserError(f"{where}: shards of format {fmt}, this version reads format {FORMAT}")
    for split, entry in splits.items():
        missing = [f for f in entry["files"] if not paths_lib.of(os.path.join(directory, f)).is_file()]
        if missing:
            raise UserError(f"{where}: {split} file {missing[0]} is missing; make the shards again")
    return meta


def check_tokenizer(meta: dict, tok: tokenizer_lib.Tokenizer, directory: str) -> None:
    """UserError where the shards were made with another tokenizer than `tok` (the run's
    config.data.tokenizer): their ids would mean other text."""
    made = meta["tokenizer"]
    if made["digest"] != tok.digest:
        now = "bytes" if tok.kind == tokenizer_lib.BYTES else f"{tok.spec} (sha256 {tok.digest})"
        then = (
            "bytes" if made["digest"] == tokenizer_lib.BYTES else f"{made['spec']} (sha256 {made['digest']})"
        )
        raise UserError(
            f"config.data.shards={directory} was made with tokenizer {then}; config.data.tokenizer is "
            f"{now}: set config.data.tokenizer to the shards' tokenizer, or make shards with the run's"
        )


# Bytes of shard files in a bucket that one process holds on local disk at once (GSPMD_TP_SHARD_CACHE_MB).
CACHE_MB = 4096
# ArrayRecord's options for random reads: no readahead, no reader threads.
RANDOM_ACCESS = "readahead_buffer_size:0,max_parallelism:0"


def cache_bytes() -> int:
    """The local-disk budget of shard files fetched from a bucket: $GSPMD_TP_SHARD_CACHE_MB MiB (default
    CACHE_MB); UserError, one line, where the variable is not a positive number."""
    text = os.environ.get("GSPMD_TP_SHARD_CACHE_MB", str(CACHE_MB))
    try:
        mb = float(text)
    except ValueError:
        mb = -1.0
    if not mb > 0:
        raise UserError(f"GSPMD_TP_SHARD_CACHE_MB={text}: give a number of MiB above 0")
    return int(mb * 2**20)


class BucketRecords:
    """The records of a split's ArrayRecord files in a bucket, read by index as grain's data source is.

    ArrayRecord's reader opens local files only (array_record 0.8.6 takes a path and reads it through
    riegeli's file descriptor reader), so a file is fetched whole the first time one of its records is
    read, into a private file under the cache directory that is unlinked as soon as the reader has
    opened it: the disk it takes is freed when the reader closes, by eviction or by the process ending
    however it ends, and no other process sees it. Files stay open least recently read first out,
    within `budget` bytes (always the file being read). The first file is opened at once: prepare's
    writer gives every file but the last its record count. A file whose count does not fit shards.json
    raises UserError when it is opened.
    """

    def __init__(self, urls: list[str], records: int, budget: int, where: str):
        self.urls, self.records, self.budget, self.where = urls, records, budget, where
        self.fetches = 0  # files fetched so far (a file read again after eviction counts again)
        self._open: dict[int, tuple[object, int]] = {}  # file index -> (reader, size), oldest first
        self._lock = threading.Lock()  # the pipeline's read-ahead thread and the caller both read
        # prepare's writer fills every file but the last with the same count: the first file's.
        self.per_file = None
        self._reader(0)

    def __len__(self) -> int:
        return self.records

    def __getitem__(self, record: int) -> bytes:
        f, i = divmod(int(record), self.per_file)
        with self._lock:
            return self._reader(f).read([i])[0]

    def _reader(self, f: int):
        if f in self._open:
            self._open[f] = self._open.pop(f)  # most recently read last
            return self._open[f][0]
        import fsspec
        from array_record.python.array_record_module import ArrayRecordReader

        url = self.urls[f]
        fs, _ = fsspec.core.url_to_fs(url)
        size = fs.info(url)["size"]
        while self._open and sum(s for _, s in self._open.values()) + size > self.budget:
            reader, _ = self._open.pop(next(iter(self._open)))
            reader.close()
        os.makedirs(cache := os.path.join(paths_lib.cache_root(), "shards"), exist_ok=True)
        fd, local = tempfile.mkstemp(suffix=".array_record", dir=cache)
        try:
            os.close(fd)
            fs.get_file(url, local)
            reader = ArrayRecordReader(local, RANDOM_ACCESS)
        finally:
            os.unlink(local)
        self.fetches += 1
        n, found = len(self.urls), reader.num_records()
        if self.per_file is None:
            # prepare's writer fills every file but the last with the same count: the first file's.
            self.per_file = found if n > 1 else self.records
        want = min(self.per_file, self.records - f * self.per_file)
        if found != want or not self.per_file * (n - 1) < self.records <= self.per_file * n:
            reader.close()
            raise UserError(
                f"{self.where}: {url} holds {found} records, which does not fit the {self.records} "
                f"records in {n} file(s) that {META} lists; make the shards again"
            )
        self._open[f] = (reader, size)
        return reader

    def close(self) -> None:
        """Closes the open files (their local copies are gone with them)."""
        with self._lock:
            for reader, _ in self._open.values():
                reader.close()
            self._open.clear()


class ShardedTokens:
    """One split's token stream in a shards directory, read as a 1-D array is: len(), dtype and
    slices [a:b], each read from the records it overlaps (np.ndarray of dtype)."""

    def __init__(self, directory: str, split: str, meta: dict):
        entry = meta["splits"][split]
        self.directory, self.split = directory, split
        self.dtype = np.dtype(meta["dtype"])
        self.chunk_tokens = int(meta["chunk_tokens"])
        self.text_bytes = int(entry["text_bytes"])
        self._fingerprint = {"tokens": int(entry["tokens"]), "sha256": entry["sha256"]}
        self._source = None
        if entry["files"]:
            paths = [os.path.join(directory, f) for f in entry["files"]]
            where = f"config.data.shards={directory}"
            if paths_lib.is_url(directory):
                self._source = BucketRecords(paths, int(entry["records"]), cache_bytes(), where)
            else:
                import grain

                self._source = grain.sources.ArrayRecordDataSource(paths)
        found = len(self._source) if self._source is not None else 0
        if found != entry["records"]:
            raise UserError(
                f"config.data.shards={directory}: the {split} files hold {found} records, {META} says "
                f"{entry['records']}; make the shards again"
            )

    def __len__(self) -> int:
        return self._fingerprint["tokens"]

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("ShardedTokens reads contiguous slices only")
        if stop <= start:
            return np.zeros(0, self.dtype)
        first, last = start // self.chunk_tokens, (stop - 1) // self.chunk_tokens
        records = [np.frombuffer(self._source[r], self.dtype) for r in range(first, last + 1)]
        tokens = records[0] if len(records) == 1 else np.concatenate(records)
        offset = first * self.chunk_tokens
        return tokens[start - offset : stop - offset]

    def fingerprint(self) -> dict:
        """pipeline.fingerprint of the stream, as recorded when the shards were made."""
        return dict(self._fingerprint)


def open_splits(directory: str, tok: tokenizer_lib.Tokenizer) -> tuple[ShardedTokens, ShardedTokens]:
    """(train, held_out) token streams of the shards in `directory`, made with tokenizer `tok`."""
    meta = read_meta(directory)
    check_tokenizer(meta, tok, directory)
    return ShardedTokens(directory, "train", meta), ShardedTokens(directory, "held_out", meta)
