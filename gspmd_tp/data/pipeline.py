"""Input pipeline: documents -> tokens -> packed fixed-length windows -> grain batches.

Documents are a user's files (documents.py reads them) or, by default, a corpus that needs no
download: the source files of the installed Python standard library. config.data.tokenizer turns
them into tokens (tokenizer.py: bytes by default, byte 0 ending each document), in grain's worker
processes where config.data.workers > 0. Documents go to the held-out split by a hash of their
name, so the split does not depend on file order or seed. config.data.shards reads both splits
instead from a corpus tokenized once (shards.py).

Windows are cut from the stream end to end, so one holds the tail of a document and the start of
the next. With config.data.document_mask (the default) each window also carries, for its input
positions, which document each belongs to (`segment_ids`, from 1; 0 on padding rows) and its
position within that document (`positions`, from 0), and the model attends within a document only,
its rotary positions restarting at each: read off the separators the tokenizer puts between
documents (document_segments). A document cut by a window boundary continues in the next window as
a new segment whose positions restart at 0, as MaxText and seqio packing do (rotary scores depend on
position differences only, so this changes no score).
"""

from __future__ import annotations

import functools
import hashlib
import os
import queue
import sysconfig
import threading
from collections.abc import Sequence
from pathlib import Path

import grain
import jax
import numpy as np

from gspmd_tp.data import documents, shards
from gspmd_tp.data import tokenizer as tokenizer_lib
from gspmd_tp.job.errors import UserError
from gspmd_tp.storage import paths

SEPARATOR = tokenizer_lib.BYTE_SEPARATOR
BYTE_VOCAB = 256
# The token of an evaluation batch's padding rows: no vocabulary id, so no target counts it.
PAD = -1


def padded_vocab(size: int = BYTE_VOCAB, multiple: int = 128) -> int:
    """Vocabulary size rounded up so that the vocab axis shards evenly on common meshes."""
    return -(-size // multiple) * multiple


@functools.cache  # read once per process: a trainer's evaluate, a library caller's second run
def _stdlib_documents() -> tuple[tuple[str, bytes], ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    # site-packages is not the standard library; test/ is mostly fixtures, not prose-like code. Both
    # are left unwalked: of the ~13,000 .py files under the root ~1,000 are kept, and a walk of them
    # all took a second of every run's start (as Path.rglob, symbolic links to directories are not
    # followed; the documents and their order are the same).
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages" and not (top == str(root) and d == "test")]
        paths += [Path(top, f) for f in files if f.endswith(".py")]
    return tuple((str(path.relative_to(root)), path.read_bytes()) for path in sorted(paths))


def _held_out(name: str, fraction: float) -> bool:
    # surrogateescape: a file name that is not UTF-8 hashes as its bytes on disk (os.fsencode), where
    # strict encoding would fail; a UTF-8 name hashes as before.
    digest = int.from_bytes(hashlib.sha1(name.encode("utf-8", "surrogateescape")).digest()[:4], "little")
    return digest % 100_000 < fraction * 100_000


def tokenized(texts: Sequence[bytes], tok: tokenizer_lib.Tokenizer, workers: int = 0):
    """The documents' ids, one array each, in order: a grain pipeline, tokenizing in `workers`
    processes (0: this one)."""
    # tok.document pickles by reference to tokenizer.py: a worker imports neither this module nor jax.
    ds = grain.MapDataset.source(texts).map(tok.document).to_iter_dataset()
    if workers > 0:
        from absl import flags

        if not flags.FLAGS.is_parsed():  # grain's workers read its absl flags (a library caller's)
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=16))
    return ds


def _pack(
    docs: Sequence[tuple[str, bytes]], tok=tokenizer_lib.BYTE_TOKENIZER, workers: int = 0
) -> np.ndarray:
    """Concatenates the documents' ids, separators included, into one token stream (tok.dtype)."""
    if tok.kind == tokenizer_lib.BYTES:  # numpy alone: no worker would be faster
        parts = []
        for _, text in docs:
            parts.append(np.frombuffer(text.replace(b"\0", b""), np.uint8))
            parts.append(np.array([SEPARATOR], np.uint8))
    else:
        parts = list(tokenized([text for _, text in docs], tok, workers))
    return np.concatenate(parts) if parts else np.zeros((0,), tok.dtype)


