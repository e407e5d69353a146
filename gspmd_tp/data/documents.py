"""A user's data files: config.data's globs matched (~ expanded, the run's workdir left out) and
the matches checked (directories, pipes, broken links, extensions), then read as documents: a .txt
file is one, a .jsonl file one per non-blank line's text field, a parquet file (shards only:
python -m gspmd_tp.data.prepare) one per row's text column.

Documents are (name, bytes); data.py splits, packs and batches them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import json
import os
from pathlib import Path

from gspmd_tp.job.errors import UserError
from gspmd_tp.storage import paths


def absolute_patterns(patterns: str) -> str:
    """Comma-separated file patterns made absolute, so that a saved run's data is found from any
    working directory and one file spelled two ways is one run's data."""
    return ",".join(paths.absolute(p.strip()) for p in patterns.split(",") if p.strip())


def _name_under_pattern(pattern: str, path: str) -> str:
    """`path` relative to the pattern's directories before the first wildcard: the name a
    document's held-out hash reads, the same however the pattern spells those directories."""
    parts = Path(pattern).parts
    literal = []
    for part in parts[:-1]:
        if any(ch in part for ch in "*?["):
            break
        literal.append(part)
    return os.path.relpath(path, os.path.join(*literal) if literal else ".")


def _is_pattern(text: str) -> bool:
    return any(ch in text for ch in "*?[")


def _inside(path: str, directory: str | None) -> bool:
    if not directory:
        return False
    if paths.is_url(path) or paths.is_url(directory):  # a bucket has no links: the names decide
        return path == directory or path.startswith(directory.rstrip("/") + "/")
    directory = os.path.realpath(directory)
    return os.path.commonpath([os.path.realpath(path), directory]) == directory


TEXT_FILES = (".txt", ".jsonl")
SHARD_INPUTS = (".txt", ".jsonl", ".parquet")  # what the shards command reads


def matched_files(
    patterns: str, what: str, workdir: str | None = None, extensions: tuple[str, ...] = TEXT_FILES
) -> list[tuple[str, str]]:
    """(pattern, path) of every file the comma-separated globs match, in order, but for those inside
    the run's `workdir`; UserError for a glob that matches no file and for a match that is no
    readable document (of `extensions`)."""
    found = []
    # ~ as the shell would have expanded it: `--config.data.train_files=~/data/*.txt` is left as it is
    # by bash (the word is no assignment), and glob does not expand it.
    for pattern in [paths.expand(p.strip()) for p in patterns.split(",") if p.strip()]:
        matched = sorted(_glob(pattern))
        if not matched:
            raise UserError(f"config.data.{what}: no file matches {pattern!r}")
        files = []
        # The run's own metrics.jsonl is no document: a glob such as **/*.jsonl would take it from
        # the second start on, and the run (whose train_files may not change) could not resume.
        matched = [path for path in matched if not _inside(path, workdir)]
        if not matched:
            raise UserError(f"config.data.{what}: no file matches {pattern!r} outside the run's {workdir}")
        for path in matched:
            if paths.is_url(path):
                if paths.of(path).is_dir():
                    if _is_pattern(pattern):
                        continue
                    raise UserError(f"config.data.{what}: {path} is a directory; give a glob of its files")
                if not path.endswith(extensions):
                    kinds = " nor ".join(", ".join(extensions).rsplit(", ", 1))
                    raise UserError(f"config.data.{what}: {path} is neither {kinds}")
                files.append((pattern, path))
                continue
            if os.path.isdir(path):
                if _is_pattern(pattern):  # `data/**` also matches the directories it walks through
                    continue
                raise UserError(
                    f"config.data.{what}: {path} is a directory; give a glob of its files, "
                    f"e.g. {os.path.join(path, '**', '*.txt')}"
                )
            if not path.endswith(extensions):
                kinds = " nor ".join(", ".join(extensions).rsplit(", ", 1))
                raise UserError(f"config.data.{what}: {path} is neither {kinds}")
            if os.path.islink(path) and not os.path.exists(path):
                raise UserError(
                    f"config.data.{what}: {path} is a symbolic link to {os.readlink(path)}, which is missing"
                )
            if os.path.exists(path) and not os.path.isfile(path):
                # A named pipe would block the run in its first read until some other process wrote it.
                raise UserError(
                    f"config.data.{what}: {path} is not a regular file (a pipe, socket or device)"
                )
            files.append((pattern, path))
        if not files:
            raise UserError(f"config.data.{what}: {pattern!r} matches directories only, no file")
        found += files
    return found


