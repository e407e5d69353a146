"""The training loop: config -> mesh, rules, sharded state -> jit-compiled steps -> metrics, checkpoints.

`train(config, workdir)` is the library entry point that train.py and the tests call.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from gspmd_tp import axes, checkpoint, checkpoint_files, data, faults, metrics, optim, outputs
from gspmd_tp import loss as loss_lib
from gspmd_tp import state as state_lib
from gspmd_tp.errors import UserError
from gspmd_tp.mesh import make_mesh, mesh_string
from gspmd_tp.model import ModelConfig, Transformer, flops_per_token, param_count
from gspmd_tp.projection import explicit_projection_grad
from gspmd_tp.rules import Rules, axes_of, load_rules


def log(message: str) -> None:
    """Prints on process 0 only."""
    if jax.process_index() == 0:
        print(message, flush=True)


def model_config(config) -> ModelConfig:
    """config.model as a validated ModelConfig."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(config.model) - fields)
    if unknown:
        raise UserError(f"config.model has unknown key {unknown[0]!r} (known: {', '.join(sorted(fields))})")
    cfg = ModelConfig(**config.model.to_dict())
    problems = cfg.validate()
    if problems:
        raise UserError(problems[0])
    return cfg


def check_config(config) -> None:
    """Checks the run-level keys; raises UserError naming the key."""
    for key in (
        "steps",
        "batch_size",
        "grad_accum",
        "seq_len",
        "log_every",
        "checkpoint_every",
        "keep_checkpoints",
        "eval_every",
        "eval_batches",
    ):
        if config[key] <= 0:
            raise UserError(f"config.{key} must be positive, got {config[key]}")
    if config.loss_chunk < 0 or (config.loss_chunk and config.seq_len % config.loss_chunk):
        raise UserError(
            f"config.loss_chunk={config.loss_chunk} must be 0 or divide config.seq_len={config.seq_len}"
        )
    if config.batch_size % config.grad_accum:
        raise UserError(
            f"config.batch_size={config.batch_size} is not divisible by config.grad_accum={config.grad_accum}"
        )
    if config.batch_size % jax.process_count():
        raise UserError(
            f"config.batch_size={config.batch_size} is not divisible by the {jax.process_count()} processes"
        )
    optim.check(config.optim)
    if config.host_device_count < 0:
        raise UserError(
            f"config.host_device_count must be 0 (the host's devices) or more, got {config.host_device_count}"
        )
    if config.peak_flops_per_device < 0:
        peak = config.peak_flops_per_device
        raise UserError(f"config.peak_flops_per_device must be 0 (the known peak) or more, got {peak}")
    if not 0 <= config.data.seed < 2**32:
        raise UserError(f"config.data.seed must be in [0, 2**32), got {config.data.seed}")
    data.check(config.data)
    if config.data.prefetch < -1:
        raise UserError(f"config.data.prefetch must be -1 (auto), 0 or more, got {config.data.prefetch}")
    # Every data source yields byte tokens, whatever the files hold.
    if config.model.vocab_size < data.BYTE_VOCAB:
        raise UserError(f"config.model.vocab_size={config.model.vocab_size} is below the 256 byte tokens")


@dataclasses.dataclass
class Setup:
    """Everything a run derives from its config before compiling anything."""

    config: object
    model_cfg: ModelConfig
    rules: Rules
    mesh: jax.sharding.Mesh
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    abstract_state: object  # ShapeDtypeStructs carrying NamedShardings
    shardings: object
    batch_sharding: jax.sharding.NamedSharding

    @property
    def micro_batch(self) -> int:
        return self.config.batch_size // self.config.grad_accum

    def meta(self) -> dict:
        """What a checkpoint records about how it was made."""
        return {
            "model": dataclasses.asdict(self.model_cfg),
            "rules": {"source": self.rules.source, "text": self.rules.text},
            "mesh": mesh_string(self.mesh),
            "process_count": jax.process_count(),
            "config": self.config.to_dict(),
        }


