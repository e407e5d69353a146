"""Hugging Face Llama checkpoints in and out: logits equal transformers' under 1D and 2D sharding.

No download: a small random LlamaForCausalLM is built from a LlamaConfig and saved with
save_pretrained. Every parameter is perturbed away from its default init (norm scales included),
so a mistake in any mapping changes the logits.
"""

import importlib.util
import json
import os
import select
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import LLAMA, child_env, small_config

from gspmd_tp.checkpoint import step_dirs, store
from gspmd_tp.convert import llama
from gspmd_tp.job.errors import UserError
from gspmd_tp.model.transformer import Transformer
from gspmd_tp.storage import lock
from gspmd_tp.train import state as state_lib

ROOT = Path(__file__).resolve().parents[2]
# torch and transformers (the hf extra) are imported by the tests that use them, not when the suite
# is collected: they were a third of each collection's time, paid again by every worker.
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers")),
    reason="needs torch and transformers (the hf extra)",
)

MODELS = {
    "untied": dict(LLAMA, tie_word_embeddings=False),
    # head_dim 16 is not hidden_size / heads (8): the projections change width.
    "tied_wide_heads": dict(LLAMA, tie_word_embeddings=True, head_dim=16),
}


def _hf_model(kind):
    import torch
    import transformers

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
    import torch
    import transformers

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


def _tree(path):
    return {str(p): p.stat().st_mtime_ns for p in path.rglob("*")}


@pytest.mark.parametrize(
    "kind,rules,scan,batch,export",
    # Each kind, rule file, layer layout and export target at least once (an untied model under
    # megatron_1d adds none: the untied mapping is the first case's, megatron_1d's reads the second's).
    [
        # to-hf reads parameters only: a run's batch of 4 does not stop it reading onto dp=8.
        ("untied", "megatron_2d", True, 4, ("dp", "dp=8,mp=1")),
        ("tied_wide_heads", "megatron_1d", True, 8, (None, None)),  # the rules and mesh it was saved with
        # layers_0, layers_1 instead of one stacked axis
        ("tied_wide_heads", "megatron_2d", False, 8, ("fsdp", "dp=8,mp=1")),
    ],
)
def test_import_and_export_reproduce_transformers_logits(
    tmp_path, hf_models, monkeypatch, kind, rules, scan, batch, export
):
    """Each import, restored as train.py does, gives transformers' logits; its export, read onto
    `export` (rules, mesh), gives them again and the very tensors imported, and reads only the
    parameters, writing nothing in the workdir."""
    hf_dir, want = hf_models[kind]
    run = tmp_path / "run"
    config = small_config(rules=rules, mesh="dp=2,mp=4", batch_size=batch, **{"model.scan_layers": scan})
    s = llama.from_hf(str(hf_dir), str(run), config)
    assert s.model_cfg.tie_embeddings == MODELS[kind]["tie_word_embeddings"]
    assert s.model_cfg.num_kv_heads == 4 and s.model_cfg.group == 2

    # What train.py does on resume: restore step 0 into the run's own shardings.
    mngr = store.manager(str(run), keep=3)
    assert mngr.latest_step() == 0
    state, data_state = store.restore(mngr, 0, s.abstract_state)
    store.check_model_matches(store.read_meta(mngr, 0)["model"], s.model_cfg, str(run))
    mngr.close()
    assert data_state == {"next_example": 0} and int(state.step) == 0
    layer = "layers" if scan else "layers_1"
    qkv = state.params[layer]["attn"]["qkv"]
    assert qkv.sharding.spec == s.shardings.params[layer]["attn"]["qkv"].spec
    _assert_close(_our_logits(s, state.params), want)

    # Back out, onto another mesh and rule file (or the saved ones), and into transformers; with a
    # save in flight of a run training in the same workdir, which to-hf must leave alone.
    in_flight = run / "checkpoints" / "2.orbax-checkpoint-tmp-1700000000"
    in_flight.mkdir()
    (in_flight / "half_written").write_bytes(b"\0" * 100)
    before = _tree(run)
    out = tmp_path / "hf"
    with monkeypatch.context() as m:
        m.setattr(store, "_restore_step", lambda *_: pytest.fail("restored the optimizer state too"))
        m.setattr(store, "manager", lambda *_, **__: pytest.fail("opened a CheckpointManager"))
        llama.to_hf(str(run), str(out), rules=export[0], mesh=export[1])
    assert _tree(run) == before, "to-hf wrote in the workdir"
    _assert_close(_hf_logits(out), want)
    from safetensors.numpy import load_file

    exported, original = load_file(out / "model.safetensors"), load_file(hf_dir / "model.safetensors")
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)

    # A second export into the same directory is refused before the checkpoint is read.
    written = _tree(out)
    monkeypatch.setattr(llama.saved_run, "load_setup", lambda *_: pytest.fail("read the checkpoint"))
    with pytest.raises(
        UserError, match=r"--hf_dir=.*/hf is not empty \(it holds config.json, model.safetensors\)"
    ):
        llama.to_hf(str(run), str(out), dtype="bfloat16")
    assert _tree(out) == written


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
    with lock.workdir_lock(str(run)):
        with pytest.raises(UserError, match=r"--workdir=.*/run is in use by another job \(pid \d+"):
            llama.from_hf(str(hf_dir), str(run), small_config())
    assert sorted(p.name for p in run.iterdir()) == ["train.lock"]
    llama.from_hf(str(hf_dir), str(run), small_config())  # the lock went with its holder
    assert step_dirs.steps_on_disk(str(run / "checkpoints")) == [0]


