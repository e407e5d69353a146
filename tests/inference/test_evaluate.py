"""Evaluation from a checkpoint: the trainer's eval loss, per-token and per-byte figures, the
loss-curve PNG, and one-line errors."""

import json
import math
import shutil

import pytest

from gspmd_tp.checkpoint import tool
from gspmd_tp.inference import evaluate, generate, saved_run
from gspmd_tp.job.errors import UserError
from gspmd_tp.train import run_setup


def test_loss_equals_the_trainers_eval_loss(trained_workdir, capsys):
    assert evaluate.main(["--workdir", str(trained_workdir), "--json", "--config.mesh=dp=4,mp=2"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = [json.loads(line) for line in (trained_workdir / "metrics.jsonl").read_text().splitlines()]
    assert result["step"] == rows[-1]["step"] == 4 and result["mesh"] == "dp=4,mp=2"
    # Same parameters and batches, another mesh: the eval_loss training logged at step 4.
    assert result["loss"] == pytest.approx(rows[-1]["eval_loss"], rel=1e-5)
    assert result["tokens"] == 1 * 8 * 32 and result["bytes"] == result["tokens"]  # 1 batch of 8 x 32
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))
    assert result["bits_per_byte"] == pytest.approx(result["loss"] / math.log(2))
    assert result["byte_perplexity"] == pytest.approx(2 ** result["bits_per_byte"])


