"""The input pipeline: the corpus split, windows, shuffling, iterator state, prefetch, sharding."""

import time

import jax
import numpy as np
import pytest
from conftest import data_config, small_config, split_documents, write
from jax.sharding import NamedSharding, PartitionSpec

from gspmd_tp.data import pipeline
from gspmd_tp.job.errors import UserError
from gspmd_tp.sharding.mesh import make_mesh


def windows_tokens(count: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """A random uint8 stream holding exactly `count` windows of seq_len + 1 tokens."""
    return np.random.default_rng(seed).integers(0, 256, count * seq_len + 1, dtype=np.uint8)


def ids(batch) -> list[int]:
    return [int(i) for i in batch["id"]]


@pytest.fixture(scope="module")
def stdlib_corpus():
    """(train, held-out) of the default corpus, loaded once for the module."""
    return pipeline.load_corpus(data_config())


# --- the default corpus: a deterministic, disjoint held-out split ---------------------------------


def test_stdlib_split_is_deterministic(stdlib_corpus):
    train, held = stdlib_corpus
    train2, held2 = pipeline.load_corpus(data_config())
    np.testing.assert_array_equal(train, train2)
    np.testing.assert_array_equal(held, held2)
    assert train.dtype == held.dtype == np.uint8


def test_stdlib_held_out_fraction_and_disjointness(stdlib_corpus):
    train, held = stdlib_corpus
    train_docs, held_docs = split_documents(train), split_documents(held)
    fraction = len(held_docs) / (len(train_docs) + len(held_docs))
    eval_fraction = data_config().eval_fraction
    assert eval_fraction / 2 < fraction < eval_fraction * 2, fraction
    # Empty files (many __init__.py) pack to the same empty document on both sides.
    assert not (set(train_docs) & set(held_docs)) - {b""}
    assert len(train) > 1_000_000 and len(held) > 10_000


def test_user_files_split_is_disjoint_and_complete(tmp_path):
    texts = [f"document number {i}\n" for i in range(200)]
    for i, text in enumerate(texts):
        write(tmp_path / f"doc{i:03d}.txt", text)
    cfg = data_config(train_files=str(tmp_path / "*.txt"), eval_fraction=0.25)
    train, held = pipeline.load_corpus(cfg)
    train_docs = {d.decode() for d in split_documents(train)}
    held_docs = {d.decode() for d in split_documents(held)}
    assert not train_docs & held_docs
    assert train_docs | held_docs == set(texts)
    assert 25 <= len(held_docs) <= 75, len(held_docs)
    again = pipeline.load_corpus(cfg)
    np.testing.assert_array_equal(again[0], train)
    np.testing.assert_array_equal(again[1], held)


def test_evaluation_reads_only_the_eval_files(tmp_path):
    write(tmp_path / "e.txt", "held out")
    cfg = data_config(train_files=str(tmp_path / "moved_away" / "*.txt"), eval_files=str(tmp_path / "e.txt"))
    assert bytes(pipeline.held_out(cfg)[0]) == b"held out\0"


# --- user files ----------------------------------------------------------------------------------


def test_eval_files_put_every_training_document_in_training(tmp_path):
    for i in range(40):
        write(tmp_path / f"t{i}.txt", f"t{i}")
    write(tmp_path / "e.txt", "e")
    cfg = data_config(train_files=str(tmp_path / "t*.txt"), eval_files=str(tmp_path / "e.txt"))
    train, held = pipeline.load_corpus(cfg)
    assert len(split_documents(train)) == 40  # no hash split when eval_files is given
    assert split_documents(held) == [b"e"]


def test_corpus_smaller_than_one_batch(tmp_path):
    write(tmp_path / "small.txt", "x" * 40)
    write(tmp_path / "eval.txt", "y" * 40)  # no hash split: it would hold this one file out 1 time in 20
    config = data_config(train_files=str(tmp_path / "small.txt"), eval_files=str(tmp_path / "eval.txt"))
    train, _ = pipeline.load_corpus(config)
    # 40 bytes + separator = 41 tokens: 5 windows of 8 + 1, fewer than a batch of 8.
    with pytest.raises(
        UserError,
        match=r"5 windows of 9 tokens \(41 tokens\), fewer than config\.batch_size=8; add text to "
        r"config\.data\.train_files or lower",
    ):
        pipeline.train_dataset(train, seq_len=8, global_batch=8, seed=0)


def test_held_out_split_smaller_than_a_window():
    with pytest.raises(UserError, match=r"held-out split has no window of 9 tokens \(it has 5\); set config"):
        pipeline.eval_dataset(np.zeros((5,), np.uint8), 8, 8)


# The hash split is by document: with one .txt file (one document) or a few, one side is often empty.
# Relative paths make the documents' names, and so the split, the same on every run.
SPLIT_ERRORS = [  # files, what the message must say (eval_fraction 0.05: "corpus2.txt" is held out)
    pytest.param(
        ["corpus2.txt"],
        r"^config\.data\.train_files: its only document, corpus2\.txt, went to the held-out split "
        r"\(config\.data\.eval_fraction=0\.05 holds out whole documents by a hash of their names; a \.txt "
        r"file is one document .*\); set config\.data\.eval_files or add files$",
        id="only-one-held-out",
    ),
    pytest.param(
        ["corpus0.txt"],
        r"^config\.data\.train_files: its only document, corpus0\.txt, stayed in training, leaving the "
        r"held-out split empty \(config\.data\.eval_fraction=0\.05 .*\); set config\.data\.eval_files",
        id="only-one-in-training",
    ),
    pytest.param(
        ["part0.txt", "part1.txt"],
        r"^config\.data\.train_files: all 2 documents stayed in training, leaving the held-out split empty",
        id="few-in-training",
    ),
]


@pytest.mark.parametrize("names, message", SPLIT_ERRORS)
def test_split_leaving_a_side_empty_names_the_cause_and_the_fix(tmp_path, monkeypatch, names, message):
    monkeypatch.chdir(tmp_path)
    for name in names:
        write(tmp_path / name, "x" * 1000)
    with pytest.raises(UserError, match=message):
        pipeline.load_corpus(data_config(train_files=",".join(names), eval_fraction=0.05))
    # The fix the message names works.
    write(tmp_path / "eval.txt", "y" * 1000)
    train, held = pipeline.load_corpus(data_config(train_files=",".join(names), eval_files="eval.txt"))
    assert len(split_documents(train)) == len(names) and split_documents(held) == [b"y" * 1000]


@pytest.mark.parametrize("train_files", ["", "corpus0.txt"])
def test_eval_fraction_zero_without_eval_files_is_an_error(tmp_path, monkeypatch, train_files):
    # The trainer evaluates every eval_every steps and at the end: it needs a held-out split.
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "corpus0.txt", "x" * 1000)
    cfg = data_config(train_files=train_files, eval_fraction=0.0)
    with pytest.raises(
        UserError,
        match=r"^config\.data\.eval_fraction=0 holds out no document and config\.data\.eval_files is "
        r"empty, but training evaluates on held-out data; set config\.data\.eval_files",
    ):
        pipeline.load_corpus(cfg)
    with pytest.raises(UserError, match=r"^config\.data\.eval_fraction must be in \(0, 1\), got 1\.0$"):
        pipeline.check(data_config(eval_fraction=1.0))
    write(tmp_path / "eval.txt", "y")
    pipeline.check(data_config(eval_fraction=0.0, eval_files="eval.txt"))  # not used with eval_files


