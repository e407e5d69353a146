"""The sharded train step computes what one device computes, under every rule file."""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_steps, small_config, token_batches
from shipped_rules import SHIPPED, mesh_for

from gspmd_tp.checkpoint import tool
from gspmd_tp.job.errors import UserError
from gspmd_tp.sharding.rules import RULES_DIR
from gspmd_tp.train import loop, optimizer, run_setup
from gspmd_tp.train import step as step_lib

# Each shipped rule file on a mesh that splits both axes (three-axis files: 2x2x2), and the meshes where
# a rule file places arrays unlike anything else here: fsdp over all 8 devices, megatron_1d with one
# key/value head per device, megatron_2d with the other axis the larger. tests/sharding's golden
# tables check every file's parameter specs without compiling.
CASES = [(r, mesh_for(r)) for r in SHIPPED]
CASES += [("fsdp", "dp=8,mp=1"), ("megatron_1d", "dp=1,mp=8"), ("megatron_2d", "dp=4,mp=2")]


@pytest.fixture(scope="module")
def reference():
    """Losses and gradient norms of an unsharded run on a single device."""
    c = small_config(rules="dp", mesh="dp=1,mp=1")
    _, history = run_steps(c, batches(c), devices=jax.devices()[:1])
    return history


def batches(c):
    """Two random batches, then the first again: its loss must have dropped by the third step."""
    b0, b1 = token_batches(c, 2)
    return [b0, b1, b0]


@pytest.mark.parametrize("rules, mesh", CASES)
def test_sharded_run_equals_single_device(reference, rules, mesh):
    c = small_config(rules=rules, mesh=mesh)
    _, history = run_steps(c, batches(c))
    np.testing.assert_allclose(np.array(history), np.array(reference), rtol=1e-5)
    assert history[2][0] < history[0][0]  # it learns


@pytest.mark.parametrize(
    "rules, mesh, slices", [("megatron_2d", "dp=2,mp=4", 2), ("fsdp_tp", "dp=4,mp=2", 4)]
)
def test_a_run_with_the_mlp_gathered_in_slices_equals_single_device(reference, rules, mesh, slices):
    """model.mlp_slices: the MLP's weights gathered in slices (kernels.sliced_mlp), under
    remat as the trainer runs it."""
    c = small_config(rules=rules, mesh=mesh, **{"model.mlp_slices": slices, "model.remat": "dots_no_batch"})
    _, history = run_steps(c, batches(c))
    np.testing.assert_allclose(np.array(history), np.array(reference), rtol=1e-5)


def test_fused_mlp_gradient_sharded_equals_single_device(reference):
    """model.mlp_grad=fused (auto's GPU choice where mlp is unsplit; forced here under both splits)."""
    c = small_config(rules="megatron_2d", mesh="dp=4,mp=2", **{"model.mlp_grad": "fused"})
    _, history = run_steps(c, batches(c))
    np.testing.assert_allclose(np.array(history), np.array(reference), rtol=1e-5)


@pytest.mark.parametrize(
    "rules, mesh, overrides",
    [
        ("dp", "dp=8,mp=1", {}),
        ("megatron_1d", "dp=4,mp=2", {"grad_accum": 2}),  # microbatches summed per batch shard
        ("fsdp", "dp=8,mp=1", {}),
        ("megatron_2d", "dp=4,mp=2", {"model.mlp_grad": "fused", "loss_chunk": 16, "grad_accum": 2}),
        ("megatron_2d", "dp=2,mp=4", {"model.mlp_slices": 2}),  # the sliced MLP's scatters in bf16
    ],
)
def test_a_bfloat16_gradient_reduction_trains_close_to_one_device_with_float32_state(
    reference, rules, mesh, overrides
):
    """optim.grad_reduce_dtype=bfloat16 rounds only what crosses the batch axes: the losses and
    gradient norms within bfloat16's rounding of one device's, and the parameters and both moments
    stay float32. megatron_1d with two microbatches sums them per batch shard and all-reduces the
    sums; the others make the gradients in bfloat16 where GSPMD reduces them (megatron_2d: the
    fused MLP's, the chunked loss's head; or the sliced MLP's scatters of its weight gradients)."""
    c = small_config(rules=rules, mesh=mesh, **{"optim.grad_reduce_dtype": "bfloat16"}, **overrides)
    state, history = run_steps(c, batches(c))
    np.testing.assert_allclose(np.array(history), np.array(reference), rtol=2e-3)
    assert not np.allclose(np.array(history), np.array(reference), rtol=1e-6, atol=0)  # it was rounded
    leaves = jax.tree.leaves((state.params, state.opt_state))
    assert {x.dtype for x in leaves if x.ndim} == {jnp.dtype("float32")}


