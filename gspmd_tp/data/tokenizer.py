"""Tokenizers (config.data.tokenizer): `bytes`, a Hugging Face tokenizer (a tokenizer.json file or a
model directory holding one, read with `tokenizers`), or a SentencePiece model (a .model file or a
directory holding tokenizer.model).

Each separates documents by its own convention: a tokenizer whose post-processor or
tokenizer_config.json adds a beginning-of-sequence token (Llama's `<s>`, Llama 3's
`<|begin_of_text|>`, a SentencePiece model's bos) starts every document with it; one without ends
every document with its end token (GPT-2's `<|endoftext|>`); bytes end every document with byte 0.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os

import numpy as np

from gspmd_tp.job.errors import UserError, first_line
from gspmd_tp.storage import paths

BYTES = "bytes"
BYTE_SEPARATOR = 0  # ends every document in byte tokens (NUL never occurs in text; removed where it does)
# End tokens of common tokenizers, for a tokenizer.json with no tokenizer_config.json beside it.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
_HF_FILE, _SP_FILE, _HF_CONFIG = "tokenizer.json", "tokenizer.model", "tokenizer_config.json"


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A loaded tokenizer's identity and document convention; encode/decode load its library lazily
    (once per process), so the object pickles small into grain's worker processes."""

    spec: str  # "bytes" or the absolute path of the file read
    kind: str  # bytes | huggingface | sentencepiece
    vocab_size: int  # ids 0..vocab_size-1
    bos: int | None  # starts every document (None: this tokenizer ends them with eos instead)
    eos: int | None  # ends every document where bos is None; ends a sample in generate
    digest: str  # 16 hex digits of the file's sha256; "bytes" for bytes

    def encode(self, text: bytes) -> np.ndarray:
        """Token ids of a document's text, without separators."""
        if self.kind == BYTES:
            return np.frombuffer(text.replace(b"\0", b""), np.uint8)
        string = text.decode("utf-8", errors="replace")
        if self.kind == "huggingface":
            ids = _hf(self.spec).encode(string, add_special_tokens=False).ids
        else:
            ids = _sp(self.spec).encode(string)
        return np.asarray(ids, self.dtype)

    def document(self, text: bytes) -> np.ndarray:
        """A document's ids as the packed stream holds them: with its bos before or its eos after."""
        ids = self.encode(text)
        if self.bos is not None:
            return np.concatenate([np.asarray([self.bos], self.dtype), ids])
        return np.concatenate([ids, np.asarray([self.eos], self.dtype)])

    def prompt(self, text: bytes) -> list[int]:
        """The ids of a prompt, as a document's beginning follows the stream's previous separator."""
        return [self.bos if self.bos is not None else self.eos, *self.encode(text).tolist()]

    def decode(self, ids) -> str:
        """Text of generated ids up to the first separator (the model ended the document)."""
        ids = [int(i) for i in ids]
        stops = [i for i, t in enumerate(ids) if t in (self.bos, self.eos)]
        ids = ids[: stops[0]] if stops else ids
        if self.kind == BYTES:
            return bytes(ids).decode("utf-8", errors="replace")
        if self.kind == "huggingface":
            return _hf(self.spec).decode(ids, skip_special_tokens=True)
        return _sp(self.spec).decode(ids)

    @property
    def dtype(self):
        """The smallest unsigned dtype that holds every id: the packed stream's (and the shards')."""
        return np.uint8 if self.vocab_size <= 256 else np.uint16 if self.vocab_size <= 65536 else np.uint32


BYTE_TOKENIZER = Tokenizer(BYTES, BYTES, 256, None, BYTE_SEPARATOR, BYTES)


def resolve(spec: str) -> str:
    """config.data.tokenizer as saved: "bytes", a URL, or the path made absolute (found from any
    directory)."""
    return spec if spec == BYTES or paths.is_url(spec) else os.path.abspath(paths.expand(spec))


@functools.cache
def load(spec: str) -> Tokenizer:
    """The tokenizer config.data.tokenizer names; UserError, one line, where it does not load."""
    if spec == BYTES:
        return BYTE_TOKENIZER
    where = f"config.data.tokenizer={spec}"
    path = paths.local_copy(resolve(spec))  # a bucket's file, or its directory's files, copied locally
    if os.path.isdir(path):
        found = [os.path.join(path, f) for f in (_HF_FILE, _SP_FILE) if os.path.isfile(os.path.join(path, f))]
        if not found:
            raise UserError(f"{where}: the directory holds neither {_HF_FILE} nor {_SP_FILE}")
        path = found[0]
    if not os.path.isfile(path):
        raise UserError(f"{where}: no such file or directory ('bytes' for byte tokens)")
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    try:
        if path.endswith(".json"):
            return _hf_tokenizer(path, digest)
        return _sp_tokenizer(path, digest)
    except UserError:
        raise
    except Exception as e:  # the libraries raise their own types (Rust exceptions, RuntimeError, ...)
        what = "a Hugging Face tokenizer.json" if path.endswith(".json") else "a SentencePiece model"
        raise UserError(f"{where}: {path} does not load as {what}: {first_line(e)}") from None


@functools.cache
def _hf(path: str):
    import tokenizers

    return tokenizers.Tokenizer.from_file(path)


@functools.cache
def _sp(path: str):
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=path)


def _token_id(tok, value) -> int | None:
    """The id of a tokenizer_config.json token entry (a string or {"content": ...}), or None."""
    if isinstance(value, dict):
        value = value.get("content")
    return tok.token_to_id(value) if isinstance(value, str) else None


def _hf_tokenizer(path: str, digest: str) -> Tokenizer:
    tok = _hf(path)
    vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    # The post-processor's own convention: what it adds around a text (Llama: bos before it).
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    prefix = full[: len(full) - len(plain)] if full[-len(plain) :] == plain else []
    suffix = full[len(plain) :] if full[: len(plain)] == plain else []
    conf = {}
    conf_path = os.path.join(os.path.dirname(path), _HF_CONFIG)
    if os.path.isfile(conf_path):
        with open(conf_path) as f:
            conf = json.load(f)
    bos = prefix[0] if prefix else None
    if bos is None and conf.get("add_bos_token"):
        bos = _token_id(tok, conf.get("bos_token"))
    eos = suffix[-1] if suffix else _token_id(tok, conf.get("eos_token"))
    if eos is None:
        eos = next((i for i in map(tok.token_to_id, _EOS_NAMES) if i is not None), None)
    if bos is None and eos is None:
        raise UserError(
            f"config.data.tokenizer={path}: no beginning or end token to separate documents (none added by "
            f"its post-processor, none in a {_HF_CONFIG} beside it, none of {', '.join(_EOS_NAMES)})"
        )
    return Tokenizer(path, "huggingface", vocab_size, bos, eos, digest)


def _sp_tokenizer(path: str, digest: str) -> Tokenizer:
    sp = _sp(path)
    bos, eos = sp.bos_id(), sp.eos_id()
    if bos < 0 and eos < 0:
        raise UserError(f"config.data.tokenizer={path}: the SentencePiece model has no bos or eos piece")
    return Tokenizer(path, "sentencepiece", sp.get_piece_size(), bos if bos >= 0 else None,
                     eos if eos >= 0 else None, digest)  # fmt: skip


def train_bpe(texts, vocab_size: int, path: str) -> None:
    """Trains a byte-level BPE (GPT-2's convention: `<|endoftext|>`, id 0, ends every document) of
    `vocab_size` ids on `texts` (an iterable of str) and saves it as a tokenizer.json at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(path)