def setup(config, devices=None, rules: Rules | None = None) -> Setup:
    """Validates the config, rule file and mesh (raising UserError), and derives the shardings.

    `rules`, where given, stands in for the file config.rules names (a checkpoint's saved copy).
    """
    check_config(config)
    model_cfg = model_config(config)
    rules = rules or load_rules(config.rules)
    mesh = make_mesh(config.mesh, rules.mesh_axes, devices)
    platform = mesh.devices.flat[0].platform
    if model_cfg.attention == "cudnn" and platform != "gpu":
        raise UserError(f"config.model.attention='cudnn' needs GPU devices; this run's are {platform}")
    # "auto" follows the devices the step compiles for, not the host (a TPU plan made on a laptop).
    explicit = explicit_projection_grad(model_cfg.projection_grad, platform)
    model_cfg = dataclasses.replace(model_cfg, projection_grad="explicit" if explicit else "xla")
    state_lib.validate(model_cfg, rules, mesh, config.batch_size // config.grad_accum, config.seq_len)
    tx, schedule = optim.make_optimizer(config.optim, config.steps)
    abstract, shardings = state_lib.state_shardings(model_cfg, tx, mesh, rules, config.seq_len)
    return Setup(
        config=config,
        model_cfg=model_cfg,
        rules=rules,
        mesh=mesh,
        tx=tx,
        schedule=schedule,
        abstract_state=abstract,
        shardings=shardings,
        batch_sharding=jax.sharding.NamedSharding(mesh, rules.spec((axes.BATCH, None))),
    )


def _loss_sums(model: Transformer, params, tokens, loss_chunk: int = 0):
    """(sum of token losses, number of tokens) for (batch, seq_len + 1) tokens.

    loss_chunk > 0 computes the logits that many positions at a time (see gspmd_tp/loss.py).
    """
    if loss_chunk:
        hidden, head = model.apply({"params": params}, tokens[:, :-1], return_hidden=True)
        return loss_lib.chunked_cross_entropy_sums(hidden, head, tokens[:, 1:], loss_chunk)
    return loss_lib.cross_entropy_sums(model.apply({"params": params}, tokens[:, :-1]), tokens[:, 1:])


def accumulated_grads(model: Transformer, accum: int, param_shardings, params, tokens, loss_chunk: int = 0):
    """(mean token loss, gradient of it) for (batch, seq_len + 1) tokens, over `accum` microbatches.

    Each microbatch differentiates its loss sum already divided by the tokens of the whole batch
    (a constant), so the gradients sum to the full-batch gradient for any `accum` and no pass over
    the gradients is left to divide them afterwards. Call it under the run's logical rules.

    Where no parameter is sharded over the batch's mesh axes (dp, Megatron), every batch shard
    keeps its own partial sum over the microbatches, and the data-parallel reduction runs once per
    step instead of once per microbatch. Where parameters are (FSDP, 2D), each microbatch's
    gradient is reduce-scattered onto them, as a sharded parameter needs.
    """
    b, t = tokens.shape
    count = b * (t - 1)

    def loss_and_grad(tokens_i):
        return jax.value_and_grad(lambda p: _loss_sums(model, p, tokens_i, loss_chunk)[0] / count)(params)

    if accum == 1:
        return loss_and_grad(tokens)
    # Microbatch i takes rows i, i + accum, ...: each stays spread over the batch axes.
    micro = tokens.reshape(b // accum, accum, t).swapaxes(0, 1)
    micro = nn.with_logical_constraint(micro, (None, axes.BATCH, None))
    batch_axes = axes_of(nn.logical_to_mesh_axes((axes.BATCH,))[0])
    if sums_per_batch_shard(batch_axes, param_shardings, b // accum):
        return _shard_partial_sums(model, micro, count, batch_axes, params, param_shardings, loss_chunk)

    def body(carry, tokens_i):
        grads_acc, loss_acc = carry
        loss_i, grads_i = loss_and_grad(tokens_i)
        grads_acc = jax.tree.map(jnp.add, grads_acc, grads_i)
        grads_acc = jax.lax.with_sharding_constraint(grads_acc, param_shardings)
        return (grads_acc, loss_acc + loss_i), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grads, loss), _ = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), micro)
    return loss, grads


def sums_per_batch_shard(batch_axes: tuple, param_shardings, micro_batch: int) -> bool:
    """Whether accumulated_grads sums the microbatches' gradients per batch shard and reduces them
    over `batch_axes` once per step: no parameter is sharded over those axes, and a microbatch of
    `micro_batch` rows splits evenly over them."""
    mesh = jax.tree.leaves(param_shardings)[0].mesh
    shards = math.prod(mesh.shape[a] for a in batch_axes)
    sharded = {a for sh in jax.tree.leaves(param_shardings) for e in sh.spec for a in axes_of(e)}
    return shards > 1 and micro_batch % shards == 0 and not sharded & set(batch_axes)