def check(data) -> None:
    """Checks config.data's file lists, workers and held-out split keys; raises UserError naming the key."""
    if data.workers < 0:
        raise UserError(f"config.data.workers must be 0 (this process) or more, got {data.workers}")
    if data.shards:
        # The shards hold both splits, chosen when they were made.
        given = [key for key in ("train_files", "eval_files") if data[key].strip()]
        if given:
            raise UserError(
                f"config.data.shards={data.shards} holds the corpus and its held-out split; leave "
                f"config.data.{given[0]} empty (python -m gspmd_tp.data.prepare reads the files)"
            )
        return
    for key in ("train_files", "eval_files"):
        # Only commas or spaces would otherwise read as empty: the default corpus, or a split of it.
        if data[key] and not any(p.strip() for p in data[key].split(",")):
            raise UserError(f"config.data.{key}={data[key]!r} names no file; leave it empty for the default")
    if data.eval_files:
        return  # eval_fraction is not used
    if data.eval_fraction == 0:
        # The trainer evaluates every eval_every steps and at the end; there is no run without eval.
        raise UserError(
            "config.data.eval_fraction=0 holds out no document and config.data.eval_files is empty, but "
            "training evaluates on held-out data; set config.data.eval_files or eval_fraction in (0, 1)"
        )
    if not 0 < data.eval_fraction < 1:
        raise UserError(f"config.data.eval_fraction must be in (0, 1), got {data.eval_fraction}")


def split_documents(data, workdir: str | None = None, matches: documents.Matches | None = None):
    """(train documents, held-out documents) per config.data, each a list of (name, bytes); files
    inside the run's `workdir` are left out. `matches`: documents.match(data, workdir) where the
    caller has it."""
    check(data)
    if matches is None:
        matches = documents.match(data, workdir)
    if data.train_files:
        docs = documents.documents(matches.train, data.jsonl_field, "train_files")
        source = "config.data.train_files"
    else:
        docs = _stdlib_documents()
        source = "the default corpus (config.data.train_files is empty)"
    if data.eval_files:
        return docs, documents.documents(matches.eval, data.jsonl_field, "eval_files")
    train = [d for d in docs if not _held_out(d[0], data.eval_fraction)]
    held = [d for d in docs if _held_out(d[0], data.eval_fraction)]
    if not train or not held:
        # With a few documents (a .txt file is one) a hash split often leaves one side empty.
        which = f"its only document, {docs[0][0]}," if len(docs) == 1 else f"all {len(docs)} documents"
        went = (
            "stayed in training, leaving the held-out split empty" if train else "went to the held-out split"
        )
        raise UserError(
            f"{source}: {which} {went} (config.data.eval_fraction={data.eval_fraction} holds out whole "
            f"documents by a hash of their names; a .txt file is one document and a .jsonl line is one); "
            f"set config.data.eval_files or add files"
        )
    return train, held


