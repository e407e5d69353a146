"""Eight simulated CPU devices for every test (a device count already in XLA_FLAGS wins), through
XLA_FLAGS so that the commands the tests start inherit them (child_env takes the count out)."""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

# Compiling is most of the suite's CPU time, spent generating machine code for steps that run a few
# times at most here. Three flags cut it without changing the optimized HLO (the collectives, fusions
# and memory analysis the tests read): LLVM at -O0 instead of -O2; XLA:CPU's elemental emitter for
# each fusion instead of its MLIR fusion emitters (which set up an MLIR context and pass pipeline
# per kernel); and the machine code generated as one module rather than split for several threads
# (two workers already keep both cores busy: the split cost a test step's compile about a fifth
# more CPU). Results differ by float rounding alone (a train step's loss by about 2e-7, relative),
# far inside every tolerance here. Subprocesses get them too: those that set their own device count
# through child_env(). A setting of any of them already in XLA_FLAGS wins.
FAST_COMPILE = [
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
]
for flag in FAST_COMPILE:
    if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += f" {flag}"

# Many tests compile the same small programs (and train.py subprocesses recompile on resume): a
# compilation cache shared by the session and its subprocesses cuts the suite's CPU time by a third.
# The process that makes the directory (pytest, before its xdist workers start) removes it at exit.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="gspmd_tp_jax_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# libtpu is installed for the TPU ahead-of-time tests; on a machine without a TPU it must not try
# to open one. A platform the caller chose wins.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Tests mirror the packages in folders of their own and share a few helpers across them (train.py's
# flags, a checkpoint's damage, a job's start): each folder is importable whichever files a run collects.
sys.path[1:1] = sorted(
    str(p) for p in Path(__file__).parent.iterdir() if p.is_dir() and p.name.isidentifier()
)

import pytest  # noqa: E402

# The tokenizers tests build offline (bpe_path, sp_path), session-scoped fixtures of every folder.
pytest_plugins = ["tiny_tokenizers"]

from configs import tiny  # noqa: E402


def child_env(**extra) -> dict:
    """os.environ for a command that sets its own device count as a user's run does (train.py asks
    for 8): XLA_FLAGS without this session's count, the rest of it (FAST_COMPILE) kept, and no
    JAX_NUM_CPU_DEVICES (a count jax reads, which would win as well)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
    ]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return {**env, **extra}


# python -c: a command run as `python -m` / `python FILE` would run it, with one function replaced by a
# Ctrl-C (KeyboardInterrupt) once its imports are done. Fields: module and name (what is replaced),
# argv0, run ("run_module" or "run_path") and target (the module or file).
CTRL_C_AT = """
import runpy, sys
import {module} as module
def ctrl_c(*_, **__):
    raise KeyboardInterrupt
module.{name} = ctrl_c
sys.argv = [{argv0!r}, *sys.argv[1:]]
runpy.{run}({target!r}, run_name="__main__")
"""


def small_config(**overrides):
    """configs/tiny.py shrunk for tests: every mesh of 8 devices divides it, GQA included."""
    c = tiny.get_config()
    c.steps = 4
    c.batch_size = 8
    c.seq_len = 32
    c.log_every = 2
    c.eval_every = 2
    c.eval_batches = 1
    c.checkpoint_every = 2
    c.model.d_model = 64
    c.model.num_layers = 2
    c.model.num_heads = 16
    c.model.num_kv_heads = 8  # two query heads per key/value head
    c.model.head_dim = 8
    c.model.mlp_dim = 128
    c.optim.warmup_steps = 2
    for key, value in overrides.items():
        target = c
        *parents, leaf = key.split(".")
        for p in parents:
            target = target[p]
        target[leaf] = value
    return c


def split_documents(tokens) -> list[bytes]:
    """Splits a packed stream back into its documents (each one ends with the separator)."""
    from gspmd_tp.data import pipeline

    assert len(tokens) == 0 or tokens[-1] == pipeline.SEPARATOR
    return bytes(tokens).split(bytes([pipeline.SEPARATOR]))[:-1]


def data_config(**overrides):
    """config.data of the small test config, with `overrides` applied."""
    d = small_config().data
    for key, value in overrides.items():
        d[key] = value
    return d


def write(path, text: str | bytes):
    """Writes `text` (as UTF-8) or bytes to `path` (parents created) and returns the path as a string."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return str(path)


@pytest.fixture
def config():
    """A fresh small config per test."""
    return small_config()


