"""Hugging Face Llama checkpoints in and out: logits equal transformers' under 1D and 2D sharding.

No download: a small random LlamaForCausalLM is built from a LlamaConfig and saved with
save_pretrained. Every parameter is perturbed away from its default init (norm scales included),
so a mistake in any mapping changes the logits.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import CTRL_C_AT, LLAMA, child_env, small_config

from gspmd_tp.checkpoint import step_dirs, store
from gspmd_tp.convert import llama
from gspmd_tp.job import output_paths
from gspmd_tp.job.errors import UserError
from gspmd_tp.model.transformer import Transformer
from gspmd_tp.train import state as state_lib

ROOT = Path(__file__).resolve().parents[2]
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MODELS = {
    "untied": dict(LLAMA, tie_word_embeddings=False),
    # head_dim 16 is not hidden_size / heads (8): the projections change width.
    "tied_wide_heads": dict(LLAMA, tie_word_embeddings=True, head_dim=16),
}


def _hf_model(kind):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**MODELS[kind])
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """{kind: (directory, logits of transformers on TOKENS)} for each model."""
    out = {}
    for kind in MODELS:
        model = _hf_model(kind)
        path = tmp_path_factory.mktemp(kind)
        model.save_pretrained(path)
        out[kind] = (path, _hf_logits(path))
    return out


TOKENS = np.random.default_rng(0).integers(0, 256, (2, 24), dtype=np.int32)


def _hf_logits(path):
    model = transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS.astype(np.int64))).logits.float().numpy()


def _our_logits(s, params):
    model = Transformer(s.model_cfg)
    with state_lib.sharding_context(s.mesh, s.rules):
        fwd = jax.jit(
            lambda p, t: model.apply({"params": p}, t), in_shardings=(s.shardings.params, s.batch_sharding)
        )
        return np.asarray(fwd(params, jax.device_put(TOKENS, s.batch_sharding)))


def _assert_close(ours, theirs):
    # Relative to the logits' scale: individual logits near 0 make a per-element rtol meaningless.
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"max |ours - transformers| / max |transformers| = {rel:.2e}")
    assert rel < 1e-4, rel


@pytest.mark.parametrize(
    "kind,rules,scan",
    [
        ("untied", "megatron_1d", True),
        ("untied", "megatron_2d", True),
        ("tied_wide_heads", "megatron_1d", True),
        ("tied_wide_heads", "megatron_2d", False),  # layers_0, layers_1 instead of one stacked axis
    ],
)
def test_import_and_export_reproduce_transformers_logits(tmp_path, hf_models, kind, rules, scan):
    hf_dir, want = hf_models[kind]
    run = tmp_path / "run"
    config = small_config(rules=rules, mesh="dp=2,mp=4", **{"model.scan_layers": scan})
    s = llama.from_hf(str(hf_dir), str(run), config)
    assert s.model_cfg.tie_embeddings == MODELS[kind]["tie_word_embeddings"]
    assert s.model_cfg.num_kv_heads == 4 and s.model_cfg.group == 2

    # What train.py does on resume: restore step 0 into the run's own shardings.
    mngr = store.manager(str(run), keep=3)
    assert mngr.latest_step() == 0
    state, data_state = store.restore(mngr, 0, s.abstract_state)
    store.check_model_matches(store.read_meta(mngr, 0)["model"], s.model_cfg, str(run))
    assert data_state == {"next_example": 0} and int(state.step) == 0
    layer = "layers" if scan else "layers_1"
    qkv = state.params[layer]["attn"]["qkv"]
    assert qkv.sharding.spec == s.shardings.params[layer]["attn"]["qkv"].spec
    _assert_close(_our_logits(s, state.params), want)

    # Back out, onto another mesh and rule file, and into transformers.
    out = tmp_path / "hf"
    llama.to_hf(str(run), str(out), rules="fsdp", mesh="dp=8,mp=1")
    _assert_close(_hf_logits(out), want)
    from safetensors.numpy import load_file

    exported, original = load_file(out / "model.safetensors"), load_file(hf_dir / "model.safetensors")
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)


def test_vocab_the_mesh_does_not_divide_is_an_error(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(LLAMA, vocab_size=258)))
    with pytest.raises(UserError, match=r"vocab=258\) is not divisible by mesh axes mp=4"):
        llama.from_hf(str(tmp_path / "hf"), str(tmp_path / "run"), small_config(rules="megatron_1d"))
    assert not (tmp_path / "run").exists()  # nothing written


def test_tensor_that_does_not_match_config_json_is_named(tmp_path, hf_models):
    hf_dir, _ = hf_models["untied"]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
    conf = json.loads((hf_dir / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**conf, "intermediate_size": 128}))
    with pytest.raises(UserError, match=r"mlp.gate_proj.weight has shape \(96, 64\), config.json implies"):
        llama.from_hf(str(tmp_path / "hf"), str(tmp_path / "run"), small_config())
    assert not (tmp_path / "run").exists()  # no empty checkpoints/ left behind


def test_import_into_a_workdir_in_use_writes_nothing(tmp_path, hf_models):
    """A training run just started there holds the lock and has no checkpoint yet: a step 0
    written under it would be resumed from by neither or both."""
    hf_dir, _ = hf_models["untied"]
    run = tmp_path / "run"
    run.mkdir()
    with output_paths.workdir_lock(str(run)):
        with pytest.raises(UserError, match=r"--workdir=.*/run is in use by another job \(pid \d+"):
            llama.from_hf(str(hf_dir), str(run), small_config())
    assert sorted(p.name for p in run.iterdir()) == ["train.lock"]
    llama.from_hf(str(hf_dir), str(run), small_config())  # the lock went with its holder
    assert step_dirs.steps_on_disk(str(run / "checkpoints")) == [0]


def test_export_onto_a_mesh_the_training_batch_does_not_divide(tmp_path, hf_models):
    """to-hf reads parameters only: a run's batch of 4 does not stop it reading onto dp=8."""
    hf_dir, want = hf_models["untied"]
    run = tmp_path / "run"
    llama.from_hf(str(hf_dir), str(run), small_config(batch_size=4))  # megatron_2d on dp=2,mp=4
    llama.to_hf(str(run), str(tmp_path / "hf"), rules="dp", mesh="dp=8,mp=1")
    _assert_close(_hf_logits(tmp_path / "hf"), want)


