"""Resuming: the reshard matrix (rule file x mesh x device count) and exact data positions."""

import json
import os
import signal
import time

import jax
import numpy as np
import pytest
from conftest import run_steps, small_config, token_batches

from gspmd_tp.checkpoint import store
from gspmd_tp.data import pipeline, prepare
from gspmd_tp.train import loop, run_setup

K = 2  # steps before the save; two more after it

# (rules, mesh, devices) saved -> (rules, mesh, devices) resumed.
MATRIX = [
    (("megatron_1d", "dp=2,mp=4", 8), ("megatron_2d", "dp=4,mp=2", 8)),
    (("megatron_2d", "dp=2,mp=4", 8), ("dp", "dp=1,mp=1", 1)),
    (("dp", "dp=8,mp=1", 8), ("megatron_2d", "dp=1,mp=2", 2)),
    # Three mesh axes and back: megatron_1d's (dp, mp) onto (data, fsdp, tensor), and the reverse.
    (("megatron_1d", "dp=2,mp=4", 8), ("data_fsdp_tensor", "data=2,fsdp=2,tensor=2", 8)),
    (("data_fsdp_tensor", "data=2,fsdp=2,tensor=2", 8), ("megatron_1d", "dp=2,mp=4", 8)),
]


class Saved:
    """Checkpoints at step K, one per source (rules, mesh, devices), made once for the module."""

    def __init__(self, root):
        self.root, self.dirs = root, {}
        self.batches = token_batches(small_config(), K + 2)
        # The uninterrupted run: K steps, a save on the way (it must not disturb anything), 2 more.
        state = self._train_and_save(("megatron_1d", "dp=2,mp=4", 8))
        c = small_config(rules="megatron_1d", mesh="dp=2,mp=4")
        _, history = run_steps(c, self.batches[K:], state=state)
        self.want = [loss for loss, _ in history]

    def _train_and_save(self, source):
        rules, mesh, n = source
        c = small_config(rules=rules, mesh=mesh)
        state, _ = run_steps(c, self.batches[:K], devices=jax.devices()[:n])
        workdir = str(self.root / f"{rules}-{mesh}-{n}")
        mngr = store.manager(workdir, keep=1)
        meta = run_setup.setup(c, jax.devices()[:n]).meta()
        store.save(mngr, K, state, {"next_example": K * c.batch_size}, meta)
        mngr.wait_until_finished()
        self.dirs[source] = mngr
        return state

    def manager(self, source):
        if source not in self.dirs:
            self._train_and_save(source)
        return self.dirs[source]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return Saved(tmp_path_factory.mktemp("saved"))


def _name(case):
    (r0, m0, n0), (r1, m1, n1) = case
    return f"{r0}[{m0}]x{n0}->{r1}[{m1}]x{n1}"


@pytest.mark.parametrize("case", MATRIX, ids=[_name(c) for c in MATRIX])
def test_resume_on_another_rule_file_mesh_and_device_count(saved, case):
    source, (dst_rules, dst_mesh, dst_n) = case
    mngr = saved.manager(source)
    dest = small_config(rules=dst_rules, mesh=dst_mesh)
    devices = jax.devices()[:dst_n]
    s = run_setup.setup(dest, devices)
    t0 = time.perf_counter()
    restored, _ = store.restore(mngr, K, s.abstract_state)
    jax.block_until_ready(restored)
    restore_s = time.perf_counter() - t0
    # Each leaf lives on the new devices in the new sharding, not in the one it was saved with.
    for leaf, want_sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(s.shardings), strict=True):
        assert leaf.sharding.is_equivalent_to(want_sharding, leaf.ndim)
        assert leaf.sharding.device_set == set(devices)
    _, history = run_steps(dest, saved.batches[K:], devices=devices, state=restored)
    got = [loss for loss, _ in history]
    np.testing.assert_allclose(got, saved.want, rtol=1e-5)
    rel = max(abs(g - w) / abs(w) for g, w in zip(got, saved.want, strict=True))
    print(
        f"\nreshard {_name(case)}: restore {restore_s * 1e3:.0f} ms, max relative loss difference {rel:.1e}"
    )


# --- data positions ---


