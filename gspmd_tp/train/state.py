"""The training state: its abstract shape, its shardings under a rule file, and sharded init.

Parameters are born sharded: the state is described with jax.eval_shape, its logical
PartitionSpecs are turned into NamedShardings on the mesh, and init runs under jit with those
out_shardings, so no device ever holds the whole model.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gspmd_tp.model.params import abstract_params, param_axes
from gspmd_tp.model.transformer import ModelConfig, Transformer
from gspmd_tp.sharding import axes
from gspmd_tp.sharding.rules import Rules, axes_of, check_coverage, check_divisible


@flax.struct.dataclass
class TrainState:
    """Step counter, parameters and optimizer state; the whole of what a checkpoint saves on device."""

    step: jax.Array
    params: Any
    opt_state: Any


@contextlib.contextmanager
def sharding_context(mesh: Mesh, rules: Rules):
    """Mesh and logical rules in force while tracing, so nn.with_logical_constraint takes effect."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules.rules):
        yield


def _fresh_state(params, tx: optax.GradientTransformation) -> TrainState:
    """Step 0: `params` and the optimizer's initial state of them (boxed params give boxed moments)."""
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def _init_fn(model: Transformer, tx: optax.GradientTransformation, seq_len: int):
    def init(rng):
        tokens = jnp.zeros((1, seq_len), jnp.int32)
        return _fresh_state(model.init(rng, tokens)["params"], tx)  # boxed: leaves carry logical names

    return init


@functools.lru_cache(maxsize=16)
def logical_specs(model_cfg: ModelConfig, tx: optax.GradientTransformation):
    """(abstract state with boxed leaves, tree of logical PartitionSpecs), computed without FLOPs:
    the optimizer's state traced over the model's abstract parameters (params.abstract_params, the
    model traced once per config). Shared between callers: read it, do not change it."""
    boxed = jax.eval_shape(functools.partial(_fresh_state, tx=tx), abstract_params(model_cfg))
    return boxed, nn.get_partition_spec(boxed)


def validate(model_cfg: ModelConfig, rules: Rules, mesh: Mesh, micro_batch: int, seq_len: int) -> None:
    """Raises UserError (naming the rule file and the item) before anything compiles."""
    params = param_axes(model_cfg)
    used = {n for _, names in params.values() for n in names if n} | set(axes.ACTIVATION_AXES)
    check_coverage(rules, used)
    check_divisible(rules, dict(mesh.shape), _tensors(model_cfg, micro_batch, seq_len))


# The activations of the products that make up a step's compute (attention, MLP, output layer): a
# mesh axis that splits none of them leaves its devices all computing the same products.
_PRODUCT_ACTIVATIONS = (
    "activation queries",
    "activation attention scores",
    "activation mlp hidden",
    "activation logits",
)


def idle_mesh_axes(model_cfg: ModelConfig, rules: Rules, mesh: Mesh) -> dict[str, list[str]]:
    """Mesh axes of more than one device along which every device computes the same products,
    each with what it does shard: [] (nothing at all), or some of "parameters" and "the residual
    stream" (fsdp.yaml with [batch, dp] shards parameters only on mp; [norm_length, sp] on a mesh
    axis of its own the residual stream only, which is gathered whole for attention and the MLP)."""
    found: dict[str, set[str]] = {}
    for name, (_, names) in _tensors(model_cfg, 1, 1).items():
        if name in _PRODUCT_ACTIVATIONS:
            kind = "products"
        else:  # the tokens and the residual stream, or a parameter
            kind = "the residual stream" if name.startswith("activation ") else "parameters"
        for entry in rules.spec(names):
            for a in axes_of(entry):
                found.setdefault(a, set()).add(kind)
    return {
        a: sorted(found.get(a, set()))
        for a, n in mesh.shape.items()
        if n > 1 and "products" not in found.get(a, set())
    }


