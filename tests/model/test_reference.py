"""The Transformer against a reference written here in plain numpy (float64), on one device.

The reference shares no code with gspmd_tp.model: it reads the parameters out of the params tree and
computes the forward pass from the architecture's definition (docs/model.md). Its gradients are
central differences of the float64 reference along a random direction per parameter (per layer), so
the model's backward passes (in float32) are checked against the math, not against another setting.
Property tests pin what a reference that shares a mistake with the model would not catch: causality
at every position, which query heads share a key/value head, rotary's dependence on relative
positions only, RMSNorm's scale invariance, and the parameter and FLOP counts from the config's sizes.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspmd_tp.model import params as params_lib
from gspmd_tp.model.transformer import Attention, ModelConfig, RMSNorm, Transformer
from gspmd_tp.train import loss as loss_lib

# Non-default rope_theta and norm_eps, so a reference or model that ignored either would disagree;
# an eps of 1e-3 moves the logits by ~5e-4 relative, 50 times the tolerance.
CFG = ModelConfig(
    vocab_size=64,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,  # two query heads per key/value head
    head_dim=8,
    mlp_dim=64,
    rope_theta=500.0,
    norm_eps=1e-3,
)
BATCH, SEQ = 2, 16
TOKENS_NP = np.random.default_rng(1).integers(0, 50, (BATCH, SEQ)).astype(np.int32)  # < vocab_tokens below
TARGETS_NP = np.random.default_rng(2).integers(0, 50, (BATCH, SEQ)).astype(np.int32)


def variant(**changes) -> ModelConfig:
    return dataclasses.replace(CFG, **changes)


# Settings that change the computation on CPU, combined so that each costs one compile (compiling
# is most of this file's time). The others are tested equal to these elsewhere: attention xla
# (against einsum) and blocks of 4, 5 and 12 in test_kernels.py, mlp_grad fused and one_pass in
# test_kernels.py, every remat policy and scan_layers=False in test_model.py.
VARIANTS = {
    "base": CFG,  # einsum attention, one block, nn.scan, no remat, mlp_grad auto (xla on CPU)
    "tied_padded_blocked": variant(
        tie_embeddings=True,
        qk_norm=True,  # Qwen3's per-head query/key norm
        vocab_tokens=50,  # ids 50..63 are padding
        attention_block=5,  # blocks 5+5+5+1
        remat="dots_no_batch",
        remat_save="attn_in,attn_out,query,key",  # under nn.scan (test_model.py keeps them unrolled)
        mlp_grad="fused",
    ),
    "bfloat16": variant(dtype="bfloat16", attention="auto", scan_layers=False),  # forward only
}


# --- the reference, float64 numpy ---


def np_rmsnorm(x, scale, eps):
    """x / sqrt(mean(x^2) + eps) * scale over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def np_rotary(x, theta):
    """Rotary embedding of x (..., length, head_dim) at positions 0..length-1: features i and
    i + head_dim/2 turn together as the complex number x_i + 1j * x_{i + d/2}, by position *
    theta^(-2i/d)."""
    length, d = x.shape[-2:]
    half = d // 2
    angle = np.arange(length)[:, None] * theta ** (-2.0 * np.arange(half) / d)  # (length, half)
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * angle)
    return np.concatenate([z.real, z.imag], axis=-1)


def model_grouping(cfg, h):
    """Query head h (the out projection's head axis) is query slot h % group of key/value head
    h // group in the fused qkv kernel, and reads that key/value head."""
    return h // cfg.group, h % cfg.group, h // cfg.group