def _ids(stream, batches, state=None):
    it = iter(stream)
    if state is not None:
        it.set_state(state)
    return [next(it)["id"] for _ in range(batches)], it.get_state()


def _global_ids(tokens, batch, processes, batches, state=None):
    """Every process's rows of `batches` global batches, concatenated: what the global batch holds."""
    share = batch // processes
    per_process = [
        _ids(pipeline.train_dataset(tokens, 8, batch, 0, (p * share, share)), batches, state)
        for p in range(processes)
    ]
    states = {json.dumps(s) for _, s in per_process}
    assert len(states) == 1  # every process records the same position
    ids = [np.concatenate([ids[b] for ids, _ in per_process]) for b in range(batches)]
    return ids, per_process[0][1]


def test_data_position_is_global_across_process_counts_and_batch_sizes():
    tokens = np.arange(1, 8 * 40 + 2, dtype=np.uint8)  # 40 windows of 9 tokens
    want, _ = _global_ids(tokens, 8, 1, 12)  # 12 batches of 8: more than two epochs
    for processes in (2, 4):
        got, _ = _global_ids(tokens, 8, processes, 12)
        np.testing.assert_array_equal(got, want)
    # Stop after 5 batches on 4 processes, resume on 2: the same examples follow.
    _, state = _global_ids(tokens, 8, 4, 5)
    assert state == {"next_example": 40}
    resumed, _ = _global_ids(tokens, 8, 2, 7, state)
    np.testing.assert_array_equal(resumed, want[5:])
    # A new batch size continues from the same example (16 = two old batches).
    resumed, _ = _global_ids(tokens, 16, 2, 2, state)
    np.testing.assert_array_equal(np.concatenate(resumed), np.concatenate(want[5:9]))


def test_interrupted_run_sees_the_same_examples_also_on_another_mesh(tmp_path, monkeypatch):
    # The run reads shards of the default corpus (data/shards.py): the examples are the in-memory
    # pipeline's, and each process reads its rows from disk.
    shards = str(tmp_path / "shards")
    prepare.prepare(small_config().data, shards)
    placed = []  # per run, the batches in the order the input thread placed them (it reads ahead)
    original = pipeline.global_batch

    def recording(local, sharding, batch_size=None):
        placed[-1].append((local["id"].tolist(), local["tokens"].tolist()))
        if stop_after and len(placed[-1]) == stop_after:
            os.kill(os.getpid(), signal.SIGTERM)  # as a preemption would: the run saves and returns
        return original(local, sharding, batch_size)

    monkeypatch.setattr(pipeline, "global_batch", recording)
    monkeypatch.setattr(loop, "evaluate", lambda *args: None)  # held-out batches are not training data
    # Read ahead on a thread, as on accelerators (CPU runs read on the loop's thread by default).
    common = {"steps": 4, "log_every": 1, "eval_every": 100, "checkpoint_every": 100, "data.prefetch": 2}
    common["data.shards"] = shards
    stop_after = 2
    placed.append([])
    first = loop.train(small_config(**common), str(tmp_path / "run"))
    assert first["stopped"] and 1 <= first["step"] < 4
    stop_after = 0
    placed.append([])
    loop.train(small_config(rules="megatron_1d", mesh="dp=4,mp=2", **common), str(tmp_path / "run"))

    # The batches trained on: the first run's up to its checkpoint, then the resumed run's. Those read
    # ahead and not trained on must not count, nor be skipped by the resumed run.
    k = first["step"]
    trained = placed[0][:k] + placed[1][: 4 - k]
    # What an uninterrupted run reads: the pipeline's first four global batches, in order.
    c = small_config()
    tokens, _ = pipeline.load_corpus(c.data)
    it = iter(pipeline.train_dataset(tokens, c.seq_len, c.batch_size, c.data.seed))
    assert trained == [(b["id"].tolist(), b["tokens"].tolist()) for b in (next(it) for _ in range(4))]
    assert len({tuple(ids) for ids, _ in trained}) == 4  # four different batches
    # Losses after a resume are compared with an uninterrupted run by the reshard matrix above.
    assert [r["step"] for r in _rows(tmp_path / "run")] == [1, 2, 3, 4]


def _rows(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
