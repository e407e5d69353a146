"""Tokenize a corpus once into shards that training reads from disk (shards.py):

    python -m gspmd_tp.data.prepare --config=configs/tiny.py --out=DIR \\
        --config.data.train_files='data/*.parquet' --config.data.tokenizer=path/to/tokenizer.json
    python train.py --config=configs/tiny.py --workdir=runs/x --config.data.shards=DIR \\
        --config.data.tokenizer=path/to/tokenizer.json

The config's data keys say what to read, as train.py reads them: train_files and eval_files (.txt,
.jsonl, and here also .parquet, whose rows' text is data.parquet_column), eval_fraction,
jsonl_field, tokenizer, workers. The splits and their token streams are those the run would make
from the same files in memory. Files are read one at a time and tokenized in groups of documents;
nothing of the corpus is held whole. The shards go to DIR once complete, never partly.
"""

if __name__ == "__main__":
    from gspmd_tp.job import entry

    entry.begin()  # before jax is imported: no accelerator probe on a host without one

import json
import os
import sys
import time

from absl import flags

from gspmd_tp.cli import arguments
from gspmd_tp.cli.arguments import no_positional_arguments, parse_flags
from gspmd_tp.data import documents, pipeline, shards
from gspmd_tp.data import tokenizer as tokenizer_lib
from gspmd_tp.job.errors import UserError, interrupted
from gspmd_tp.storage import outputs, paths

CHUNK_TOKENS = 8192  # tokens per record: a window of up to ~8K tokens reads one or two records
RECORDS_PER_FILE = 16384  # 128M tokens per file (256 MiB of uint16)
GROUP_BYTES = 16 << 20  # text tokenized at a time (by data.workers processes where > 0)


def _inputs(data, what: str) -> list[tuple[str, str]]:
    """config.data.`what`'s files, their parquet columns checked (before anything is written)."""
    matched = documents.matched_files(data[what], what, extensions=documents.SHARD_INPUTS)
    for _, path in matched:
        if path.endswith(".parquet"):
            documents.check_parquet_column(path, data.parquet_column)
    return matched


def _documents(data, train: list, held: list):
    """Yields (split, text) of every document, in the order pipeline.split_documents keeps."""
    if train:
        source = documents.iter_documents(train, data.jsonl_field, "train_files", data.parquet_column)
    else:
        source = iter(pipeline._stdlib_documents())
    for name, text in source:
        held_out = not held and pipeline._held_out(name, data.eval_fraction)
        yield ("held_out" if held_out else "train"), text
    for _, text in documents.iter_documents(held, data.jsonl_field, "eval_files", data.parquet_column):
        yield "held_out", text


def _groups(docs, limit: int = GROUP_BYTES):
    """The (split, text) pairs in lists of about `limit` bytes of text."""
    group, size = [], 0
    for split, text in docs:
        group.append((split, text))
        size += len(text)
        if size >= limit:
            yield group
            group, size = [], 0
    if group:
        yield group


