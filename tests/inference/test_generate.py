"""Sampling: the cache reproduces the full forward pass, any rule file and mesh give the same
tokens, the command line end to end, and one-line errors raised before anything compiles."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import child_env, small_config
from jax.sharding import PartitionSpec as P

from gspmd_tp.inference import generate, saved_run
from gspmd_tp.job.errors import UserError
from gspmd_tp.model.transformer import Transformer
from gspmd_tp.sharding import hlo
from gspmd_tp.train import run_setup
from gspmd_tp.train import state as state_lib

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def main(", "import os\n", "x"]  # three lengths: rows are padded differently


def reference_greedy(s, params, token_lists, steps):
    """Greedy decoding by running the whole sequence through the model again for every token."""
    model = Transformer(s.model_cfg)
    width = max(len(t) for t in token_lists) + steps
    # Right-padded to one width (one compile): causal attention keeps padding out of the logits read.
    forward = jax.jit(lambda p, t: model.apply({"params": p}, t))
    rows = [list(t) for t in token_lists]
    chosen, logits_seen = [], []
    for _ in range(steps):
        batch = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            batch[i, : len(r)] = r
        logits = np.asarray(forward(params, batch))
        last = np.stack([logits[i, len(r) - 1] for i, r in enumerate(rows)])
        nxt = last[:, :256].argmax(-1)
        for r, t in zip(rows, nxt, strict=True):
            r.append(int(t))
        chosen.append(nxt)
        logits_seen.append(last)
    return np.stack(chosen, 1), np.stack(logits_seen, 1)


def test_cached_greedy_decoding_equals_rerunning_the_full_forward_with_unscanned_layers():
    """The scanned layers' case is the trained run's: in the test below, on its reference sampler."""
    config = small_config(**{"model.scan_layers": False, "rules": "megatron_1d"})
    s = run_setup.setup(config)
    assert s.model_cfg.num_heads == 16 and s.model_cfg.num_kv_heads == 8  # grouped key/value heads
    init = lambda key: nn.meta.unbox(Transformer(s.model_cfg).init(key, jnp.zeros((1, 8), jnp.int32)))
    params = jax.jit(lambda key: init(key)["params"], out_shardings=s.shardings.params)(jax.random.key(0))
    token_lists = [generate.encode(p) for p in PROMPTS]
    steps = 6
    got, got_logits = generate.sample_tokens(s, params, token_lists, steps, return_logits=True)
    want, want_logits = reference_greedy(s, params, token_lists, steps)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got_logits, want_logits, atol=2e-5, rtol=1e-4)


def test_cache_is_sharded_by_the_rule_file(config):
    s = run_setup.setup(small_config(rules="megatron_1d", mesh="dp=2,mp=4"))
    shardings = generate.cache_shardings(s, rows=2, prompt_len=5, cache_length=9)
    key = shardings["layers"]["attn"]["key"]
    # (layers, batch, length, kv_heads, head_dim): batch over dp, each device its own kv heads.
    assert key.spec == P(None, "dp", None, "mp", None)
    s = run_setup.setup(small_config(rules="dp", mesh="dp=2,mp=4"))
    assert generate.cache_shardings(s, 8, 5, 9)["layers"]["attn"]["value"].spec == P(
        None, ("dp", "mp"), None, None, None
    )


def _ring_bytes(s, max_new_tokens, compiled=None):
    """Bytes each device sends per call of the compiled greedy sampler (one 10-token prompt);
    `compiled`: that sampler's executable, where it was compiled already."""
    if compiled is None:
        prompt_len = len(generate.encode(PROMPTS[0]))
        run = generate.make_sampler(s, generate.batch_rows(s, 1), prompt_len, max_new_tokens, 0.0, 0)
        compiled = run.compiled()
    return sum(c.ring_bytes_per_call for c in hlo.collectives(compiled.as_text(), s.mesh.size))


def test_parameters_sharded_over_the_batch_axes_are_gathered_once_not_per_token():
    """The decode loop reads the parameters laid out for decoding (replicated over the batch's mesh
    axes), gathered once before it. In their training layout each new token sent 345 KB per device
    under fsdp (66% of the parameters' 526 KB) and 150 KB under megatron_2d on dp=4,mp=2. fsdp's
    case is checked in the fsdp test below, on the sampler it compiles already."""
    s = run_setup.setup(small_config(rules="megatron_2d", mesh="dp=4,mp=2"))
    _check_gathered_once(s, _ring_bytes(s, 4), _ring_bytes(s, 12))