@pytest.mark.parametrize("key, given", [("train_files", ",,"), ("train_files", " "), ("eval_files", ", ,")])
def test_a_file_list_of_only_commas_or_spaces_is_an_error(key, given):
    """It read as empty: the default corpus, or a held-out split of the training files, without a word."""
    with pytest.raises(UserError, match=rf"^config\.data\.{key}='{given}' names no file; leave it empty"):
        pipeline.check(data_config(**{key: given}))
    pipeline.check(data_config(**{key: ""}))


# --- windows -------------------------------------------------------------------------------------


def test_packed_windows_shift_and_overlap():
    seq_len = 8
    tokens = windows_tokens(6, seq_len)
    windows = pipeline.PackedWindows(tokens, seq_len)
    assert len(windows) == 6
    for i in range(len(windows)):
        w = windows[i]
        assert w["tokens"].shape == (seq_len + 1,) and w["tokens"].dtype == np.int32
        assert int(w["id"]) == i
        inputs, targets = w["tokens"][:-1], w["tokens"][1:]
        np.testing.assert_array_equal(inputs, tokens[i * seq_len : (i + 1) * seq_len])
        np.testing.assert_array_equal(targets, tokens[i * seq_len + 1 : (i + 1) * seq_len + 1])
    for i in range(len(windows) - 1):
        # Exactly one shared token: the last target of window i is the first input of window i + 1.
        assert windows[i]["tokens"][-1] == windows[i + 1]["tokens"][0]
        np.testing.assert_array_equal(windows[i]["tokens"][-1:], windows[i + 1]["tokens"][:1])
    stitched = np.concatenate([windows[i]["tokens"][:-1] for i in range(len(windows))])
    np.testing.assert_array_equal(stitched, tokens[:-1])


