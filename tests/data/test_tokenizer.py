"""Tokenizers: round trips, each one's document convention, bad input, tokenizing in grain workers."""

import numpy as np
import pytest
from conftest import data_config, write
from tiny_tokenizers import BPE_VOCAB, SP_VOCAB

from gspmd_tp.data import pipeline, tokenizer
from gspmd_tp.job.errors import UserError

TEXTS = ["def f(x):\n    return x  # café ☃\n", "", "\tline one\n\n  line two  \r\n", "import os\x00x"]


@pytest.mark.parametrize("kind", ["bytes", "bpe", "sp"])
def test_round_trip_and_document_convention(kind, request):
    spec = {"bytes": "bytes", "bpe": "bpe_path", "sp": "sp_path"}[kind]
    tok = tokenizer.load(spec if kind == "bytes" else request.getfixturevalue(spec))
    assert tok.vocab_size == {"bytes": 256, "bpe": BPE_VOCAB, "sp": SP_VOCAB}[kind]
    for text in TEXTS:
        doc = tok.document(text.encode())
        assert doc.dtype == tok.dtype
        if kind == "sp":  # Llama's convention: bos starts every document
            assert doc[0] == tok.bos == 1 and tok.bos not in doc[1:].tolist()
            body = doc[1:]
        else:  # GPT-2's and bytes': the end token ends it
            assert tok.bos is None and doc[-1] == tok.eos and tok.eos not in doc[:-1].tolist()
            body = doc[:-1]
        assert tok.decode(body) == text.replace("\x00", "" if kind == "bytes" else "\x00")
        # generate: a prompt follows the separator; the sample stops at the next one
        assert tok.prompt(text.encode())[1:] == body.tolist()
        assert tok.decode([*body.tolist(), tok.eos, *body.tolist()]) == tok.decode(body)


def test_a_tokenizer_that_does_not_load_is_one_line(tmp_path):
    for spec, message in [
        (str(tmp_path / "nope.json"), "no such file or directory"),
        (write(tmp_path / "bad.json", "{}"), "does not load as a Hugging Face tokenizer.json"),
        (write(tmp_path / "bad.model", "not a model"), "does not load as a SentencePiece model"),
        (str(tmp_path), "holds neither tokenizer.json nor tokenizer.model"),
    ]:
        with pytest.raises(UserError, match=message) as e:
            tokenizer.load(spec)
        assert "\n" not in str(e.value) and str(e.value).startswith(f"config.data.tokenizer={spec}")


def test_a_model_directory_is_read_and_workers_tokenize_the_same(bpe_path, tmp_path):
    """A directory holding tokenizer.json loads as the file; a corpus tokenized in one grain worker
    process equals the corpus tokenized here (same ids, same order)."""
    assert tokenizer.load(str(tmp_path.parent / bpe_path.split("/")[-2])) == tokenizer.load(bpe_path)
    files = [write(tmp_path / f"d{i}.txt", f"doc {i}: " + "text " * i) for i in range(6)]
    held = write(tmp_path / "held.txt", "def held(out):\n    return out\n")
    cfg = data_config(train_files=",".join(files), eval_files=held, tokenizer=bpe_path)
    here = pipeline.load_corpus(cfg)
    tokens, text_bytes = pipeline.held_out(cfg)  # here too: each call with workers starts its own
    assert text_bytes == 30 and len(tokens) < text_bytes
    np.testing.assert_array_equal(tokens, here[1])
    cfg.workers = 1
    there = pipeline.load_corpus(cfg)
    for a, b in zip(here, there, strict=True):
        np.testing.assert_array_equal(a, b)
    assert here[0].dtype == np.uint16 and (here[0] == 0).sum() == len(files)  # one end token each