def _tree(path):
    return {str(p): p.stat().st_mtime_ns for p in path.rglob("*")}


def test_to_hf_reads_only_the_parameters_and_writes_nothing_in_the_workdir(tmp_path, hf_models, monkeypatch):
    hf_dir, want = hf_models["untied"]
    run = tmp_path / "run"
    llama.from_hf(str(hf_dir), str(run), small_config(rules="megatron_1d"))
    # A save in flight of a run training in the same workdir: to-hf must leave it alone.
    in_flight = run / "checkpoints" / "2.orbax-checkpoint-tmp-1700000000"
    in_flight.mkdir()
    (in_flight / "half_written").write_bytes(b"\0" * 100)
    before = _tree(run)
    monkeypatch.setattr(store, "_restore_step", lambda *_: pytest.fail("restored the optimizer state too"))
    monkeypatch.setattr(store, "manager", lambda *_, **__: pytest.fail("opened a CheckpointManager"))
    llama.to_hf(str(run), str(tmp_path / "hf"))
    assert _tree(run) == before
    _assert_close(_hf_logits(tmp_path / "hf"), want)
    # A second export into the same directory is refused before the checkpoint is read.
    exported = _tree(tmp_path / "hf")
    monkeypatch.setattr(llama.saved_run, "load_setup", lambda *_: pytest.fail("read the checkpoint"))
    with pytest.raises(
        UserError, match=r"--hf_dir=.*/hf is not empty \(it holds config.json, model.safetensors\)"
    ):
        llama.to_hf(str(run), str(tmp_path / "hf"), dtype="bfloat16")
    assert _tree(tmp_path / "hf") == exported


def test_to_hf_checks_hf_base_before_reading_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(llama.saved_run, "load_setup", lambda *_: pytest.fail("read the checkpoint"))
    with pytest.raises(UserError) as e:
        llama.to_hf(str(tmp_path / "run"), str(tmp_path / "hf"), hf_base=str(tmp_path / "nope"))
    assert str(e.value) == (
        f"--hf_base={tmp_path / 'nope'}: no config.json (expected a Hugging Face model directory)"
    )
    assert not (tmp_path / "hf").exists()


