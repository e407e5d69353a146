"""Resuming: the reshard matrix (rule file x mesh x device count) and exact data positions."""

import json
import os
import signal

import jax
import numpy as np
from conftest import run_steps, small_config, token_batches

from gspmd_tp.checkpoint import store
from gspmd_tp.data import pipeline, prepare
from gspmd_tp.train import loop, run_setup

K = 2  # steps before the save; two more after it

# A chain of (rules, mesh, devices): each restores the checkpoint the one before saved (a rule file,
# a mesh and a device count of its own) and saves it again in its own layout. The first trains K
# steps; the links marked True train the two steps after and must match the uninterrupted run.
CHAIN = [
    ("megatron_2d", "dp=2,mp=4", 8, False),
    ("megatron_1d", "dp=4,mp=2", 8, True),  # another rule file and mesh (the data test's second run)
    ("dp", "dp=1,mp=1", 1, True),  # 8 devices -> 1
    ("megatron_2d", "dp=1,mp=2", 2, False),  # 1 -> 2
    # Three mesh axes and back: megatron_2d's (dp, mp) onto (data, fsdp, tensor), and the reverse.
    ("data_fsdp_tensor", "data=2,fsdp=2,tensor=2", 8, False),
    ("megatron_1d", "dp=2,mp=4", 8, False),
]


def _save(workdir, config, devices, state):
    mngr = store.manager(str(workdir), keep=1)
    meta = run_setup.setup(config, devices).meta()
    store.save(mngr, K, state, {"next_example": K * config.batch_size}, meta)
    mngr.wait_until_finished()
    return mngr


def test_resume_on_another_rule_file_mesh_and_device_count(tmp_path):
    batches = token_batches(small_config(), K + 2)
    rules, mesh, n, _ = CHAIN[0]
    c = small_config(rules=rules, mesh=mesh)
    state, _ = run_steps(c, batches[:K], devices=jax.devices()[:n])
    saved = jax.device_get(state)
    mngr = _save(tmp_path / "0", c, jax.devices()[:n], state)
    # The uninterrupted run: K steps, a save on the way (it must not disturb anything), 2 more.
    want = [loss for loss, _ in run_steps(c, batches[K:], state=state)[1]]
    for i, (rules, mesh, n, train) in enumerate(CHAIN[1:], 1):
        name = f"{CHAIN[i - 1][:3]} -> {(rules, mesh, n)}"
        dest, devices = small_config(rules=rules, mesh=mesh), jax.devices()[:n]
        s = run_setup.setup(dest, devices)
        restored, _ = store.restore(mngr, K, s.abstract_state)
        # Each leaf lives on the new devices in the new sharding, not in the one it was saved with,
        # and holds the values saved.
        for leaf, want_sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(s.shardings), strict=True):
            assert leaf.sharding.is_equivalent_to(want_sharding, leaf.ndim), name
            assert leaf.sharding.device_set == set(devices), name
        for got, value in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(saved), strict=True):
            np.testing.assert_array_equal(got, value, err_msg=name)
        mngr = _save(tmp_path / str(i), dest, devices, restored)  # before the step donates it
        if train:
            got = [loss for loss, _ in run_steps(dest, batches[K:], devices=devices, state=restored)[1]]
            np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=name)


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
