"""A user's data files: globs matched and checked, .txt and .jsonl files read as documents."""

import collections
import glob
import json
import os
import re
import threading

import numpy as np
import pytest
from conftest import data_config, small_config, split_documents, write

from gspmd_tp.data import documents, pipeline
from gspmd_tp.inference import evaluate
from gspmd_tp.job.errors import UserError
from gspmd_tp.train import inputs, loop, run_setup

# --- names and globs: ~, recursive globs, spellings of a path, the run's own workdir -----------


def test_the_split_is_the_same_however_the_path_is_spelled(tmp_path, monkeypatch):
    for i in range(60):
        write(tmp_path / "data" / f"doc{i:02d}.txt", f"document {i}")
    write(
        tmp_path / "data" / "lines.jsonl",
        "".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(60)),
    )
    monkeypatch.chdir(tmp_path)
    spellings = ["data/*", "./data/*", f"{tmp_path}/data/*", "data/../data/*"]
    splits = [pipeline.load_corpus(data_config(train_files=p, eval_fraction=0.2)) for p in spellings]
    for train, held in splits[1:]:
        np.testing.assert_array_equal(train, splits[0][0])
        np.testing.assert_array_equal(held, splits[0][1])
    assert 0 < len(split_documents(splits[0][1])) < 120


def test_a_glob_from_the_home_directory(tmp_path, monkeypatch):
    # bash leaves ~ in --config.data.train_files=~/... as it is; it was made absolute under the cwd.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    write(tmp_path / "home" / "data" / "a.txt", "a")
    write(tmp_path / "home" / "eval.txt", "e")
    assert (
        documents.absolute_patterns("~/data/*.txt, x.txt")
        == f"{tmp_path}/home/data/*.txt,{os.path.abspath('x.txt')}"
    )
    train, held = pipeline.load_corpus(data_config(train_files="~/data/*.txt", eval_files="~/eval.txt"))
    assert split_documents(train) == [b"a"] and split_documents(held) == [b"e"]


def test_a_recursive_glob_reads_the_files_below_the_directories_it_matches(tmp_path):
    # `data/**` matches data/ and data/sub/ too: they are walked through, not refused as documents.
    write(tmp_path / "data" / "a.txt", "a")
    write(tmp_path / "data" / "sub" / "b.txt", "b")
    write(tmp_path / "eval.txt", "e")
    cfg = data_config(train_files=str(tmp_path / "data" / "**"), eval_files=str(tmp_path / "eval.txt"))
    train, held = pipeline.load_corpus(cfg)
    assert split_documents(train) == [b"a", b"b"] and split_documents(held) == [b"e"]


def test_files_inside_the_runs_workdir_are_no_data(tmp_path):
    # A glob like **/*.jsonl took the run's own metrics.jsonl from its second start on: "no such field".
    write(tmp_path / "data" / "a.jsonl", '{"text": "a"}\n')
    write(tmp_path / "eval.txt", "e")
    write(tmp_path / "runs" / "x" / "metrics.jsonl", '{"step": 2, "loss": 5.0}\n')
    cfg = data_config(train_files=str(tmp_path / "**" / "*.jsonl"), eval_files=str(tmp_path / "eval.txt"))
    train, _ = pipeline.load_corpus(cfg, workdir=str(tmp_path / "runs" / "x"))
    assert split_documents(train) == [b"a"]
    cfg.train_files = str(tmp_path / "runs" / "**" / "*.jsonl")
    with pytest.raises(UserError, match=r"train_files: no file matches '.*' outside the run's .*/runs/x$"):
        pipeline.load_corpus(cfg, workdir=str(tmp_path / "runs" / "x"))


# --- .txt and .jsonl files, and what no glob may match -----------------------------------------