def np_attention(cfg, x, qkv, w_out, grouping=model_grouping, q_norm=None, k_norm=None):
    """Causal attention of x (batch, length, embed); qkv (embed, kv_heads, group + 2, head_dim),
    each key/value head's `group` query slots then its key then its value; w_out (heads, head_dim,
    embed). grouping(cfg, h) -> (kv head of h's query slot, the slot, the kv head h reads).
    q_norm, k_norm (head_dim): where given (model.qk_norm), each head's query and key RMS-normed
    over head_dim with these scales before rotary (Qwen3)."""
    g, d = cfg.group, cfg.head_dim
    length = x.shape[1]
    causal = np.tril(np.ones((length, length), bool))
    y = np.zeros_like(x)

    def normed(a, scale):
        return a if scale is None else np_rmsnorm(a, scale, cfg.norm_eps)

    for h in range(cfg.num_heads):
        q_kv, slot, kv = grouping(cfg, h)
        q = np_rotary(normed(x @ qkv[:, q_kv, slot], q_norm), cfg.rope_theta) / np.sqrt(d)  # (b, l, d)
        k = np_rotary(normed(x @ qkv[:, kv, g], k_norm), cfg.rope_theta)
        v = x @ qkv[:, kv, g + 1]
        s = np.where(causal, q @ k.transpose(0, 2, 1), -np.inf)  # (batch, query, key)
        p = np.exp(s - s.max(-1, keepdims=True))
        y += (p / p.sum(-1, keepdims=True)) @ v @ w_out[h]
    return y


def np_swiglu_mlp(x, gate_up, down):
    gate, up = x @ gate_up[:, 0], x @ gate_up[:, 1]
    return (gate / (1 + np.exp(-gate)) * up) @ down


def np_forward(cfg, p, tokens, grouping=model_grouping):
    """Logits (batch, length, vocab) of the reference parameters `p` (reference_params)."""
    eps = cfg.norm_eps
    x = p["embedding"][tokens]
    for layer in p["layers"]:
        x = x + np_attention(
            cfg,
            np_rmsnorm(x, layer["attn_norm"], eps),
            layer["qkv"],
            layer["out"],
            grouping,
            *((layer["q_norm"], layer["k_norm"]) if cfg.qk_norm else ()),
        )
        x = x + np_swiglu_mlp(np_rmsnorm(x, layer["mlp_norm"], eps), layer["gate_up"], layer["down"])
    x = np_rmsnorm(x, p["final_norm"], eps)
    logits = x @ (p["embedding"].T if cfg.tie_embeddings else p["lm_head"])
    if cfg.vocab_tokens:
        logits[..., cfg.vocab_tokens :] = -np.inf
    return logits


def np_loss(cfg, p):
    """Mean cross entropy of the reference's logits of TOKENS_NP against TARGETS_NP."""
    logits = np_forward(cfg, p, TOKENS_NP)
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    return float((lse - np.take_along_axis(logits, TARGETS_NP[..., None], -1)[..., 0]).mean())


# --- parameters: the model's tree <-> the reference's dict ---

LAYER_LEAVES = {  # reference name -> path in a layer of the params tree
    "attn_norm": ("attn_norm", "scale"),
    "qkv": ("attn", "qkv"),
    "out": ("attn", "out"),
    "mlp_norm": ("mlp_norm", "scale"),
    "gate_up": ("mlp", "gate_up"),
    "down": ("mlp", "down"),
}
# With model.qk_norm, also (a layer's attn holds them as submodules):
QK_NORM_LEAVES = {"q_norm": ("attn", "q_norm", "scale"), "k_norm": ("attn", "k_norm", "scale")}


def _layer_leaves(cfg):
    return {**LAYER_LEAVES, **(QK_NORM_LEAVES if cfg.qk_norm else {})}


def reference_params(cfg, tree):
    """The float64 parameters of a params tree (nn.scan's stacked `layers` or unrolled `layers_i`):
    {embedding, lm_head (untied), final_norm, layers: [{attn_norm, qkv, out, mlp_norm, gate_up, down}]}."""
    tree = jax.tree.map(lambda a: np.asarray(a, np.float64), tree)
    layers = []
    for i in range(cfg.num_layers):
        layer = tree["layers"] if cfg.scan_layers else tree[f"layers_{i}"]
        take = (lambda a, i=i: a[i]) if cfg.scan_layers else (lambda a: a)
        leaves = _layer_leaves(cfg).items()
        layers.append({name: take(functools.reduce(dict.__getitem__, path, layer)) for name, path in leaves})
    p = {"embedding": tree["embedding"], "final_norm": tree["final_norm"]["scale"], "layers": layers}
    if not cfg.tie_embeddings:
        p["lm_head"] = tree["lm_head"]
    return p