def _shard_partial_sums(model, micro, count, batch_axes: tuple, params, param_shardings, loss_chunk):
    """accumulated_grads for parameters not sharded over `batch_axes`: manual over those axes
    (shard_map; GSPMD still shards the rest), each batch shard sums its microbatches' gradients
    locally, and one psum over the batch axes reduces the sums."""
    mesh = jax.tree.leaves(param_shardings)[0].mesh
    # Inside, a shard's rows are local: no activation may name the manual axes.
    inner = tuple(
        (name, tuple(a for a in axes_of(target) if a not in batch_axes) or None)
        for name, target in nn.get_logical_axis_rules()
    )

    def local(params, micro):  # micro: (accum, rows of this shard, seq_len + 1)
        def body(carry, tokens_i):
            grads_acc, loss_acc = carry
            loss_i, grads_i = jax.value_and_grad(
                lambda p: _loss_sums(model, p, tokens_i, loss_chunk)[0] / count
            )(params)
            return (jax.tree.map(jnp.add, grads_acc, grads_i), loss_acc + loss_i), None

        with nn.logical_axis_rules(inner):
            zeros = jax.tree.map(jnp.zeros_like, params)
            (grads, loss), _ = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)), micro)
        return jax.lax.psum((loss, grads), batch_axes)

    # check_vma=False: the model's custom VJPs (explicit projection gradients) return cotangents
    # without shard_map's varying-axes types; nothing here is differentiated through the map.
    loss, grads = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(None, batch_axes, None)),
        out_specs=(P(), P()),
        axis_names=set(batch_axes),
        check_vma=False,
    )(params, micro)
    return loss, jax.lax.with_sharding_constraint(grads, param_shardings)


def make_train_step(s: Setup):
    """The jit-compiled step: accumulate gradients over microbatches, clip, AdamW; state donated.

    With config.skip_nonfinite_steps a step whose loss or gradient is NaN/Inf keeps the old
    parameters and optimizer state (a select on device, no host sync); only the step counter moves.
    """
    model = Transformer(s.model_cfg)
    skip_nonfinite = s.config.skip_nonfinite_steps

    def step(state: state_lib.TrainState, tokens):
        loss, grads = accumulated_grads(
            model, s.config.grad_accum, s.shardings.params, state.params, tokens, s.config.loss_chunk
        )
        grad_norm = optax.global_norm(grads)
        updates, opt_state = s.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if skip_nonfinite:
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            keep = lambda new, old: jnp.where(finite, new, old)
            params = jax.tree.map(keep, params, state.params)
            opt_state = jax.tree.map(keep, opt_state, state.opt_state)
        new_state = state_lib.TrainState(step=state.step + 1, params=params, opt_state=opt_state)
        # The rate this update used: the optimizer's own step count, which a skipped step leaves.
        counts = optax.tree_utils.tree_get_all_with_path(state.opt_state, "count")
        lr = s.schedule(counts[0][1] if counts else state.step)
        stats = {"loss": loss, "grad_norm": grad_norm, "learning_rate": lr}
        return new_state, stats

    replicated = state_lib.replicated(s.mesh)
    return jax.jit(
        step,
        in_shardings=(s.shardings, s.batch_sharding),
        out_shardings=(s.shardings, replicated),
        donate_argnums=(0,),
    )


def make_eval_step(s: Setup):
    """jit-compiled (sum of token losses, token count) on one held-out batch."""
    model = Transformer(s.model_cfg)

    def step(params, tokens):
        loss_sum, count = _loss_sums(model, params, tokens, s.config.loss_chunk)
        return loss_sum, jnp.asarray(count, jnp.float32)

    return jax.jit(step, in_shardings=(s.shardings.params, s.batch_sharding))


def abstract_batch(s: Setup, batch_size: int) -> jax.ShapeDtypeStruct:
    """The (batch, seq_len + 1) int32 token array the steps take, with its sharding."""
    return jax.ShapeDtypeStruct((batch_size, s.config.seq_len + 1), jnp.int32, sharding=s.batch_sharding)


def compile_train_step(s: Setup):
    """Ahead-of-time compiles the train step for the setup's abstract state and batch."""
    with state_lib.sharding_context(s.mesh, s.rules):
        return make_train_step(s).lower(s.abstract_state, abstract_batch(s, s.config.batch_size)).compile()


def eval_batch_count(s: Setup, dataset) -> int:
    """config.eval_batches, at most one pass over the held-out batches (no window counted twice)."""
    per_pass = getattr(dataset, "batches_per_pass", None)
    return min(s.config.eval_batches, per_pass) if per_pass else s.config.eval_batches


