"""Mixture of experts: the layer against a float64 numpy reference, the router's losses worked by
hand, the dense model untouched by the MoE keys, the active-parameter count, and the checks."""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gspmd_tp.model import moe
from gspmd_tp.model.params import flops_per_token, param_count
from gspmd_tp.model.transformer import ModelConfig, MoeFeedForward, Transformer

CFG = ModelConfig(
    vocab_size=64,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_dim=64,
    num_experts=4,
    experts_per_token=2,
    expert_mlp_dim=16,
)
X = np.random.default_rng(0).normal(size=(2, 6, 32)).astype(np.float32)


def _silu(x):
    return x / (1 + np.exp(-x))


def reference_moe(cfg, p, x, kept=None):
    """The MoE layer in float64 numpy, token by token: softmax over all experts, the top k,
    renormalised or not, each chosen expert's SwiGLU weighted and summed (only the (token, expert)
    pairs in `kept`, where given); plus the shared MLP."""
    x = x.astype(np.float64).reshape(-1, x.shape[-1])
    w = {k: np.asarray(v, np.float64) for k, v in p.items() if k != "shared"}
    out = np.zeros_like(x)
    for t, row in enumerate(x):
        logits = row @ w["router"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        top = np.argsort(-probs, kind="stable")[: cfg.experts_per_token]
        weights = probs[top] / (probs[top].sum() if cfg.router_renormalize else 1.0)
        for e, g in zip(top, weights, strict=True):
            if kept is not None and (t, int(e)) not in kept:
                continue
            gate_up = np.einsum("d,dtm->tm", row, w["gate_up"][e])
            out[t] += g * ((_silu(gate_up[0]) * gate_up[1]) @ w["down"][e])
    if "shared" in p:
        s = {k: np.asarray(v, np.float64) for k, v in p["shared"].items()}
        gate_up = np.einsum("nd,dtm->ntm", x, s["gate_up"])
        out += (_silu(gate_up[:, 0]) * gate_up[:, 1]) @ s["down"]
    return out


def layer_params(cfg):
    """The MoE layer's parameters (with a router scaled up, so that the routing is far from even)."""
    p = nn.meta.unbox(MoeFeedForward(cfg).init(jax.random.key(1), X)["params"])
    return {**p, "router": p["router"] * 50}


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"router_renormalize": False},
        {"shared_experts": 2},
        {"experts_per_token": 1},
        {"experts_per_token": 4},
    ],
)
def test_the_layer_equals_a_float64_reference(changes):
    cfg = dataclasses.replace(CFG, **changes)
    p = layer_params(cfg)
    got, state = jax.jit(lambda p, x: MoeFeedForward(cfg).apply({"params": p}, x, mutable=["intermediates"]))(
        p, X
    )
    want = reference_moe(cfg, p, X).reshape(X.shape)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    counts = state["intermediates"]["expert_counts"][0]
    assert float(counts.sum()) == X.shape[0] * X.shape[1] * cfg.experts_per_token
    assert float(counts.min()) < X.shape[0] * X.shape[1] or cfg.experts_per_token == cfg.num_experts
    assert float(counts.max()) > 0  # the routing is uneven (a scaled-up router), yet every token counted


def test_the_gradient_equals_the_reference_by_finite_differences():
    """The layer's gradient in a router weight and an expert weight, against central differences of
    the float64 reference (the routing does not change within the step)."""
    p = layer_params(CFG)
    loss = lambda p: (MoeFeedForward(CFG).apply({"params": p}, X) ** 2).sum()  # noqa: E731
    grads = jax.jit(jax.grad(loss))(p)
    for name, index in (("router", (3, 1)), ("gate_up", (2, 5, 1, 7)), ("down", (0, 3, 4))):
        step = 1e-4
        plus = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
        minus = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
        plus[name][index] += step
        minus[name][index] -= step
        numeric = ((reference_moe(CFG, plus, X) ** 2).sum() - (reference_moe(CFG, minus, X) ** 2).sum()) / (
            2 * step
        )
        assert float(grads[name][index]) == pytest.approx(numeric, rel=1e-3, abs=1e-4), name