def test_report_and_plot(trained_workdir, tmp_path, capsys):
    png = tmp_path / "loss.png"
    argv = ["--workdir", str(trained_workdir), "--eval_batches=2", f"--plot={png}"]
    assert evaluate.main(argv) == 0
    out = capsys.readouterr().out
    assert "held-out: 2 batches, 512 tokens (512 bytes)" in out
    assert "nats/token" in out and "bits/byte" in out and f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    png.unlink()
    assert evaluate.main(["--workdir", str(trained_workdir), f"--plot={png}", "--plot_only"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--eval_batches=0"], "--eval_batches must be a positive integer or all, got '0'"),
        (["--eval_batches=al"], "--eval_batches must be a positive integer or all, got 'al'"),
        (["--step=3"], "checkpoints: no step 3 (have 2, 4)"),
        (["--plot_only"], "--plot_only needs --plot=PNG"),
        (["--config.rules=nonexistent"], "rule file 'nonexistent' not found"),
        (["--plot=/dev/null/loss.png"], "--plot=/dev/null/loss.png: /dev/null is a file, not a directory"),
        (["--plot=/tmp/loss.jpgg"], "--plot=/tmp/loss.jpgg: the extension .jpgg is not an image format"),
        (  # not train.py's "use a new --workdir": nothing is written here
            ["--config.model.scan_layers=False"],
            "holds a checkpoint of a different model (scan_layers: saved True, now False; parameters: ",
        ),
        (["--config.model.d_model=32"], "; the parameters are read as saved: leave out the --config.model"),
    ],
)
def test_bad_input_is_one_line(trained_workdir, monkeypatch, capsys, args, message):
    monkeypatch.setattr(saved_run, "restore_params", lambda *_: pytest.fail("read parameters"))
    assert evaluate.main(["--workdir", str(trained_workdir), *args]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err


def test_a_run_saved_before_newer_config_keys_or_with_a_read_ahead_over_todays_bound_evaluates_and_samples(
    trained_workdir, tmp_path, capsys
):
    """Keys added to the config since a run was saved (data.prefetch, model.attention) take defaults;
    keys no longer read (optim.schedule_kind here) are left out. Only training reads ahead: evaluate
    and generate read a run whose saved config.data.prefetch is over the bound data.check_prefetch
    sets now (a run saved before there was one). One copy of the run holds both: step 4 without
    the newer keys, step 2 with the read-ahead."""
    old = tmp_path / "old"
    shutil.copytree(trained_workdir, old)
    for meta_file in old.glob("checkpoints/4/meta/metadata"):
        meta = json.loads(meta_file.read_text())
        del meta["config"]["data"]["prefetch"], meta["config"]["model"]["attention"]
        del meta["model"]["attention"]
        meta["config"]["optim"]["schedule_kind"] = "cosine"
        meta_file.write_text(json.dumps(meta))
    for meta_file in old.glob("checkpoints/2/meta/metadata"):
        meta = json.loads(meta_file.read_text())
        meta["config"]["data"]["prefetch"] = 10**9
        meta_file.write_text(json.dumps(meta))
    assert evaluate.main(["--workdir", str(old), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 4
    assert evaluate.main(["--workdir", str(old), "--json", "--step=2"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2
    # The sampler test_generate's CLI tests compile (5 positions, 3 new tokens, greedy).
    argv = ["--workdir", str(old), "--step=2", "--prompt=abcd", "--max_new_tokens=3", "--temperature=0"]
    assert generate.main(argv) == 0
    assert capsys.readouterr().out.startswith("abcd")


def test_no_checkpoint_or_metrics_is_one_line(tmp_path, capsys):
    assert evaluate.main(["--workdir", str(tmp_path)]) == 1
    assert "no checkpoint found" in capsys.readouterr().err
    assert evaluate.main(["--workdir", str(tmp_path), "--plot=x.png", "--plot_only"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "metrics.jsonl: no such file" in err and "\n" not in err


@pytest.mark.parametrize(
    "main, args, message",
    [
        (
            evaluate.main,
            ["--workdir=x", "--step=abc"],
            "flag --step=abc: invalid literal for int() with base 10: 'abc' (--helpshort lists the flags)",
        ),
        (
            generate.main,
            ["--workdir=x", "--top_k=k"],
            "flag --top_k=k: invalid literal for int() with base 10: 'k' (--helpshort lists the flags)",
        ),
        (generate.main, ["--workdir=x", "--prompt=x", "--nonsense"], "Unknown command line flag 'nonsense'"),
        (generate.main, ["--prompt=x"], "flag --workdir=None: Flag --workdir must have a value other"),
        (
            evaluate.main,
            ["--workdir=x", "config.mesh=dp=8"],
            "unexpected argument 'config.mesh=dp=8' (flags are --NAME=VALUE, config keys --config.KEY=VALUE)",
        ),
        (tool.main, ["infoo", "x"], "unknown command 'infoo'; usage: python -m gspmd_tp.checkpoint info DIR"),
        (tool.main, ["export", "x"], "export takes DIR OUT.npz (1 given); usage: "),
        (tool.main, ["info", "x", "--step=-"], "flag --step=-: invalid literal for int()"),
    ],
)
def test_flag_mistakes_are_one_line(capsys, main, args, message):
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_a_flag_left_out_takes_its_default_not_an_earlier_calls_value(trained_workdir, tmp_path, capsys):
    """main() parses the command's own flags afresh at each call (tests and a job's processes call it
    in one process): --plot_only given once must not hold for the next call."""
    png = tmp_path / "loss.png"
    assert evaluate.main(["--workdir", str(trained_workdir), f"--plot={png}", "--plot_only"]) == 0
    assert capsys.readouterr().out.strip() == f"plot: {png}"
    assert evaluate.main(["--workdir", str(trained_workdir), "--json", "--step=2"]) == 0
    result = json.loads(capsys.readouterr().out)  # evaluated, and not plotted
    # An older step asked for is the one evaluated: the eval_loss training logged at step 2.
    rows = {
        r["step"]: r for r in map(json.loads, (trained_workdir / "metrics.jsonl").read_text().splitlines())
    }
    assert result["step"] == 2 and result["loss"] == pytest.approx(rows[2]["eval_loss"], rel=1e-5)
    assert evaluate.main(["--workdir", str(trained_workdir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 4  # the newest again


def test_help_lists_the_commands_own_flags_and_the_job_flags(capsys):
    for main, own in ((evaluate.main, "--plot"), (generate.main, "--prompts_file"), (tool.main, "--step")):
        with pytest.raises(SystemExit) as e:
            main(["--helpshort"])
        out = capsys.readouterr().out
        assert e.value.code == 0 and f"  {own}:" in out, out
        assert ("  --num_processes:" in out) == (main is not tool.main), out


@pytest.mark.parametrize(
    "chars, batches, windows",
    [(800, 4, 25), (100, 1, 3)],  # chars + 1 tokens with the separator, in windows of 32 + 1
    ids=["last-batch-partial", "less-than-a-batch"],
)
def test_more_batches_than_the_held_out_split_are_one_pass(
    trained_workdir, tmp_path, capsys, chars, batches, windows
):
    """Every held-out window counts once: the pass's last batch is filled with padding, not with
    windows read again, and the padding counts no token."""
    held_out = tmp_path / "held_out.txt"
    held_out.write_text("x" * chars)
    argv = ["--workdir", str(trained_workdir), "--eval_batches=all", f"--config.data.eval_files={held_out}"]
    assert evaluate.main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["eval_batches"] == batches and result["tokens"] == windows * 32


def test_a_partial_newest_checkpoint_falls_back_to_the_one_before(trained_workdir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_workdir, run)
    shutil.rmtree(run / "checkpoints" / "4" / "meta")
    assert evaluate.main(["--workdir", str(run), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["step"] == 2
    assert captured.err.strip() == (
        f"warning: skipping checkpoint {run / 'checkpoints' / '4'}: partial or corrupted "
        "(FileNotFoundError: item 'meta' is missing)"
    )


def test_steps_logged_again_after_a_resume_are_drawn_once(tmp_path):
    """A resume from step 2 after step 4 was logged logs steps 3 and 4 again; the later rows count."""
    losses = [(1, 5.0), (2, 4.0), (3, 3.9), (4, 3.8), (3, 3.7), (4, 3.6), (5, 3.5)]
    lines = [json.dumps({"step": step, "loss": loss}) + "\n" for step, loss in losses]
    (tmp_path / "metrics.jsonl").write_text("".join(lines))
    rows = evaluate.read_metrics(str(tmp_path))
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 5.0), (2, 4.0), (3, 3.7), (4, 3.6), (5, 3.5)]


def test_an_evaluation_step_too_large_for_memory_is_one_line_before_any_read(
    trained_workdir, monkeypatch, capsys
):
    monkeypatch.setattr(run_setup, "_host_memory", lambda: 2**20)  # a host of 1 MiB
    monkeypatch.setattr(saved_run, "params_for", lambda *a, **k: pytest.fail("read before checking memory"))
    assert evaluate.main(["--workdir", str(trained_workdir)]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("error: the compiled evaluation step needs 8 CPU devices x ") and err.count("\n") == 1
    )
    assert "more than this host's 0.0 GiB of RAM; shrink --config.batch_size or --config.seq_len" in err


def test_held_out_files_that_are_gone_are_one_line_before_compiling_or_reading(
    trained_workdir, tmp_path, monkeypatch, capsys
):
    # Before, the eval step compiled and the parameters were read (minutes on a large model) first.
    monkeypatch.setattr(
        evaluate, "compiled_eval_step", lambda *_: pytest.fail("compiled before reading data")
    )
    monkeypatch.setattr(saved_run, "params_for", lambda *a, **k: pytest.fail("read parameters before data"))
    gone = tmp_path / "moved" / "*.txt"
    assert evaluate.main(["--workdir", str(trained_workdir), f"--config.data.eval_files={gone}"]) == 1
    err = capsys.readouterr().err
    assert err == f"error: config.data.eval_files: no file matches '{gone}'\n"


def test_a_held_out_split_edited_since_the_checkpoint_is_noted(trained_workdir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_workdir, run)
    assert evaluate.main(["--workdir", str(run), "--json"]) == 0
    assert capsys.readouterr().err == ""  # the same held-out tokens as at step 4
    meta_file = run / "checkpoints" / "4" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    saved = meta["corpus"]["held_out"]
    meta["corpus"]["held_out"] = {"tokens": saved["tokens"] - 7, "sha256": "0" * 16}  # as if edited since
    meta_file.write_text(json.dumps(meta))
    assert evaluate.main(["--workdir", str(run), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["step"] == 4
    assert captured.err == (
        f"note: the held-out split changed since step 4 was saved ({saved['tokens'] - 7:,} tokens, now "
        f"{saved['tokens']:,}; its files were edited): this loss does not compare with the run's eval_loss\n"
    )
    # Other held-out data asked for on purpose is no change to note.
    other = tmp_path / "other.txt"
    other.write_text("x" * 100)
    assert evaluate.main(["--workdir", str(run), "--json", f"--config.data.eval_files={other}"]) == 0
    assert capsys.readouterr().err == ""


def test_a_last_metrics_line_cut_short_by_a_kill_is_left_out(tmp_path, capsys):
    # A run killed while writing a row leaves no newline after it; --plot refused the whole file.
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n{"step": 3, "lo'
    )
    assert [r["step"] for r in evaluate.read_metrics(str(tmp_path))] == [1, 2]
    assert capsys.readouterr().err == (
        f"note: {tmp_path / 'metrics.jsonl'}:3 was cut short (the run was killed writing it); left out\n"
    )
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 5.0}\n{"step": 2, "lo\n{"step": 3, "loss": 3.0}\n'
    )
    with pytest.raises(UserError, match=r"metrics\.jsonl:2: not a JSON object$"):  # not the last line
        evaluate.read_metrics(str(tmp_path))


def test_ctrl_c_is_one_line_and_status_130(trained_workdir, monkeypatch, capsys):
    # Was KeyboardInterrupt's traceback from inside jax.
    def interrupted(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(saved_run, "params_for", interrupted)
    assert evaluate.main(["--workdir", str(trained_workdir)]) == 130
    assert capsys.readouterr().err == "stopped by Ctrl-C (nothing in the workdir was written)\n"
