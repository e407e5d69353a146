"""Peak FLOP/s lookup, MFU, the metric writers, the progress line, and the FLOP formula."""

import dataclasses
import json
import math
import struct
import threading
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import dot_flops, program_flops, small_config

from gspmd_tp.model.params import flops_per_token, param_count
from gspmd_tp.model.transformer import ModelConfig, Transformer
from gspmd_tp.train import metrics, run_setup

# --- peak FLOP/s and MFU -------------------------------------------------------------------------


# Each device's dense bf16 peak worked out from its architecture: (multiply units) x (FLOPs each does
# a clock) x (clock), from the vendors' architecture papers, not from the table under test.
# TPU: TensorCores x MXUs per core x (systolic array side)^2 multiply-adds x 2 FLOPs x clock.
# NVIDIA: SMs x dense bf16 tensor-core FLOPs per SM a clock x boost clock (A100: 2048; H100,
# H200: 4096, twice Ampere's; Ada's L4: 1024).
DERIVED_PEAKS = [
    ("TPU v5 lite", 1 * 4 * 128**2 * 2 * 1.5e9),  # v5e: must not fall through to the v5p entry
    ("TPU v5e", 1 * 4 * 128**2 * 2 * 1.5e9),
    ("TPU v5", 2 * 4 * 128**2 * 2 * 1.75e9),  # v5p reports itself as "TPU v5"
    ("TPU v5p", 2 * 4 * 128**2 * 2 * 1.75e9),
    ("TPU v6 lite", 1 * 4 * 256**2 * 2 * 1.75e9),  # Trillium: 256x256 MXUs
    ("TPU v4", 2 * 4 * 128**2 * 2 * 1.05e9),
    ("NVIDIA H100 80GB HBM3", 132 * 4096 * 1.83e9),  # SXM5
    ("NVIDIA H100 PCIe", 114 * 4096 * 1.62e9),
    ("NVIDIA H200", 132 * 4096 * 1.83e9),  # the H100 SXM's chip with more memory
    ("NVIDIA A100-SXM4-80GB", 108 * 2048 * 1.41e9),
    ("NVIDIA L4", 58 * 1024 * 2.04e9),
    ("nvidia h100 80gb hbm3", 132 * 4096 * 1.83e9),  # case does not matter
]


@pytest.mark.parametrize("device_kind, derived", DERIVED_PEAKS)
def test_peak_flops_known_devices_are_their_architectures_dense_bf16_peak(device_kind, derived):
    """Within 0.5% of the figure derived above (the data sheets round it): a sparse figure (twice),
    an fp8 one, or another chip's entry matched by mistake is far outside."""
    assert metrics.peak_flops(device_kind) == pytest.approx(derived, rel=0.005)


@pytest.mark.parametrize("device_kind", ["cpu", "TFRT_CPU", "", "Some Future Chip"])
def test_peak_flops_unknown_is_none(device_kind):
    assert metrics.peak_flops(device_kind) is None


@pytest.mark.parametrize("device_kind", ["NVIDIA L40S", "NVIDIA L40"])
def test_peak_flops_l4_does_not_match_l40(device_kind):
    assert metrics.peak_flops(device_kind) is None  # not in the table: no guess
    assert metrics.peak_flops("NVIDIA L4") == pytest.approx(58 * 1024 * 2.04e9, rel=0.005)


def test_peak_flops_override_wins():
    assert metrics.peak_flops("TPU v5 lite", override=1e12) == 1e12
    assert metrics.peak_flops("cpu", override=2.5e12) == 2.5e12
    # 0 means no override: the table's figure.
    assert metrics.peak_flops("NVIDIA H100 80GB HBM3", override=0.0) == metrics.peak_flops("NVIDIA H100")


