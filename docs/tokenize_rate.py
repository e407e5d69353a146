"""How many tokens per second this host tokenizes, by number of grain worker processes.

    python docs/tokenize_rate.py --out=DIR [--tokenizer=PATH] [--workers=0,1,2] [--vocab=8192]

Without --tokenizer it first trains a byte-level BPE (GPT-2's convention) of --vocab ids on the
default corpus, the Python standard library's sources, and saves it as DIR/tokenizer.json (a
tokenizer to train with: --config.data.tokenizer=DIR/tokenizer.json --config.model.vocab_size=0).
Then it tokenizes that corpus through the pipeline train.py runs (pipeline.tokenized) with each
worker count, prints a table and writes DIR/tokenize_rate.json.
"""

import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gspmd_tp.data import pipeline  # noqa: E402
from gspmd_tp.data import tokenizer as tokenizer_lib  # noqa: E402

_OUT = flags.DEFINE_string("out", None, "Directory for tokenizer.json and tokenize_rate.json.", required=True)
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "A tokenizer to time instead of a BPE trained here.")
_WORKERS = flags.DEFINE_string("workers", "0,1,2", "Comma-separated grain worker counts.")
_VOCAB = flags.DEFINE_integer("vocab", 8192, "Vocabulary of the BPE trained without --tokenizer.")


def main(argv) -> None:
    """Trains (or loads) the tokenizer, then times the pipeline at each worker count."""
    del argv
    os.makedirs(_OUT.value, exist_ok=True)
    texts = [text for _, text in pipeline._stdlib_documents()]
    path = _TOKENIZER.value
    if path is None:
        path = os.path.join(_OUT.value, "tokenizer.json")
        t0 = time.perf_counter()
        tokenizer_lib.train_bpe((t.decode("utf-8", "replace") for t in texts), _VOCAB.value, path)
        print(
            f"trained a {_VOCAB.value}-id BPE on {len(texts)} documents "
            f"in {time.perf_counter() - t0:.1f}s: {path}"
        )
    tok = tokenizer_lib.load(path)
    mb = sum(len(t) for t in texts) / 1e6
    rows = []
    print(
        f"{'workers':>7} {'tokens':>12} {'seconds':>8} {'tokens/s':>10}  "
        f"({mb:.1f} MB of text, {os.cpu_count()} CPUs)"
    )
    for workers in [int(w) for w in _WORKERS.value.split(",")]:
        t0 = time.perf_counter()
        tokens = sum(len(ids) for ids in pipeline.tokenized(texts, tok, workers))
        seconds = time.perf_counter() - t0
        rows.append(
            {"workers": workers, "tokens": tokens, "seconds": seconds, "tokens_per_sec": tokens / seconds}
        )
        print(f"{workers:>7} {tokens:>12,} {seconds:>8.2f} {tokens / seconds:>10,.0f}")
    report = {"tokenizer": path, "vocab": tok.vocab_size, "text_mb": mb, "cpus": os.cpu_count(), "rows": rows}
    with open(os.path.join(_OUT.value, "tokenize_rate.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    app.run(main)
