"""Sampling from a trained run: prefill the prompts, then decode token by token from a key/value cache.

    python -m gspmd_tp.generate --workdir=DIR --prompt=TEXT [--max_new_tokens=N] [--temperature=T]
        [--top_k=K] [--seed=S] [--step=N] [--config.rules=NAME --config.mesh=dp=4,mp=2 ...]
    python -m gspmd_tp.generate --workdir=DIR --prompts_file=FILE    # one prompt per line, one batch

The newest checkpoint's parameters are restored onto the run's mesh and rule file (or the ones
given with --config.*). A prompt is its ids in the run's tokenizer (config.data.tokenizer: bytes,
or the tokenizer convert from-hf recorded) after the separator that starts every training document,
and the samples print as text through it. Prompts are left-padded to one length so that every row
writes the same cache slot at each step; each row keeps its own rotary positions and never attends
to its padding. The cache's logical axes (layers, batch, length, kv_heads, head_dim) resolve
through the rule file like the parameters', so under Megatron rules each device keeps the keys and
values of its own heads.
Prefill and the whole decode loop are one jit-compiled function. It first lays the parameters out
for decoding (state.decoding_shardings: replicated over the mesh axes of the batch, mp shards kept),
so that fsdp.yaml and megatron_2d.yaml gather them once per call rather than once per new token;
where that layout does not fit in memory they stay in their training layout, with a note on stderr.

As one process of a job of several (a pod, a cluster), with train.py's job flags:
--coordinator_address=HOST:PORT --num_processes=N --process_id=I, or --distributed; process 0 prints.
"""

from __future__ import annotations

if __name__ == "__main__":  # before jax is imported: Ctrl-C while importing is one line
    from gspmd_tp.job import entry

    entry.begin()  # main() asks for the devices once the flags are read

import dataclasses
import functools
import math
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from gspmd_tp.cli import arguments
from gspmd_tp.cli.arguments import no_positional_arguments, parse_command_flags
from gspmd_tp.data import pipeline, tokenizer
from gspmd_tp.inference import saved_run
from gspmd_tp.job import distributed
from gspmd_tp.job.errors import UserError, warn
from gspmd_tp.model.params import path_str
from gspmd_tp.model.transformer import Decoding, Transformer
from gspmd_tp.sharding import axes
from gspmd_tp.sharding.mesh import mesh_string
from gspmd_tp.sharding.rules import check_divisible
from gspmd_tp.storage import paths
from gspmd_tp.train import run_setup
from gspmd_tp.train import state as state_lib

DEFAULT_MAX_NEW_TOKENS = 100
DEFAULT_TEMPERATURE = 0.8  # a little sharper than the model's distribution, as in nanoGPT


def encode(prompt: str, tok: tokenizer.Tokenizer = tokenizer.BYTE_TOKENIZER) -> list[int]:
    """Token ids of a prompt, after the separator that starts every training document (byte tokens
    by default)."""
    # surrogateescape: bytes that are not UTF-8 (Python keeps them so in argv and in read_prompts)
    # are the prompt's own bytes, as any bytes of a training file are tokens.
    return tok.prompt(prompt.encode("utf-8", "surrogateescape"))


def decode(tokens, tok: tokenizer.Tokenizer = tokenizer.BYTE_TOKENIZER) -> str:
    """Text of generated ids up to the first separator (the model ended the document)."""
    return tok.decode(tokens)


# --- checks on the request, each raised before anything is restored or compiled ---


def read_prompts(prompt: str | None, prompts_file: str | None) -> list[str]:
    """The prompts of --prompt or --prompts_file (one per line); UserError if none or empty."""
    if (prompt is None) == (prompts_file is None):
        raise UserError("give exactly one of --prompt=TEXT and --prompts_file=FILE")
    if prompt is not None:
        if not prompt:
            raise UserError("--prompt is empty: give some text to continue")
        return [prompt]
    try:  # any bytes: encode() takes them back
        lines = paths.of(prompts_file).read_bytes().decode("utf-8", "surrogateescape").splitlines()
    except OSError as e:
        raise UserError(f"--prompts_file={prompts_file}: {e}") from None
    if not lines:
        raise UserError(f"--prompts_file={prompts_file} has no prompts")
    for i, line in enumerate(lines):
        if not line:
            raise UserError(f"--prompts_file={prompts_file}: line {i + 1} is an empty prompt")
    return lines