def _cli(*args):
    env = child_env()  # the commands ask for 8 devices
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_commands_refuse_unwritable_outputs_in_one_line():
    env = child_env()
    for command, flags, message in [
        ("from-hf", ["--hf_dir=/nonexistent", "--workdir=/dev/null/run"], "--workdir=/dev/null/run"),
        ("to-hf", ["--workdir=/nonexistent", "--hf_dir=/dev/null/hf"], "--hf_dir=/dev/null/hf"),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "gspmd_tp.convert", command, *flags],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
        last = result.stderr.strip().splitlines()[-1]
        assert last == f"error: {message}: /dev/null is a file, not a directory"


@pytest.mark.parametrize(
    "command, flags, message",
    [
        (
            "from-hf",
            ["--dtype=bfloat16", "--step=3"],
            "--step, --dtype: to-hf flags; from-hf takes the rules",
        ),
        ("to-hf", ["--config.steps=3"], "--config.steps: from-hf flags; to-hf reads the run's saved config"),
        ("to-hf", ["--host_device_count=0"], "--host_device_count=0: must be 1 or more"),
    ],
)
def test_a_flag_the_command_would_ignore_is_refused(tmp_path, command, flags, message):
    env = child_env()
    result = subprocess.run(
        [sys.executable, "-m", "gspmd_tp.convert", command, f"--workdir={tmp_path / 'run'}",
         f"--hf_dir={tmp_path / 'hf'}", *flags],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1 and result.stdout == "", result.stderr[-2000:]
    assert result.stderr.startswith(f"error: {message}") and result.stderr.count("\n") == 1
    assert os.listdir(tmp_path) == []


def test_an_unknown_command_is_named():
    result = subprocess.run(
        [sys.executable, "-m", "gspmd_tp.convert", "to_hf", "--workdir=/nonexistent"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(
        "error: unknown command 'to_hf'; usage: python -m gspmd_tp.convert {from-hf,to-hf}"
    )
    assert result.stderr.count("\n") == 1


def test_a_positional_argument_after_the_command_is_named(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "gspmd_tp.convert", "to-hf", f"--workdir={tmp_path}", "--hf_dir=x",
         "config.steps=5"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (
        "error: unexpected argument 'config.steps=5' after 'to-hf' (flags are --NAME=VALUE); "
        "usage: python -m gspmd_tp.convert {from-hf,to-hf} --FLAG=VALUE ...\n"
    )


def test_commands_import_fine_tune_with_train_py_and_export(tmp_path, hf_models):
    hf_dir, want = hf_models["untied"]
    run, out = tmp_path / "run", tmp_path / "hf"
    small = ["--config.batch_size=8", "--config.seq_len=32", "--config.eval_batches=1"]
    printed = _cli("-m", "gspmd_tp.convert", "from-hf", f"--hf_dir={hf_dir}", f"--workdir={run}", *small)
    resume = printed.strip().splitlines()[-1].split()
    assert resume[:2] == ["python", "train.py"] and "--config.model.num_kv_heads=4" in resume

    assert all(flag in resume for flag in small)  # seq_len must match on resume: the import's overrides carry
    # The printed command, as a user would run it, resumes from the converted step 0, on the user's
    # own data (step 0 has read none, so the import's data does not bind the fine-tune).
    for i in range(40):
        (tmp_path / "mine" / f"doc{i}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "mine" / f"doc{i}.txt").write_text(f"my document {i} " * 30)
    mine = [f"--config.data.train_files={tmp_path}/mine/*.txt", "--config.data.eval_fraction=0.5"]
    trained = _cli(*resume[1:], *mine, "--config.steps=2", "--config.log_every=1", "--config.eval_every=2")
    assert "resumed from step 0" in trained and "step 2/2 | loss" in trained
    assert "learning-rate schedule differs" not in trained  # step 0 trained on no schedule
    assert sorted(os.listdir(run / "checkpoints")) == ["0", "2"]

    export = ["-m", "gspmd_tp.convert", "to-hf", f"--workdir={run}", f"--hf_dir={out}", f"--hf_base={hf_dir}"]
    _cli(*export, "--dtype=bfloat16")
    assert (out / "generation_config.json").is_file()
    conf = json.loads((out / "config.json").read_text())
    assert conf["dtype"] == "bfloat16" and conf["rope_parameters"]["rope_theta"] == 500000.0
    fine_tuned = _hf_logits(out)
    assert np.isfinite(fine_tuned).all() and not np.allclose(fine_tuned, want)  # two steps moved it


def _ctrl_c(*_, **__):
    raise KeyboardInterrupt


@pytest.mark.parametrize("existing", [False, True], ids=["new_dir", "empty_dir"])
def test_an_export_cut_short_by_ctrl_c_is_removed(tmp_path, hf_models, monkeypatch, existing):
    """The weights were written when Ctrl-C came: left there without their config.json they passed
    for part of a model, and the next export into the directory was refused as not empty."""
    run, out = tmp_path / "run", tmp_path / "hf"
    llama.from_hf(str(hf_models["untied"][0]), str(run), small_config())
    if existing:
        out.mkdir()
    monkeypatch.setattr(llama.hf_layout, "hf_config", _ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        llama.to_hf(str(run), str(out))
    assert (list(out.iterdir()) == []) if existing else not out.exists()


def test_an_import_cut_short_by_ctrl_c_leaves_no_checkpoints(tmp_path, hf_models, monkeypatch):
    """A save in flight when Ctrl-C came left checkpoints/ with a partial step 0 in it, which train.py
    set aside and began from scratch, where the user meant to fine-tune the import."""
    run = tmp_path / "run"

    def cut_short(mngr, *_):
        (run / "checkpoints" / "0.orbax-checkpoint-tmp-1700000000" / "state").mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(llama.store, "save", cut_short)
    with pytest.raises(KeyboardInterrupt):
        llama.from_hf(str(hf_models["untied"][0]), str(run), small_config())
    assert not run.exists()  # the workdir it created, with the lock, went too


@pytest.mark.parametrize(
    "command, at, left",
    [
        ("from-hf", ("convert.hf_layout", "read_hf_config"), "no step 0 left in --workdir={run}"),
        (
            "to-hf",
            ("inference.saved_run", "load_setup"),
            "no export left in --hf_dir={out}; nothing in the workdir was",
        ),
    ],
)
def test_ctrl_c_is_one_line_and_status_130(tmp_path, command, at, left):
    """Was KeyboardInterrupt's traceback, from inside jax or orbax."""
    run, out = tmp_path / "run", tmp_path / "hf"
    script = CTRL_C_AT.format(
        module=f"gspmd_tp.{at[0]}", name=at[1], argv0="convert", run="run_module", target="gspmd_tp.convert"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, command, f"--workdir={run}", f"--hf_dir={out}"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 130, result.stderr[-2000:]
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(f"stopped by Ctrl-C ({left.format(run=run, out=out)}")
    )
    assert "Traceback" not in result.stderr and not run.exists() and not out.exists()


def test_an_imported_model_brings_its_tokenizer_and_generate_prints_text(tmp_path, bpe_path, capsys):
    """from-hf records the model directory's tokenizer.json in the run's config: generate encodes a
    text prompt and prints text through it, with no tokenizer flag."""
    from gspmd_tp.inference import generate

    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(LLAMA, vocab_size=300))).save_pretrained(
        hf_dir
    )
    shutil.copy(bpe_path, hf_dir / "tokenizer.json")
    s = llama.from_hf(str(hf_dir), str(tmp_path / "run"), small_config())
    assert s.config.data.tokenizer == str(hf_dir.resolve()) and s.model_cfg.vocab_size == 300
    args = ["--workdir", str(tmp_path / "run"), "--prompt=def f(x):", "--max_new_tokens=6", "--temperature=0"]
    assert generate.main(args) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("def f(x):") and len(printed.strip()) > len("def f(x):"), printed
    # to-hf with no --hf_base carries the tokenizer the run recorded.
    files = llama.to_hf(str(tmp_path / "run"), str(tmp_path / "export"))
    assert str(tmp_path / "export" / "tokenizer.json") in files
    assert (tmp_path / "export" / "tokenizer.json").read_bytes() == Path(bpe_path).read_bytes()
