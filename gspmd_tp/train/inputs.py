"""A run's inputs, read from files: the corpus (its fingerprints and datasets) and config.init_from's
parameters, and the check that every process of a job read the same ones."""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING

import jax

from gspmd_tp.checkpoint import tool
from gspmd_tp.data import documents, pipeline, tokenizer
from gspmd_tp.job import distributed
from gspmd_tp.job.errors import JobError, UserError
from gspmd_tp.storage import paths

if TYPE_CHECKING:
    from gspmd_tp.train.run_setup import Setup

# The corpus fingerprints' token streams: {split: (its name in messages, what a change on resume means)}.
CORPUS_SPLITS = {
    "train": ("training corpus", "the examples from here on are not those the run would have seen"),
    "held_out": ("held-out split", "eval_loss from here on does not compare with the rows before"),
}


def read(s: Setup, resuming: bool, workdir: str, log):
    """(corpus fingerprints, train dataset, eval dataset, imported parameters or None, the sha256
    of the imported parameters or ""): what the run reads from files, on every process (the digest
    in a multi-process job only). Warnings and notes go to `log`."""
    c = s.config
    # Each glob walked once, its matches read by the three below (a walk of many files costs seconds).
    matches = documents.match(c.data, workdir)  # not the run's own files
    shared = documents.files_in_both(matches)
    if shared:
        overlap = (
            f"config.data.eval_files and train_files both match {_plural_files(shared)}: the held-out loss "
            "is measured on text the run trains on"
        )
        if not resuming:
            raise UserError(f"{overlap}; take them out of one of the two")
        # A run that began so cannot change eval_files (another run) and must stay resumable.
        log(f"warning: {overlap}")
    twice = documents.files_matched_twice(matches)
    if twice and not resuming:  # on purpose, it weights them; by mistake, a resume need not repeat it
        files = f"{len(twice)} files" if len(twice) > 1 else "1 file"
        log(
            f"note: config.data.train_files matches {files} more than once ({twice[0]}"
            f"{', ...' if len(twice) > 1 else ''}): each is read, and trained on, once per match"
        )
    train_tokens, eval_tokens = pipeline.load_corpus(c.data, workdir, matches)
    corpus = {"train": pipeline.fingerprint(train_tokens), "held_out": pipeline.fingerprint(eval_tokens)}
    corpus["tokenizer"] = tokenizer.load(c.data.tokenizer).digest  # a resume checks it (check_tokenizer)
    rows = pipeline.process_rows(s.batch_sharding, c.batch_size)
    separator = pipeline.document_separator(c.data)  # None: config.data.document_mask is off
    train_ds = pipeline.train_dataset(train_tokens, c.seq_len, c.batch_size, c.data.seed, rows, separator)
    eval_ds = pipeline.eval_dataset(eval_tokens, c.seq_len, c.batch_size, rows, separator)
    imported, digest = None, None
    if not resuming and c.init_from:  # read only by a fresh run: a resumed one may have lost the file
        if not paths.of(c.init_from).is_file():  # local, or in a bucket
            raise UserError(f"config.init_from: no file {c.init_from}")
        # Compared between processes only: one digest of what the import reads anyway.
        digest = hashlib.sha256() if jax.process_count() > 1 else None
        imported = tool.import_params(c.init_from, s.abstract_state.params, digest)
    return corpus, train_ds, eval_ds, imported, digest.hexdigest() if digest else ""


def check_tokenizer(saved_corpus: dict, data, where: str) -> None:
    """UserError where the run in `where` was trained with another tokenizer (a file of other
    content) than config.data.tokenizer: its token ids would mean other text."""
    saved = saved_corpus.get("tokenizer", tokenizer.BYTES)  # a run saved before tokenizers: bytes
    tok = tokenizer.load(data.tokenizer)
    if saved != tok.digest:
        what = "byte tokens" if saved == tokenizer.BYTES else f"a tokenizer of sha256 {saved}"
        now = "bytes" if tok.kind == tokenizer.BYTES else f"{tok.spec} (sha256 {tok.digest})"
        raise UserError(
            f"{where} was trained with {what}; config.data.tokenizer is {now}: resume with the run's "
            "tokenizer, or use a new --workdir"
        )


def recorded_tokenizer(config, workdir: str, log) -> None:
    """Sets config.data.tokenizer, where left at bytes, to the tokenizer the workdir's newest
    checkpoint recorded (an imported model's, from convert from-hf; a run's own on resume)."""
    from gspmd_tp.checkpoint import step_dirs

    if config.data.tokenizer != tokenizer.BYTES:
        return
    ckpt_dir = step_dirs.checkpoint_dir(workdir)
    try:
        newest = step_dirs.steps_on_disk(ckpt_dir)[0]
        saved = step_dirs.read_step_meta(os.path.join(ckpt_dir, str(newest)))["config"]["data"]["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return  # no checkpoint, or one saved before tokenizers: bytes; a damaged one is named later
    if saved != tokenizer.BYTES:
        log(f"tokenizer: {saved} (recorded in {ckpt_dir})")
        config.data.tokenizer = saved


def _plural_files(paths: list[str]) -> str:
    """The first of `paths`, and how many more."""
    more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
    return f"{paths[0]}{more}"


def check_same(corpus: dict, init_from: str = "", init_digest: str = "") -> None:
    """UserError on every process where some process of the job read other tokens or another
    config.init_from (the same config, other files: a relative path from another directory, a
    host's own copy that differs). Each process reads only its rows of each batch, and places only
    its shards of the imported parameters: the job would mix the two. `corpus` holds the
    fingerprints of the splits read ({"held_out": ...} alone for a reader that only evaluates)."""
    if jax.process_count() == 1:
        return
    splits = [split for split in CORPUS_SPLITS if split in corpus]
    found = distributed.first_disagreement([corpus[split]["sha256"] for split in splits] + [init_digest])
    if found is None:
        return
    column, other = found
    if column == len(splits):
        raise JobError(
            f"config.init_from={init_from} read by process {other} of this job differs from process 0's "
            f"(here: parameters digest {init_digest[:16]}): every process must read the same file (a "
            "relative path from each process's own directory)"
        )
    mine = corpus[splits[column]]
    raise JobError(
        f"the {CORPUS_SPLITS[splits[column]][0]} read by process {other} of this job differs from "
        f"process 0's (here: {mine['tokens']:,} tokens, sha256 {mine['sha256']}): every process must "
        "read the same files (config.data's paths; relative ones from each process's own directory)"
    )
