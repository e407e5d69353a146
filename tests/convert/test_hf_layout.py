"""The Hugging Face Llama-family layouts without transformers: config.json and every tensor block
there and back.

tests/test_convert.py checks the same mappings against transformers' logits; these run without torch
and read each parameter the way a sharded import does, one block per device.
"""

import itertools
import json
import os

import numpy as np
import pytest
from conftest import LLAMA, small_config

from gspmd_tp.convert import hf_layout
from gspmd_tp.job.errors import UserError
from gspmd_tp.model.params import param_axes
from gspmd_tp.train import run_setup


@pytest.mark.parametrize(
    "option,message",
    [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling with rope_type 'llama3'"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type 'yarn'"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"mlp_bias": True}, "mlp_bias=true is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"model_type": "mixtral"}, r"config.json: num_local_experts is None, not a positive integer"),
        ({"head_dim": 7}, "head_dim must be even"),
        ({"hidden_size": None}, r"config.json has no hidden_size \(a Llama config.json sets it\)"),
        ({"hidden_size": "128"}, r"config.json: hidden_size is '128', not a positive integer"),
        ({"num_hidden_layers": 0}, r"config.json: num_hidden_layers is 0, not a positive integer"),
        ({"num_key_value_heads": 2.5}, r"config.json: num_key_value_heads is 2.5, not a positive integer"),
    ],
)
def test_unsupported_option_is_named(option, message):
    base = run_setup.model_config(small_config())
    with pytest.raises(UserError, match=message):
        hf_layout.model_config_from_hf({**LLAMA, **option}, base)


def test_written_config_json_reads_back_as_the_same_model():
    base = run_setup.model_config(small_config())
    cfg = hf_layout.model_config_from_hf(LLAMA, base)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim) == (8, 4, 8, 96)
    written = hf_layout.hf_config(cfg, "bfloat16", 32, base={"bos_token_id": 1, "torch_dtype": "float32"})
    assert written["bos_token_id"] == 1 and "torch_dtype" not in written
    assert hf_layout.model_config_from_hf(written, base) == cfg


@pytest.mark.parametrize(
    "kind,options",
    [
        ("qwen3", {"head_dim": 16}),
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
        # Qwen3-MoE's own spelling of the expert count, and renormalised top-k weights.
        (
            "qwen3_moe",
            {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "norm_topk_prob": True},
        ),
    ],
)
def test_each_familys_config_json_reads_back_as_the_same_model(kind, options):
    base = run_setup.model_config(small_config(**{"model.num_experts": 2, "model.shared_experts": 1}))
    cfg = hf_layout.model_config_from_hf({**LLAMA, "model_type": kind, **options}, base)
    assert hf_layout.family(cfg) == kind and cfg.shared_experts == 0  # the run's MoE keys replaced
    assert cfg.qk_norm == kind.startswith("qwen3")
    if kind != "qwen3":
        assert cfg.num_experts == options.get("num_experts", options.get("num_local_experts"))
        assert cfg.expert_width == options.get("moe_intermediate_size", 96) and cfg.router_renormalize
    else:
        assert cfg.num_experts == 0 and cfg.head_dim == 16
    written = hf_layout.hf_config(cfg, "float32", 32)
    assert written["model_type"] == kind and hf_layout.model_config_from_hf(written, base) == cfg


def test_a_qwen3_config_json_without_head_dim_reads_transformers_default():
    """Qwen3Config's head_dim defaults to 128 (not hidden_size / heads, as Llama's and Mixtral's)."""
    base = run_setup.model_config(small_config())
    assert hf_layout.model_config_from_hf({**LLAMA, "model_type": "qwen3"}, base).head_dim == 128
    assert (
        hf_layout.model_config_from_hf(
            {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}, base
        ).head_dim
        == 8
    )


def _halves(shape):
    """Every block of `shape` cut in two along each axis longer than 1, as a sharding would read it."""
    cuts = [[slice(0, n)] if n == 1 else [slice(0, n // 2), slice(n // 2, n)] for n in shape]
    return itertools.product(*cuts)


# Mixtral (experts) and Qwen3-MoE (experts and the q/k norms), besides Llama's two layouts.
_MOE = {"model.num_experts": 4, "model.expert_mlp_dim": 24}


@pytest.mark.parametrize(
    "scan,tied,extra",
    [
        (True, False, {}),
        (False, True, {}),
        (True, False, _MOE),
        (False, True, {**_MOE, "model.qk_norm": True}),
    ],
)
def test_every_block_of_every_parameter_reads_back_from_sharded_files(tmp_path, scan, tied, extra):
    pytest.importorskip("safetensors")
    overrides = {"model.scan_layers": scan, "model.tie_embeddings": tied, **extra}
    cfg = run_setup.model_config(small_config(**overrides))
    rng = np.random.default_rng(0)
    params = {
        path: rng.standard_normal(shape).astype(np.float32) for path, (shape, _) in param_axes(cfg).items()
    }
    tensors = hf_layout.hf_tensors(cfg, params)
    umask = os.umask(0o022)
    try:
        files = hf_layout.write_safetensors(tmp_path, tensors, np.float32, max_shard_bytes=100_000)
    finally:
        os.umask(umask)
    assert all(os.stat(f).st_mode & 0o777 == 0o644 for f in files)  # others may read an export
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and index["weight_map"].keys() == hf_layout.hf_shapes(cfg).keys()

    with hf_layout.hf_reader(tmp_path) as read:
        assert {name: read(name) for name in index["weight_map"]} == hf_layout.hf_shapes(cfg)
        for path, x in params.items():
            # The split group axis of qkv cuts between query heads and the key: blocks, not heads.
            for block in _halves(x.shape):
                got = hf_layout.read_param(read, cfg, path, x.shape, block)
                np.testing.assert_array_equal(got, x[block], err_msg=f"{path} {block}")


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 1000),
            r"model.safetensors: embed does not read",
        ),
        (lambda d: (d / "model.safetensors").write_bytes(b""), r"model.safetensors: embed does not read"),
        (
            lambda d: (d / "model.safetensors.index.json").write_text(
                '{"weight_map": {"embed": "part-2.safetensors"}}'
            ),
            r"part-2.safetensors: embed does not read \(FileNotFoundError",
        ),
        (
            lambda d: (d / "model.safetensors.index.json").write_text("[1]"),
            r"does not read as a safetensors index",
        ),
        (
            lambda d: (d / "model.safetensors.index.json").write_text("{"),
            r"does not read as a safetensors index",
        ),
    ],
    ids=["garbage", "empty", "shard-missing", "index-not-an-object", "index-not-json"],
)
def test_safetensors_that_do_not_read_are_one_line_naming_the_file(tmp_path, damage, message):
    from safetensors.numpy import save_file

    save_file({"embed": np.ones((4, 2), np.float32)}, str(tmp_path / "model.safetensors"))
    damage(tmp_path)
    with pytest.raises(UserError, match=message), hf_layout.hf_reader(tmp_path) as read:
        read("embed")