def check_sampling(
    max_new_tokens: int | None,
    temperature: float,
    top_k: int,
    seed: int = 0,
    vocab: int = pipeline.BYTE_VOCAB,
) -> None:
    """Sampling flags that are wrong for a tokenizer of `vocab` ids: UserError naming the flag."""
    if not 0 <= seed < 2**31:  # the sampling key's seed is an int32 on the devices
        raise UserError(f"--seed must be in [0, 2**31), got {seed}")
    if max_new_tokens is not None and max_new_tokens <= 0:
        raise UserError(f"--max_new_tokens must be positive, got {max_new_tokens}")
    if not 0 <= temperature < math.inf:  # also NaN; inf would divide the masked logits into NaN
        raise UserError(f"--temperature must be a finite number >= 0 (0: greedy), got {temperature}")
    if vocab is not None and not 0 <= top_k <= vocab:
        raise UserError(f"--top_k must be in 0..{vocab} (0: no limit), got {top_k}")


def fit_length(token_lists: list[list[int]], max_new_tokens: int | None, seq_len: int) -> int:
    """New tokens to generate: all must fit in the seq_len positions the model was trained on.

    None means DEFAULT_MAX_NEW_TOKENS, or fewer when the prompt leaves less room.
    """
    longest = max(len(t) for t in token_lists)
    room = seq_len - longest
    which = "the longest prompt" if len(token_lists) > 1 else "the prompt"
    prompt = f"{which} ({longest - 1} byte{'' if longest == 2 else 's'} and the document separator)"
    hint = "or pass --config.seq_len=N to sample past the trained context"
    if max_new_tokens is None:
        if room <= 0:
            raise UserError(
                f"{prompt} fills the {seq_len} positions the model was trained on (config.seq_len); "
                f"shorten it, {hint}"
            )
        return min(DEFAULT_MAX_NEW_TOKENS, room)
    if max_new_tokens > room:
        raise UserError(
            f"{prompt} plus --max_new_tokens="
            f"{max_new_tokens} is longer than the {seq_len} positions the model was trained on "
            f"(config.seq_len); ask for at most {max(room, 0)} new tokens, {hint}"
        )
    return max_new_tokens


# --- the sampler ---