def model_params(cfg, p):
    """The params tree of `cfg`'s layout holding the reference parameters `p`, in float32."""
    tree = {"embedding": p["embedding"], "final_norm": {"scale": p["final_norm"]}}
    if not cfg.tie_embeddings:
        tree["lm_head"] = p["lm_head"]
    for i, layer in enumerate(p["layers"]):
        sub = {}
        for name, path in _layer_leaves(cfg).items():
            node = sub
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = layer[name]
        tree[f"layers_{i}"] = sub
    if cfg.scan_layers:
        per_layer = [tree.pop(f"layers_{i}") for i in range(cfg.num_layers)]
        tree["layers"] = jax.tree.map(lambda *a: np.stack(a), *per_layer)
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)


@functools.cache
def reference_parameters():
    """CFG's parameters, read from the tree its init makes (shapes and layout), each drawn at a scale
    where it matters: the init's norm scales of one and small output projections would let a missing
    norm scale or a misplaced attention head pass unseen at 1e-5. Rounded to float32 so that model
    and reference start from the same numbers."""
    init = lambda: Transformer(CFG).init(jax.random.key(0), jnp.asarray(TOKENS_NP))["params"]
    tree = jax.tree.map(lambda s: np.zeros(s.shape), nn.meta.unbox(jax.eval_shape(init)))
    p = reference_params(CFG, tree)
    rng = np.random.default_rng(3)
    fan_in = {"qkv": CFG.d_model, "out": CFG.num_heads * CFG.head_dim, "gate_up": CFG.d_model}
    fan_in |= {"down": CFG.mlp_dim, "lm_head": CFG.d_model, "embedding": 1}

    def draw(name, a):
        if "norm" in name:
            return rng.uniform(0.5, 1.5, a.shape)
        return rng.normal(0, fan_in[name] ** -0.5, a.shape)

    p = {k: v if k == "layers" else draw(k, v) for k, v in p.items()}
    p["layers"] = [{k: draw(k, v) for k, v in layer.items()} for layer in p["layers"]]
    # The q/k norm scales of the variants with model.qk_norm, from a generator of their own (the
    # other parameters stay the draws above).
    norms = np.random.default_rng(5)
    for layer in p["layers"]:
        layer.update({name: norms.uniform(0.5, 1.5, CFG.head_dim) for name in QK_NORM_LEAVES})
    return jax.tree.map(lambda a: a.astype(np.float32).astype(np.float64), p)


def for_config(cfg, p):
    """The reference parameters `p` as `cfg` has them (no lm_head when tied, no q/k norms without
    model.qk_norm)."""
    out = {k: v for k, v in p.items() if k != "lm_head" or not cfg.tie_embeddings}
    keep = _layer_leaves(cfg)
    out["layers"] = [{k: v for k, v in layer.items() if k in keep} for layer in p["layers"]]
    return out


GRADIENT_VARIANTS = [name for name, cfg in VARIANTS.items() if cfg.dtype == "float32"]


@functools.cache
def compiled(name):
    """VARIANTS[name]'s (loss, logits) and gradient of (params tree, tokens, targets): one compile,
    shared by every test of the variant. In bfloat16 the forward pass only (gradient None): a
    gradient of several bfloat16 roundings (2^-8 each) needs a tolerance that would say little, and
    its compile costs three forward passes' (tests/model/test_kernels_grad.py checks the MLP's)."""
    cfg = VARIANTS[name]

    def loss_fn(tree, tokens, targets):
        logits = Transformer(cfg).apply({"params": tree}, tokens)
        total, count = loss_lib.cross_entropy_sums(logits, targets)
        return total / count, logits

    if name not in GRADIENT_VARIANTS:
        return jax.jit(lambda *a: (loss_fn(*a), None))
    return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))