def test_mfu():
    # 1e9 FLOPs/token at 1e5 tokens/s on 4 devices of 1e14: 1e14 / 4e14.
    assert metrics.mfu(1e9, 1e5, 4, 1e14) == pytest.approx(0.25)
    # A step of 16 sequences of 1,024 tokens (16,384) at 3e9 FLOPs a token is 4.9152e13 FLOPs; in
    # 0.125 s (131,072 tokens/s) that is 3.93216e14 FLOP/s, of the 16 * 2e14 = 3.2e15 of 16 devices.
    assert metrics.mfu(3e9, 131_072, 16, 2e14) == pytest.approx(0.12288)


def test_mfu_is_none_without_a_peak_or_throughput():
    assert metrics.mfu(1e9, 1e5, 4, None) is None
    assert metrics.mfu(1e9, 1e5, 4, metrics.peak_flops("cpu")) is None
    assert metrics.mfu(1e9, 0.0, 4, 1e14) is None


# --- writers -------------------------------------------------------------------------------------


def read_scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} from every TFRecord event file under `tb_dir`, as TensorBoard reads
    them: a session start at step N (a writer's purge_step) drops the values of steps >= N before it."""
    metrics._event_protos()  # tensorboardX as the trainer imports it: without torch, seconds faster
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        raw = path.read_bytes()
        pos = 0
        while pos < len(raw):
            (length,) = struct.unpack("<Q", raw[pos : pos + 8])
            event = event_pb2.Event.FromString(raw[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4  # length, its crc, the record, its crc
            if event.session_log.status == event_pb2.SessionLog.START:
                scalars = {t: [(st, v) for st, v in vs if st < event.step] for t, vs in scalars.items()}
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_metrics_writer_jsonl_and_tensorboard(tmp_path):
    workdir = tmp_path / "run"
    writer = metrics.MetricsWriter(str(workdir), enabled=True)
    writer.write(10, {"loss": 2.5, "tokens_per_sec": 1000.0, "mfu": None})
    writer.write(20, {"loss": 2.0, "tokens_per_sec": 1200.0, "mfu": 0.25, "grad_norm": math.nan})
    writer.close()

    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    # Strict JSON, as jq and JavaScript read it: a non-finite value is null, not NaN.
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} is not JSON")) for line in lines]
    assert rows[0] == {"step": 10, "loss": 2.5, "tokens_per_sec": 1000.0, "mfu": None}
    assert rows[1] == {"step": 20, "loss": 2.0, "tokens_per_sec": 1200.0, "mfu": 0.25, "grad_norm": None}

    tb_dir = workdir / "tensorboard"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    scalars = read_scalars(tb_dir)
    assert scalars["loss"] == [(10, 2.5), (20, 2.0)]
    assert scalars["tokens_per_sec"] == [(10, 1000.0), (20, 1200.0)]
    assert scalars["mfu"] == [(20, 0.25)]  # None is in JSON only
    assert "grad_norm" not in scalars  # and so is NaN


def test_tensorboard_events_are_on_disk_once_written_and_no_thread_writes_them(tmp_path):
    """What a killed run leaves: each step's values, readable before close. They are written in
    the caller's thread (a writer thread polling its queue would keep a core busy all run long)."""
    before = threading.enumerate()
    writer = metrics.MetricsWriter(str(tmp_path), enabled=True)
    writer.write(1, {"loss": 3.0})
    writer.write(2, {"loss": 2.0, "lr": 0.5})
    assert threading.enumerate() == before
    assert read_scalars(tmp_path / "tensorboard") == {"loss": [(1, 3.0), (2, 2.0)], "lr": [(2, 0.5)]}
    writer.close()


def test_metrics_writer_appends_on_resume(tmp_path):
    for step in (1, 2):
        writer = metrics.MetricsWriter(str(tmp_path), enabled=True)
        writer.write(step, {"loss": float(step)})
        writer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_a_run_restarted_at_a_checkpoint_replaces_the_later_rows(tmp_path):
    writer = metrics.MetricsWriter(str(tmp_path), enabled=True)
    for step in (1, 2, 3):
        writer.write(step, {"loss": float(step)})
    writer.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # a row cut short by a kill: moved out, or the next row would join it
    assert metrics.set_aside_after(str(tmp_path), 1) == 2
    writer = metrics.MetricsWriter(str(tmp_path), enabled=True, start=1)
    writer.write(2, {"loss": 20.0})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines == ['{"step": 1, "loss": 1.0}', '{"step": 2, "loss": 20.0}']
    replaced = (tmp_path / metrics.REPLACED).read_text().splitlines()
    assert [json.loads(line)["step"] for line in replaced[:2]] == [2, 3]
    assert replaced[2] == '{"step": 4, "lo'
    # TensorBoard hides the first run's steps >= 2 (a writer opened in the same second keeps its file).
    assert len(list((tmp_path / "tensorboard").iterdir())) == 2
    assert read_scalars(tmp_path / "tensorboard")["loss"] == [(1, 1.0), (2, 20.0)]
    assert metrics.set_aside_after(str(tmp_path / "nowhere"), 0) == 0


def test_rows_moved_again_after_a_kill_are_not_duplicated(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {i}}}\n' for i in (1, 2, 3)))
    (tmp_path / metrics.REPLACED).write_text('{"step": 3}\n')  # moved, then killed before the replace
    assert metrics.set_aside_after(str(tmp_path), 1) == 2
    assert (tmp_path / metrics.REPLACED).read_text() == '{"step": 3}\n{"step": 2}\n'


def test_an_event_is_on_disk_soon_after_it_is_written_without_closing(tmp_path):
    """A run killed after logging a step must not lose its events: the writer's own thread flushes
    every 120 s unless told otherwise, and flush() does not wait for that thread."""
    writer = metrics.MetricsWriter(str(tmp_path), enabled=True)
    writer.write(7, {"loss": 7.0})
    deadline = time.monotonic() + 10
    while "loss" not in read_scalars(tmp_path / "tensorboard") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert read_scalars(tmp_path / "tensorboard")["loss"] == [(7, 7.0)]
    writer.close()


def test_amend_adds_to_the_row_of_its_step_or_writes_one(tmp_path):
    writer = metrics.MetricsWriter(str(tmp_path), enabled=True)
    writer.write(2, {"loss": 2.0})
    writer.amend(2, {"eval_loss": 2.5})
    writer.amend(4, {"eval_loss": math.nan})
    writer.write(5, {"loss": 5.0})  # appends after an amend
    writer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 2, "loss": 2.0, "eval_loss": 2.5},
        {"step": 4, "eval_loss": None},
        {"step": 5, "loss": 5.0},
    ]
    assert read_scalars(tmp_path / "tensorboard")["eval_loss"] == [(2, 2.5)]