def _check_gathered_once(s, short, long):
    """`short` and `long`: _ring_bytes of 4 and 12 new tokens."""
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(s.abstract_state.params))
    # What does grow per token is the activations' collectives (megatron_2d splits embed over mp in
    # them: 2.2 KB) and the token's gather: under 1% of the parameters, where it was 28% and 66%.
    assert (long - short) / 8 < 0.01 * param_bytes, (short, long, param_bytes)


def test_every_rule_file_and_mesh_generates_the_tokens_and_logits_of_replicated_parameters(
    trained_workdir, tmp_path, capsys
):
    """The trained run read under other rule files and meshes samples what it does with its
    parameters replicated (rules dp: nothing to gather), greedy tokens and logits alike, which is
    what rerunning the full forward pass for every token chooses: under
    megatron_1d, under fsdp and megatron_2d with the parameters laid out for decoding (fsdp on
    dp=8,mp=1 too), and under a rule file that shards the sequence over mp (sampling shards no
    sequence position: a prompt of any length, and the one position decoded at a time, would not
    divide a length rule's mesh axes). Each sampler is compiled once for all these checks."""
    text = (Path(__file__).parents[2] / "rules" / "megatron_1d.yaml").read_text()
    length_mp = tmp_path / "length_mp.yaml"
    length_mp.write_text(
        text.replace("[length, null]", "[length, mp]").replace("[norm_length, null]", "[norm_length, mp]")
    )
    token_lists = [generate.encode(p) for p in PROMPTS]  # up to 10 positions, on mp=4
    prompt_len = max(len(t) for t in token_lists)

    def restored(rules, mesh):  # as generate reads the run
        step, _, s = saved_run.load_setup(str(trained_workdir), {"rules": rules, "mesh": mesh}, sampling=True)
        return s, saved_run.restore_params(str(trained_workdir), step, s)

    def greedy(s, params):
        run = generate.make_sampler(
            s, generate.batch_rows(s, len(token_lists)), prompt_len, 8, 0.0, 0, return_logits=True
        )
        return run.layout(), *generate.sample_tokens(s, params, token_lists, 8, return_logits=True, run=run)

    s, params = restored("dp", "dp=2,mp=4")
    _, want, want_logits = greedy(s, params)
    # The cache reproduces the full forward pass, rerun for every token (grouped key/value heads).
    assert s.model_cfg.num_heads == 16 and s.model_cfg.num_kv_heads == 8 and s.model_cfg.scan_layers
    ref, ref_logits = reference_greedy(s, params, token_lists, 8)
    np.testing.assert_array_equal(want, ref)
    np.testing.assert_allclose(want_logits, ref_logits, atol=2e-5, rtol=1e-4)
    read = {}
    for rules, mesh, layout in [
        ("megatron_1d", "dp=2,mp=4", None),  # its decoding layout is its training one
        ("megatron_2d", "dp=4,mp=2", "decoding"),
        ("fsdp", "dp=2,mp=4", "decoding"),
        ("fsdp", "dp=8,mp=1", "decoding"),
        (str(length_mp), "dp=2,mp=4", None),
    ]:
        read[rules, mesh] = s, params = restored(rules, mesh)
        got_layout, got, got_logits = greedy(s, params)
        assert layout in (None, got_layout), (rules, mesh, got_layout)
        np.testing.assert_array_equal(got, want, err_msg=f"{rules} on {mesh}")
        np.testing.assert_allclose(
            got_logits, want_logits, atol=2e-5, rtol=1e-4, err_msg=f"{rules} on {mesh}"
        )
    p1, p2 = read["megatron_1d", "dp=2,mp=4"][1], read["megatron_2d", "dp=4,mp=2"][1]
    assert p1["layers"]["attn"]["qkv"].sharding.spec != p2["layers"]["attn"]["qkv"].sharding.spec
    # Sampling: the same seed gives the same sample on another mesh (the random bits do not
    # depend on how the logits are sharded: over mp, or not at all). On each mesh these sample as
    # the --prompts_file of test_cli_prints_the_continued_prompts (dp=2,mp=4) and of
    # test_the_training_batch_size_does_not_limit_the_meshes_generate_reads_on (dp=8,mp=1) do:
    # one compile for both.
    s1, p1 = restored("megatron_2d", "dp=2,mp=4")
    s2, p2 = restored("megatron_2d", "dp=8,mp=1")
    two = [generate.encode(p) for p in ("class ", "import ")]
    a = generate.sample_tokens(s1, p1, two, 4, temperature=1.0, top_k=5, seed=3)
    b = generate.sample_tokens(s2, p2, two, 4, temperature=1.0, top_k=5, seed=3)
    np.testing.assert_array_equal(a, b)
    assert ((a >= 0) & (a < 256)).all()
    assert not capsys.readouterr().err  # the layout for decoding fits: no note