@pytest.mark.parametrize("length, count", [(0, 0), (8, 0), (9, 1), (16, 1), (17, 2)])
def test_packed_windows_count(length, count):
    assert len(pipeline.PackedWindows(np.zeros((length,), np.uint8), 8)) == count


# --- document segments ---------------------------------------------------------------------------


def test_document_segments_worked_by_hand():
    # Separator 0 starts a segment; so does the window's first token (the rest of a cut document).
    inputs = np.array([[5, 6, 0, 7, 8, 9, 0, 4], [0, 3, 4, 0, 0, 1, 2, 3]], np.int32)
    segment_ids, positions = pipeline.document_segments(inputs, 0)
    np.testing.assert_array_equal(segment_ids, [[1, 1, 2, 2, 2, 2, 3, 3], [1, 1, 1, 2, 3, 3, 3, 3]])
    np.testing.assert_array_equal(positions, [[0, 1, 0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 0, 1, 2, 3]])
    assert segment_ids.dtype == positions.dtype == np.int32


def _documents_of_stream(lengths: list[int]) -> list[int]:
    """Which document each token of the byte stream of documents of `lengths` belongs to, counted
    with a loop over the documents: the separator that ends document k starts document k + 1 (as a
    prompt starts with it), and the last one belongs to a document not in the stream."""
    owner = []
    for k, n in enumerate(lengths):
        owner += [k] * n + [k + 1]
    return owner


@pytest.mark.parametrize("seq_len", [4, 8, 13])
def test_packed_windows_segments_restart_at_documents_and_window_boundaries(seq_len):
    """Documents of 5, 11, 1, 3 and 7 bytes packed end to end and cut into windows: each window's
    segments are its runs of one document, numbered from 1; a document cut by a window boundary is
    a new segment in the next window, its positions restarting at 0."""
    rng = np.random.default_rng(0)
    lengths = [5, 11, 1, 3, 7]
    docs = [(f"d{k}", bytes(rng.integers(1, 256, n, dtype=np.uint8))) for k, n in enumerate(lengths)]
    stream = pipeline._pack(docs)
    owner = _documents_of_stream(lengths)
    assert len(stream) == len(owner) == sum(lengths) + len(lengths)
    windows = pipeline.PackedWindows(stream, seq_len, separator=pipeline.SEPARATOR)
    cut = 0
    for i in range(len(windows)):
        w = windows[i]
        mine = owner[i * seq_len : (i + 1) * seq_len]
        want_segments, want_positions = [], []
        for j, doc in enumerate(mine):
            new = j == 0 or doc != mine[j - 1]
            want_segments.append(1 if j == 0 else want_segments[-1] + new)
            want_positions.append(0 if new else want_positions[-1] + 1)
        np.testing.assert_array_equal(w["segment_ids"], want_segments)
        np.testing.assert_array_equal(w["positions"], want_positions)
        assert w["segment_ids"].shape == w["positions"].shape == (seq_len,)
        cut += i > 0 and mine[0] == owner[i * seq_len - 1]  # a document carried over from window i - 1
    assert cut > 0  # some document was cut by a boundary, at every seq_len here


