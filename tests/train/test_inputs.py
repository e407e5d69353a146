"""A run's inputs: the corpus and config.init_from's parameters, read from files."""

from conftest import small_config, write

from gspmd_tp.train import inputs, run_setup


def test_the_trainer_reads_no_data_from_its_own_workdir(tmp_path):
    write(tmp_path / "data" / "a.jsonl", "".join(f'{{"text": "{"x" * 300}"}}\n' for _ in range(10)))
    write(tmp_path / "eval.txt", "e" * 300)
    write(tmp_path / "runs" / "x" / "metrics.jsonl", '{"step": 2, "loss": 5.0}\n')  # as a first start leaves
    cfg = small_config()
    cfg.data.train_files, cfg.data.eval_files = str(tmp_path / "**" / "*.jsonl"), str(tmp_path / "eval.txt")
    corpus = inputs.read(run_setup.setup(cfg), True, str(tmp_path / "runs" / "x"), print)[0]
    assert corpus["train"]["tokens"] == 10 * 301