def evaluate(s: Setup, eval_step, params, dataset, stop=lambda: False) -> float | None:
    """Mean token loss over eval_batch_count() held-out batches; None if `stop()` cut it short."""
    total, count = 0.0, 0.0
    it = iter(dataset)
    for _ in range(eval_batch_count(s, dataset)):
        if stop():
            return None
        loss_sum, n = eval_step(params, data.global_batch(next(it), s.batch_sharding, s.config.batch_size))
        total, count = total + float(loss_sum), count + float(n)
    return total / count


def _initial_state(s: Setup, workdir: str, found: list, mngr, imported_params):
    """(state, data-iterator state or None, start step): the newest checkpoint that restores, else init."""
    c = s.config
    if found:
        start, meta, state, data_state = checkpoint.restore_newest(mngr, found, s.abstract_state, warn=log)
        log(f"resumed from step {start} (saved on mesh {meta['mesh']} with rules {meta['rules']['source']})")
        return state, data_state, start
    state = state_lib.init_state(s.model_cfg, s.tx, s.mesh, s.rules, c.seq_len, c.seed)
    if imported_params is not None:
        state = state.replace(params=imported_params)
        log(f"initial parameters from {c.init_from}")
    return state, None, 0


def train(config, workdir: str) -> dict:
    """Trains per `config`, resuming from the newest checkpoint in workdir; returns final metrics.

    A SIGTERM/SIGINT saves at the next step boundary and returns with "stopped" set; a second
    exits at once. A NaN/Inf loss or gradient raises UserError (or is skipped, per config).
    """
    outputs.check_dir(workdir, "--workdir")
    s = setup(config)
    c = s.config
    workdir = os.path.abspath(workdir)
    n_params = param_count(s.model_cfg)
    log(
        f"gspmd_tp: {n_params['total'] / 1e6:.2f}M parameters | mesh {mesh_string(s.mesh)} on "
        f"{jax.device_count()} {jax.devices()[0].device_kind} devices | rules {s.rules.source}"
    )

    train_tokens, eval_tokens = data.load_corpus(c.data)
    rows = data.process_rows(s.batch_sharding, c.batch_size)
    train_ds = data.train_dataset(train_tokens, c.seq_len, c.batch_size, c.data.seed, rows)
    eval_ds = data.eval_dataset(eval_tokens, c.seq_len, c.batch_size, rows)
    if eval_batch_count(s, eval_ds) < c.eval_batches:
        log(
            f"config.eval_batches={c.eval_batches} is more than the held-out split's "
            f"{eval_ds.batches_per_pass} batches; evaluating those"
        )
    data_iter = iter(train_ds)

    # Read-only look at the workdir: a different model or another run is an error before any write.
    found = checkpoint_files.readable_checkpoints(workdir, warn=log)
    for _, meta in found:
        checkpoint.check_model_matches(meta["model"], s.model_cfg, workdir)
        checkpoint.check_same_run(meta["config"], c, workdir)
    imported = None
    if not found and c.init_from:  # read only by a fresh run: a resumed one may have lost the file
        if not os.path.isfile(c.init_from):
            raise UserError(f"config.init_from: no file {c.init_from}")
        imported = checkpoint.import_params(c.init_from, s.abstract_state.params)

    t0 = time.perf_counter()
    train_step = compile_train_step(s)
    with state_lib.sharding_context(s.mesh, s.rules):
        eval_step = make_eval_step(s)
    compile_s = time.perf_counter() - t0

    # The first write: unreadable newest steps move aside so that saving those steps again works.
    checkpoint_files.move_aside_unreadable(workdir, [step for step, _ in found], warn=log)
    mngr = checkpoint.manager(workdir, c.keep_checkpoints)
    state, data_state, start = _initial_state(s, workdir, found, mngr, imported)
    if data_state is not None:
        data_iter.set_state(data_state)
    if start >= c.steps:
        log(f"nothing to do: the newest checkpoint is at step {start} >= config.steps={c.steps}")
        mngr.close()
        return {"step": start}
    log(f"compiled in {compile_s:.1f}s; training steps {start + 1}..{c.steps}")

    writer = metrics.MetricsWriter(workdir, enabled=jax.process_index() == 0)
    flops = flops_per_token(s.model_cfg, c.seq_len)
    peak = metrics.peak_flops(jax.devices()[0].device_kind, c.peak_flops_per_device)
    tokens_per_step = c.batch_size * c.seq_len
    watch = faults.NonFiniteWatch(c.skip_nonfinite_steps, log)
    last_saved = start if start else None
    last_row: dict = {}
    # `data_wait_ms` is what the loop waits for its next batch, read ahead or not.
    depth = c.data.prefetch if c.data.prefetch >= 0 else (0 if jax.devices()[0].platform == "cpu" else 2)
    batches = None
    window = {"start": time.perf_counter(), "data_wait": []}  # one wait per step dispatched

    def report(step: int, stats, steps: int, eval_params=None) -> None:
        """Reads a logged step's stats (the host's only wait) and writes its row. `steps` of the
        window had been dispatched when it was logged; later ones start the next window."""
        nonlocal last_row
        stats = jax.device_get(stats)
        watch.check(last_saved, upto=step)
        now = time.perf_counter()
        elapsed = now - window["start"]
        tps = tokens_per_step * steps / elapsed
        row = {k: float(v) for k, v in stats.items()}
        row.update(
            tokens_per_sec=tps,
            step_time_s=elapsed / steps,
            data_wait_ms=1e3 * sum(window["data_wait"][:steps]) / steps,
            mfu=metrics.mfu(flops, tps, jax.device_count(), peak),
        )
        if watch.skipped:
            row["skipped_steps"] = watch.skipped
        if eval_params is not None:
            eval_loss = evaluate(s, eval_step, eval_params, eval_ds, stop.requested)
            if eval_loss is not None:
                row["eval_loss"] = eval_loss
        writer.write(step, row)
        log(metrics.progress_line(step, c.steps, row))
        last_row = {"step": step, **row}
        later = window["data_wait"][steps:]
        window.update(start=time.perf_counter(), data_wait=later)

    pending = None  # a logged step whose stats are read once the next step is dispatched
    finish_saves = True
    try:
        with state_lib.sharding_context(s.mesh, s.rules), faults.StopSignal(log) as stop:
            # Read ahead only once a stop signal is handled: one that comes while a batch is being
            # read must save and stop, not kill the run.
            place = lambda b: data.global_batch(b, s.batch_sharding, c.batch_size)  # noqa: E731
            batches = data.Prefetcher(data_iter, place, depth)
            for step in range(start + 1, c.steps + 1):
                t = time.perf_counter()
                batch = next(batches)
                window["data_wait"].append(time.perf_counter() - t)
                state, stats = train_step(state, batch)
                watch.add(step, stats)
                if pending is not None:  # the device is busy with this step meanwhile
                    report(*pending)
                    pending = None
                done = step == c.steps
                evaluating = step % c.eval_every == 0 or done
                if step % c.log_every == 0 or evaluating or step == start + 1:
                    if evaluating:  # evaluates this step's parameters: now
                        report(step, stats, len(window["data_wait"]), eval_params=state.params)
                    else:
                        pending = (step, stats, len(window["data_wait"]))
                stopping = stop.requested()
                if step % c.checkpoint_every == 0 or done or stopping:
                    watch.check(last_saved)  # never save a state that went through a non-finite step
                    checkpoint.save(mngr, step, state, batches.get_state(), s.meta())
                    last_saved = step
                if stopping:
                    if pending is not None:
                        report(*pending)
                        pending = None
                    mngr.wait_until_finished()  # synchronous: the process may be killed soon after
                    log(
                        f"stopped by {stop.stopped_by} after step {step}: checkpoint saved; "
                        "run again to resume"
                    )
                    last_row = {**last_row, "step": step, "stopped": True}
                    break
            if pending is not None:
                report(*pending)
    except Exception as e:
        # A failed step of a multi-process job: a peer is almost surely gone, and a save in flight
        # would wait for it in its own collectives until the coordination service aborts. The
        # caller exits instead; the next start removes the unfinished save.
        finish_saves = jax.process_count() == 1 or isinstance(e, UserError)
        raise
    finally:
        if batches is not None:
            batches.close()
        # Also on an error: let a save in flight finish, so the newest checkpoint on disk is complete.
        if finish_saves:
            mngr.wait_until_finished()
            mngr.close()
        writer.close()
    log(
        f"done: metrics in {os.path.join(workdir, 'metrics.jsonl')}, TensorBoard events in "
        f"{os.path.join(workdir, 'tensorboard')}, checkpoints in {checkpoint_files.checkpoint_dir(workdir)}"
    )
    return last_row
