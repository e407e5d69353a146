"""Tokenizers the tests build offline, once per session: a byte-level BPE (GPT-2's convention, the
end token after each document) and a SentencePiece model (Llama's, bos before each), both trained
on a few standard-library source files with a tiny vocabulary."""

import sysconfig
from pathlib import Path

import pytest

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = [str(STDLIB / name) for name in ("functools.py", "json/__init__.py", "textwrap.py")]
BPE_VOCAB = 300  # not a multiple of 128: a model from scratch pads it
SP_VOCAB = 400  # byte_fallback needs 256 byte pieces


@pytest.fixture(scope="session")
def bpe_path(tmp_path_factory) -> str:
    """A tokenizer.json: byte-level BPE, `<|endoftext|>` (id 0) ending every document."""
    from gspmd_tp.data import tokenizer

    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tokenizer.train_bpe((Path(p).read_text() for p in SOURCES), BPE_VOCAB, str(path))
    return str(path)


@pytest.fixture(scope="session")
def sp_path(tmp_path_factory) -> str:
    """A SentencePiece .model: BPE over bytes where a piece is missing, bos (id 1) starting every document."""
    import sentencepiece

    out = tmp_path_factory.mktemp("sp")
    text = "\n".join(Path(p).read_text() for p in SOURCES)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()),
        model_prefix=str(out / "sp"),
        vocab_size=SP_VOCAB,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",  # text as it is: an exact round trip
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    return str(out / "sp.model")