def test_metrics_writer_disabled_writes_nothing(tmp_path):
    workdir = tmp_path / "run"
    writer = metrics.MetricsWriter(str(workdir), enabled=False)
    writer.write(1, {"loss": 1.0})
    writer.close()
    assert not workdir.exists()
    assert list(tmp_path.iterdir()) == []


def progress_metrics(**extra):
    m = {
        "loss": 2.34567,
        "grad_norm": 0.5,
        "learning_rate": 3e-3,
        "tokens_per_sec": 12345.6,
        "step_time_s": 0.25,
    }
    return {**m, **extra}


def test_progress_line():
    line = metrics.progress_line(7, 300, progress_metrics(mfu=0.4123, eval_loss=2.5))
    assert line.startswith("step   7/300")
    assert "loss 2.3457" in line
    assert "eval_loss 2.5000" in line
    assert "12,346 tok/s" in line
    assert "250 ms/step" in line
    assert "lr 3.00e-03" in line
    assert "MFU 41.2%" in line


def test_progress_line_without_mfu_or_eval():
    line = metrics.progress_line(300, 300, progress_metrics(mfu=None))
    assert "loss 2.3457" in line and "tok/s" in line
    assert "MFU" not in line and "eval_loss" not in line


def test_progress_line_of_a_mixture_of_experts():
    moe = {"router_aux_loss": 1.0234, "expert_max_load": 1.361}
    line = metrics.progress_line(3, 9, progress_metrics(**moe))
    assert "aux 1.023" in line and "max_load 1.36x" in line and "dropped" not in line
    assert "dropped 0.25%" in metrics.progress_line(3, 9, progress_metrics(**moe, expert_dropped=0.0025))