def test_load_corpus_txt_and_jsonl_with_eval_files(tmp_path):
    write(tmp_path / "txt" / "b.txt", "second\x00 file")  # the NUL is dropped: it is the separator
    write(tmp_path / "txt" / "a.txt", "first file")
    lines = [json.dumps({"content": "json one", "other": 1}), "", json.dumps({"content": "déjà vu"})]
    write(tmp_path / "json" / "deep" / "c.jsonl", "\n".join(lines) + "\n")
    write(tmp_path / "eval.jsonl", json.dumps({"content": "held out"}) + "\n")
    cfg = data_config(
        train_files=f"{tmp_path}/txt/*.txt, {tmp_path}/json/**/*.jsonl",
        eval_files=str(tmp_path / "eval.jsonl"),
        jsonl_field="content",
    )
    train, held = pipeline.load_corpus(cfg)
    # Globs are expanded in sorted order; every document is followed by one separator.
    assert bytes(train) == "first file\0second file\0json one\0déjà vu\0".encode()
    assert bytes(held) == b"held out\0"


ERRORS = [  # files to write, the config key, its glob, what the message must say
    pytest.param(
        {}, "train_files", "no/*.txt", r"train_files: no file matches '.*no/\*\.txt'", id="no-match"
    ),
    pytest.param({"t.txt": "x"}, "eval_files", "no*.txt", r"eval_files: no file matches", id="eval-no-match"),
    pytest.param(
        {"d.jsonl": '{"text": "a"}\n{"body": 2}\n'},
        "train_files",
        "d.jsonl",
        r"d\.jsonl:2: .*'text' \(config\.data\.jsonl_field\); no such field$",
        id="field",
    ),
    pytest.param(
        {"d.jsonl": '{"text": "a"}\n\n[\n'},
        "train_files",
        "d.jsonl",
        r"d\.jsonl:3: .*'text' .*; not valid JSON$",
        id="bad-json",
    ),
    # A value that is not a string would be trained on as its Python str() ("None", "5", "['a']").
    *[
        pytest.param(
            {"d.jsonl": f'{{"text": "a"}}\n{{"text": {value}}}\n'},
            "train_files",
            "d.jsonl",
            rf"d\.jsonl:2: expected a JSON object with a string field 'text' .*; got {re.escape(value)}$",
            id=f"not-a-string-{kind}",
        )
        for kind, value in [("null", "null"), ("number", "5"), ("list", '["a"]'), ("object", '{"b": "c"}')]
    ],
    pytest.param(
        {"d.jsonl": '{"text": "ok"}\n{"text": "caf\xe9"}\n'.encode("latin-1")},
        "train_files",
        "d.jsonl",
        r"d\.jsonl:2: not UTF-8 \(byte 0xe9 at column 14\); re-encode it as UTF-8$",
        id="jsonl-not-utf8",
    ),
    pytest.param(  # was a RecursionError traceback from json.loads
        {"d.jsonl": '{"text": "a"}\n{"text": "b", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}\n"},
        "train_files",
        "d.jsonl",
        r"d\.jsonl:2: expected a JSON object with a string field 'text' .*; nested too deeply to parse$",
        id="jsonl-too-deep",
    ),
    pytest.param(  # valid JSON, but no UTF-8 text: it was a UnicodeEncodeError traceback
        {"d.jsonl": '{"text": "a"}\n{"text": "half \\ud83d an emoji"}\n'},
        "train_files",
        "d.jsonl",
        r"d\.jsonl:2: field 'text' holds a lone surrogate \"\\ud83d\" "
        r"\(half of a UTF-16 pair, no character\); remove it or give its pair$",
        id="jsonl-lone-surrogate",
    ),
    pytest.param(
        {"d.jsonl": "\n  \n"},
        "train_files",
        "*.jsonl",
        r"train_files: 1 file but no document \(a \.jsonl file holds one per non-blank line\)$",
        id="blank-jsonl",
    ),
    pytest.param(  # was "dir is neither .txt nor .jsonl"
        {"dir/inner.txt": "x"},
        "train_files",
        "dir",
        r"train_files: .*/dir is a directory; give a glob of its files, e.g. .*/dir/\*\*/\*\.txt$",
        id="directory",
    ),
    pytest.param(  # was "cannot read .../dir.txt: Is a directory"
        {"dir.txt/inner.md": "x"},
        "train_files",
        "*.txt",
        r"train_files: '.*\*\.txt' matches directories only, no file$",
        id="directories-only",
    ),
    pytest.param(
        {"d.jsonl": '["a"]\n'},
        "train_files",
        "d.jsonl",
        r"d\.jsonl:1: expected a JSON object.*; not an object$",
        id="list",
    ),
    pytest.param(
        {"n.md": "# hi"}, "train_files", "*.md", r"n\.md is neither \.txt nor \.jsonl", id="extension"
    ),
]


@pytest.mark.parametrize("files, key, pattern, message", ERRORS)
def test_load_corpus_errors(tmp_path, files, key, pattern, message):
    for name, text in files.items():
        write(tmp_path / name, text)
    cfg = data_config(train_files=str(tmp_path / "t.txt") if key == "eval_files" else "")
    cfg[key] = str(tmp_path / pattern)
    with pytest.raises(UserError, match=message):
        pipeline.load_corpus(cfg)


def test_a_broken_symbolic_link_is_named_as_one(tmp_path):
    (tmp_path / "gone.txt").symlink_to(tmp_path / "moved" / "gone.txt")
    with pytest.raises(
        UserError, match=r"gone\.txt is a symbolic link to .*moved/gone\.txt, which is missing$"
    ):
        pipeline.load_corpus(data_config(train_files=str(tmp_path / "*.txt")))


def test_a_named_pipe_is_refused_not_read_until_someone_writes_it(tmp_path):
    write(tmp_path / "a.txt", "a")
    pipe = tmp_path / "pipe.txt"
    os.mkfifo(pipe)
    outcome = {}

    def load():
        try:
            pipeline.load_corpus(
                data_config(train_files=str(tmp_path / "*.txt"), eval_files=str(tmp_path / "a.txt"))
            )
        except UserError as e:
            outcome["error"] = str(e)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=20)
    if reader.is_alive():  # blocked opening the pipe: let it go (a writer that opens and closes it)
        os.close(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
    assert re.search(
        r"pipe\.txt is not a regular file \(a pipe, socket or device\)$", outcome.get("error", "")
    )


def test_a_file_name_that_is_not_utf8_is_split_by_its_bytes(tmp_path):
    # Linux names are bytes; Python gives a non-UTF-8 one as a str with surrogates, which the held-out
    # hash could not encode (a traceback from load_corpus).
    name = os.fsdecode(b"caf\xe9.txt")
    for i in range(20):
        write(tmp_path / f"doc{i}.txt", f"text {i}")
    write(tmp_path / name, "latin-1 name")
    train, held = pipeline.load_corpus(data_config(train_files=str(tmp_path / "*.txt"), eval_fraction=0.3))
    assert b"latin-1 name" in split_documents(train) + split_documents(held)
    assert pipeline._held_out(name, 0.3) == pipeline._held_out(name, 0.3)  # the same split on every run


# --- train and eval globs that overlap, training globs that match a file twice -----------------


def test_files_in_both_train_and_eval_files(tmp_path):
    for name in ("a.txt", "b.txt", "c.txt"):
        write(tmp_path / name, name)
    (tmp_path / "link.txt").symlink_to(tmp_path / "b.txt")
    cfg = data_config(train_files=str(tmp_path / "[ab].txt"), eval_files=str(tmp_path / "c.txt"))
    assert documents.files_in_both(documents.match(cfg)) == []
    cfg.eval_files = f"{tmp_path / 'c.txt'},{tmp_path / 'link.txt'}"  # b.txt by another name
    assert documents.files_in_both(documents.match(cfg)) == [str(tmp_path / "b.txt")]
    assert (
        documents.files_in_both(documents.match(data_config(eval_files=str(tmp_path / "c.txt")))) == []
    )  # the default corpus


def test_files_matched_twice_by_the_training_globs(tmp_path):
    write(tmp_path / "data" / "a.txt", "a")
    write(tmp_path / "data" / "sub" / "b.txt", "b")
    (tmp_path / "data" / "link.txt").symlink_to(tmp_path / "data" / "sub" / "b.txt")
    cfg = data_config(train_files=str(tmp_path / "data" / "**" / "*.txt"))
    assert documents.files_matched_twice(documents.match(cfg)) == [
        str(tmp_path / "data" / "sub" / "b.txt")
    ]  # and by its link
    cfg.train_files = f"{tmp_path}/data/a.txt,{tmp_path}/data/sub/*.txt"
    assert documents.files_matched_twice(documents.match(cfg)) == []
    cfg.train_files = f"{tmp_path}/data/*.txt,{tmp_path}/data/**/*.txt"  # ** matches no directory too
    assert documents.files_matched_twice(documents.match(cfg)) == [
        str(tmp_path / "data" / name) for name in ("a.txt", "sub/b.txt")
    ]
    assert documents.files_matched_twice(documents.match(data_config())) == []  # the default corpus


def test_a_fresh_run_whose_eval_files_are_training_files_is_refused(tmp_path):
    write(tmp_path / "train" / "a.txt", "x" * 3000)
    write(tmp_path / "train" / "b.txt", "y" * 3000)
    cfg = small_config()
    cfg.data.train_files = str(tmp_path / "train" / "*.txt")
    cfg.data.eval_files = str(tmp_path / "train" / "b.txt")
    workdir = tmp_path / "run"
    with pytest.raises(
        UserError,
        match=r"^config\.data\.eval_files and train_files both match .*train/b\.txt: the held-out loss is "
        r"measured on text the run trains on; take them out of one of the two$",
    ):
        loop.train(cfg, str(workdir))
    assert not workdir.exists()  # nothing written


# --- each glob walked once per start ------------------------------------------------------------


class ReadAll(Exception):
    """Raised where a trainer start has read its data files, to stop it before compiling."""


def counted_globs(monkeypatch) -> collections.Counter:
    """{pattern: times glob.glob walked it}, from now on."""
    walked, real = collections.Counter(), glob.glob

    def counting(pattern, *args, **kwargs):
        walked[pattern] += 1
        return real(pattern, *args, **kwargs)

    monkeypatch.setattr(glob, "glob", counting)
    return walked


def test_a_training_start_walks_each_glob_once(tmp_path, monkeypatch):
    # files_in_both, files_matched_twice and load_corpus each walked the training globs (three walks,
    # and two of the eval globs): seconds per start with tens of thousands of files.
    for i in range(6):
        write(tmp_path / "train" / f"{i}.txt", "x" * 400)
    write(tmp_path / "more" / "m.jsonl", '{"text": "more"}\n')
    write(tmp_path / "eval" / "e.txt", "e" * 400)
    train_globs = [str(tmp_path / "train" / "*.txt"), str(tmp_path / "more" / "**" / "*.jsonl")]
    eval_glob = str(tmp_path / "eval" / "*.txt")
    cfg = small_config(**{"data.train_files": ",".join(train_globs), "data.eval_files": eval_glob})
    walked = counted_globs(monkeypatch)

    def stop(corpus, *_):
        raise ReadAll(corpus)

    monkeypatch.setattr(inputs, "check_same", stop)  # called once the inputs are read
    with pytest.raises(ReadAll) as read:
        loop.train(cfg, str(tmp_path / "run"))
    assert read.value.args[0]["train"]["tokens"] == 6 * 401 + 5  # it read every file
    assert walked == {train_globs[0]: 1, train_globs[1]: 1, eval_glob: 1}


@pytest.mark.parametrize("with_eval_files", [True, False])
def test_evaluation_walks_each_glob_once(tmp_path, monkeypatch, with_eval_files):
    for i in range(40):
        write(tmp_path / "train" / f"{i}.txt", f"document {i} " * 20)
    write(tmp_path / "eval" / "e.txt", "e" * 400)
    cfg = small_config(**{"data.train_files": str(tmp_path / "train" / "*.txt"), "data.eval_fraction": 0.5})
    if with_eval_files:
        cfg.data.eval_files = str(tmp_path / "eval" / "*.txt")
    s = run_setup.setup(cfg)
    walked = counted_globs(monkeypatch)
    evaluate.held_out_batches(s, str(tmp_path / "run"))
    # With eval_files the training globs are not walked at all (those files may be gone).
    assert walked == {cfg.data.eval_files if with_eval_files else cfg.data.train_files: 1}