def prepare(
    data,
    out: str,
    chunk_tokens: int = CHUNK_TOKENS,
    records_per_file: int = RECORDS_PER_FILE,
) -> dict:
    """Tokenizes config.data's files into shards in directory `out` (which must not exist or be
    empty) and returns its shards.json; UserError, one line, for bad input, with nothing written."""
    if data.shards:
        raise UserError(f"config.data.shards={data.shards} is what training reads; leave it empty here")
    pipeline.check(data)
    if chunk_tokens < 1 or records_per_file < 1:
        raise UserError("--chunk_tokens and --records_per_file must be 1 or more")
    out = paths.absolute(out)
    outputs.check_dir(out, "--out")  # a bucket's first: before anything reads there
    target = paths.of(out)
    if target.is_file() or (target.is_dir() and any(True for _ in target.iterdir())):
        raise UserError(f"--out={out} exists and is not an empty directory; shards go to a new one")
    outputs.check_dir(out, "--out")
    tok = tokenizer_lib.load(data.tokenizer)
    # Every file found and every parquet column checked before the first write.
    train = _inputs(data, "train_files") if data.train_files else []
    held = _inputs(data, "eval_files") if data.eval_files else []
    with outputs.whole_file(out) as partial:
        os.makedirs(partial)
        writers = {
            s: shards.SplitWriter(partial, s, tok.dtype, chunk_tokens, records_per_file)
            for s in shards.SPLITS
        }
        for group in _groups(_documents(data, train, held)):
            texts = [text for _, text in group]
            ids = (
                map(tok.document, texts)
                if data.workers == 0
                else pipeline.tokenized(texts, tok, data.workers)
            )
            for (split, text), doc_ids in zip(group, ids, strict=True):
                writers[split].add(doc_ids, len(text))
        splits = {split: writer.close() for split, writer in writers.items()}
        _check_splits(data, splits)
        meta = {
            "format": shards.FORMAT,
            "tokenizer": {
                "spec": tok.spec,
                "kind": tok.kind,
                "vocab_size": tok.vocab_size,
                "digest": tok.digest,
            },
            "dtype": tok.dtype.__name__,
            "chunk_tokens": chunk_tokens,
            "source": {
                k: data[k]
                for k in ("train_files", "eval_files", "eval_fraction", "jsonl_field", "parquet_column")
            },
            "splits": splits,
        }
        with open(os.path.join(partial, shards.META), "w") as f:
            json.dump(meta, f, indent=1)
    return meta


def _check_splits(data, splits: dict) -> None:
    """UserError where a split came out empty (as split_documents refuses one)."""
    for split, what in (("train", "config.data.train_files"), ("held_out", "the held-out split")):
        if splits[split]["documents"] == 0:
            hint = (
                "config.data.eval_fraction holds out whole documents by a hash of their names; set "
                "config.data.eval_files or add files"
                if split == "held_out" and not data.eval_files
                else "add documents"
            )
            raise UserError(f"{what} holds no document; {hint}")


def summary(meta: dict, out: str, seconds: float) -> str:
    """The command's report: each split's size, the files, and the flag that trains on them."""
    tok = meta["tokenizer"]
    lines = [f"tokenizer: {tok['spec']} ({tok['vocab_size']:,} ids, {meta['dtype']})"]
    for split, s in meta["splits"].items():
        lines.append(
            f"{split}: {s['documents']:,} documents, {s['tokens']:,} tokens in {s['records']:,} records of "
            f"{meta['chunk_tokens']:,} tokens, {len(s['files'])} file(s); sha256 {s['sha256']}"
        )
    size = sum(f.stat().length for f in paths.of(out).iterdir())
    lines.append(
        f"wrote {out} ({size / 2**20:.1f} MiB) in {seconds:.1f}s; train with --config.data.shards={out}"
    )
    return "\n".join(lines)


def main(argv) -> None:
    """The command: flags in, prepare() out, its summary on stdout (a UserError: one line, exit 1)."""
    no_positional_arguments(argv)
    out = flags.FLAGS.out
    t0 = time.perf_counter()
    try:
        meta = prepare(flags.FLAGS.config.data, out, flags.FLAGS.chunk_tokens, flags.FLAGS.records_per_file)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(interrupted(f"--out={out} not written"))
    print(summary(meta, paths.absolute(out), time.perf_counter() - t0))


if __name__ == "__main__":
    from gspmd_tp.cli.arguments import define_config

    define_config("tiny", "A configs/*.py file: its data.* keys say what to read.")
    arguments.define_path("out", None, "The shards directory to write (new, or empty).")
    flags.mark_flags_as_required(["out"])
    flags.DEFINE_integer("chunk_tokens", CHUNK_TOKENS, "Tokens per record.")
    flags.DEFINE_integer("records_per_file", RECORDS_PER_FILE, "Records per ArrayRecord file.")
    entry.run(main, parse_flags)