# --- the FLOP formula and the parameter count ----------------------------------------------------

CFG = ModelConfig(
    vocab_size=256, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64
)


def test_the_product_counter_counts_a_matrix_product_by_hand():
    """conftest.dot_flops, which the FLOP tests below and the plan tests use: a (3, 4) x (4, 5)
    product is 3 * 5 outputs of 4 multiply-adds, 120 FLOPs; its gradient with respect to both
    operands adds two products of the same size; batched products count apart."""
    x, w = jnp.ones((3, 4)), jnp.ones((4, 5))
    assert dot_flops(jax.make_jaxpr(jnp.dot)(x, w).jaxpr) == (120, 0)
    grad = jax.make_jaxpr(jax.value_and_grad(lambda x, w: (x @ w).sum(), argnums=(0, 1)))(x, w)
    assert dot_flops(grad.jaxpr) == (3 * 120, 0)
    batched = jax.make_jaxpr(lambda a, b: jnp.einsum("bij,bjk->bik", a, b))(
        jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5))
    )
    assert dot_flops(batched.jaxpr) == (0, 2 * 120)
    scanned = jax.make_jaxpr(lambda x: jax.lax.scan(lambda c, _: (c @ jnp.ones((4, 4)), None), x, length=7))
    assert dot_flops(scanned(x).jaxpr) == (7 * 2 * 3 * 4 * 4, 0)
    # A loop of unknown length, or one branch of two: no count rather than a wrong one.
    looped = jax.make_jaxpr(
        lambda x: jax.lax.while_loop(lambda c: c.sum() < 9, lambda c: c @ jnp.ones((4, 4)), x)
    )
    chosen = jax.make_jaxpr(lambda x: jax.lax.cond(x.sum() > 0, lambda y: y @ w, lambda y: 2 * y @ w, x))
    for program in (looped(x), chosen(x)):
        with pytest.raises(ValueError, match="dot_flops cannot count the products of a (while|cond)"):
            dot_flops(program.jaxpr)


def test_flops_per_token_is_what_the_training_program_multiplies():
    """flops_per_token against the products JAX traces for one training step of the model (forward
    and backward), counted by conftest.program_flops: every weight product as the program runs it,
    attention's scores and weighted values halved (causal: PaLM counts the half of the scores that
    is used). Tying the embedding saves parameters, not FLOPs: the output projection is still a
    product."""
    small = {
        "vocab_size": 256,
        "d_model": 32,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "mlp_dim": 64,
    }
    # Two query heads per key/value head, the embedding tied to the output projection.
    c = small_config(seq_len=16, **{f"model.{k}": v for k, v in {**small, "tie_embeddings": True}.items()})
    weights, attention = program_flops(c)
    assert weights > 0 and attention > 0
    tokens = c.batch_size * c.seq_len
    cfg = run_setup.model_config(c)
    assert flops_per_token(cfg, c.seq_len) * tokens == pytest.approx(weights + attention / 2, rel=1e-12)


def created_params(cfg: ModelConfig) -> dict[str, int]:
    """{parameter path: size} of what Transformer(cfg).init creates, without computing it."""
    shapes = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
    params = nn.meta.unbox(shapes["params"])
    return {
        jax.tree_util.keystr(path): math.prod(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_param_count_matches_created_parameters(tie, scan_layers):
    cfg = dataclasses.replace(CFG, tie_embeddings=tie, scan_layers=scan_layers)
    created = created_params(cfg)
    counted = param_count(cfg)
    assert counted["total"] == sum(created.values())
    assert any("lm_head" in p for p in created) != tie
    # N of the MFU formula: every non-norm weight, with the tied embedding counted once as the head.
    non_norm = sum(size for path, size in created.items() if "norm" not in path)
    head_extra = 0 if tie else cfg.vocab_size * cfg.d_model  # the lookup table is not a matmul
    assert counted["matmul"] == non_norm - head_extra