def test_schedule_warms_up_then_decays():
    s = run_setup.setup(small_config(steps=100))
    lrs = [float(s.schedule(i)) for i in (0, 1, 2, 50, 99)]
    peak = s.config.optim.lr
    assert lrs[0] == 0.0 and lrs[2] == pytest.approx(peak)
    assert peak > lrs[3] > lrs[4] >= peak * s.config.optim.min_lr_ratio - 1e-12


def test_clip_norm_zero_turns_clipping_off():
    c = small_config()
    c.optim.warmup_steps, c.optim.weight_decay = 0, 0.0
    c.optim.eps = 10.0  # large, so that Adam's first update depends on the gradient's scale
    params, grads = {"w": jnp.zeros(2)}, {"w": jnp.array([30.0, 40.0])}  # global norm 50

    def first_update(clip_norm):
        c.optim.clip_norm = clip_norm
        tx, _ = optimizer.make_optimizer(c.optim, 10)
        updates, _ = tx.update(grads, tx.init(params), params)
        return np.asarray(updates["w"])

    unclipped = first_update(0.0)
    np.testing.assert_allclose(unclipped, first_update(1e9), rtol=1e-6)  # a bound never reached
    assert np.abs(first_update(1.0)).max() < np.abs(unclipped).max() / 5


def test_evaluates_every_eval_every_steps_whatever_log_every(tmp_path):
    c = small_config(steps=4, log_every=3, eval_every=2, checkpoint_every=4)
    loop.train(c, str(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # the first, every 3rd, every 2nd, the last
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 4]


def test_resuming_needs_no_init_from_file(trained_workdir, tmp_path, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(trained_workdir, workdir)
    last = loop.train(small_config(steps=5, init_from=str(tmp_path / "gone.npz")), str(workdir))
    assert last["step"] == 5  # resumed from step 4; the file is read by fresh runs only
    assert "gone.npz is not read: the run resumes from its checkpoints" in capsys.readouterr().out
    with pytest.raises(UserError, match=r"config.init_from: no file .*gone.npz"):
        loop.train(small_config(init_from=str(tmp_path / "gone.npz")), str(tmp_path / "fresh"))
    assert not (tmp_path / "fresh").exists()


def test_a_resumed_run_replaces_the_rows_of_the_steps_it_trains_again(trained_workdir, tmp_path, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(trained_workdir, workdir)
    shutil.rmtree(workdir / "checkpoints" / "4")  # as if killed after logging step 4, before saving it
    before = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in before] == [1, 2, 4]
    loop.train(small_config(steps=6), str(workdir))
    out = capsys.readouterr().out
    assert (
        "metrics.jsonl: 1 row of steps after 2 moved to metrics_replaced.jsonl; steps 3..6 train again" in out
    )
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 6]  # once each; 3 is the resumed run's first
    assert rows[:2] == before[:2]
    assert [json.loads(line) for line in (workdir / "metrics_replaced.jsonl").read_text().splitlines()] == [
        before[2]
    ]
    # The decay now runs to step 6. Step 3 still trains at the peak (the warmup's 2 steps are over,
    # the decay's first step is its peak in both); the note gives the rate of step 4, the first that
    # differs, and the old one.
    old, new = (
        optimizer.make_schedule(small_config().optim, 4),
        optimizer.make_schedule(small_config().optim, 6),
    )
    assert float(new(2)) == float(old(2)) and float(new(3)) != float(old(3))
    assert (
        "note: the learning-rate schedule differs from the one step 2 was trained on (config.steps 4 -> 6): "
        f"step 4 trains at lr {float(new(3)):.3e}, not {float(old(3)):.3e}"
    ) in out
    assert rows[2]["learning_rate"] == pytest.approx(float(new(2)))
    assert "note: changed since" not in out  # config.steps is the schedule note's


def test_a_resume_names_the_settings_it_changed(trained_workdir, tmp_path, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(trained_workdir, workdir)
    shutil.rmtree(workdir / "checkpoints" / "4")
    changed = {"batch_size": 16, "model.remat": "dots", "optim.clip_norm": 0.5, "mesh": "dp=4,mp=2"}
    loop.train(small_config(**changed), str(workdir))
    out = capsys.readouterr().out
    # The mesh is the resume line's to name; the model's settings come in their section's order.
    assert re.search(r"resumed from step 2 \(saved on mesh dp=2,mp=4 with rules \S*megatron_2d.yaml\)", out)
    assert (
        "note: changed since step 2 was saved: batch_size 8 -> 16; model.remat 'none' -> 'dots'; "
        "optim.clip_norm 1.0 -> 0.5\n"
    ) in out


def _moment_dtypes(step_dir) -> dict[str, set[str]]:
    """{"mu": dtypes, "nu": dtypes} of AdamW's moments as a checkpoint's metadata gives them."""
    tree = tool._state_tree_metadata(str(step_dir))
    found = {"mu": set(), "nu": set()}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree["opt_state"])[0]:
        keys = [str(getattr(k, "key", "")) for k in path]
        for moment in found:
            if moment in keys:
                found[moment].add(str(leaf.dtype))
    return found


def test_a_resume_may_keep_the_first_moment_in_another_dtype(trained_workdir, tmp_path, capsys):
    """The saved moment is read into the dtype the config asks for, either way."""
    workdir = tmp_path / "run"
    shutil.copytree(trained_workdir, workdir)
    ckpts = workdir / "checkpoints"
    loop.train(small_config(steps=6, **{"optim.mu_dtype": "bfloat16"}), str(workdir))
    assert "optim.mu_dtype 'float32' -> 'bfloat16'" in capsys.readouterr().out
    assert _moment_dtypes(ckpts / "4") == {"mu": {"float32"}, "nu": {"float32"}}
    assert _moment_dtypes(ckpts / "6") == {"mu": {"bfloat16"}, "nu": {"float32"}}
    last = loop.train(small_config(steps=8), str(workdir))
    assert "optim.mu_dtype 'bfloat16' -> 'float32'" in capsys.readouterr().out
    assert _moment_dtypes(ckpts / "8") == {"mu": {"float32"}, "nu": {"float32"}}
    assert np.isfinite(last["loss"])


def test_a_finished_run_says_so_before_compiling(trained_workdir, tmp_path, monkeypatch, capsys):
    workdir = tmp_path / "run"
    shutil.copytree(trained_workdir, workdir)
    monkeypatch.setattr(step_lib, "compile_train_step", lambda s: pytest.fail("compiled a finished run"))
    assert loop.train(small_config(steps=4), str(workdir)) == {"step": 4}
    assert "nothing to do: the newest checkpoint is at step 4 >= config.steps=4" in capsys.readouterr().out


def test_a_rule_file_given_by_relative_path_is_saved_absolute(trained_workdir, tmp_path, monkeypatch):
    """Readers started in another directory then find this file, not one of the same name there."""
    from gspmd_tp.checkpoint import step_dirs

    (tmp_path / "here").mkdir()
    shutil.copy(RULES_DIR / "megatron_1d.yaml", tmp_path / "here" / "mine.yaml")
    monkeypatch.chdir(tmp_path / "here")
    loop.train(small_config(steps=2, rules="mine.yaml", eval_every=100), str(tmp_path / "run"))
    [(_, meta)] = step_dirs.readable_checkpoints(str(tmp_path / "run"))
    assert meta["config"]["rules"] == str(tmp_path / "here" / "mine.yaml")
    # A shipped rule file stays a name (any checkout's copy): the shared run's, given by name.
    for _, meta in step_dirs.readable_checkpoints(str(trained_workdir)):
        assert meta["config"]["rules"] == small_config().rules == "megatron_2d"


def test_a_finished_run_sets_aside_rows_logged_after_its_last_checkpoint(trained_workdir, tmp_path, capsys):
    """Killed after logging step 5 of 8, then shortened to 4 steps: nothing is left to train, and
    step 5's row goes where the rows of steps trained again go."""
    workdir = tmp_path / "run"
    shutil.copytree(trained_workdir, workdir)
    with open(workdir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "loss": 1.0}) + "\n")
    assert loop.train(small_config(steps=4), str(workdir)) == {"step": 4}
    out = capsys.readouterr().out
    assert "nothing to do" in out and "1 row of steps after 4 moved to metrics_replaced.jsonl" in out
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 4


