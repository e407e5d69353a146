"""A run's inputs: the corpus and config.init_from's parameters, read from files."""

import pytest
from conftest import data_config, small_config, write

from gspmd_tp.job.errors import UserError
from gspmd_tp.train import inputs, run_setup


def test_the_trainer_reads_no_data_from_its_own_workdir(tmp_path):
    write(tmp_path / "data" / "a.jsonl", "".join(f'{{"text": "{"x" * 300}"}}\n' for _ in range(10)))
    write(tmp_path / "eval.txt", "e" * 300)
    write(tmp_path / "runs" / "x" / "metrics.jsonl", '{"step": 2, "loss": 5.0}\n')  # as a first start leaves
    cfg = small_config()
    cfg.data.train_files, cfg.data.eval_files = str(tmp_path / "**" / "*.jsonl"), str(tmp_path / "eval.txt")
    corpus = inputs.read(run_setup.setup(cfg), True, str(tmp_path / "runs" / "x"), print)[0]
    assert corpus["train"]["tokens"] == 10 * 301


def test_a_resume_under_another_tokenizer_is_one_line(bpe_path, sp_path):
    from gspmd_tp.data import tokenizer

    saved = {"tokenizer": tokenizer.load(bpe_path).digest}
    inputs.check_tokenizer(saved, data_config(tokenizer=bpe_path), "runs/x")  # the same: no error
    inputs.check_tokenizer({}, data_config(), "runs/x")  # a run saved before tokenizers: bytes
    for data, now in [(data_config(tokenizer=sp_path), sp_path), (data_config(), "bytes")]:
        with pytest.raises(UserError, match=r"^runs/x was trained with a tokenizer of sha256 \w+; con") as e:
            inputs.check_tokenizer(saved, data, "runs/x")
        assert now in str(e.value) and "\n" not in str(e.value)