def batch_rows(s: run_setup.Setup, prompts: int) -> int:
    """Rows of the decoding batch: the prompts, rounded up to divide over the mesh axes of `batch`."""
    ways = math.prod(s.mesh.shape[a] for a in s.rules.batch_axes())
    return -(-prompts // ways) * ways


def left_pad(token_lists: list[list[int]], rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, positions), both (rows, longest prompt): each prompt ends in the last column.

    Positions count from each prompt's first token (negative on padding). Rows past the prompts
    repeat the first one (they only fill the batch up to a divisible size).
    """
    length = max(len(t) for t in token_lists)
    tokens = np.full((rows, length), pipeline.SEPARATOR, np.int32)
    positions = np.zeros((rows, length), np.int32)
    for i in range(rows):
        row = token_lists[i] if i < len(token_lists) else token_lists[0]
        pad = length - len(row)
        tokens[i, pad:] = row
        positions[i] = np.arange(length) - pad
    return tokens, positions


def cache_shardings(s: run_setup.Setup, rows: int, prompt_len: int, cache_length: int):
    """NamedShardings of the key/value cache: its logical axes resolved by the rule file.

    Raises UserError, naming the cache leaf, when the mesh axes do not divide it.
    """
    model = Transformer(s.model_cfg)

    def init():
        tokens = jnp.zeros((rows, prompt_len), jnp.int32)
        decoding = Decoding(tokens, jnp.int32(0), cache_length)
        return model.init(jax.random.key(0), tokens, decoding=decoding)["cache"]

    boxed = jax.eval_shape(init)
    leaves = jax.tree_util.tree_flatten_with_path(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]
    tensors = {f"cache/{path_str(path)}": (leaf.value.shape, leaf.names) for path, leaf in leaves}
    tensors["activation prompt tokens"] = ((rows, prompt_len), (axes.BATCH, axes.LENGTH))
    tensors["activation decoded token"] = ((rows, 1), (axes.BATCH, axes.LENGTH))
    check_divisible(s.rules, dict(s.mesh.shape), tensors)
    return nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), s.mesh, s.rules.rules)


def _choose(logits_bv, key, temperature: float, top_k: int, vocab: int = pipeline.BYTE_VOCAB):
    """The next token of each row: argmax at temperature 0, else a sample (top_k > 0: of the k best)."""
    # Only the tokenizer's ids decode to text; ids past them (vocabulary padding) are never picked.
    ids = jnp.arange(logits_bv.shape[-1])
    logits_bv = jnp.where(ids < vocab, logits_bv, -jnp.inf)
    if temperature == 0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    # From the row's largest logit, so that a small temperature cannot overflow the leaders to inf
    # (argmax over the ties would take the first, not the likeliest), and by no less than the smallest
    # normal float32: the CPU flushes a subnormal one to 0, and 0 / 0 is NaN.
    temperature = max(temperature, float(np.finfo(np.float32).tiny))
    logits_bv = (logits_bv - logits_bv.max(axis=-1, keepdims=True)) / temperature
    if top_k:
        kth = jax.lax.top_k(logits_bv, top_k)[0][:, -1:]
        logits_bv = jnp.where(logits_bv >= kth, logits_bv, -jnp.inf)
    return jax.random.categorical(key, logits_bv).astype(jnp.int32)


def make_sampler(
    s: run_setup.Setup,
    rows: int,
    prompt_len: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    return_logits: bool = False,
):
    """fn(params, tokens, positions, seed) -> new tokens (rows, max_new_tokens), jit-compiled on
    first call; with return_logits also the logits each token was chosen from (rows, new, vocab).

    The parameters come in their training layout and are laid out for decoding (state.
    decoding_shardings) before the prompts are read, unless that layout does not fit in memory:
    then they stay as they are, with a note on stderr. fn.layout() says which ("decoding" or
    "training"); fn.compiled() raises UserError where not even the training layout fits.
    """
    model = Transformer(dataclasses.replace(s.model_cfg, remat="none"))  # no gradients here
    vocab = tokenizer.load(s.config.data.tokenizer).vocab_size
    cache_length = prompt_len + max_new_tokens
    cache_sh = cache_shardings(s, rows, prompt_len, cache_length)
    layouts = {"training": s.shardings.params}
    decoding_sh = state_lib.decoding_shardings(s.shardings.params, s.rules)
    if jax.tree.leaves(decoding_sh) != jax.tree.leaves(s.shardings.params):  # megatron_1d: the same
        layouts["decoding"] = decoding_sh

    def sample(params_sh, params, tokens_bl, positions_bl, seed):
        # Here, outside the decode loop, GSPMD gathers what the layout replicates once per call.
        params = jax.lax.with_sharding_constraint(params, params_sh)
        key = jax.random.key(seed)
        prefill = Decoding(positions_bl, jnp.int32(0), cache_length)
        (hidden_ble, head_ev), variables = model.apply(
            {"params": params}, tokens_bl, return_hidden=True, decoding=prefill, mutable=["cache"]
        )
        # Every prompt ends in the last column: only that position's logits are needed.
        logits_bv = jnp.einsum("be,ev->bv", hidden_ble[:, -1], head_ev.astype(hidden_ble.dtype))
        logits_bv = nn.with_logical_constraint(logits_bv.astype(jnp.float32), (axes.BATCH, axes.VOCAB))
        cache = jax.lax.with_sharding_constraint(nn.meta.unbox(variables["cache"]), cache_sh)
        first = _choose(logits_bv, jax.random.fold_in(key, 0), temperature, top_k, vocab)

        def step(carry, i):
            cache, token_b, position_b = carry
            decoding = Decoding(position_b[:, None], prompt_len + i, cache_length)
            logits, variables = model.apply(
                {"params": params, "cache": cache}, token_b[:, None], decoding=decoding, mutable=["cache"]
            )
            cache = jax.lax.with_sharding_constraint(variables["cache"], cache_sh)
            chosen = _choose(logits[:, 0], jax.random.fold_in(key, i + 1), temperature, top_k, vocab)
            return (cache, chosen, position_b + 1), ((chosen, logits[:, 0]) if return_logits else chosen)

        carry = (cache, first, positions_bl[:, -1] + 1)
        _, ys = jax.lax.scan(step, carry, jnp.arange(max_new_tokens - 1, dtype=jnp.int32))
        rest = ys[0] if return_logits else ys  # (new - 1, rows)
        tokens = jnp.concatenate([first[:, None], rest.T], axis=1)
        if not return_logits:
            return tokens
        return tokens, jnp.concatenate([logits_bv[:, None], ys[1].swapaxes(0, 1)], axis=1)

    batch_sh = state_lib.batch_sharding(s.mesh, s.rules)
    replicated = state_lib.replicated(s.mesh)  # the results are small: every process reads them whole
    executables = {}

    def compiled_for(layout: str):
        """The function compiled ahead of time for these shapes with the parameters in `layout`
        (once): its memory is known before any parameter is read."""
        if layout not in executables:
            jitted = jax.jit(
                functools.partial(sample, layouts[layout]),
                in_shardings=(s.shardings.params, batch_sh, batch_sh, replicated),
                out_shardings=replicated,
            )
            prompts = jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32, sharding=batch_sh)
            seed = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
            with state_lib.sharding_context(s.mesh, s.rules):
                lowered = jitted.lower(s.abstract_state.params, prompts, prompts, seed)
            executables[layout] = lowered.compile()
        return executables[layout]

    chosen = None

    def layout() -> str:
        """The parameters' layout in the loop: "decoding" where it fits in memory, else "training"."""
        nonlocal chosen
        if chosen is None:
            chosen = _fitting_layout(s, compiled_for, layouts)
        return chosen

    def compiled():
        """The function compiled for the layout it samples with; UserError where none fits in memory."""
        return compiled_for(layout())

    def run(params, tokens_bl, positions_bl, seed):
        return compiled()(params, tokens_bl, positions_bl, seed)

    run.compiled, run.compiled_for, run.layout = compiled, compiled_for, layout
    return run


_MEMORY_FIX = "fewer --max_new_tokens or prompts, or read on another --config.mesh"


def _fitting_layout(s: run_setup.Setup, compiled_for, layouts) -> str:
    """The first of "decoding", "training" in `layouts` whose compiled sampler fits in memory, with a
    note on stderr where that is the training layout; UserError where neither fits."""
    note = None
    if "decoding" in layouts:
        gathered = ", ".join(s.rules.batch_axes())
        instead = f"sampling with them in their training layout, gathered over {gathered} for every new token"
        try:
            run_setup.check_memory(
                compiled_for("decoding").memory_analysis(),
                s.mesh,
                f"sampling step with the parameters replicated over {gathered} for decoding",
                instead,
            )
        except UserError as e:
            note = f"note: {e}"
        # One program on every process of a job: a host with less memory decides for all of them.
        short = [i for i, [fits] in enumerate(distributed.every_process([int(note is None)])) if not fits]
        if not short:
            return "decoding"
        note = note or f"note: process {short[0]} cannot hold the parameters laid out for decoding; {instead}"
    run_setup.check_memory(compiled_for("training").memory_analysis(), s.mesh, "sampling step", _MEMORY_FIX)
    if note and jax.process_index() == 0:
        warn(note)
    return "training"


def _put(array: np.ndarray, sharding) -> jax.Array:
    """A host array every process holds whole, as a global array in `sharding`."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def sample_tokens(
    s: run_setup.Setup,
    params,
    token_lists: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    return_logits: bool = False,
    run=None,
):
    """New tokens (prompts, max_new_tokens) as numpy for each prompt's tokens [, their logits];
    `run` is sampler_for's for the same arguments, where it was made (and compiled) already."""
    rows = batch_rows(s, len(token_lists))
    tokens, positions = left_pad(token_lists, rows)
    run = run or make_sampler(s, rows, tokens.shape[1], max_new_tokens, temperature, top_k, return_logits)
    batch_sh = state_lib.batch_sharding(s.mesh, s.rules)
    seed_arr = _put(np.asarray(seed, np.int32), state_lib.replicated(s.mesh))
    out = run(params, _put(tokens, batch_sh), _put(positions, batch_sh), seed_arr)
    if return_logits:
        return np.asarray(out[0])[: len(token_lists)], np.asarray(out[1])[: len(token_lists)]
    return np.asarray(out)[: len(token_lists)]


def sampler_for(s: run_setup.Setup, token_lists: list[list[int]], max_new_tokens: int, temperature, top_k):
    """make_sampler for these prompts, compiled; UserError where it cannot fit in memory."""
    rows = batch_rows(s, len(token_lists))
    run = make_sampler(s, rows, left_pad(token_lists, rows)[0].shape[1], max_new_tokens, temperature, top_k)
    run.compiled()  # checks the memory
    return run


FLAGS = saved_run.reader_flags()  # the command's own: evaluate's share some names
flags.DEFINE_string("prompt", None, "Text to continue.", flag_values=FLAGS)
arguments.define_path("prompts_file", None, "One prompt per line, sampled as one batch.", flag_values=FLAGS)
flags.DEFINE_integer(
    "max_new_tokens",
    None,
    f"Default {DEFAULT_MAX_NEW_TOKENS}, or what fits in config.seq_len after the prompt.",
    flag_values=FLAGS,
)
flags.DEFINE_float("temperature", DEFAULT_TEMPERATURE, "0: greedy.", flag_values=FLAGS)
flags.DEFINE_integer("top_k", 0, "Sample among the k likeliest (0: all).", flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "The sampling key's seed.", flag_values=FLAGS)


def main(argv: list[str] | None = None) -> int:
    """python -m gspmd_tp.generate --workdir=DIR --prompt=TEXT [...]; prints each prompt continued.
    `argv` is the command's arguments (default: sys.argv[1:]). Returns the exit status."""
    config_args, argv = saved_run.config_arguments(sys.argv[1:] if argv is None else argv)
    no_positional_arguments(parse_command_flags(FLAGS, ["python -m gspmd_tp.generate", *argv], __doc__))
    saved_run.request_devices([*argv, *config_args])  # before jax's backend starts
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # orbax logs every read at INFO
    return saved_run.run_reader(lambda: _generate(config_args), FLAGS, "nothing in the workdir was written")


def _generate(config_args: list[str]) -> str:
    """The samples main() asked for, as the text for stdout (process 0's); UserError for bad input."""
    overrides = saved_run.split_overrides(config_args)
    prompts = distributed.agreed(read_prompts, FLAGS.prompt, FLAGS.prompts_file)  # a file one host lacks
    check_sampling(FLAGS.max_new_tokens, FLAGS.temperature, FLAGS.top_k, FLAGS.seed, vocab=None)
    # Every process of a job samples the same batch: one program, and the same random draws.
    asked = (FLAGS.step, prompts, FLAGS.max_new_tokens, FLAGS.temperature, FLAGS.top_k, FLAGS.seed)
    names = ("--step", "the prompts", "--max_new_tokens", "--temperature", "--top_k", "--seed")
    distributed.check_same_everywhere(None, flags=dict(zip(names, asked, strict=True)))
    step, _, s = saved_run.load_setup(FLAGS.workdir, overrides, FLAGS.step, sampling=True)
    tok = tokenizer.load(s.config.data.tokenizer)  # the run's (from-hf records the model's)
    check_sampling(FLAGS.max_new_tokens, FLAGS.temperature, FLAGS.top_k, FLAGS.seed, vocab=tok.vocab_size)
    token_lists = [encode(p, tok) for p in prompts]
    max_new = fit_length(token_lists, FLAGS.max_new_tokens, s.config.seq_len)
    # Every check above runs before the parameters are read and before anything compiles.
    run = distributed.agreed(sampler_for, s, token_lists, max_new, FLAGS.temperature, FLAGS.top_k)
    step, params = saved_run.params_for(FLAGS.workdir, step, s, exact=FLAGS.step is not None)
    if jax.process_index() == 0:
        print(
            f"step {step} of {FLAGS.workdir} | mesh {mesh_string(s.mesh)} | rules {s.rules.source} | "
            f"{len(prompts)} prompt(s), {max_new} new tokens, temperature {FLAGS.temperature}, "
            f"top_k {FLAGS.top_k or 'all'}, seed {FLAGS.seed}",
            file=sys.stderr,
            flush=True,
        )
    new = sample_tokens(s, params, token_lists, max_new, FLAGS.temperature, FLAGS.top_k, FLAGS.seed, run=run)
    lines = []
    for i, (prompt, tokens) in enumerate(zip(prompts, new, strict=True)):
        if len(prompts) > 1:
            lines.append(f"--- {i + 1}/{len(prompts)} ---")
        # The prompt's own text and the continuation (bytes not UTF-8 print as U+FFFD).
        lines.append(decode(encode(prompt, tok)[1:] + list(tokens), tok))
    return "\n".join(lines)


if __name__ == "__main__":
    entry.run(main)