def test_router_losses_worked_by_hand():
    """Two layers, 4 experts, k = 2 over 4 tokens (8 assignments). Layer 0: even (2 each), every
    probability 1/4: aux 4 * sum(1/4 * 1/4) = 1. Layer 1: assignments 4, 4, 0, 0 and mean
    probabilities 0.4, 0.4, 0.1, 0.1: aux 4 * (0.5 * 0.4 * 2) = 1.6; max load 0.5 / 0.25 = 2."""
    stats = {
        "layers": {
            "moe": {
                "expert_counts": (jnp.array([[2.0, 2, 2, 2], [4, 4, 0, 0]]),),
                "router_probs": (jnp.array([[1.0, 1, 1, 1], [1.6, 1.6, 0.4, 0.4]]),),
                "router_z": (jnp.array([4.0, 8.0]),),  # squared log-sum-exps summed over 4 tokens
            }
        }
    }
    got = moe.router_losses(stats, k=2)
    assert float(got["aux_loss"]) == pytest.approx((1.0 + 1.6) / 2)
    assert float(got["z_loss"]) == pytest.approx((1.0 + 2.0) / 2)
    assert float(got["max_load"]) == pytest.approx(2.0)


def test_the_model_sows_one_row_of_router_stats_per_layer_scanned_or_not():
    cfg = dataclasses.replace(CFG, scan_layers=False)
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8)
    for c in (CFG, cfg):
        model = Transformer(c)
        params = model.init(jax.random.key(0), tokens)["params"]
        _, state = model.apply({"params": params}, tokens, mutable=["intermediates"])
        counts = [x for p, x in jax.tree_util.tree_flatten_with_path(state)[0] if "expert_counts" in str(p)]
        assert sum(x.size for x in counts) == c.num_layers * c.num_experts
        got = moe.router_losses(state["intermediates"], c.experts_per_token)
        assert 1.0 <= float(got["max_load"]) <= c.num_experts / c.experts_per_token


def test_the_moe_keys_leave_a_dense_model_as_it_is():
    dense = dataclasses.replace(CFG, num_experts=0)
    knobs = dataclasses.replace(
        dense, experts_per_token=3, expert_mlp_dim=8, shared_experts=2, router_renormalize=False
    )
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8)
    params = Transformer(dense).init(jax.random.key(0), tokens)["params"]
    assert "mlp" in params["layers"] and "moe" not in params["layers"]
    a = Transformer(dense).apply({"params": params}, tokens)
    b = Transformer(knobs).apply({"params": params}, tokens)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_parameter_count_is_the_models_and_the_flops_count_the_active_ones():
    """Counted here from the parameters the model creates: all of them, and per token the router's,
    k of the E experts' and the shared experts' (the norms and the lookup table never multiply)."""
    cfg = dataclasses.replace(CFG, shared_experts=1)
    tokens = np.zeros((1, 8), np.int32)
    shapes = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), tokens))["params"]
    leaves = jax.tree_util.tree_leaves_with_path(nn.meta.unbox(shapes))
    total = sum(int(np.prod(x.shape)) for _, x in leaves)
    active = 0
    for path, x in leaves:
        name = jax.tree_util.keystr(path)
        if "norm" in name or "embedding" in name:
            continue
        size = int(np.prod(x.shape))
        expert_weight = "moe" in name and "shared" not in name and "router" not in name
        active += size * cfg.experts_per_token // cfg.num_experts if expert_weight else size
    assert param_count(cfg) == {"total": total, "matmul": active}
    attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 16 / 2
    assert flops_per_token(cfg, 16) == 6 * active + attention


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"experts_per_token": 5}, r"model.experts_per_token must be in 1..model.num_experts \(4\), got 5"),
        ({"experts_per_token": 0}, r"model.experts_per_token must be in 1..model.num_experts \(4\), got 0"),
        ({"num_experts": -1}, r"model.num_experts must be 0 or more, got -1"),
        ({"router_aux_loss_coef": float("nan")}, r"model.router_aux_loss_coef must be 0 or more"),
        ({"moe_buffer_factor": 0.5}, r"model.moe_buffer_factor must be 0 .* or at least 1 .*, got 0.5"),
        ({"moe_buffer_factor": -1.0}, r"model.moe_buffer_factor must be 0 .*, got -1.0"),
        ({"moe_buffer_factor": float("nan")}, r"model.moe_buffer_factor must be 0 .*, got nan"),
    ],
)
def test_moe_config_problems_are_one_line_each(changes, message):
    problems = dataclasses.replace(CFG, **changes).validate()
    assert len(problems) == 1 and "\n" not in problems[0]
    assert re.fullmatch(message, problems[0]) or re.match(message, problems[0])