def test_to_hf_checks_hf_base_before_reading_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(llama.saved_run, "load_setup", lambda *_: pytest.fail("read the checkpoint"))
    with pytest.raises(UserError) as e:
        llama.to_hf(str(tmp_path / "run"), str(tmp_path / "hf"), hf_base=str(tmp_path / "nope"))
    assert str(e.value) == (
        f"--hf_base={tmp_path / 'nope'}: no config.json (expected a Hugging Face model directory)"
    )
    assert not (tmp_path / "hf").exists()


# The commands, each run as `python -m gspmd_tp.convert ...` (or `python train.py ...`) runs: under
# `__main__`, in a process of its own with its own exit status, stdout and stderr. Starting Python and
# importing jax for each costs seconds of CPU: one process of this module (the `commands` fixture)
# imports them once, without starting a jax backend, and forks a child per command. The child runs
# the command as Python would run it: an uncaught exception prints its traceback and exits 1, a
# KeyboardInterrupt exits by SIGINT, a SystemExit with its code, and atexit handlers run.
FORK_PER_COMMAND = r"""
import importlib, json, os, runpy, sys
import jax
import gspmd_tp.convert.llama, gspmd_tp.train.loop, gspmd_tp.job.signals  # noqa: F401 (imports only)
from jax._src import xla_bridge

# What the commands run as __main__ is not imported as itself before, as in a process of their own
# (runpy warns on stderr otherwise); what it imports is.
del sys.modules["gspmd_tp.convert.llama"], gspmd_tp.convert.llama

for line in sys.stdin:
    request = json.loads(line)
    # A backend's threads would not survive the fork (jax warns); none has started in this process.
    assert not xla_bridge._backends, "a jax backend started before the fork"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        if request["ctrl_c_at"]:  # a Ctrl-C (KeyboardInterrupt) in place of this function
            module, name = request["ctrl_c_at"]

            def ctrl_c(*_, **__):
                raise KeyboardInterrupt

            setattr(importlib.import_module(module), name, ctrl_c)
        sys.argv = request["argv"]
        if request["argv"][0].endswith(".py"):
            runpy.run_path(request["argv"][0], run_name="__main__")
        else:
            runpy.run_module(request["argv"][0], run_name="__main__", alter_sys=True)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    print(json.dumps(os.waitstatus_to_exitcode(status)), flush=True)
"""


class Commands:
    """run(): one command's (exit status, stdout, stderr), from a child of the forking process."""

    def __init__(self, tmp):
        self.tmp, self.count = tmp, 0
        self.process = subprocess.Popen(
            [sys.executable, "-c", FORK_PER_COMMAND],
            cwd=ROOT,
            env=child_env(),  # the commands ask for their own device count (8)
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, *argv, ctrl_c_at=None):
        """`argv`: the module (as after `python -m`) or the .py file, then its arguments."""
        self.count += 1
        out, err = self.tmp / f"{self.count}.out", self.tmp / f"{self.count}.err"
        request = {"argv": list(argv), "stdout": str(out), "stderr": str(err), "ctrl_c_at": ctrl_c_at}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        # One reply line per request: nothing is ever left in the pipe's buffer for select to miss.
        assert select.select([self.process.stdout], [], [], 300)[0], f"{argv} ran past 300 s"
        reply = self.process.stdout.readline()
        assert reply, f"the forking process ended (status {self.process.wait()})"
        return subprocess.CompletedProcess(argv, json.loads(reply), out.read_text(), err.read_text())

    def ok(self, *argv):
        result = self.run(*argv)
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    c = Commands(tmp_path_factory.mktemp("commands"))
    yield c
    c.process.stdin.close()
    try:
        assert c.process.wait(timeout=60) == 0
    finally:
        c.process.kill()  # where a command was left running