def run_model(name, p, tokens=TOKENS_NP):
    """(loss, logits, gradient as reference parameters or None) of VARIANTS[name] with reference
    parameters p."""
    cfg = VARIANTS[name]
    tree = model_params(cfg, for_config(cfg, p))
    (loss, logits), grads = compiled(name)(tree, jnp.asarray(tokens), jnp.asarray(TARGETS_NP))
    return float(loss), np.asarray(logits, np.float64), grads and reference_params(cfg, grads)


@functools.cache
def model_outputs(name):
    """run_model of VARIANTS[name] on the reference parameters and tokens."""
    return run_model(name, reference_parameters())


# float32: rounding alone (measured: logits 4e-7 of the largest, gradients 2.5e-6 of their norm).
# bfloat16 (8 bits of mantissa, a few roundings per layer; measured 8e-3): 2^-4 of the largest
# logit leaves room for those and none for a wrong formula (errors of order one).
TOLERANCE = {name: (2**-4 if cfg.dtype == "bfloat16" else 1e-5) for name, cfg in VARIANTS.items()}


def max_relative(got, want) -> float:
    """The largest difference of the finite values over the largest |want|; -inf where want has it."""
    finite = np.isfinite(want)
    assert np.array_equal(finite, np.isfinite(got))
    assert np.array_equal(got[~finite], want[~finite])  # -inf where the vocabulary is padding
    return float(np.abs(got[finite] - want[finite]).max() / np.abs(want[finite]).max())


@pytest.mark.parametrize("name", VARIANTS)
def test_logits_and_loss_equal_the_numpy_reference(name):
    """The whole forward pass (lookup, pre-norm blocks, rotary GQA attention, SwiGLU, final norm,
    tied or untied head, padding masked) gives the float64 reference's logits, under each setting."""
    cfg = VARIANTS[name]
    p = for_config(cfg, reference_parameters())
    loss, logits, _ = model_outputs(name)
    want = np_forward(cfg, p, TOKENS_NP)
    assert max_relative(logits, want) < TOLERANCE[name]
    assert loss == pytest.approx(np_loss(cfg, p), rel=TOLERANCE[name])


def _leaves(p):
    """(name, array) of every reference parameter, per layer."""
    out = [(k, v) for k, v in p.items() if k != "layers"]
    for i, layer in enumerate(p["layers"]):
        out += [(f"layers_{i}/{k}", v) for k, v in layer.items()]
    return out


def _with(p, name, value):
    q = {**p, "layers": [dict(layer) for layer in p["layers"]]}
    if name.startswith("layers_"):
        i, leaf = name.removeprefix("layers_").split("/")
        q["layers"][int(i)][leaf] = value
    else:
        q[name] = value
    return q


@pytest.mark.parametrize("name", GRADIENT_VARIANTS)
def test_gradients_equal_the_numpy_references_central_differences(name):
    """Each parameter's gradient (each layer's apart) projected on a random direction equals the
    float64 reference's central difference along it (truncation error ~1e-9): autodiff's backward
    pass, and the blocked attention's, the fused MLP's and remat's with names saved under nn.scan."""
    cfg = VARIANTS[name]
    p = for_config(cfg, reference_parameters())
    grads = dict(_leaves(model_outputs(name)[2]))
    rng, eps = np.random.default_rng(4), 1e-4
    for leaf, value in _leaves(p):
        direction = rng.normal(size=value.shape)
        numeric = (
            np_loss(cfg, _with(p, leaf, value + eps * direction))
            - np_loss(cfg, _with(p, leaf, value - eps * direction))
        ) / (2 * eps)
        analytic = float((grads[leaf] * direction).sum())
        # A sum of random-signed terms is of the size of the gradient's norm: relative to that.
        scale = np.linalg.norm(grads[leaf])
        assert abs(analytic - numeric) < 2e-5 * scale, (leaf, analytic, numeric)


# --- grouped-query attention ---


def interleaved(cfg, h):
    return h % cfg.num_kv_heads, h // cfg.num_kv_heads, h % cfg.num_kv_heads