def token_batches(config, count, seed=0):
    """`count` fixed random (batch, seq_len + 1) token batches, as numpy."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = (config.batch_size, config.seq_len + 1)
    return [rng.integers(0, 256, shape, dtype=np.int32) for _ in range(count)]


def run_steps(config, batches, devices=None, state=None):
    """Trains on `batches` from a fresh (or given) state; returns (state, [(loss, grad_norm)])."""
    import jax

    from gspmd_tp.train import run_setup
    from gspmd_tp.train import state as state_lib
    from gspmd_tp.train import step as step_lib

    s = run_setup.setup(config, devices)
    if state is None:
        state = state_lib.init_state(s.model_cfg, s.tx, s.mesh, s.rules, config.seq_len, config.seed)
    step = step_lib.compile_train_step(s)
    history = []
    for tokens in batches:
        state, stats = step(state, jax.device_put(step_lib.host_batch(s, tokens), s.batch_sharding))
        history.append((float(stats["loss"]), float(stats["grad_norm"])))
    return state, history


def save_checkpoint(workdir, config, state):
    """Saves `state` as step 2 of a checkpoint in workdir, with config's meta; returns the manager."""
    from gspmd_tp.checkpoint import store
    from gspmd_tp.train import run_setup

    s = run_setup.setup(config)
    mngr = store.manager(str(workdir), keep=2)
    store.save(mngr, 2, state, {"next_index": 2}, s.meta())
    mngr.wait_until_finished()
    return mngr


def loss_and_grads(config, variants):
    """[(mean loss, gradient)] of step.accumulated_grads on one batch of `config`'s initial
    parameters, one jit-compiled call per (grad_accum, loss_chunk) in `variants`."""
    import jax

    from gspmd_tp.model.transformer import Transformer
    from gspmd_tp.train import run_setup
    from gspmd_tp.train import state as state_lib
    from gspmd_tp.train import step as step_lib

    s = run_setup.setup(config)
    state = state_lib.init_state(s.model_cfg, s.tx, s.mesh, s.rules, config.seq_len, config.seed)
    tokens = jax.device_put(step_lib.host_batch(s, token_batches(config, 1)[0]), s.batch_sharding)
    model = Transformer(s.model_cfg)
    out = []
    with state_lib.sharding_context(s.mesh, s.rules):
        for accum, chunk in variants:
            fn = jax.jit(
                lambda p, t, a=accum, k=chunk: step_lib.accumulated_grads(
                    model, a, s.shardings.params, p, t, k
                )
            )
            out.append(fn(state.params, tokens))
    return out


def _sub_jaxprs(value):
    """The jaxprs inside an equation's parameter (a scan's body, a jit's, a custom_vjp's forward)."""
    from jax.extend import core

    if isinstance(value, core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def dot_flops(jaxpr, times: int = 1) -> tuple[int, int]:
    """(FLOPs of the products without batch dimensions, FLOPs of those with) that `jaxpr` runs:
    2 * output elements * contracted size for each dot_general, a scan's body times its length. In
    the model the first are its weights' products, the second attention's scores and weighted values."""
    import math

    weights = batched = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("while", "cond"):  # runs a body an unknown number of times, or one branch
            raise ValueError(f"dot_flops cannot count the products of a {eqn.primitive.name}")
        if eqn.primitive.name == "dot_general":
            (contracting, _), (batch, _) = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            flops = 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contracting)
            if batch:
                batched += flops * times
            else:
                weights += flops * times
        length = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                w, b = dot_flops(sub, times * length)
                weights, batched = weights + w, batched + b
    return weights, batched


def program_flops(config) -> tuple[int, int]:
    """dot_flops of one training step of `config`'s model (forward and backward, one microbatch of the
    whole batch, the loss not chunked, nothing recomputed: the FLOPs the model needs, not those a
    schedule adds), counted in the program JAX traces for it; nothing compiled. Independent of
    gspmd_tp.model.params, which the plan and bench figures use."""
    import dataclasses

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from gspmd_tp.model.transformer import Transformer
    from gspmd_tp.train import run_setup
    from gspmd_tp.train import step as step_lib

    cfg = dataclasses.replace(run_setup.model_config(config), remat="none")
    model = Transformer(cfg)
    boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    tokens = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32)
    step = jax.make_jaxpr(lambda p, t: step_lib.accumulated_grads(model, 1, None, p, t))
    return dot_flops(step(nn.meta.unbox(boxed["params"]), tokens).jaxpr)