@pytest.mark.parametrize("remat", ["full", "dots_no_batch"])
def test_remat_changes_neither_the_gradient_nor_the_router_stats(remat):
    """The router's stats are sown inside the rematerialized, scanned block: the same rows, and
    the gradient of the logits plus the aux loss the same, as without remat."""
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8)
    params = Transformer(CFG).init(jax.random.key(0), tokens)["params"]

    def objective(cfg):
        def f(p):
            logits, state = Transformer(cfg).apply({"params": p}, tokens, mutable=["intermediates"])
            losses = moe.router_losses(state["intermediates"], cfg.experts_per_token)
            return logits.mean() + losses["aux_loss"], losses

        return jax.jit(jax.value_and_grad(f, has_aux=True))(params)

    (_, want_stats), want = objective(CFG)
    (_, got_stats), got = objective(dataclasses.replace(CFG, remat=remat))
    for key in want_stats:
        assert float(got_stats[key]) == pytest.approx(float(want_stats[key]), rel=1e-6)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """jax.lax.ragged_all_to_all's semantics in plain jnp (XLA:CPU compiles no ragged-all-to-all):
    every device's operand, offsets and sizes gathered; the rows sender s sends this device,
    operand_s[input_offsets_s[me] + r] for r < send_sizes_s[me], written at output_offsets_s[me] + r."""
    del recv_sizes  # what this device receives is what the senders say they send it
    me = jax.lax.axis_index(axis_name)
    operands, starts, sizes, lands = (
        jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, send_sizes, output_offsets)
    )
    r = jnp.arange(operand.shape[0])
    for s in range(operands.shape[0]):
        rows = operands[s][jnp.clip(starts[s, me] + r, 0, operand.shape[0] - 1)]
        to = jnp.where(r < sizes[s, me], lands[s, me] + r, output.shape[0])  # the rest dropped
        output = output.at[to].set(rows, mode="drop")
    return output