def test_padding_rows_are_segment_zero_and_document_masking_off_adds_nothing():
    tokens = windows_tokens(3, 4)
    padded = pipeline.PaddedWindows(pipeline.PackedWindows(tokens, 4, separator=0), 4)
    np.testing.assert_array_equal(padded[3]["segment_ids"], [0, 0, 0, 0])
    np.testing.assert_array_equal(padded[3]["positions"], [0, 1, 2, 3])
    assert (padded[0]["segment_ids"] >= 1).all()
    assert set(pipeline.PaddedWindows(pipeline.PackedWindows(tokens, 4), 4)[3]) == {"tokens", "id"}
    stream = pipeline.eval_dataset(tokens, 4, 2, separator=0)
    batch = next(iter(stream))
    assert batch["segment_ids"].shape == batch["positions"].shape == (2, 4)
    assert set(next(iter(pipeline.eval_dataset(tokens, 4, 2)))) == {"tokens", "id"}


def test_document_separator_follows_the_tokenizer_and_the_switch(bpe_path, sp_path):
    assert pipeline.document_separator(data_config()) == pipeline.SEPARATOR == 0  # bytes: byte 0 ends each
    assert pipeline.document_separator(data_config(tokenizer=bpe_path)) == 0  # <|endoftext|> ends each
    assert pipeline.document_separator(data_config(tokenizer=sp_path)) == 1  # bos starts each
    assert pipeline.document_separator(data_config(document_mask=False)) is None


def test_global_batch_carries_segments_where_the_rows_have_them():
    mesh = make_mesh("dp=4,mp=2", ("dp", "mp"))
    sharding = NamedSharding(mesh, PartitionSpec("dp", None))
    tokens = np.array([[5, 0, 6, 7, 0], [1, 2, 0, 3, 4]] * 4, np.int32)
    segments, positions = pipeline.document_segments(tokens[:, :-1], 0)
    local = {"tokens": tokens, "segment_ids": segments, "positions": positions, "id": np.arange(8)}
    batch = pipeline.global_batch(local, sharding, 8)
    assert sorted(batch) == ["positions", "segment_ids", "tokens"]
    assert batch["segment_ids"].shape == (8, 4) and batch["segment_ids"].sharding.is_equivalent_to(
        sharding, 2
    )
    np.testing.assert_array_equal(np.asarray(batch["segment_ids"])[:2], [[1, 2, 2, 2], [1, 1, 2, 2]])
    np.testing.assert_array_equal(np.asarray(batch["positions"])[:2], [[0, 0, 1, 2], [0, 1, 0, 1]])


# --- shuffling, epochs, iterator state -----------------------------------------------------------

SEQ, BATCH, WINDOWS = 4, 4, 48  # 12 batches per epoch