def misaligned_params(
    model_cfg: ModelConfig, rules: Rules, mesh: Mesh
) -> list[tuple[str, str, tuple, tuple]]:
    """(parameter path, logical name, its mesh axes, the activations' mesh axes) where a parameter
    dimension is split over the mesh axes that split that name in the activations and more, but
    not with those axes first: [mlp, [dp, mp]] then [mlp, mp] puts block dp*4+mp of the weight on
    a device whose activations hold blocks 2mp and 2mp+1, so GSPMD shuffles the weight between
    devices and reduces its whole gradient (1.73 of the analysis on dp=2,mp=4); [mlp, [mp, dp]]
    nests each device's slice of the weight inside its slice of the activations. One entry per
    logical name and pair of layouts, with the first parameter that has it. Mesh axes of one
    device split nothing and are left out ([dp, mp] on dp=1 is [mp])."""
    tensors = _tensors(model_cfg, 1, 1)

    def split_by(entry) -> tuple[str, ...]:
        return tuple(a for a in axes_of(entry) if mesh.shape[a] > 1)

    in_activations: dict[str, set[tuple]] = {}
    for name, (_, names) in tensors.items():
        if name.startswith("activation "):
            for logical, entry in zip(names, rules.spec(names), strict=False):
                if logical and split_by(entry):
                    in_activations.setdefault(logical, set()).add(split_by(entry))
    found, seen = [], set()
    for name, (_, names) in tensors.items():
        if name.startswith("activation "):
            continue
        for logical, entry in zip(names, rules.spec(names), strict=False):
            mine = split_by(entry)
            for theirs in sorted(in_activations.get(logical, ())):
                key = (logical, mine, theirs)
                if set(theirs) <= set(mine) and mine[: len(theirs)] != theirs and key not in seen:
                    seen.add(key)
                    found.append((name, logical, axes_of(entry), theirs))
    return found


def _tensors(model_cfg: ModelConfig, micro_batch: int, seq_len: int):
    """{name: (shape, logical names)} of every parameter and key activation, as validate checks them."""
    params = param_axes(model_cfg)
    activations = {
        "activation tokens": ((micro_batch, seq_len), (axes.BATCH, axes.LENGTH)),
        "activation residual stream": (
            (micro_batch, seq_len, model_cfg.d_model),
            (axes.BATCH, axes.NORM_LENGTH, axes.EMBED),
        ),
        "activation attention scores": (
            (micro_batch, model_cfg.num_kv_heads, model_cfg.group, seq_len, seq_len),
            (axes.BATCH, axes.KV_HEADS, None, axes.LENGTH, None),
        ),
        "activation queries": (
            (micro_batch, seq_len, model_cfg.num_heads, model_cfg.head_dim),
            (axes.BATCH, axes.LENGTH, axes.HEADS, axes.HEAD_DIM),
        ),
        "activation mlp hidden": (  # a mixture of experts': each expert's
            (micro_batch, seq_len, model_cfg.expert_width if model_cfg.num_experts else model_cfg.mlp_dim),
            (axes.BATCH, axes.LENGTH, axes.MLP),
        ),
        "activation logits": (
            (micro_batch, seq_len, model_cfg.vocab_size),
            (axes.BATCH, axes.LENGTH, axes.VOCAB),
        ),
    }
    return {**{f"params/{k}": v for k, v in params.items()}, **activations}


def state_shardings(model_cfg: ModelConfig, tx, mesh: Mesh, rules: Rules):
    """(abstract unboxed state as ShapeDtypeStructs carrying NamedShardings, sharding tree)."""
    boxed, specs = logical_specs(model_cfg, tx)
    shardings = nn.logical_to_mesh_sharding(specs, mesh, rules.rules)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        nn.meta.unbox(boxed),
        shardings,
    )
    return abstract, shardings


def init_state(model_cfg: ModelConfig, tx, mesh: Mesh, rules: Rules, seq_len: int, seed: int):
    """A freshly initialized TrainState, every leaf created directly in its sharding."""
    _, shardings = state_shardings(model_cfg, tx, mesh, rules)
    init = _init_fn(Transformer(model_cfg), tx, seq_len)
    with sharding_context(mesh, rules):
        return jax.jit(lambda r: nn.meta.unbox(init(r)), out_shardings=shardings)(jax.random.key(seed))


def decoding_shardings(shardings, rules: Rules):
    """The parameters' shardings for decoding: each one's PartitionSpec without the mesh axes of
    `batch`, so that they are replicated over those axes (other axes, such as mp, keep their shards).

    A decode step reads every parameter for one token per row: a parameter split over the batch's
    axes (fsdp.yaml's embed, megatron_2d.yaml's embed on dp) would be gathered again for every token
    in the loop, where one gather before it serves them all (as MaxText and t5x reshard for serving).
    """
    batch_axes = set(rules.batch_axes())

    def without_batch_axes(entry):
        if entry is None or isinstance(entry, str):
            return None if entry in batch_axes else entry
        kept = tuple(a for a in entry if a not in batch_axes)
        return kept or None

    return jax.tree.map(
        lambda sh: NamedSharding(sh.mesh, PartitionSpec(*(without_batch_axes(e) for e in sh.spec))),
        shardings,
    )


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
    """The sharding of a (batch, length) token array."""
    return NamedSharding(mesh, rules.spec((axes.BATCH, axes.LENGTH)))


def replicated(mesh: Mesh) -> NamedSharding:
    """A sharding that puts the whole value on every device."""
    return NamedSharding(mesh, PartitionSpec())