def step_flops(config) -> float:
    """Model FLOPs of one training step of `config` as MFU counts them (PaLM, appendix B): the
    products program_flops counts, causal attention's halved (the program computes every score and
    masks half of them; the convention counts the half that is used)."""
    weights, attention = program_flops(config)
    return weights + attention / 2


def activation_gathers(found, result_bytes: int, where: str) -> int:
    """Runs per step of the all-gathers among `found` (hlo.collectives) that produce `result_bytes`
    and come from a jax op whose name contains `where`."""
    return sum(
        c.executions
        for c in found
        if c.kind == "all-gather" and c.result_bytes == result_bytes and where in c.op_name
    )


@pytest.fixture(scope="session")
def trained_workdir(tmp_path_factory):
    """A workdir trained 4 steps with small_config() (megatron_2d on dp=2,mp=4): checkpoints at
    steps 2 and 4, metrics.jsonl with eval_loss at steps 2 and 4. Shared: treat it as read-only."""
    from gspmd_tp.train import loop

    workdir = tmp_path_factory.mktemp("trained")
    loop.train(small_config(), str(workdir))
    return workdir


@pytest.fixture(scope="session")
def fsdp_job(tmp_path_factory):
    """(workdir, each process's (stdout, stderr), losses) of a train.py job of 2 processes x 4 devices
    under fsdp that trained 2 steps (checkpoints at 1 and 2) and traced step 2 (config.profile). One
    start for the multiprocess tests: test_multiprocess damages and resumes it and runs its readers on it,
    test_profiling reads its traces."""
    from test_multiprocess import FSDP, finish, losses, start

    run = tmp_path_factory.mktemp("fsdp_job")
    outs = finish(start(run, 2, *FSDP, "--config.profile.steps=1", "--config.profile.skip_steps=1"))
    return run, outs, losses(run)


# A config.json as transformers' LlamaConfig writes it: 8 query heads on 4 key/value heads (grouped),
# so megatron's mp=4 divides kv_heads.
LLAMA = dict(
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    rope_theta=500000.0,
    rms_norm_eps=1e-6,
)


# Modules whose tests share what one process computed (plans cached per process, module-scoped
# fixtures that train or convert), by the xdist group they run in: under `pytest -n 2 --dist
# loadgroup` each group runs on one worker, so that work is done once rather than once per worker.
# Other tests spread test by test.
SHARED_WORK = {
    "test_plan": "test_plan",
    "test_plan_gpu": "test_plan_gpu",
    "test_plan_tpu": "tpu_plans",  # both read tests/plan/tpu_plans.py's plans
    "test_overlap": "tpu_plans",
    "test_calibration": "test_calibration",
    "test_convert": "test_convert",
    "test_faults": "test_faults",
    "test_resume": "test_resume",
    "test_trainer": "test_trainer",
    "test_reference": "test_reference",
    "test_bucket": "test_bucket",  # one emulator, two runs trained in it
    "test_moe_training": "test_moe_training",  # one single-device reference for every mesh
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the test ids
def pytest_collection_modifyitems(items):
    """Marks the tests of SHARED_WORK modules with their xdist group."""
    for item in items:
        name = item.module.__name__.rpartition(".")[2]
        if name in SHARED_WORK:
            item.add_marker(pytest.mark.xdist_group(SHARED_WORK[name]))
        elif "fsdp_job" in getattr(item, "fixturenames", ()):  # one job, damaged and read in order
            item.add_marker(pytest.mark.xdist_group("fsdp_job"))


@pytest.fixture(scope="module")
def gcs_emulator():
    """A GCS emulator (gcp-storage-emulator, in memory, as tests/gcs_emulator.py adjusts it) on a free
    127.0.0.1 port, for the tests of a
    module, with a bucket `bkt`; the clients reach it through the standard variables alone
    (STORAGE_EMULATOR_HOST for gcsfs, TENSORSTORE_GCS_HTTP_URL for orbax's arrays), set in
    os.environ meanwhile (subprocesses inherit them). Yields the endpoint URL; stopped afterwards."""
    import socket
    import subprocess
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "gcs_emulator.py"), "start", "--in-memory",
         "--host", "127.0.0.1", "--port", str(port), "--default-bucket", "bkt"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    env = {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "t",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), 0.1).close()
                break
            except OSError:
                assert server.poll() is None, "the GCS emulator exited"
                time.sleep(0.05)
        yield url
    finally:
        server.terminate()
        server.wait(10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