def test_a_resume_warns_when_the_data_files_changed_in_place(tmp_path, capsys):
    train_file, held_out = tmp_path / "train.txt", tmp_path / "held_out.txt"
    train_file.write_text("def f(x):\n    return x\n" * 100)
    held_out.write_text("class A:\n    pass\n" * 40)
    files = {"data.train_files": str(train_file), "data.eval_files": str(held_out)}
    workdir = str(tmp_path / "run")
    loop.train(small_config(steps=2, **files), workdir)
    loop.train(small_config(steps=3, **files), workdir)  # the same files: no warning
    assert "changed since" not in capsys.readouterr().out
    with open(train_file, "a") as f:
        f.write("import os\n" * 10)
    loop.train(small_config(steps=4, **files), workdir)
    out = capsys.readouterr().out
    assert "warning: the training corpus changed since step 3 was saved (2,301 tokens, now 2,401; " in out
    assert "held-out split changed" not in out


def test_processes_compare_the_config_once_and_the_rule_file_after_setup(tmp_path, monkeypatch):
    """The comparison after setup carries the rule file's text alone: the config is the one
    compared before (each comparison is an exchange between every process of the job)."""
    compared = []
    monkeypatch.setattr(loop.distributed, "check_same_everywhere", lambda *a: compared.append(a))
    monkeypatch.setattr(loop, "_train", lambda *a: {})
    loop.train(small_config(), str(tmp_path / "run"))
    assert compared == [(small_config().to_dict(),), (None, run_setup.setup(small_config()).rules.text)]
