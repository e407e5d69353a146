"""The checkpoint tool (python -m gspmd_tp.checkpoint info | export) and the import of its .npz."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import small_config

from gspmd_tp.checkpoint import tool
from gspmd_tp.inference import saved_run
from gspmd_tp.job.errors import UserError
from gspmd_tp.model.params import param_count
from gspmd_tp.train import loop, run_setup

# --- the checkpoint tool: info, export, import ---


def test_info_export_and_import_onto_another_mesh(trained_workdir, tmp_path):
    # The shared run: small_config() trained under megatron_2d on dp=2,mp=4, steps 2 and 4 saved.
    info = subprocess.run(
        [sys.executable, "-m", "gspmd_tp.checkpoint", "info", str(trained_workdir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert info.returncode == 0, info.stderr[-2000:]
    assert info.stderr == ""  # nothing from orbax about a healthy checkpoint
    assert "steps: 2 (" in info.stdout and "), 4 (" in info.stdout and "step 4:" in info.stdout
    assert "saved on mesh dp=2,mp=4 by 1 process(es) with rules" in info.stdout
    assert "megatron_2d.yaml" in info.stdout and "d_model=64" in info.stdout
    assert "parameters: 131,392 (0.53 MB); optimizer state 1.05 MB" in info.stdout

    out = str(tmp_path / "params.npz")
    shapes = tool.export_params(str(trained_workdir), out)
    assert shapes["layers/attn/qkv"] == (2, 64, 8, 4, 8)
    # What the export must hold: step 4's parameters as saved_run reads them (onto the saved mesh).
    saved = saved_run.restore_params(str(trained_workdir), 4, run_setup.setup(small_config()))
    dest = run_setup.setup(small_config(rules="megatron_1d", mesh="dp=1,mp=8"))
    params = tool.import_params(out, dest.abstract_state.params)
    for got, want, sharding in zip(
        jax.tree.leaves(params),
        jax.tree.leaves(saved),
        jax.tree.leaves(dest.shardings.params),
        strict=True,
    ):
        assert got.sharding == sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    other = run_setup.setup(small_config(**{"model.mlp_dim": 256}))
    with pytest.raises(UserError, match=r"layers/mlp/down: file \(2, 128, 64\), model \(2, 256, 64\)"):
        tool.import_params(out, other.abstract_state.params)


def test_export_to_an_unwritable_path_is_one_line_before_reading(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tool, "export_params", lambda *a: pytest.fail("read the checkpoint"))
    assert tool.main(["export", str(tmp_path), "/dev/null/params.npz"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: OUT=/dev/null/params.npz: /dev/null is a file, not a directory"


def test_init_from_starts_a_fresh_run_from_exported_parameters(trained_workdir, tmp_path, capsys):
    # The shared 4-step run's last parameters. Its step 1 trained the initial parameters on the batch
    # a fresh run's step 1 trains on: the loss of a run that started from init.
    first = json.loads((trained_workdir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1
    out = str(tmp_path / "a.npz")
    tool.export_params(str(trained_workdir), out)
    capsys.readouterr()
    # The shared run's own config (its 4 steps, mesh and rules): its compiled train and eval steps
    # are reused from the compilation cache. The import onto another mesh is
    # test_info_export_and_import_onto_another_mesh's.
    loop.train(small_config(init_from=out), str(tmp_path / "b"))
    assert f"initial parameters from {out}" in capsys.readouterr().out
    second = json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[0])
    assert second["step"] == 1
    assert second["loss"] < first["loss"] - 0.05  # it starts from the trained parameters, not from init


# --- the tool on damaged checkpoints: the newest that reads, or one line ---


def test_tool_skips_a_damaged_newest_step_and_refuses_it_when_asked(trained_workdir, tmp_path, capsys):
    from test_faults import flip_bytes

    run = tmp_path / "run"
    shutil.copytree(trained_workdir, run)
    flip_bytes(run / "checkpoints" / "4")
    out, want = tmp_path / "newest.npz", tmp_path / "step2.npz"
    assert tool.main(["export", str(run), str(out)]) == 0
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"warning: skipping checkpoint {run / 'checkpoints' / '4'}: partial or corrupted (")
    assert "\n" not in err and "TensorStore" not in err
    tool.export_params(str(trained_workdir), str(want), step=2)
    got, expected = np.load(out), np.load(want)
    assert sorted(got.files) == sorted(expected.files)
    for k in expected.files:
        np.testing.assert_array_equal(got[k], expected[k])

    assert tool.main(["export", str(run), str(out), "--step", "4"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {run / 'checkpoints' / '4'} is partial or corrupted (") and "\n" not in err

    # A partial newest step (an item missing) is never exported or described as if complete.
    shutil.rmtree(run / "checkpoints" / "4" / "meta")
    assert tool.main(["info", str(run)]) == 0
    captured = capsys.readouterr()
    assert "step 2:" in captured.out and "item 'meta' is missing" in captured.err
    assert tool.main(["info", str(run), "--step", "4"]) == 1
    err = capsys.readouterr().err.strip()
    assert "is partial or corrupted (FileNotFoundError: item 'meta' is missing)" in err and "\n" not in err


def test_info_warns_when_a_steps_array_files_are_gone(trained_workdir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained_workdir, run)
    assert tool.main(["info", str(run)]) == 0
    assert capsys.readouterr().err == ""  # a whole step: no warning
    # The arrays' data, largest file first, only until the step's files take under a tenth of its
    # 0.53 MB of parameters (where info warns): the small files of their metadata, some 40 kB, must
    # stay readable. How orbax splits the data into files varies (a busy machine's run wrote it in many
    # files under 10 kB), so no fixed file size or count tells them apart.
    params = param_count(run_setup.model_config(small_config()))["total"]
    state = run / "checkpoints" / "4" / "state"
    arrays = sorted(
        (f for f in state.rglob("*") if f.is_file() and f.parent.name == "d"), key=lambda f: -f.stat().st_size
    )
    for f in arrays:
        if sum(g.stat().st_size for g in state.rglob("*") if g.is_file()) < params * 4 / 10:
            break
        f.unlink()
    assert tool.main(["info", str(run)]) == 0
    captured = capsys.readouterr()
    assert "step 4:" in captured.out
    assert captured.err.startswith(f"warning: {run / 'checkpoints' / '4'}: its array files take ")
    assert "files may be missing" in captured.err and captured.err.count("\n") == 1
    # With the metadata's own files gone too, the step is damaged: skipped, not an unexplained failure.
    for f in (run / "checkpoints" / "4" / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.unlink()
    assert tool.main(["info", str(run)]) == 0
    captured = capsys.readouterr()
    assert "step 2:" in captured.out
    assert captured.err.startswith(
        f"warning: skipping checkpoint {run / 'checkpoints' / '4'}: partial or corrupted"
    )


def test_a_step_directory_and_another_step_conflict(trained_workdir, capsys):
    step_dir = trained_workdir / "checkpoints" / "2"
    for command in (["info", str(step_dir)], ["export", str(step_dir), "/tmp/unused.npz"]):
        assert tool.main([*command, "--step", "4"]) == 1
        err = capsys.readouterr().err.strip()
        assert err == (
            f"error: {step_dir} is the directory of step 2 but --step 4 was given; "
            f"pass {trained_workdir / 'checkpoints'} with --step 4, or leave --step out"
        )
    assert tool.main(["info", str(step_dir), "--step", "2"]) == 0  # no conflict
    assert "step 2:" in capsys.readouterr().out


@pytest.mark.parametrize("content", [b"plain text\n", b"PK\x03\x04 a cut zip"], ids=["text", "zip"])
def test_init_from_that_is_not_an_npz_is_one_line(tmp_path, content):
    path = tmp_path / "params.npz"
    path.write_bytes(content)
    s = run_setup.setup(small_config())
    with pytest.raises(UserError, match=rf"config.init_from={path} is not a readable .npz") as e:
        tool.import_params(str(path), s.abstract_state.params)
    assert "\n" not in str(e.value) and "pickle" not in str(e.value)


def test_init_from_with_nan_or_inf_is_named_before_anything_is_placed(tmp_path):
    s = run_setup.setup(small_config())
    params = {k: np.zeros(v.shape, np.float32) for k, v in tool._flat(s.abstract_state.params).items()}
    params["lm_head"][0, 0] = np.nan
    params["embedding"][1, 1] = np.inf
    path = tmp_path / "params.npz"
    np.savez(path, **params)
    with pytest.raises(UserError) as e:
        tool.import_params(str(path), s.abstract_state.params)
    assert str(e.value) == f"config.init_from={path}: NaN or Inf values in embedding, lm_head"


def test_import_digests_the_parameters_as_it_reads_them(tmp_path):
    """The processes of a job compare this digest of config.init_from: it comes from the import's own
    read, and follows the parameters (not how the file packs them)."""
    import hashlib

    s = run_setup.setup(small_config())
    params = {k: np.zeros(v.shape, np.float32) for k, v in tool._flat(s.abstract_state.params).items()}
    np.savez(tmp_path / "a.npz", **params)
    np.savez_compressed(tmp_path / "packed.npz", **params)
    params["embedding"][1, 1] = 1.0
    np.savez(tmp_path / "b.npz", **params)
    digests = []
    for name in ("a", "packed", "b"):
        digest = hashlib.sha256()
        tool.import_params(str(tmp_path / f"{name}.npz"), s.abstract_state.params, digest)
        digests.append(digest.hexdigest())
    assert digests[0] == digests[1] != digests[2]


@pytest.mark.skipif(os.geteuid() != 0, reason="os.access already refuses /proc to a user other than root")
def test_export_to_a_path_the_filesystem_refuses_is_one_line_before_reading(tmp_path, capsys):
    # As root os.access says /proc is writable: np.savez failed with a traceback after the read.
    assert tool.main(["export", str(tmp_path), "/proc/gspmd_tp_none.npz"]) == 1
    error = "error: OUT=/proc/gspmd_tp_none.npz: cannot write it (No such file or directory)\n"
    assert capsys.readouterr().err == error


def _ctrl_c(*_, **__):
    raise KeyboardInterrupt


@pytest.mark.parametrize("existing", [False, True], ids=["new", "over_an_older_export"])
def test_ctrl_c_in_export_is_one_line_130_and_leaves_out_as_it_was(
    trained_workdir, tmp_path, monkeypatch, capsys, existing
):
    """Was KeyboardInterrupt's traceback, and np.savez writing OUT in place: a file cut short that
    passed for an export by its name, or an older export destroyed."""
    out = tmp_path / "params.npz"
    if existing:
        out.write_bytes(b"an older export")

    def cut_short(f, **arrays):  # the write has begun when Ctrl-C comes
        f.write(b"PK\x03\x04 the first bytes")
        raise KeyboardInterrupt

    monkeypatch.setattr(tool.np, "savez", cut_short)
    try:
        code = tool.main(["export", str(trained_workdir), str(out)])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt left main")
    assert code == 130
    assert capsys.readouterr().err == f"stopped by Ctrl-C (OUT={out} is as it was)\n"
    assert os.listdir(tmp_path) == (["params.npz"] if existing else [])
    assert not existing or out.read_bytes() == b"an older export"


def test_ctrl_c_in_info_is_one_line_and_130(trained_workdir, monkeypatch, capsys):
    monkeypatch.setattr(tool, "_size", _ctrl_c)  # while it sums the steps' sizes
    try:
        code = tool.main(["info", str(trained_workdir)])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt left main")
    assert code == 130
    assert capsys.readouterr().err == "stopped by Ctrl-C (nothing written)\n"
