"""Qwen3, Mixtral and Qwen3-MoE checkpoints in and out: logits and greedy tokens equal transformers',
and the export gives back the very tensors imported.

No download: one small random model per family (2 layers, d 64, 4 experts) is built from its
transformers config and saved with save_pretrained, every parameter perturbed away from its default
init (norm scales included), so a mistake in any mapping changes the logits. Each family is imported
once (a module-scoped fixture) and its three checks read that run.
"""

import importlib.util
import json

import jax
import numpy as np
import pytest
from conftest import LLAMA, small_config

from gspmd_tp.checkpoint import store
from gspmd_tp.convert import hf_layout, llama
from gspmd_tp.inference import generate
from gspmd_tp.job.errors import UserError
from gspmd_tp.model.transformer import Transformer
from gspmd_tp.train import state as state_lib

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torch", "transformers")),
    reason="needs torch and transformers (the hf extra)",
)

_BASE = {k: v for k, v in LLAMA.items() if k != "model_type"}
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
# family: (transformers config class, its options, our rules, mesh)
FAMILIES = {
    # head_dim 16 is not hidden_size / heads (8): the q/k norms' width is head_dim's.
    "qwen3": ("Qwen3Config", dict(_BASE, head_dim=16, tie_word_embeddings=True), "megatron_1d", "dp=2,mp=4"),
    "mixtral": ("MixtralConfig", dict(_BASE, **_MOE), "expert_fsdp", "data=2,expert=4"),
    # norm_topk_prob False: the top-k weights are not renormalised (router_renormalize False).
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(_BASE, **_MOE, head_dim=16, moe_intermediate_size=24, norm_topk_prob=False),
        "expert_fsdp",
        "data=2,expert=4",
    ),
}
CLASSES = {
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# 8 rows: expert_fsdp splits the batch over all 8 devices.
TOKENS = np.random.default_rng(0).integers(0, 256, (8, 24), dtype=np.int32)
PROMPTS = TOKENS[:2, :8]


def _hf_class(kind):
    import transformers

    return getattr(transformers, CLASSES[kind])


def _hf_logits(kind, path):
    import torch

    model = _hf_class(kind).from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS.astype(np.int64))).logits.float().numpy()


@pytest.fixture(scope="module", params=list(FAMILIES))
def imported(request, tmp_path_factory):
    """(kind, HF directory, transformers' logits on TOKENS, its greedy tokens, the run's Setup, run)."""
    import torch
    import transformers

    kind = request.param
    config_class, options, rules, mesh = FAMILIES[kind]
    torch.manual_seed(0)
    model = _hf_class(kind)(getattr(transformers, config_class)(**options)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else 0.1 * torch.randn_like(p))
    hf_dir = tmp_path_factory.mktemp(kind)
    model.save_pretrained(hf_dir)
    with torch.no_grad():
        prompt = torch.from_numpy(PROMPTS.astype(np.int64))
        greedy = model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)[:, 8:].numpy()
    run = tmp_path_factory.mktemp(f"{kind}_run") / "run"
    s = llama.from_hf(str(hf_dir), str(run), small_config(rules=rules, mesh=mesh))
    return kind, hf_dir, _hf_logits(kind, hf_dir), greedy, s, run


def _restored(s, run):
    mngr = store.manager(str(run), keep=3)
    state, _ = store.restore(mngr, 0, s.abstract_state)
    mngr.close()
    return state.params


def _assert_close(ours, theirs):
    # Relative to the logits' scale, the Llama tests' tolerance.
    rel = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"max |ours - transformers| / max |transformers| = {rel:.2e}")
    assert rel < 1e-4, rel


def test_the_imported_config_is_the_families(imported):
    kind, _, _, _, s, _ = imported
    cfg = s.model_cfg
    assert hf_layout.family(cfg) == kind
    assert cfg.qk_norm == (kind != "mixtral")
    if kind == "qwen3":
        assert (cfg.num_experts, cfg.head_dim, cfg.tie_embeddings) == (0, 16, True)
    else:
        assert (cfg.num_experts, cfg.experts_per_token) == (4, 2)
        assert cfg.expert_width == (96 if kind == "mixtral" else 24)
        assert cfg.router_renormalize == (kind == "mixtral")


def test_imported_logits_equal_transformers(imported):
    kind, _, want, _, s, run = imported
    params = _restored(s, run)
    model = Transformer(s.model_cfg)
    with state_lib.sharding_context(s.mesh, s.rules):
        fwd = jax.jit(
            lambda p, t: model.apply({"params": p}, t), in_shardings=(s.shardings.params, s.batch_sharding)
        )
        ours = np.asarray(fwd(params, jax.device_put(TOKENS, s.batch_sharding)))
    _assert_close(ours, want)


def test_greedy_generation_equals_transformers(imported):
    kind, _, _, want, s, run = imported
    params = _restored(s, run)
    got = generate.sample_tokens(s, params, [list(map(int, row)) for row in PROMPTS], 6)
    np.testing.assert_array_equal(got, want)


def test_the_export_is_the_imported_checkpoint_bit_for_bit(imported, tmp_path):
    from safetensors.numpy import load_file

    kind, hf_dir, want, _, _, run = imported
    out = tmp_path / "hf"
    llama.to_hf(str(run), str(out))
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == [CLASSES[kind]] and conf["model_type"] == kind
    exported, original = load_file(out / "model.safetensors"), load_file(hf_dir / "model.safetensors")
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)
    _assert_close(_hf_logits(kind, out), want)


@pytest.mark.parametrize(
    "kind,option,message",
    [
        ("qwen3_moe", {"decoder_sparse_step": 2}, r"decoder_sparse_step=2 is not supported"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\] is not supported"),
        ("qwen3_moe", {"shared_expert_intermediate_size": 32}, r"shared_expert_intermediate_size=32"),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 16}, r"sliding_window=16 is not supported"),
        ("mixtral", {"sliding_window": 16}, r"sliding_window=16 is not supported"),
        ("mixtral", {"router_jitter_noise": 0.1}, r"router_jitter_noise=0.1 is not supported"),
        ("qwen3", {"attention_bias": True}, r"attention_bias=true is not supported"),
        (
            "qwen3_moe",
            {"num_local_experts": 0},
            r"config.json: num_local_experts is 0, not a positive integer",
        ),
    ],
)
def test_an_option_this_model_lacks_is_named_before_anything_is_written(tmp_path, kind, option, message):
    _, options, rules, mesh = FAMILIES[kind]
    (tmp_path / "hf").mkdir()
    conf = {**options, "model_type": kind, **option}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(UserError, match=rf"--hf_dir=.*/hf: {message}") as e:
        llama.from_hf(str(tmp_path / "hf"), str(tmp_path / "run"), small_config(rules=rules, mesh=mesh))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_model_no_family_holds_is_refused_before_the_export_writes(tmp_path):
    from gspmd_tp.model.transformer import ModelConfig

    assert "shared_experts=1" in hf_layout.export_problem(ModelConfig(num_experts=4, shared_experts=1))
    assert "router_renormalize=False" in hf_layout.export_problem(
        ModelConfig(num_experts=4, router_renormalize=False)
    )
    assert (
        hf_layout.export_problem(ModelConfig(num_experts=4, router_renormalize=False, qk_norm=True)) is None
    )