def _glob(pattern: str) -> list[str]:
    """The paths glob `pattern` matches (`**` any depth of directories); a bucket's through fsspec,
    as URLs."""
    if not paths.is_url(pattern):
        return glob.glob(pattern, recursive=True)
    import fsspec

    paths.check_scheme(pattern, "config.data")
    fs, _ = fsspec.core.url_to_fs(pattern)
    scheme = paths.scheme(pattern)
    found = fs.glob(pattern) if _is_pattern(pattern) else ([pattern] if fs.exists(pattern) else [])
    return [p if paths.is_url(p) else f"{scheme}://{p}" for p in found]


@dataclasses.dataclass(frozen=True)
class Matches:
    """The (pattern, path) pairs that config.data.train_files and eval_files match ([] for an empty
    list): each glob walked once per start, by match(), and read by documents(), files_in_both() and
    files_matched_twice() (a walk of many files costs seconds)."""

    train: list[tuple[str, str]]
    eval: list[tuple[str, str]]


def match(data, workdir: str | None = None) -> Matches:
    """config.data's train_files and eval_files globs matched, in that order (matched_files)."""
    return Matches(
        train=matched_files(data.train_files, "train_files", workdir) if data.train_files else [],
        eval=matched_files(data.eval_files, "eval_files", workdir) if data.eval_files else [],
    )


def iter_documents(matched: list[tuple[str, str]], field: str, what: str, column: str = ""):
    """Yields (name, bytes) of the documents in matched_files' (pattern, path) pairs for
    config.data.`what`, one file read at a time: a .txt file is one, a .jsonl file one per non-blank
    line's `field` (name path:line), a .parquet file one per row's `column` (name path:row, from 0)."""
    for pattern, path in matched:
        name = _name_under_pattern(pattern, path)
        try:
            if path.endswith(".jsonl"):
                for line, text in _jsonl_documents(path, field):
                    yield f"{name}:{line}", text
            elif path.endswith(".parquet"):
                for row, text in _parquet_documents(path, column):
                    yield f"{name}:{row}", text
            else:
                yield name, paths.of(path).read_bytes()  # tokens are bytes: any encoding trains
        except OSError as e:
            raise UserError(f"config.data.{what}: cannot read {path}: {e.strerror or e}") from None


def documents(matched: list[tuple[str, str]], field: str, what: str) -> list[tuple[str, bytes]]:
    """(name, bytes) of the documents in matched_files' (pattern, path) pairs for config.data.`what`:
    a .txt file is one, a .jsonl file one per non-blank line's `field`."""
    docs = list(iter_documents(matched, field, what))
    if not docs:
        # Only .jsonl files of blank lines get here: a .txt file is a document even when empty.
        raise UserError(
            f"config.data.{what}: {_plural(len(matched), 'file')} but no document "
            f"(a .jsonl file holds one per non-blank line)"
        )
    return docs


def _not_utf8(path: str, line: int, raw: bytes, e: UnicodeDecodeError) -> UserError:
    return UserError(
        f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); re-encode it as UTF-8"
    )