def next_kv_head(cfg, h):
    return h // cfg.group, h % cfg.group, (h // cfg.group + 1) % cfg.num_kv_heads


def slots_swapped(cfg, h):
    return h // cfg.group, (h + 1) % cfg.group, h // cfg.group


@pytest.mark.parametrize("grouping", [interleaved, next_kv_head, slots_swapped], ids=lambda f: f.__name__)
def test_another_head_grouping_in_the_reference_disagrees_with_the_model(grouping):
    """The reference's grouping (head h: query slot h % group of kv head h // group, reading that kv
    head) is the one the logits test matches; these others give other logits, so that match pins
    the model's grouping rather than passing whatever it is."""
    p = reference_parameters()
    assert max_relative(model_outputs("base")[1], np_forward(CFG, p, TOKENS_NP, grouping)) > 1e-2


@functools.cache
def attention_layer():
    """(jitted Attention(CFG) of (params, x, positions), random params of its tree, x (1, SEQ, embed))."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(1, SEQ, CFG.d_model)).astype(np.float32)
    shapes = jax.eval_shape(lambda: Attention(CFG).init(jax.random.key(0), x, jnp.arange(SEQ))["params"])
    params = {k: rng.normal(0, 0.3, s.shape).astype(np.float32) for k, s in nn.meta.unbox(shapes).items()}
    apply = jax.jit(lambda p, x, pos: Attention(CFG).apply({"params": p}, x, pos))
    return apply, params, x


def test_a_key_value_head_reaches_its_own_query_group_only():
    """With the out projection of every head but h zeroed, changing the key and value weights of kv
    head k changes the output iff h is in k's group (h // group == k): the model's own grouping, not
    one it shares with the reference."""
    apply, params, x = attention_layer()
    g, pos = CFG.group, jnp.arange(SEQ)
    for h in range(CFG.num_heads):
        only_h = {**params, "out": np.where(np.arange(CFG.num_heads)[:, None, None] == h, params["out"], 0)}
        before = np.asarray(apply(only_h, x, pos))
        for k in range(CFG.num_kv_heads):
            qkv = params["qkv"].copy()
            qkv[:, k, g:] += 0.5  # its key and its value
            changed = np.abs(np.asarray(apply({**only_h, "qkv": qkv}, x, pos)) - before).max()
            assert (changed > 1e-3) == (h // g == k), (h, k, changed)


# --- rotary position embedding ---


def test_attention_depends_on_relative_positions_only():
    """Rotary embedding turns queries and keys by their absolute positions, so the scores (and the
    attention's output) depend on position differences only: every position shifted by 7 or 100
    changes nothing, while positions twice as far apart do change it (rotary is applied at all)."""
    apply, params, x = attention_layer()
    pos = jnp.arange(SEQ)
    at_zero = np.asarray(apply(params, x, pos))
    for shift in (7, 100):
        # float32 angles of positions ~100 carry ~1e-5 rad of rounding
        assert max_relative(np.asarray(apply(params, x, pos + shift)), at_zero) < 1e-4, shift
    assert max_relative(np.asarray(apply(params, x, 2 * pos)), at_zero) > 1e-2


# --- causality ---


@pytest.mark.parametrize("name", ["base", "tied_padded_blocked"])
def test_a_token_changes_no_logit_before_it(name):
    """For every position t: a different token at t leaves the logits before t exactly as they were
    and changes those at t: in the whole masked square and in query blocks of 5 (edges at 5, 10, 15)."""
    p = reference_parameters()
    _, logits, _ = model_outputs(name)
    half = SEQ // 2
    for t in range(half):  # row 0 changes position t, row 1 position t + half
        tokens = TOKENS_NP.copy()
        tokens[0, t] = (tokens[0, t] + 1) % 50
        tokens[1, t + half] = (tokens[1, t + half] + 1) % 50
        _, changed, _ = run_model(name, p, tokens)
        for row, at in ((0, t), (1, t + half)):
            np.testing.assert_array_equal(changed[row, :at], logits[row, :at])
            finite = np.isfinite(logits[row, at])
            assert np.abs(changed[row, at][finite] - logits[row, at][finite]).max() > 1e-3


# --- RMSNorm ---


def test_rmsnorm_is_invariant_to_each_positions_scale_and_adds_eps_to_the_mean_square():
    """RMSNorm over the embed axis: without eps, scaling each position by its own factor changes
    nothing (a norm over another axis, or a mean instead of a root mean square, would); with eps,
    x / sqrt(mean(x^2) + eps) * scale, eps inside the root, on inputs small enough for it to count."""
    rng = np.random.default_rng(6)
    x = rng.normal(size=(2, SEQ, CFG.d_model))
    scale = rng.uniform(0.5, 1.5, CFG.d_model)
    factors = 2.0 ** rng.uniform(-10, 10, (2, SEQ, 1))
    norm = lambda eps, x: np.asarray(
        RMSNorm(eps, jnp.float32).apply(
            {"params": {"scale": jnp.asarray(scale, jnp.float32)}}, jnp.asarray(x)
        )
    )
    assert max_relative(norm(0.0, x * factors), norm(0.0, x)) < 1e-6
    small = x * np.sqrt(CFG.norm_eps)  # mean square ~ eps
    assert max_relative(norm(CFG.norm_eps, small), np_rmsnorm(small, scale, CFG.norm_eps)) < 1e-6


def test_logits_ignore_the_residual_streams_scale():
    """Pre-norm: the residual stream reaches the logits through norms only, so the embedding and the
    two projections that write into the stream scaled by 256 give the reference's logits without eps
    (eps / 256^2 of the mean square left)."""
    p = reference_parameters()
    scaled = {**p, "embedding": 256 * p["embedding"]}
    scaled["layers"] = [{**la, "out": 256 * la["out"], "down": 256 * la["down"]} for la in p["layers"]]
    no_eps = dataclasses.replace(CFG, norm_eps=0.0)
    want = np_forward(no_eps, p, TOKENS_NP)
    assert max_relative(run_model("base", scaled)[1], want) < 1e-5
    assert max_relative(np_forward(CFG, p, TOKENS_NP), want) > 1e-4  # eps counts at scale 1


# --- parameter and FLOP counts ---


# CFG by hand: per layer qkv 32 x (4 + 2 x 2) x 8 = 2048, out 4 x 8 x 32 = 1024, gate_up 32 x 2 x 64
# = 4096, down 64 x 32 = 2048: 9216 in products, x 2 layers = 18432; norms 2 x 2 x 32 + 32 = 160;
# embedding and lm_head 64 x 32 = 2048 each. The output projection multiplies, tied or not. The q/k
# norms (qk_norm) add 2 x 8 per layer, 32 in all, to the total and none to the products.
@pytest.mark.parametrize(
    "tied, qk_norm, total", [(False, False, 22688), (True, False, 20640), (False, True, 22720)]
)
def test_param_count_matches_the_hand_count_and_the_tree(tied, qk_norm, total):
    cfg = dataclasses.replace(CFG, tie_embeddings=tied, qk_norm=qk_norm)
    assert params_lib.param_count(cfg) == {"total": total, "matmul": 18432 + 2048}
    tree = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), jnp.asarray(TOKENS_NP)))
    assert sum(int(np.prod(s.shape)) for s in jax.tree.leaves(nn.meta.unbox(tree["params"]))) == total


# 6 per multiplying weight (2 forward, 4 backward): 6 x 20480 = 122880. Attention per token, layer and
# head: q.k and p.v over T keys, 2 x 2 x 8 x T forward, x 3 with the backward, halved (causal):
# 2 layers x 4 heads x 96 x T / 2 = 384 T, 6144 at T = 16, 12288 at T = 32.
@pytest.mark.parametrize("seq_len, flops", [(16, 122880 + 6144), (32, 122880 + 12288)])
def test_flops_per_token_match_the_hand_count(seq_len, flops):
    assert params_lib.flops_per_token(CFG, seq_len) == flops