def test_commands_refuse_unwritable_outputs_in_one_line(commands):
    for command, flags, message in [
        ("from-hf", ["--hf_dir=/nonexistent", "--workdir=/dev/null/run"], "--workdir=/dev/null/run"),
        ("to-hf", ["--workdir=/nonexistent", "--hf_dir=/dev/null/hf"], "--hf_dir=/dev/null/hf"),
    ]:
        result = commands.run("gspmd_tp.convert", command, *flags)
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
def test_a_flag_the_command_would_ignore_is_refused(commands, tmp_path, command, flags, message):
    result = commands.run(
        "gspmd_tp.convert", command, f"--workdir={tmp_path / 'run'}", f"--hf_dir={tmp_path / 'hf'}", *flags
    )
    assert result.returncode == 1 and result.stdout == "", result.stderr[-2000:]
    assert result.stderr.startswith(f"error: {message}") and result.stderr.count("\n") == 1
    assert os.listdir(tmp_path) == []


def test_an_unknown_command_is_named(commands):
    result = commands.run("gspmd_tp.convert", "to_hf", "--workdir=/nonexistent")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(
        "error: unknown command 'to_hf'; usage: python -m gspmd_tp.convert {from-hf,to-hf}"
    )
    assert result.stderr.count("\n") == 1


def test_a_positional_argument_after_the_command_is_named(commands, tmp_path):
    result = commands.run(
        "gspmd_tp.convert", "to-hf", f"--workdir={tmp_path}", "--hf_dir=x", "config.steps=5"
    )
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (
        "error: unexpected argument 'config.steps=5' after 'to-hf' (flags are --NAME=VALUE); "
        "usage: python -m gspmd_tp.convert {from-hf,to-hf} --FLAG=VALUE ...\n"
    )


def test_commands_import_fine_tune_with_train_py_and_export(commands, tmp_path, hf_models):
    hf_dir, want = hf_models["untied"]
    run, out = tmp_path / "run", tmp_path / "hf"
    small = ["--config.batch_size=8", "--config.seq_len=32", "--config.eval_batches=1"]
    printed = commands.ok("gspmd_tp.convert", "from-hf", f"--hf_dir={hf_dir}", f"--workdir={run}", *small)
    resume = printed.strip().splitlines()[-1].split()
    assert resume[:2] == ["python", "train.py"] and "--config.model.num_kv_heads=4" in resume

    assert all(flag in resume for flag in small)  # seq_len must match on resume: the import's overrides carry
    # The printed command, as a user would run it, resumes from the converted step 0, on the user's
    # own data (step 0 has read none, so the import's data does not bind the fine-tune).
    for i in range(40):
        (tmp_path / "mine" / f"doc{i}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "mine" / f"doc{i}.txt").write_text(f"my document {i} " * 30)
    mine = [f"--config.data.train_files={tmp_path}/mine/*.txt", "--config.data.eval_fraction=0.5"]
    trained = commands.ok(
        *resume[1:], *mine, "--config.steps=2", "--config.log_every=1", "--config.eval_every=2"
    )
    assert "resumed from step 0" in trained and "step 2/2 | loss" in trained
    assert "learning-rate schedule differs" not in trained  # step 0 trained on no schedule
    assert sorted(os.listdir(run / "checkpoints")) == ["0", "2"]

    export = ["gspmd_tp.convert", "to-hf", f"--workdir={run}", f"--hf_dir={out}", f"--hf_base={hf_dir}"]
    commands.ok(*export, "--dtype=bfloat16")
    assert (out / "generation_config.json").is_file()
    conf = json.loads((out / "config.json").read_text())
    assert conf["dtype"] == "bfloat16" and conf["rope_parameters"]["rope_theta"] == 500000.0
    fine_tuned = _hf_logits(out)
    assert np.isfinite(fine_tuned).all() and not np.allclose(fine_tuned, want)  # two steps moved it


def _ctrl_c(*_, **__):
    raise KeyboardInterrupt


@pytest.fixture(scope="module")
def untied_run(tmp_path_factory, hf_models):
    """A run of the untied model imported under small_config(), for the tests that only export it
    (to-hf writes nothing in the workdir: test_import_and_export_reproduce_transformers_logits)."""
    run = tmp_path_factory.mktemp("untied_run") / "run"
    llama.from_hf(str(hf_models["untied"][0]), str(run), small_config())
    return run


@pytest.mark.parametrize("existing", [False, True], ids=["new_dir", "empty_dir"])
def test_an_export_cut_short_by_ctrl_c_is_removed(tmp_path, untied_run, monkeypatch, existing):
    """The weights were written when Ctrl-C came: left there without their config.json they passed
    for part of a model, and the next export into the directory was refused as not empty."""
    run, out = untied_run, tmp_path / "hf"
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
def test_ctrl_c_is_one_line_and_status_130(commands, tmp_path, command, at, left):
    """Was KeyboardInterrupt's traceback, from inside jax or orbax."""
    run, out = tmp_path / "run", tmp_path / "hf"
    result = commands.run(
        "gspmd_tp.convert",
        command,
        f"--workdir={run}",
        f"--hf_dir={out}",
        ctrl_c_at=(f"gspmd_tp.{at[0]}", at[1]),
    )
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
    import torch
    import transformers

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