def dataset(seed=0, process_index=0, process_count=1, count=2 * WINDOWS // BATCH):
    """The first `count` batches this process reads (two epochs by default)."""
    rows = (process_index * BATCH // process_count, BATCH // process_count)
    stream = pipeline.train_dataset(windows_tokens(WINDOWS, SEQ), SEQ, BATCH, seed, rows)
    it = iter(stream)
    return [next(it) for _ in range(count)]


def test_train_dataset_deterministic_by_seed():
    a, b, c = dataset(seed=0), dataset(seed=0), dataset(seed=1)
    for k in range(3):
        np.testing.assert_array_equal(a[k]["tokens"], b[k]["tokens"])
        assert ids(a[k]) == ids(b[k])
        assert a[k]["tokens"].shape == (BATCH, SEQ + 1)
    assert [ids(a[k]) for k in range(3)] != [ids(c[k]) for k in range(3)]


def test_train_dataset_reshuffles_each_epoch():
    ds = dataset()
    per_epoch = WINDOWS // BATCH
    epoch0 = [i for k in range(per_epoch) for i in ids(ds[k])]
    epoch1 = [i for k in range(per_epoch, 2 * per_epoch) for i in ids(ds[k])]
    assert sorted(epoch0) == sorted(epoch1) == list(range(WINDOWS))  # every window once per epoch
    assert epoch0 != list(range(WINDOWS))  # shuffled
    assert epoch0 != epoch1  # and reshuffled


def test_iterator_state_round_trip():
    stream = pipeline.train_dataset(windows_tokens(WINDOWS, SEQ), SEQ, BATCH, 0)
    it = iter(stream)
    first = next(it)
    for _ in range(2):
        next(it)
    state = it.get_state()
    expected = next(it)
    fresh = iter(stream)
    fresh.set_state(state)
    got = next(fresh)
    assert ids(got) == ids(expected)
    np.testing.assert_array_equal(got["tokens"], expected["tokens"])
    assert ids(got) != ids(first)  # the state, not a restart, produced it


def test_prefetcher_reads_ahead_but_its_state_follows_what_was_handed_out():
    stream = pipeline.train_dataset(windows_tokens(WINDOWS, SEQ), SEQ, BATCH, 0)
    plain = iter(stream)
    placed = []
    ahead = pipeline.Prefetcher(iter(stream), lambda b: placed.append(ids(b)) or b, depth=3)
    try:
        for _ in range(4):
            want, got = next(plain), next(ahead)
            assert ids(got) == ids(want)
            np.testing.assert_array_equal(got["tokens"], want["tokens"])
        # The thread fills the queue (3) and holds one more batch waiting for a place: no further.
        deadline = time.monotonic() + 10
        while len(placed) < 4 + 3 + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert len(placed) == 4 + 3 + 1
        assert ahead.get_state() == plain.get_state()  # not the read-ahead position
    finally:
        ahead.close()
    resumed = iter(stream)
    resumed.set_state(ahead.get_state())
    assert ids(next(resumed)) == ids(next(plain))


def test_prefetcher_without_a_thread_reads_when_asked():
    stream = pipeline.train_dataset(windows_tokens(WINDOWS, SEQ), SEQ, BATCH, 0)
    plain, placed = iter(stream), []
    inline = pipeline.Prefetcher(iter(stream), lambda b: placed.append(ids(b)) or b, depth=0)
    for n in range(1, 4):
        assert ids(next(inline)) == ids(next(plain))
        assert len(placed) == n  # nothing read ahead
        assert inline.get_state() == plain.get_state()
    inline.close()


def test_prefetcher_raises_the_reading_error_in_the_loop():
    def place(batch):
        raise UserError("disk went away")

    stream = pipeline.train_dataset(windows_tokens(WINDOWS, SEQ), SEQ, BATCH, 0)
    ahead = pipeline.Prefetcher(iter(stream), place)
    with pytest.raises(UserError, match="disk went away"):
        next(ahead)
    ahead.close()


def test_prefetch_is_bounded_as_grain_bounds_its_read_ahead():
    # Without document masking a batch is its tokens alone.
    assert pipeline.max_prefetch(8, 32, document_mask=False) == pipeline.MAX_PREFETCH == 1000  # 1,056 bytes
    # 8 x 131,073 int32 tokens = 4,194,336 bytes: 254 batches ahead and the one being read fill 1 GiB.
    assert pipeline.max_prefetch(8, 2**17, document_mask=False) == 254
    # With it, each row also holds 2 x 131,072 int32 segment ids and positions: 8 x 393,217 x 4 =
    # 12,582,944 bytes a batch, 85 of which fit in 1 GiB (86 are 1,082,133,184 bytes): 84 ahead.
    assert pipeline.max_prefetch(8, 2**17) == 84
    assert (
        pipeline.max_prefetch(1024, 2**17) == pipeline.AUTO_PREFETCH == 2
    )  # batches of 512 MiB: the default
    for fine in (-1, 0, 254):
        pipeline.check_prefetch(fine, 8, 2**17, document_mask=False)
    with pytest.raises(
        UserError,
        match=r"^config\.data\.prefetch=255 is over its limit of 254 batches read ahead \(at most 1000, "
        r"and 1 GiB with the batch being read; a batch of 8 x 131073 int32 tokens is 4,194,336 bytes\); "
        r"-1 is the default$",
    ):
        pipeline.check_prefetch(255, 8, 2**17, document_mask=False)
    pipeline.check_prefetch(84, 8, 2**17)
    with pytest.raises(
        UserError,
        match=r"^config\.data\.prefetch=85 is over its limit of 84 batches read ahead \(at most 1000, and "
        r"1 GiB with the batch being read; a batch of 8 x 131073 int32 tokens with their segment ids and "
        r"positions is 12,582,944 bytes\); -1 is the default$",
    ):
        pipeline.check_prefetch(85, 8, 2**17)
    with pytest.raises(UserError, match=r"^config\.data\.prefetch must be -1 \(auto\), 0 or more, got -2$"):
        pipeline.check_prefetch(-2, 8, 32)


def test_a_huge_prefetch_is_refused_before_anything_is_compiled_or_written(tmp_path, monkeypatch):
    # It was accepted, and read ahead without bound: memory filled while the run trained.
    from gspmd_tp.train import loop
    from gspmd_tp.train import step as step_lib

    def no_compile(*args):
        raise AssertionError("compiled")

    monkeypatch.setattr(step_lib, "compile_train_step", no_compile)
    workdir = tmp_path / "run"
    with pytest.raises(
        UserError, match=r"^config\.data\.prefetch=1000000000 is over its limit of 1000 batches read ahead "
    ) as refused:
        loop.train(small_config(**{"data.prefetch": 10**9}), str(workdir))
    assert "\n" not in str(refused.value)
    assert not workdir.exists()  # nothing written


def test_process_shards_are_disjoint_and_make_the_global_batch():
    single = dataset()
    p0, p1 = dataset(process_index=0, process_count=2), dataset(process_index=1, process_count=2)
    seen = []
    for k in range(WINDOWS // BATCH):
        a, b = ids(p0[k]), ids(p1[k])
        assert len(a) == len(b) == BATCH // 2
        assert p0[k]["tokens"].shape == (BATCH // 2, SEQ + 1)
        assert not set(a) & set(b)
        assert sorted(a + b) == sorted(ids(single[k]))
        seen += a + b
    assert sorted(seen) == list(range(WINDOWS))  # one epoch of the two processes covers every window


# --- global batch, vocabulary --------------------------------------------------------------------


def test_global_batch_on_eight_devices():
    mesh = make_mesh("dp=8,mp=1", ("dp", "mp"))
    sharding = NamedSharding(mesh, PartitionSpec("dp", None))
    tokens = np.arange(8 * 5, dtype=np.int64).reshape(8, 5)
    batch = pipeline.global_batch({"tokens": tokens, "id": np.arange(8)}, sharding, 8)
    assert list(batch) == ["tokens"]  # the ids stay on the host; no segments without document masking
    arr = batch["tokens"]
    assert isinstance(arr, jax.Array)
    assert arr.shape == (8 * jax.process_count(), 5) and arr.dtype == np.int32
    assert arr.sharding.is_equivalent_to(sharding, arr.ndim)
    assert len(arr.addressable_shards) == 8
    assert {s.data.shape for s in arr.addressable_shards} == {(1, 5)}
    np.testing.assert_array_equal(np.asarray(arr), tokens)


@pytest.mark.parametrize(
    "size, multiple, padded",
    [(256, 128, 256), (257, 128, 384), (50257, 128, 50304), (100, 64, 128), (1, 8, 8)],
)
def test_padded_vocab(size, multiple, padded):
    assert pipeline.padded_vocab(size, multiple) == padded


def test_padded_vocab_default_is_the_byte_vocabulary():
    assert pipeline.padded_vocab() == pipeline.BYTE_VOCAB == 256