def test_fsdp_parameters_are_gathered_once_or_where_that_does_not_fit_sample_in_their_training_layout(
    monkeypatch, capsys
):
    """fsdp's case of test_parameters_sharded_over_the_batch_axes_are_gathered_once_not_per_token
    (in their training layout each new token sent 345 KB per device, 66% of the parameters' 526
    KB), and the same sampler where the layout for decoding does not fit in memory."""
    s = run_setup.setup(small_config(rules="fsdp", mesh="dp=2,mp=4"))
    params = state_lib.init_state(s.model_cfg, s.tx, s.mesh, s.rules, 32, seed=0).params
    token_lists = [generate.encode(PROMPTS[0])]
    rows, prompt_len = generate.batch_rows(s, 1), len(token_lists[0])
    run = generate.make_sampler(s, rows, prompt_len, 4, 0.0, 0)

    def need(layout):  # as run_setup.check_memory counts it: all 8 simulated devices on this host
        m = run.compiled_for(layout).memory_analysis()
        per_device = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
        return 8 * (per_device - m.alias_size_in_bytes)

    assert need("training") < need("decoding")  # the replicated parameters, held through the loop
    decoding = run.compiled_for("decoding")
    # 12 new tokens: a sampler of its own, whose layout is chosen in this host's memory.
    _check_gathered_once(s, _ring_bytes(s, 4, decoding), _ring_bytes(s, 12))
    assert not capsys.readouterr().err
    # A host where only the training layout fits: `run` chooses its layout at its first use.
    monkeypatch.setattr(run_setup, "_host_memory", lambda: (need("training") + need("decoding")) // 2)
    got = generate.sample_tokens(s, params, token_lists, 4, run=run)
    assert run.layout() == "training"
    want = generate.sample_tokens(s, params, token_lists, 4, run=decoding)
    np.testing.assert_array_equal(got, want)
    err = capsys.readouterr().err
    assert err.startswith(
        "note: the compiled sampling step with the parameters replicated over dp, mp for decoding needs "
        "8 CPU devices x "
    ), err
    assert err.endswith(
        "; sampling with them in their training layout, gathered over dp, mp for every new token\n"
    )
    assert err.count("\n") == 1


def test_cli_prints_the_continued_prompts(trained_workdir, tmp_path, capsys):
    # The sampler of test_parameters_sharded_over_the_batch_axes_are_gathered_once_not_per_token.
    argv = ["--workdir", str(trained_workdir), "--max_new_tokens=4", "--temperature=0"]
    assert generate.main([*argv, f"--prompt={PROMPTS[0]}", "--config.mesh=dp=4,mp=2"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(PROMPTS[0]) and "step 4 of" in err and "mesh dp=4,mp=2" in err, (out, err)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("class \nimport \n")
    assert generate.main([*argv, f"--prompts_file={prompts}", "--top_k=5", "--temperature=1"]) == 0
    out, _ = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == "--- 1/2 ---" and lines[1].startswith("class ") and "--- 2/2 ---" in lines


def test_prompt_bytes_that_are_not_utf8_are_the_prompts_own_tokens(trained_workdir, tmp_path, capsys):
    # Training reads any bytes; a prompt's bytes that are not UTF-8 (kept by Python as surrogates in
    # argv) were a UnicodeEncodeError traceback, and such a --prompts_file was refused.
    latin = os.fsdecode(b"caf\xe9")
    assert generate.encode(latin) == [0, *b"caf\xe9"]
    argv = ["--workdir", str(trained_workdir), "--max_new_tokens=3", "--temperature=0"]
    assert generate.main([*argv, f"--prompt={latin}"]) == 0
    assert capsys.readouterr().out.startswith("caf\ufffd")
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"caf\xe9\nna\xefve\n")
    read = generate.read_prompts(None, str(prompts))
    assert [generate.encode(p) for p in read] == [[0, *b"caf\xe9"], [0, *b"na\xefve"]]


def test_a_tiny_temperature_samples_the_likeliest_token():
    # logits / 1e-40 overflowed every positive logit to inf, and argmax took the first of the ties.
    logits = jnp.array([[0.5, 2.0, *[-1.0] * 254]])
    assert int(generate._choose(logits, jax.random.key(0), 1e-40, 0)[0]) == 1
    assert int(generate._choose(logits, jax.random.key(0), 1e-40, 2)[0]) == 1
    large = jnp.array([[50.0, 60.0, *[-1.0] * 254]])  # / 1e-37: both past float32's largest
    assert int(generate._choose(large, jax.random.key(0), 1e-37, 0)[0]) == 1


def test_decode_stops_at_the_document_separator_and_replaces_bad_bytes():
    assert generate.decode([104, 105, 0, 120]) == "hi"
    assert generate.decode([0xE2, 0x82]) == "\ufffd"  # a cut multi-byte character
    assert generate.encode("a\0b") == [0, 97, 98]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt="], "--prompt is empty"),
        (["--prompt=x", "--max_new_tokens=0"], "--max_new_tokens must be positive, got 0"),
        (
            ["--prompt=x", "--max_new_tokens=40"],
            "the prompt (1 byte and the document separator) plus --max_new_tokens=40 is longer than the 32 "
            "positions",
        ),
        (["--prompt=" + "y" * 40], "fills the 32 positions the model was trained on"),
        (["--prompt=x", "--top_k=257"], "--top_k must be in 0..256"),
        (["--prompt=x", "--top_k=-1"], "--top_k must be in 0..256"),
        (["--prompt=x", "--step=3"], "checkpoints: no step 3 (have 2, 4)"),
        (["--prompt=x", "--seed=4294967296"], "--seed must be in [0, 2**31), got 4294967296"),
        (["--prompt=x", "--temperature=-1"], "--temperature must be a finite number >= 0"),
        # Divides the padded vocabulary's masked logits into NaN, which argmax takes: a non-byte token.
        (["--prompt=x", "--temperature=inf"], "--temperature must be a finite number >= 0"),
        (["--prompt=x", "--config.nope=1"], "the run's config has no key 'nope'"),
        (
            ["--prompt=x", "--config.optim.beta1=0.8"],
            "no key 'optim.beta1' (gspmd_tp calls it config.optim.b1)",
        ),
        (["--prompt=x", "--config.mesh=dp=3,mp=4"], "mesh 'dp=3,mp=4' has 12 devices"),
        ([], "give exactly one of --prompt=TEXT and --prompts_file=FILE"),
        (["--prompt=x", "--config.mesh"], "unrecognized argument '--config.mesh' (config overrides are --c"),
    ],
)
def test_bad_input_is_one_line_before_anything_compiles(trained_workdir, monkeypatch, capsys, args, message):
    def must_not_run(*_, **__):
        raise AssertionError("read parameters or compiled before rejecting bad input")

    monkeypatch.setattr(saved_run, "restore_params", must_not_run)
    monkeypatch.setattr(generate, "make_sampler", must_not_run)
    assert generate.main(["--workdir", str(trained_workdir), *args]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err, err


def test_no_checkpoint_is_one_line(tmp_path, capsys):
    assert generate.main(["--workdir", str(tmp_path), "--prompt=x"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "no checkpoint found" in err and "\n" not in err
    assert not list(tmp_path.iterdir())  # nothing written


def test_restore_reads_the_saved_config_with_typed_overrides(trained_workdir):
    step, meta, config = saved_run.saved_config(
        str(trained_workdir), {"model.dtype": "bfloat16", "seed": "3"}
    )
    assert step == 4 and config.model.dtype == "bfloat16" and config.seed == 3
    assert json.loads(json.dumps(meta["model"]))["num_kv_heads"] == 8
    with pytest.raises(UserError, match=r"--config.steps=many: expected int \(saved: 4\)"):
        saved_run.saved_config(str(trained_workdir), {"steps": "many"})


# --- runs whose files moved on: damaged newest step, another device count, rule file, init_from ---


def _copy_editing_meta(trained_workdir, tmp_path, edit):
    run = tmp_path / "run"
    shutil.copytree(trained_workdir, run)
    for meta_file in run.glob("checkpoints/*/meta/metadata"):
        meta = json.loads(meta_file.read_text())
        edit(meta)
        meta_file.write_text(json.dumps(meta))
    return run


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(trained_workdir, tmp_path, capsys):
    from test_faults import flip_bytes

    run = tmp_path / "run"
    shutil.copytree(trained_workdir, run)
    flip_bytes(run / "checkpoints" / "4")
    before = sorted(str(p) for p in run.rglob("*"))
    # The sampler of test_prompt_bytes_that_are_not_utf8_are_the_prompts_own_tokens (5 positions).
    argv = ["--workdir", str(run), "--prompt=abcd", "--max_new_tokens=3", "--temperature=0"]
    assert generate.main(argv) == 0
    err = capsys.readouterr().err
    warning, status = err.strip().splitlines()[-2:]
    skipped = run / "checkpoints" / "4"
    assert warning.startswith(f"warning: skipping checkpoint {skipped}: partial or corrupted (")
    assert "TensorStore" not in err and status.startswith(f"step 2 of {run}")
    assert sorted(str(p) for p in run.rglob("*")) == before  # read-only: nothing moved or written


def test_a_damaged_step_asked_for_by_number_is_refused_not_skipped(trained_workdir, tmp_path):
    """restore_params (convert to-hf --step N) reads step N or says in one line why it cannot."""
    from test_faults import flip_bytes

    run = tmp_path / "run"
    shutil.copytree(trained_workdir, run)
    flip_bytes(run / "checkpoints" / "4")
    step, _, s = saved_run.load_setup(str(run), {}, 4)
    with pytest.raises(UserError, match=r"/4 is partial or corrupted \(.*\); choose another --step") as e:
        saved_run.restore_params(str(run), step, s)
    assert "\n" not in str(e.value) and "TensorStore" not in str(e.value)


def test_a_rule_file_that_moved_is_read_from_the_checkpoint(trained_workdir, tmp_path, capsys):
    def relative_rules(meta):
        meta["config"]["rules"] = "myrules/my.yaml"  # as typed in another cwd
        meta["rules"]["source"] = "myrules/my.yaml"

    run = _copy_editing_meta(trained_workdir, tmp_path, relative_rules)
    _, _, s = saved_run.load_setup(str(run), {})
    note = capsys.readouterr().err.strip()
    assert note.startswith("note: rule file 'myrules/my.yaml' not found (cwd ") and "\n" not in note
    assert s.rules.source == "myrules/my.yaml (the copy saved with step 4)"
    assert s.rules.rules == run_setup.setup(small_config(rules="megatron_2d")).rules.rules
    assert s.config.rules == "myrules/my.yaml"
    _, _, s = saved_run.load_setup(str(run), {"rules": "megatron_1d"})  # an explicit choice wins, quietly
    assert s.rules.source.endswith("megatron_1d.yaml") and not capsys.readouterr().err


def test_a_run_trained_with_cudnn_attention_is_read_with_einsum_on_cpu(trained_workdir, tmp_path, capsys):
    def trained_on_a_gpu(meta):
        meta["model"]["attention"] = meta["config"]["model"]["attention"] = "cudnn"
        meta["model"]["dtype"] = meta["config"]["model"]["dtype"] = "bfloat16"

    run = _copy_editing_meta(trained_workdir, tmp_path, trained_on_a_gpu)
    _, _, s = saved_run.load_setup(str(run), {})
    assert s.model_cfg.attention == "einsum"
    assert capsys.readouterr().err.strip() == (
        "note: the run trained with cuDNN attention; read on cpu with einsum attention"
    )
    with pytest.raises(UserError, match="needs GPU devices"):  # asked for by name: refused as before
        saved_run.load_setup(str(run), {"model.attention": "cudnn"})


def test_a_run_saved_before_document_masking_is_read_with_whole_windows(trained_workdir, tmp_path):
    """It trained attending each window whole: evaluate and generate read it so, unless asked."""
    assert saved_run.saved_config(str(trained_workdir), {})[2].data.document_mask is True

    def saved_before_the_key(meta):
        del meta["config"]["data"]["document_mask"]

    run = _copy_editing_meta(trained_workdir, tmp_path, saved_before_the_key)
    assert saved_run.saved_config(str(run), {})[2].data.document_mask is False
    assert saved_run.saved_config(str(run), {"data.document_mask": "true"})[2].data.document_mask is True


def test_a_run_started_from_init_from_samples_after_the_file_is_gone(trained_workdir, tmp_path):
    def started_from_a_file(meta):
        meta["config"]["init_from"] = str(tmp_path / "gone.npz")

    run = _copy_editing_meta(trained_workdir, tmp_path, started_from_a_file)
    _, _, config = saved_run.saved_config(str(run), {})
    assert config.init_from == ""  # only a fresh run reads it
    saved_run.load_setup(str(run), {})


def test_readers_simulate_the_devices_the_run_was_saved_on(trained_workdir, tmp_path):
    def on_four_devices(meta):
        meta["mesh"] = meta["config"]["mesh"] = "dp=4,mp=1"
        meta["config"]["host_device_count"] = 4

    run = _copy_editing_meta(trained_workdir, tmp_path, on_four_devices)
    assert saved_run.device_count_from_argv(["generate", f"--workdir={run}"]) == 4
    assert (
        saved_run.device_count_from_argv(["generate", "--workdir", str(run), "--config.mesh=dp=2,mp=1"]) == 2
    )
    assert saved_run.device_count_from_argv(["generate", f"--workdir={tmp_path / 'none'}"]) == 8
    assert saved_run.reader_device_count(str(trained_workdir)) == 8
    env = child_env()  # as a user runs it
    result = subprocess.run(
        [sys.executable, "-m", "gspmd_tp.generate", f"--workdir={run}", "--prompt=x", "--max_new_tokens=2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| mesh dp=4,mp=1 |" in result.stderr


def test_a_sampling_step_too_large_for_memory_is_one_line_before_any_read(
    trained_workdir, monkeypatch, capsys
):
    monkeypatch.setattr(run_setup, "_host_memory", lambda: 2**20)  # a host of 1 MiB
    monkeypatch.setattr(saved_run, "params_for", lambda *a, **k: pytest.fail("read before checking memory"))
    argv = ["--workdir", str(trained_workdir), "--prompt=abcd", "--max_new_tokens=3", "--temperature=0"]
    assert generate.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the compiled sampling step needs 8 CPU devices x ") and err.count("\n") == 1
    assert "more than this host's 0.0 GiB of RAM; fewer --max_new_tokens or prompts" in err


def test_the_training_batch_size_does_not_limit_the_meshes_generate_reads_on(
    trained_workdir, tmp_path, capsys
):
    """Sampling pads its own batch of prompts: a saved batch_size the mesh does not divide is no error."""
    run = tmp_path / "run"
    shutil.copytree(trained_workdir, run)
    meta_file = run / "checkpoints" / "4" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta["config"]["batch_size"] = 12  # not divisible by dp=8
    meta_file.write_text(json.dumps(meta))
    # As test_every_rule_file_and_mesh_generates_... samples on dp=8,mp=1: one compile for both.
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("class \nimport \n")
    argv = ["--workdir", str(run), f"--prompts_file={prompts}", "--max_new_tokens=4", "--temperature=1"]
    assert generate.main([*argv, "--top_k=5", "--config.mesh=dp=8,mp=1"]) == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "--- 1/2 ---" and lines[1].startswith("class ") and "--- 2/2 ---" in lines


def test_ctrl_c_is_one_line_and_status_130(trained_workdir, monkeypatch, capsys):
    # Was KeyboardInterrupt's traceback from inside jax.
    def interrupted(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "sampler_for", interrupted)  # while compiling
    assert generate.main(["--workdir", str(trained_workdir), "--prompt=x"]) == 130
    assert capsys.readouterr().err == "stopped by Ctrl-C (nothing in the workdir was written)\n"