def load_corpus(
    data, workdir: str | None = None, matches: documents.Matches | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(train tokens, held-out tokens) as streams of config.data.tokenizer's ids (its dtype); files
    inside the run's `workdir` are left out. `matches`: documents.match(data, workdir). With
    config.data.shards, both are shards.ShardedTokens: read from disk as they are sliced."""
    tok = tokenizer_lib.load(data.tokenizer)
    if data.shards:
        check(data)
        return shards.open_splits(paths.expand(data.shards), tok)
    train, held = split_documents(data, workdir, matches)
    return _pack(train, tok, data.workers), _pack(held, tok, data.workers)


def fingerprint(tokens: np.ndarray | shards.ShardedTokens) -> dict:
    """{"tokens": count, "sha256": 16 hex digits of their bytes}: a token stream's identity, saved
    with checkpoints so that a resume sees files changed in place (shards: the one they recorded)."""
    if isinstance(tokens, shards.ShardedTokens):
        return tokens.fingerprint()
    return {"tokens": len(tokens), "sha256": hashlib.sha256(tokens.tobytes()).hexdigest()[:16]}


def held_out(data, workdir: str | None = None) -> tuple[np.ndarray, int]:
    """(the held-out token stream, the bytes of text it encodes): with config.data.eval_files only
    those files are read (none inside the run's `workdir`). In byte tokens each separator counts
    as a byte, as each is a token."""
    tok = tokenizer_lib.load(data.tokenizer)
    if data.shards:
        held = load_corpus(data)[1]
        return held, len(held) if tok.kind == tokenizer_lib.BYTES else held.text_bytes
    if data.eval_files:
        check(data)
        matched = documents.matched_files(data.eval_files, "eval_files", workdir)  # train_files' unwalked
        docs = documents.documents(matched, data.jsonl_field, "eval_files")
    else:
        docs = split_documents(data, workdir)[1]
    tokens = _pack(docs, tok, data.workers)
    if tok.kind == tokenizer_lib.BYTES:
        return tokens, len(tokens)
    return tokens, sum(len(text) for _, text in docs)


def document_separator(data) -> int | None:
    """The token that starts a document's segment in a window under config.data.document_mask:
    config.data.tokenizer's beginning-of-sequence token, or the end token of one that ends documents
    instead (byte 0 for bytes), which the next document's first token follows, as a prompt follows
    it in generate. None where config.data.document_mask is off: a window is one sequence."""
    if not data.document_mask:
        return None
    tok = tokenizer_lib.load(data.tokenizer)
    return tok.bos if tok.bos is not None else tok.eos


def document_segments(inputs: np.ndarray, separator: int) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids, positions) of a window's input tokens (..., length), int32: a new segment, from
    1, starts at the window's first token and at each `separator` after it; positions count from 0
    within each segment."""
    starts = inputs == separator
    starts[..., 0] = True  # the window's first token starts a segment (a cut document's rest)
    segment_ids = np.cumsum(starts, axis=-1, dtype=np.int32)
    index = np.broadcast_to(np.arange(inputs.shape[-1], dtype=np.int32), inputs.shape)
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=-1)  # each segment's first index
    return segment_ids, (index - first).astype(np.int32)


class PackedWindows:
    """Random access to fixed windows of seq_len + 1 tokens (inputs and shifted targets) of a token
    stream: an array, or shards.ShardedTokens (a window reads from disk). With a `separator`
    (document_separator) each also holds its inputs' segment_ids and positions (document_segments)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, separator: int | None = None):
        self.tokens, self.seq_len, self.separator = tokens, seq_len, separator
        self.count = max((len(tokens) - 1) // seq_len, 0)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        start = int(i) * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].astype(np.int32)
        row = {"tokens": window, "id": np.int64(i)}
        if self.separator is not None:
            row["segment_ids"], row["positions"] = document_segments(window[:-1], self.separator)
        return row


class PaddedWindows:
    """`windows` followed by rows of PAD tokens up to `length` (a pass that fills its last batch);
    with document segments, a padding row is segment 0 at positions 0, 1, ..."""

    def __init__(self, windows: PackedWindows, length: int):
        self.windows, self.length = windows, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if i < len(self.windows):
            return self.windows[i]
        seq_len = self.windows.seq_len
        row = {"tokens": np.full((seq_len + 1,), PAD, np.int32), "id": np.int64(-1)}
        if self.windows.separator is not None:
            row["segment_ids"] = np.zeros((seq_len,), np.int32)
            row["positions"] = np.arange(seq_len, dtype=np.int32)
        return row


class BatchStream:
    """An endless MapDataset read as global batches; iterate it for this process's rows of each.

    Global batch i is examples [i * B, (i + 1) * B) of the stream, and this process reads its
    contiguous `rows` = (first, count) of each (process_rows: the rows its devices hold; default all
    of them). A position is therefore a global example index: it means the same thing for any
    process count, mesh and batch size.
    """

    def __init__(
        self,
        ds: grain.MapDataset,
        global_batch: int,
        rows: tuple[int, int] | None = None,
        batches_per_pass: int | None = None,
    ):
        self.ds, self.global_batch = ds, global_batch
        self.first_row, self.rows = rows or (0, global_batch)
        # Batches before the stream repeats an example (None: not counted, as for training).
        self.batches_per_pass = batches_per_pass
        # Bytes of text per token on average (evaluate's bits per byte); 1 for byte tokens.
        self.bytes_per_token = 1.0

    def __iter__(self) -> BatchIterator:
        return BatchIterator(self)


class BatchIterator:
    """Yields {'tokens': (rows, seq_len + 1), 'id': (rows,)} dicts, with 'segment_ids' and
    'positions' (rows, seq_len) under document masking; get_state/set_state resume it."""

    def __init__(self, stream: BatchStream):
        self.stream, self.next_example = stream, 0

    def __next__(self) -> dict[str, np.ndarray]:
        s = self.stream
        first = self.next_example + s.first_row
        rows = [s.ds[j] for j in range(first, first + s.rows)]
        self.next_example += s.global_batch
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def get_state(self) -> dict:
        """The position as the global index of the next example (independent of process count)."""
        return {"next_example": self.next_example}

    def set_state(self, state: dict) -> None:
        """Continues from a get_state() result."""
        self.next_example = int(state["next_example"])


# config.data.prefetch: -1 reads AUTO_PREFETCH batches ahead on accelerators. Read-ahead is bounded as
# grain bounds its autotuned buffer (prefetch_autotune: min(RAM budget / element size, 1000)): the
# batches wait placed on the devices, beside the memory the compiled step was checked to fit in.
AUTO_PREFETCH = 2
MAX_PREFETCH = 1000
PREFETCH_BYTES = 1 << 30


def _batch_bytes(batch_size: int, seq_len: int, document_mask: bool = True) -> int:
    # The tokens, and with document masking the segment ids and positions beside them.
    per_row = 3 * seq_len + 1 if document_mask else seq_len + 1
    return batch_size * per_row * np.dtype(np.int32).itemsize


def max_prefetch(batch_size: int, seq_len: int, document_mask: bool = True) -> int:
    """The most batches config.data.prefetch may read ahead: MAX_PREFETCH, fewer where they and the
    one being read would hold over PREFETCH_BYTES of int32 arrays (the tokens, and with
    config.data.document_mask their segment ids and positions), never fewer than AUTO_PREFETCH."""
    batch = _batch_bytes(batch_size, seq_len, document_mask)
    return max(AUTO_PREFETCH, min(MAX_PREFETCH, PREFETCH_BYTES // batch - 1))


def check_prefetch(prefetch: int, batch_size: int, seq_len: int, document_mask: bool = True) -> None:
    """UserError naming config.data.prefetch where it is below -1 or over max_prefetch()."""
    if prefetch < -1:
        raise UserError(f"config.data.prefetch must be -1 (auto), 0 or more, got {prefetch}")
    limit = max_prefetch(batch_size, seq_len, document_mask)
    if prefetch > limit:
        what = f"{batch_size} x {seq_len + 1} int32 tokens"
        if document_mask:
            what += " with their segment ids and positions"
        raise UserError(
            f"config.data.prefetch={prefetch} is over its limit of {limit} batches read ahead (at most "
            f"{MAX_PREFETCH}, and {PREFETCH_BYTES >> 30} GiB with the batch being read; a batch of "
            f"{what} is {_batch_bytes(batch_size, seq_len, document_mask):,} bytes); -1 is the default"
        )


class Prefetcher:
    """Reads and places the next batches on a background thread, off the train step's path.

    Wraps a BatchIterator (whose state is already set) and `place` (host batch -> global array). Up to
    `depth` placed batches wait in a queue, and one more in the thread's hands; get_state() is the
    position after the last batch handed out, not after the last one read ahead, so a checkpoint
    resumes exactly where training was. An error in the thread is raised by the next `next()`.
    close() stops the thread. depth 0 reads on the caller's thread, when next() is called.
    """

    def __init__(self, it: BatchIterator, place, depth: int = 2):
        self._it, self._place = it, place
        self._state = it.get_state()
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread = None
        if depth > 0:
            self._thread = threading.Thread(target=self._run, name="prefetch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = (self._place(next(self._it)), self._it.get_state(), None)
            except Exception as e:  # handed to the consumer, which raises it
                item = (None, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self):
        if self._thread is None:
            batch = self._place(next(self._it))
            self._state = self._it.get_state()
            return batch
        batch, state, error = self._queue.get()
        if error is not None:
            raise error
        self._state = state
        return batch

    def get_state(self) -> dict:
        """The underlying iterator's state after the last batch handed out."""
        return dict(self._state)

    def close(self) -> None:
        """Stops the background thread (batches read ahead are dropped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def train_dataset(
    tokens: np.ndarray,
    seq_len: int,
    global_batch: int,
    seed: int,
    rows: tuple[int, int] | None = None,
    separator: int | None = None,
) -> BatchStream:
    """Shuffled (reshuffled each epoch), endless global batches; this process reads `rows` (first,
    count) of each, by default all of them. `separator` (document_separator): each window carries
    its documents' segment ids and positions."""
    windows = PackedWindows(tokens, seq_len, separator)
    if len(windows) < global_batch:
        raise UserError(
            f"training corpus has {len(windows)} windows of {seq_len + 1} tokens ({len(tokens)} tokens), "
            f"fewer than config.batch_size={global_batch}; add text to config.data.train_files or lower "
            f"config.batch_size or config.seq_len"
        )
    ds = grain.MapDataset.source(windows).shuffle(seed=seed).repeat(None)
    return BatchStream(ds, global_batch, rows)


def eval_dataset(
    tokens: np.ndarray,
    seq_len: int,
    global_batch: int,
    rows: tuple[int, int] | None = None,
    separator: int | None = None,
) -> BatchStream:
    """The held-out windows in a fixed order, read as train_dataset reads (`separator` as there). One
    pass is `batches_per_pass` batches holding every window once; the last batch's rows past the
    windows are padding (PAD tokens), which the eval step does not count."""
    windows = PackedWindows(tokens, seq_len, separator)
    if len(windows) == 0:
        raise UserError(
            f"held-out split has no window of {seq_len + 1} tokens (it has {len(tokens)}); set "
            f"config.data.eval_files to more text (without it, config.data.eval_fraction holds out whole "
            f"documents by a hash of their names) or lower config.seq_len"
        )
    padded = PaddedWindows(windows, -(-len(windows) // global_batch) * global_batch)
    return BatchStream(
        grain.MapDataset.source(padded).repeat(None),
        global_batch,
        rows,
        batches_per_pass=len(padded) // global_batch,
    )


def process_rows(sharding, global_batch: int) -> tuple[int, int]:
    """(first row, row count) of a global batch that this process's devices hold under `sharding`.

    With fewer batch shards than processes (tensor parallelism across hosts) processes share rows,
    and each reads all of its own.
    """
    spans = {
        (index[0].start or 0, global_batch if index[0].stop is None else index[0].stop)
        for index in sharding.addressable_devices_indices_map((global_batch, 1)).values()
    }
    first, stop = min(a for a, _ in spans), max(b for _, b in spans)
    if sum(b - a for a, b in spans) != stop - first:
        raise UserError(
            f"process {jax.process_index()}'s devices hold rows {sorted(spans)} of the batch, not one "
            "contiguous block; order the mesh so that each process's devices are neighbours"
        )
    return first, stop - first


# The arrays of a batch that the train and eval steps take (the example ids stay on the host).
BATCH_KEYS = ("tokens", "segment_ids", "positions")


def global_batch(local: dict[str, np.ndarray], sharding, batch_size: int) -> dict[str, jax.Array]:
    """The global batch assembled from every process's local rows (process_rows; processes that
    share rows under tensor parallelism give the same ones): {"tokens": (batch_size, seq_len + 1)},
    with "segment_ids" and "positions" (batch_size, seq_len) where the rows have them."""
    arrays = {}
    for key in BATCH_KEYS:
        if key in local:
            rows = np.asarray(local[key], np.int32)
            arrays[key] = jax.make_array_from_process_local_data(
                sharding, rows, (batch_size,) + rows.shape[1:]
            )
    return arrays
