"""A run's setup: bad config values named before anything compiles, the step's memory checked."""

import pytest
from conftest import small_config

from gspmd_tp.job.errors import UserError
from gspmd_tp.train import run_setup


def test_auto_mlp_grad_follows_the_run_devices():
    """auto: autodiff's MLP gradient for CPU devices (the GPU choice: test_kernels.test_mlp_implementation);
    a setting given is kept, and the saved config names what ran."""
    assert run_setup.setup(small_config()).model_cfg.mlp_grad == "xla"
    assert run_setup.setup(small_config(**{"model.mlp_grad": "fused"})).model_cfg.mlp_grad == "fused"


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("optim.lr", -1e-3, "config.optim.lr must be 0 or more, got -0.001"),
        ("optim.warmup_steps", -1, "config.optim.warmup_steps must be 0 or more, got -1"),
        ("optim.min_lr_ratio", 1.5, r"config.optim.min_lr_ratio must be in \[0, 1\], got 1.5"),
        ("optim.b2", 1.0, r"config.optim.b2 must be in \[0, 1\), got 1.0"),
        ("optim.clip_norm", -1.0, "config.optim.clip_norm must be 0 or more, got -1.0"),
        ("optim.lr", float("nan"), "config.optim.lr must be 0 or more and finite, got nan"),
        ("optim.lr", float("inf"), "config.optim.lr must be 0 or more and finite, got inf"),
        (
            "optim.weight_decay",
            float("nan"),
            "config.optim.weight_decay must be 0 or more and finite, got nan",
        ),
        ("optim.eps", float("nan"), "config.optim.eps must be 0 or more and finite, got nan"),
        ("optim.clip_norm", float("nan"), "config.optim.clip_norm must be 0 or more and finite, got nan"),
        # Finite in Python, inf once float32 on the devices: the first update would overflow.
        (
            "optim.lr",
            1e39,
            r"config.optim.lr=1e\+39 is beyond float32's range \(3\.403e\+38\), in which the opt",
        ),
        ("optim.weight_decay", 4e38, r"config.optim.weight_decay=4e\+38 is beyond float32's range"),
        ("data.seed", -1, r"config.data.seed must be in \[0, 2\*\*32\), got -1"),
        ("data.eval_fraction", 1.0, r"config.data.eval_fraction must be in \(0, 1\), got 1.0"),
        ("data.eval_fraction", 0.0, r"config.data.eval_fraction=0 holds out no document"),
    ],
)
def test_bad_optimizer_and_data_values_are_named(key, value, message):
    c = small_config()
    section, name = key.split(".")
    c[section][name] = value
    with pytest.raises(UserError, match=message):
        run_setup.setup(c)


@pytest.mark.parametrize(
    "key, message",
    [
        ("host_device_count", r"config.host_device_count must be 0 \(the host's devices\) or more, got -1"),
        ("peak_flops_per_device", r"config.peak_flops_per_device must be 0 \(the known peak\) or more"),
    ],
)
def test_negative_run_values_are_named(key, message):
    c = small_config()
    c[key] = -1
    with pytest.raises(UserError, match=message):
        run_setup.setup(c)


def test_a_peak_that_is_not_a_number_is_named():
    c = small_config(peak_flops_per_device=float("nan"))
    with pytest.raises(UserError, match=r"config.peak_flops_per_device must be 0 \(the known peak\) or more"):
        run_setup.setup(c)


def test_a_step_that_cannot_fit_is_refused_before_anything_is_written():
    import types

    mesh = run_setup.setup(small_config()).mesh
    stats = types.SimpleNamespace(
        argument_size_in_bytes=2**20,
        output_size_in_bytes=2**20,
        alias_size_in_bytes=2**20,
        temp_size_in_bytes=0,
    )
    run_setup.check_memory(stats, mesh)
    stats.temp_size_in_bytes = 2**50
    with pytest.raises(
        UserError, match=r"needs 8 CPU devices x 1048576\.0 GiB, more than this host's .* of RAM"
    ):
        run_setup.check_memory(stats, mesh)


@pytest.mark.parametrize("fraction_set", [False, True])
def test_a_gpu_step_that_cannot_fit_names_jaxs_share_of_the_memory(monkeypatch, fraction_set):
    """JAX's allocator takes 75% of a GPU unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise: where
    it is unset, the refusal says how to raise the share."""
    import types

    import numpy as np

    gpu = types.SimpleNamespace(
        platform="gpu",
        device_kind="NVIDIA H100 80GB HBM3",
        memory_stats=lambda: {"bytes_limit": 60 * 2**30},
    )
    mesh = types.SimpleNamespace(devices=np.array([gpu], dtype=object))
    stats = types.SimpleNamespace(
        argument_size_in_bytes=11 * 2**30, output_size_in_bytes=11 * 2**30, alias_size_in_bytes=11 * 2**30
    )
    if fraction_set:
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    else:
        monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    stats.temp_size_in_bytes = 48 * 2**30
    run_setup.check_memory(stats, mesh)
    stats.temp_size_in_bytes = 54 * 2**30
    with pytest.raises(UserError) as e:
        run_setup.check_memory(stats, mesh)
    message = str(e.value)
    assert "needs 65.0 GiB per device, more than a NVIDIA H100 80GB HBM3's 60.0 GiB" in message
    assert ("XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 raises the share" in message) is not fraction_set
    assert "\n" not in message


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_a_vocabulary_smaller_than_the_tokenizer_is_one_line(tokenizer, request):
    c = small_config()
    if tokenizer == "bytes":
        c.model.vocab_size, ids = 128, 256
        c.data.train_files = __file__  # own files hold bytes >= 128 as well
    else:
        c.data.tokenizer, ids = request.getfixturevalue("bpe_path"), 300  # model.vocab_size 256
    message = (
        f"^config.model.vocab_size={c.model.vocab_size} cannot hold the {ids} ids of config.data.tokenizer="
    )
    with pytest.raises(UserError, match=message) as e:
        run_setup.setup(c)
    assert "\n" not in str(e.value)
