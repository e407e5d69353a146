"""Shards (data/prepare.py writes, data/shards.py reads): the in-memory pipeline's tokens read back
from disk, parquet and jsonl inputs, the bad-input lines, and the data position across process
counts. A run on shards resuming on another mesh: tests/train/test_resume.py."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import child_env, data_config, write

from gspmd_tp.data import pipeline, prepare, tokenizer
from gspmd_tp.job.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _corpus(tmp_path, docs: int = 40) -> str:
    """A .jsonl of `docs` documents and two .txt files; returns the train_files glob."""
    lines = [
        json.dumps({"text": f"document {i}: " + "lorem ipsum dolor " * (i % 7 + 1)}) for i in range(docs)
    ]
    write(tmp_path / "in" / "docs.jsonl", "\n".join(lines) + "\n")
    write(tmp_path / "in" / "a.txt", "def f(x):\n    return x + 1\n" * 5)
    write(tmp_path / "in" / "b.txt", "héllo wörld\n" * 9)
    return str(tmp_path / "in" / "*")


@pytest.mark.parametrize("tok", ["bytes", "bpe"])
def test_shards_read_back_the_in_memory_pipelines_tokens(tmp_path, tok, request):
    spec = request.getfixturevalue("bpe_path") if tok == "bpe" else "bytes"
    data = data_config(train_files=_corpus(tmp_path), eval_fraction=0.2, tokenizer=spec)
    # Records of 7 tokens, 3 to a file: windows straddle records, and records straddle files.
    meta = prepare.prepare(data, str(tmp_path / "shards"), chunk_tokens=7, records_per_file=3)
    assert len(meta["splits"]["train"]["files"]) > 1
    want_train, want_held = pipeline.load_corpus(data)
    read = data_config(shards=str(tmp_path / "shards"), tokenizer=spec)
    got_train, got_held = pipeline.load_corpus(read)
    for got, want in ((got_train, want_train), (got_held, want_held)):
        assert got.dtype == want.dtype == tokenizer.load(spec).dtype
        np.testing.assert_array_equal(got[0 : len(got)], want)
        assert pipeline.fingerprint(got) == pipeline.fingerprint(want)
        for start, stop in ((0, 1), (6, 8), (13, 29), (len(want) - 3, len(want) + 5)):
            np.testing.assert_array_equal(got[start:stop], want[start:stop])
    # The same batches, and the same held-out bytes for evaluate's bits per byte.
    a = iter(pipeline.train_dataset(want_train, 16, 4, 0))
    b = iter(pipeline.train_dataset(got_train, 16, 4, 0))
    for _ in range(3):
        np.testing.assert_array_equal(next(a)["tokens"], next(b)["tokens"])
    assert pipeline.held_out(read)[1] == pipeline.held_out(data)[1]


def _parquet(path, rows: dict) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows), str(path), row_group_size=3)
    return str(path)


def test_parquet_rows_are_documents_of_the_named_column(tmp_path):
    bodies = [f"row {i} " * (i + 1) for i in range(10)]
    _parquet(tmp_path / "in" / "t.parquet", {"id": list(range(10)), "body": bodies})
    held = write(tmp_path / "held.jsonl", '{"text": "held out text"}\n')
    data = data_config(train_files=str(tmp_path / "in" / "*.parquet"), eval_files=held, parquet_column="body")
    meta = prepare.prepare(data, str(tmp_path / "shards"), chunk_tokens=16)
    assert meta["splits"]["train"]["documents"] == 10
    train, held_tokens = pipeline.load_corpus(data_config(shards=str(tmp_path / "shards")))
    tok = tokenizer.BYTE_TOKENIZER
    np.testing.assert_array_equal(train[:], np.concatenate([tok.document(b.encode()) for b in bodies]))
    np.testing.assert_array_equal(held_tokens[:], tok.document(b"held out text"))


def test_a_missing_parquet_column_is_one_line_before_anything_is_written(tmp_path):
    _parquet(tmp_path / "in" / "t.parquet", {"id": [1, 2], "body": ["a", "b"]})
    out = tmp_path / "shards"
    data = data_config(
        train_files=str(tmp_path / "in" / "t.parquet"), eval_files=str(tmp_path / "in" / "t.parquet")
    )
    with pytest.raises(
        UserError,
        match=r"t\.parquet: no column 'text' \(config\.data\.parquet_column\); its columns: id, body",
    ):
        prepare.prepare(data, str(out))
    assert not out.exists() and os.listdir(tmp_path) == ["in"]
    # The command: the same line on stderr, status 1, nothing written.
    result = subprocess.run(
        [sys.executable, "-m", "gspmd_tp.data.prepare", "--config=configs/tiny.py", f"--out={out}",
         f"--config.data.train_files={tmp_path / 'in' / 't.parquet'}", "--config.data.parquet_column=body2"],
        cwd=ROOT, capture_output=True, text=True, env=child_env(), timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'in' / 't.parquet'}: no column 'body2' (config.data.parquet_column); "
        "its columns: id, body"
    ]
    assert not out.exists()


def test_shards_of_another_tokenizer_are_one_line(tmp_path, bpe_path):
    data = data_config(train_files=_corpus(tmp_path), eval_fraction=0.2)
    prepare.prepare(data, str(tmp_path / "shards"))
    with pytest.raises(
        UserError, match=r"was made with tokenizer bytes; config\.data\.tokenizer is .*tokenizer\.json"
    ):
        pipeline.load_corpus(data_config(shards=str(tmp_path / "shards"), tokenizer=bpe_path))
    with pytest.raises(UserError, match=r"leave config\.data\.train_files empty"):
        pipeline.load_corpus(data_config(shards=str(tmp_path / "shards"), train_files=data.train_files))
    with pytest.raises(UserError, match=r"no shards\.json in it"):
        pipeline.load_corpus(data_config(shards=str(tmp_path)))
    with pytest.raises(UserError, match=r"exists and is not an empty directory"):
        prepare.prepare(data, str(tmp_path / "shards"))


def test_a_position_in_shards_resumes_on_another_process_count(tmp_path):
    """Two processes (each reading its half of every batch from disk) stop; one process resumes:
    the examples are the in-memory pipeline's, uninterrupted."""
    data = data_config(train_files=_corpus(tmp_path), eval_fraction=0.2)
    prepare.prepare(data, str(tmp_path / "shards"), chunk_tokens=32)
    train, _ = pipeline.load_corpus(data_config(shards=str(tmp_path / "shards")))
    want = iter(pipeline.train_dataset(pipeline.load_corpus(data)[0], 8, 8, 0))
    halves = [iter(pipeline.train_dataset(train, 8, 8, 0, (first, 4))) for first in (0, 4)]
    for _ in range(3):
        batch = next(want)
        got = [next(it) for it in halves]
        np.testing.assert_array_equal(np.concatenate([g["tokens"] for g in got]), batch["tokens"])
    state = halves[0].get_state()
    assert state == halves[1].get_state() == {"next_example": 24}
    alone = iter(pipeline.train_dataset(train, 8, 8, 0))
    alone.set_state(state)
    for _ in range(3):
        np.testing.assert_array_equal(next(alone)["tokens"], next(want)["tokens"])