@pytest.mark.parametrize(
    "rules, mesh, factor",
    [
        ("expert_fsdp", "data=2,expert=4", 0.0),
        ("data_expert_tensor", "data=2,expert=2,tensor=2", 0.0),
        ("expert_fsdp", "data=2,expert=4", 1.8),
    ],
)
def test_the_ragged_dispatch_equals_the_gather_dispatch(monkeypatch, rules, mesh, factor):
    """moe_dispatch=ragged (its exchange emulated in jnp) against gather, on 8 devices: the layer's
    output and its gradients with respect to the parameters and the tokens, to 1e-5. The routing is
    far from even (a router scaled up), so the exchange's sizes and offsets differ device by device.
    A receive buffer of 1.8 times the balanced load holds this routing's largest load
    (test_a_smaller_receive_buffer_leaves_out_what_does_not_fit_and_counts_it): the same results."""
    from gspmd_tp.sharding.mesh import make_mesh
    from gspmd_tp.sharding.rules import load_rules
    from gspmd_tp.train.state import sharding_context

    calls = []

    def exchange(*args, **kwargs):
        calls.append(kwargs["axis_name"])
        return emulated_ragged_all_to_all(*args, **kwargs)

    monkeypatch.setattr(moe, "_ragged_all_to_all", exchange)
    loaded = load_rules(rules)
    m = make_mesh(mesh, loaded.mesh_axes, jax.devices()[:8], loaded.source)
    x = np.random.default_rng(1).normal(size=(8, 6, 32)).astype(np.float32)
    p = layer_params(CFG)

    def run(dispatch):
        cfg = dataclasses.replace(CFG, moe_dispatch=dispatch, moe_buffer_factor=factor)

        def loss(p, x):
            y = MoeFeedForward(cfg).apply({"params": p}, x, mutable=["intermediates"])[0]
            return jnp.sum(y * jnp.cos(y)), y

        with sharding_context(m, loaded):
            (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(p, x)
        return jax.device_get((y, grads))

    ragged = run("ragged")
    assert calls == [("expert",), ("expert",)]  # tokens out and back, over the expert axis
    gather = run("gather")
    assert len(calls) == 2
    for a, b in zip(jax.tree.leaves(ragged), jax.tree.leaves(gather), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_receive_buffer_is_the_worst_case_or_the_factor_of_the_balanced_load():
    """Worked by hand: 4 devices of 6 tokens, 2 experts a token. With one expert a device a token
    sends it at most 1 row: 4 * 6 * 1 = 24 rows; with 3 a device, both of its rows: 4 * 6 * 2 = 48.
    The balanced load is 6 * 2 = 12 rows: 1.5 of it 18, 1.01 of it 12.12 -> 13; 10 of it is capped
    at the worst case."""
    assert moe.receive_rows(6, 2, 1, 4) == 24
    assert moe.receive_rows(6, 2, 3, 4) == 48
    assert moe.receive_rows(6, 2, 1, 4, 1.5) == 18
    assert moe.receive_rows(6, 2, 1, 4, 1.01) == 13
    assert moe.receive_rows(6, 2, 1, 4, 10.0) == 24


def _kept_assignments(cfg, p, x, group: int, rows: int) -> set:
    """(token, expert) pairs the ragged exchange keeps, worked in numpy: the batch rows split one a
    device over groups of `group` devices, expert e on device e // (experts / group); each
    receiver takes, sender by sender in order, each sender's assignments to it sorted by expert
    (then by token and rank), the first `rows` of them."""
    n = cfg.num_experts // group
    b, length, _ = x.shape
    chosen = {}  # device -> [(expert, token, rank)] in that device's sorted order
    for dev in range(b):
        flat = []
        for pos in range(length):
            logits = x[dev, pos].astype(np.float64) @ np.asarray(p["router"], np.float64)
            top = np.argsort(-logits, kind="stable")[: cfg.experts_per_token]
            flat += [(int(e), dev * length + pos, j) for j, e in enumerate(top)]
        chosen[dev] = sorted(flat)
    kept = set()
    for first in range(0, b, group):
        for receiver in range(group):
            room = rows
            for sender in range(first, first + group):
                mine = [a for a in chosen[sender] if a[0] // n == receiver]
                kept |= {(t, e) for e, t, _ in mine[:room]}
                room -= min(room, len(mine))
    return kept


@pytest.mark.parametrize("factor, dropping", [(1.0, True), (1.8, False)])
def test_a_smaller_receive_buffer_leaves_out_what_does_not_fit_and_counts_it(monkeypatch, factor, dropping):
    """model.moe_buffer_factor under the ragged dispatch (emulated), expert_fsdp on data=2,expert=4
    (one sequence of 6 tokens a device, one of the 4 experts a device, 2 a token): each receive
    buffer holds factor * 12 rows of the worst case's 24. The output equals the float64 reference
    over the assignments that fit (worked in numpy, _kept_assignments), and router_losses' dropped
    is the share left out. With the router skewed, a buffer of the balanced load (factor 1) leaves
    some out; one of 1.8 times it holds this routing's largest load and leaves out none."""
    from gspmd_tp.sharding.mesh import make_mesh
    from gspmd_tp.sharding.rules import load_rules
    from gspmd_tp.train.state import sharding_context

    monkeypatch.setattr(moe, "_ragged_all_to_all", emulated_ragged_all_to_all)
    loaded = load_rules("expert_fsdp")
    m = make_mesh("data=2,expert=4", loaded.mesh_axes, jax.devices()[:8], loaded.source)
    x = np.random.default_rng(1).normal(size=(8, 6, 32)).astype(np.float32)
    cfg = dataclasses.replace(CFG, moe_dispatch="ragged", moe_buffer_factor=factor)
    p = layer_params(cfg)
    kept = _kept_assignments(cfg, p, x, 4, int(np.ceil(factor * 12)))
    assignments = x.shape[0] * x.shape[1] * cfg.experts_per_token
    assert (len(kept) < assignments) == dropping
    layer = lambda p, x: MoeFeedForward(cfg).apply({"params": p}, x, mutable=["intermediates"])  # noqa: E731
    with sharding_context(m, loaded):
        y, state = jax.jit(layer)(p, x)
    want = reference_moe(cfg, p, x, kept).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)
    dropped = moe.router_losses(state["intermediates"], cfg.experts_per_token)["dropped"]
    assert float(dropped) == pytest.approx((assignments - len(kept)) / assignments, abs=1e-7)


def test_the_ragged_dispatch_asked_for_on_cpu_is_one_line_naming_gather():
    from conftest import small_config

    from gspmd_tp.job.errors import UserError
    from gspmd_tp.train import run_setup

    c = small_config(rules="expert_fsdp", mesh="data=2,expert=4", **{"model.num_experts": 8})
    c.model.moe_dispatch = "ragged"
    with pytest.raises(
        UserError, match=r"^config.model.moe_dispatch='ragged' needs TPU or GPU devices .*'gather'"
    ):
        run_setup.setup(c)
    c.model.moe_dispatch = "auto"  # the gather dispatcher on CPU
    assert run_setup.setup(c).model_cfg.moe_dispatch == "gather"
    assert (
        moe.dispatch_implementation("auto", "tpu") == moe.dispatch_implementation("auto", "gpu") == "ragged"
    )