def _jsonl_documents(path: str, field: str):
    """Yields (line number, text) of each non-blank line's `field`."""
    # Binary lines split on "\n" only, as editors number them (text mode also splits on a lone "\r").
    with paths.of(path).open("rb") as f:
        for i, line in enumerate(f):
            try:
                line_text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _not_utf8(path, i + 1, line, e) from None
            if i == 0:
                line_text = line_text.removeprefix("\ufeff")  # a byte order mark some editors write
            if not line_text.strip():
                continue
            try:
                value = json.loads(line_text)
            except json.JSONDecodeError:
                problem = "not valid JSON"
            except RecursionError:  # Python's parser recurses once per [ or {
                problem = "nested too deeply to parse"
            else:
                if not isinstance(value, dict):
                    problem = "not an object"
                elif field not in value:
                    problem = "no such field"
                elif not isinstance(value[field], str):  # str() would train on "None", "5", "['a']"
                    problem = f"got {json.dumps(value[field])[:40]}"
                else:
                    try:
                        text = value[field].encode("utf-8")
                    except UnicodeEncodeError as e:  # JSON may escape half a UTF-16 pair: "\ud83d"
                        raise UserError(
                            f"{path}:{i + 1}: field {field!r} holds a lone surrogate "
                            f"{json.dumps(value[field][e.start])} (half of a UTF-16 pair, no character); "
                            "remove it or give its pair"
                        ) from None
                    yield i + 1, text
                    continue
            raise UserError(
                f"{path}:{i + 1}: expected a JSON object with a string field {field!r} "
                f"(config.data.jsonl_field); {problem}"
            )


def parquet_columns(path: str) -> dict[str, str]:
    """{column name: its Arrow type} of a parquet file, read from its footer alone; UserError
    where it does not read as parquet."""
    import pyarrow.parquet as pq

    try:
        with _parquet_file(path) as source:
            schema = pq.read_schema(source)
    except Exception as e:  # pyarrow's ArrowInvalid and OSError both mean: not a parquet file we can read
        raise UserError(f"{path}: does not read as parquet: {str(e).splitlines()[0]}") from None
    return {field.name: str(field.type) for field in schema}


def _parquet_file(path: str):
    """`path` opened for pyarrow: a local file by name; a bucket's object through the path library,
    whose seeks read in ranges (the footer, then only the column asked for)."""
    return paths.of(path).open("rb") if paths.is_url(path) else contextlib.nullcontext(path)


def check_parquet_column(path: str, column: str) -> None:
    """UserError, one line, where parquet file `path` has no string column `column`
    (config.data.parquet_column)."""
    columns = parquet_columns(path)
    if column not in columns:
        raise UserError(
            f"{path}: no column {column!r} (config.data.parquet_column); its columns: "
            f"{', '.join(columns) or 'none'}"
        )
    if columns[column] not in ("string", "large_string"):
        raise UserError(
            f"{path}: column {column!r} (config.data.parquet_column) holds {columns[column]}, not strings"
        )


def _parquet_documents(path: str, column: str):
    """Yields (row, text) of each row's `column`, a batch of rows read at a time."""
    import pyarrow.parquet as pq

    check_parquet_column(path, column)
    row = 0
    with _parquet_file(path) as source:
        for batch in pq.ParquetFile(source).iter_batches(batch_size=1024, columns=[column]):
            for value in batch.column(0).to_pylist():
                if value is None:
                    raise UserError(f"{path}: row {row}: column {column!r} is null; drop the row or fill it")
                yield row, value.encode("utf-8")  # Arrow strings are UTF-8
                row += 1


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _real(path: str) -> str:
    """One spelling of a file: a local one's links resolved; a URL as it is (a bucket has no links)."""
    return path if paths.is_url(path) else os.path.realpath(path)


def files_in_both(matches: Matches) -> list[str]:
    """Real paths of the files that config.data.train_files and eval_files both match (a held-out
    loss measured on text the run trains on); [] without eval_files."""
    held = {_real(path) for _, path in matches.eval}
    return sorted({_real(path) for _, path in matches.train} & held)


def files_matched_twice(matches: Matches) -> list[str]:
    """Real paths of the files that config.data.train_files' globs match more than once (read, and
    trained on, as many times: `data/*.txt,data/**/*.txt` matches data/a.txt twice, since ** also
    matches no directory)."""
    counts = collections.Counter(_real(path) for _, path in matches.train)
    return sorted(path for path, n in counts.items() if n > 1)
