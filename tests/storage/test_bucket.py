"""A run whose workdir is a bucket URL (gs://bkt/...) on a GCS emulator: it trains, resumes on
another mesh and rule file, and reads back as a run on local disk does; a second trainer and bad
buckets are refused before anything is written."""

import json
import os
import time

import pytest
from conftest import small_config

from gspmd_tp.job.errors import UserError
from gspmd_tp.storage import lock, paths
from gspmd_tp.train import loop, metrics


def _objects(prefix: str) -> list[str]:
    """Every object under the bucket URL `prefix`, as a sorted list of URLs."""
    import gcsfs

    fs = gcsfs.GCSFileSystem(skip_instance_cache=True)
    return sorted(fs.find(prefix))


def _losses(text: str) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, text.splitlines())}


@pytest.fixture(scope="module")
def runs(gcs_emulator, tmp_path_factory):
    """(local run, bucket run, the local directory that the bucket run's process worked in): the same
    run trained 4 steps on dp=2,mp=4 with megatron_2d and resumed to 6 on dp=4,mp=2 with megatron_1d,
    once on local disk and once in the bucket."""
    cwd, tmp = os.getcwd(), tmp_path_factory.mktemp("bucket_runs")
    cache = os.environ.get("XDG_CACHE_HOME")
    os.chdir(tmp)  # where a path library that took the URL for a local path would write
    os.environ["XDG_CACHE_HOME"] = str(tmp / "cache")
    local, bucket = str(tmp / "run"), "gs://bkt/runs/a"
    try:
        for workdir in (local, bucket):
            loop.train(small_config(), workdir)
            loop.train(small_config(steps=6, rules="megatron_1d", mesh="dp=4,mp=2"), workdir)
    finally:
        os.chdir(cwd)
        if cache is None:
            os.environ.pop("XDG_CACHE_HOME")
        else:
            os.environ["XDG_CACHE_HOME"] = cache
    return local, bucket, tmp


def test_a_run_in_a_bucket_trains_and_resumes_as_on_local_disk(runs):
    local, bucket, tmp = runs
    on_disk = _losses((tmp / "run" / metrics.JSONL).read_text())
    in_bucket = _losses(paths.of(f"{bucket}/{metrics.JSONL}").read_text())
    assert sorted(in_bucket) == sorted(on_disk) and max(in_bucket) == 6
    assert in_bucket == pytest.approx(on_disk, rel=1e-6)
    found = _objects(bucket)
    assert any("/checkpoints/6/state/" in f for f in found) and any("/checkpoints/4/" in f for f in found)
    events = [f for f in found if "/tensorboard/events.out.tfevents." in f]
    assert len(events) == 2  # one per start, uploaded whole
    assert not any(f.endswith(lock.LOCK) for f in found)  # the lease is released
    # Nothing beside the run on local disk: the working directory holds the local run and the cache.
    assert sorted(os.listdir(tmp)) == ["cache", "run"]


def test_the_readers_read_a_run_in_a_bucket_as_on_local_disk(runs, tmp_path, capsys):
    import numpy as np

    from gspmd_tp.checkpoint import tool
    from gspmd_tp.convert import llama
    from gspmd_tp.inference import evaluate, generate

    local, bucket, _ = runs
    said = {}
    for where, workdir in (("local", local), ("bucket", bucket)):
        assert evaluate.main(["--workdir", workdir, "--json", "--config.mesh=dp=8,mp=1"]) == 0
        evaluated = json.loads(capsys.readouterr().out)
        assert generate.main(["--workdir", workdir, "--prompt=def ", "--max_new_tokens=8"]) == 0
        generated = capsys.readouterr().out
        assert tool.main(["info", workdir]) == 0
        info = capsys.readouterr().out.replace(workdir, "RUN")
        out = f"{bucket}/exports/p.npz" if where == "bucket" else str(tmp_path / "p.npz")
        assert tool.main(["export", workdir, out]) == 0
        assert capsys.readouterr().out.rstrip().endswith(f" to {out}")
        with paths.of(out).open("rb") as f, np.load(f) as npz:
            exported = {k: npz[k] for k in npz.files}
        hf_dir = f"{bucket}/hf" if where == "bucket" else str(tmp_path / "hf")
        written = llama.to_hf(workdir, hf_dir)
        hf = {os.path.basename(f): paths.of(f).read_bytes() for f in written}
        said[where] = evaluated, generated, info, exported, hf
    (eval_l, gen_l, info_l, npz_l, hf_l), (eval_b, gen_b, info_b, npz_b, hf_b) = said["local"], said["bucket"]
    assert sorted(hf_b) == ["config.json", "model.safetensors"] and hf_b == hf_l
    assert eval_b["step"] == eval_l["step"] == 6 and eval_b["loss"] == pytest.approx(eval_l["loss"], rel=1e-6)
    assert gen_b == gen_l and gen_b.strip()
    assert info_b.splitlines()[2:5] == info_l.splitlines()[2:5]  # the step, its mesh and model
    assert sorted(npz_b) == sorted(npz_l) and all(np.array_equal(npz_b[k], npz_l[k]) for k in npz_l)
    # config.init_from in the bucket: the same parameters, placed in a run's shardings.
    import jax

    from gspmd_tp.train import run_setup

    target = run_setup.setup(small_config()).abstract_state.params
    imported = tool.import_params(f"{bucket}/exports/p.npz", target)
    flat = {k: np.asarray(v) for k, v in tool._flat(imported).items()}
    assert sorted(flat) == sorted(npz_l) and all(np.array_equal(flat[k], npz_l[k]) for k in npz_l)
    pairs = zip(jax.tree.leaves(imported), jax.tree.leaves(target), strict=True)
    assert all(a.sharding == t.sharding for a, t in pairs)


def test_inputs_in_a_bucket_read_as_their_local_files(runs, tmp_path, capsys, bpe_path):
    """A rule file, a tokenizer, a prompts file and a Hugging Face model directory (--hf_dir of
    from-hf) named by URL: each reads as the same file on local disk does, and plan's --dump_hlo
    writes into the bucket."""
    import numpy as np

    from gspmd_tp.checkpoint import tool
    from gspmd_tp.convert import llama
    from gspmd_tp.data import tokenizer
    from gspmd_tp.inference import generate
    from gspmd_tp.plan import planner
    from gspmd_tp.sharding import rules

    local, _, _ = runs
    inputs = "gs://bkt/inputs"
    paths.of(f"{inputs}/r.yaml").write_bytes(rules.resolve_path("megatron_1d").read_bytes())
    in_bucket = rules.load_rules(f"{inputs}/r.yaml")
    assert in_bucket.source == f"{inputs}/r.yaml"  # what the run's lines and metadata name
    assert (in_bucket.mesh_axes, in_bucket.rules) == (rules.load_rules("megatron_1d").mesh_axes,
                                                      rules.load_rules("megatron_1d").rules)  # fmt: skip

    paths.of(f"{inputs}/tok/tokenizer.json").write_bytes(open(bpe_path, "rb").read())
    text = b"def f(x):\n    return x\n"
    for spec in (f"{inputs}/tok/tokenizer.json", f"{inputs}/tok"):  # the file, or its directory
        assert list(tokenizer.load(spec).encode(text)) == list(tokenizer.load(bpe_path).encode(text))

    paths.of(f"{inputs}/prompts.txt").write_text("def \nclass \n")
    (tmp_path / "prompts.txt").write_text("def \nclass \n")
    said = []
    for prompts in (f"{inputs}/prompts.txt", str(tmp_path / "prompts.txt")):
        assert generate.main(["--workdir", local, f"--prompts_file={prompts}", "--max_new_tokens=6"]) == 0
        said.append(capsys.readouterr().out)
    assert said[0] == said[1] and said[0].count("def ") >= 1

    llama.to_hf(local, f"{inputs}/hf")
    llama.to_hf(local, str(tmp_path / "hf"))
    exported = []
    for i, hf_dir in enumerate((f"{inputs}/hf", str(tmp_path / "hf"))):
        llama.from_hf(hf_dir, str(tmp_path / f"imported{i}"), small_config())
        assert tool.main(["export", str(tmp_path / f"imported{i}"), str(tmp_path / f"p{i}.npz")]) == 0
        with np.load(tmp_path / f"p{i}.npz") as npz:
            exported.append({k: npz[k] for k in npz.files})
    assert sorted(exported[0]) == sorted(exported[1])
    assert all(np.array_equal(exported[0][k], exported[1][k]) for k in exported[1])
    capsys.readouterr()

    planner.plan(small_config(rules=f"{inputs}/r.yaml", mesh="dp=2,mp=4"), dump_hlo=f"{inputs}/hlo")
    dumped = _objects(f"{inputs}/hlo")
    assert len(dumped) == 1 and dumped[0].endswith(".hlo.txt")
    assert "HloModule" in paths.of(f"gs://{dumped[0]}").read_text()


def test_a_second_trainer_is_refused_and_an_expired_lease_taken_over(gcs_emulator):
    workdir = "gs://bkt/runs/b"
    holder = lock.Lease(f"{workdir}/{lock.LOCK}", job=1)
    holder.acquire()
    try:
        before = _objects(workdir)
        with pytest.raises(
            UserError, match=rf"--workdir={workdir} is in use by another job \(pid {os.getpid()} "
        ):
            loop.train(small_config(), workdir)
        assert _objects(workdir) == before  # nothing read into being, nothing written
        # The precondition itself: a lease is only created where none exists.
        with pytest.raises(FileExistsError):
            lock._upload(holder._fs, holder.url, b"pid 2\n", 0)
    finally:
        holder.release()
    assert _objects(workdir) == []
    # A lease its holder stopped renewing (expires in the past) is taken over; the old holder's
    # renewal, conditional on the generation it wrote, then fails instead of overwriting it.
    stale = lock.Lease(f"{workdir}/{lock.LOCK}", job=2)
    stale.acquire()
    stale._stop.set()
    lock._upload(
        stale._fs,
        stale.url,
        f"pid 9\ntoken {stale.token}\nexpires {time.time() - 1}\n".encode(),
        stale.generation,
    )
    taker = lock.Lease(f"{workdir}/{lock.LOCK}", job=3)
    taker.acquire()
    assert f"token {taker.token}" in paths.of(taker.url).read_text()
    with pytest.raises(FileExistsError):
        lock._upload(stale._fs, stale.url, b"pid 9\n", stale.generation)
    stale.release()  # not its lease any more: left as it is
    assert f"token {taker.token}" in paths.of(taker.url).read_text()
    taker.release()
    assert _objects(workdir) == []


@pytest.fixture
def refusing_endpoint():
    """An HTTP server on 127.0.0.1 that answers every request 401, as GCS answers bad credentials."""
    import http.server
    import threading

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": {"code": 401, "message": "Invalid Credentials"}}')

        def log_message(self, *_):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_bad_buckets_are_one_line_before_anything_is_written(
    gcs_emulator, refusing_endpoint, monkeypatch, tmp_path
):
    monkeypatch.chdir(tmp_path)

    def refused(workdir: str) -> str:
        with pytest.raises(UserError) as e:
            loop.train(small_config(), workdir)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert (
        refused("gs://nobkt/run")
        == f"--workdir=gs://nobkt/run: bucket nobkt does not exist at {gcs_emulator}"
    )
    # No bucket was made: the emulator holds none but bkt.
    import gcsfs

    assert [b.rstrip("/") for b in gcsfs.GCSFileSystem(skip_instance_cache=True).ls("")] == ["bkt"]
    assert "does not handle ftp:// URLs" in refused("ftp://host/run")
    with socket_closed() as port:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
        assert refused("gs://bkt/run").startswith(
            f"--workdir=gs://bkt/run: cannot reach http://127.0.0.1:{port} for bucket bkt"
        )
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", refusing_endpoint)
    assert refused("gs://bkt/run") == (
        f"--workdir=gs://bkt/run: {refusing_endpoint} refused the credentials for bucket bkt "
        "(HTTP 401: Invalid Credentials)"
    )
    monkeypatch.delenv("GOOGLE_AUTH_TOKEN_FOR_TESTING")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "absent.json"))
    assert "no usable credentials for" in refused("gs://bkt/run")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
    monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "t")
    assert _objects("gs://bkt/run") == [] and os.listdir(tmp_path) == []  # nothing written anywhere


class socket_closed:
    """A 127.0.0.1 port that nothing listens on (bound, then closed)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *_):
        return False


def test_data_files_and_shards_in_a_bucket_read_as_on_local_disk(gcs_emulator, tmp_path, monkeypatch):
    import numpy as np
    from conftest import data_config, write

    from gspmd_tp.data import pipeline, prepare

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    texts = {f"d/{i}.txt": f"document {i} " * (20 + i) for i in range(12)}
    texts["d/sub/x.jsonl"] = "".join(json.dumps({"text": f"line {i} " * 9}) + "\n" for i in range(5))
    for name, text in texts.items():
        write(tmp_path / "local" / name, text)
        paths.of(f"gs://bkt/data/{name}").write_text(text)
    corpora = {}
    for where, root in (("local", str(tmp_path / "local")), ("bucket", "gs://bkt/data")):
        data = data_config(train_files=f"{root}/d/*.txt,{root}/d/**/*.jsonl", eval_fraction=0.25)
        train, held = pipeline.load_corpus(data)
        out = f"{root}/shards"
        prepare.prepare(data, out, chunk_tokens=16, records_per_file=4)
        from_shards = pipeline.load_corpus(data_config(train_files="", shards=out))
        corpora[where] = train, held, [split[0 : len(split)] for split in from_shards]
    (train_l, held_l, shards_l), (train_b, held_b, shards_b) = corpora["local"], corpora["bucket"]
    assert len(train_l) > 0 and len(held_l) > 0  # both splits hold documents
    assert np.array_equal(train_b, train_l) and np.array_equal(held_b, held_l)
    assert np.array_equal(shards_b[0], train_l) and np.array_equal(shards_b[1], held_l)
    assert np.array_equal(shards_l[0], shards_b[0]) and np.array_equal(shards_l[1], shards_b[1])
    assert any(f.endswith("/shards/shards.json") for f in _objects("gs://bkt/data/shards"))

    # prepare's parquet inputs, read in ranges from the bucket.
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(8)), "body": [f"row {i} " * (i + 2) for i in range(8)]}),
                   str(tmp_path / "t.parquet"), row_group_size=3)  # fmt: skip
    paths.of("gs://bkt/data/p/t.parquet").write_bytes((tmp_path / "t.parquet").read_bytes())
    prepared = []
    for source, out in (
        (str(tmp_path / "t.parquet"), str(tmp_path / "pq")),
        ("gs://bkt/data/p/t.parquet", "gs://bkt/data/pq"),
    ):
        prepare.prepare(
            data_config(train_files=source, eval_files=source, parquet_column="body"), out, chunk_tokens=16
        )
        prepared.append(pipeline.load_corpus(data_config(train_files="", shards=out))[0][:])
    assert len(prepared[0]) > 0 and np.array_equal(prepared[0], prepared[1])


def test_train_py_in_a_bucket_stops_on_sigterm_and_resumes_there(gcs_emulator, tmp_path):
    """train.py in a process of its own, the endpoint given by the environment alone."""
    import signal
    import subprocess
    import sys

    from conftest import child_env
    from test_train_cli import ROOT, SMALL

    workdir = f"gs://bkt/runs/sigterm-{time.time_ns()}"
    flags = [*SMALL, "--config.steps=100000", "--config.checkpoint_every=100000"]
    proc = subprocess.Popen(
        [sys.executable, "train.py", "--config=configs/tiny.py", f"--workdir={workdir}", *flags],
        cwd=ROOT, env=child_env(XDG_CACHE_HOME=str(tmp_path / "cache")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 240
        while not paths.of(f"{workdir}/{metrics.JSONL}").exists():  # a first step logged there
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-2000:]
            time.sleep(0.5)
        held = paths.of(f"{workdir}/{lock.LOCK}").read_text()
        assert held.startswith(f"pid {proc.pid} on ")  # the lease names the trainer
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    stopped = [line for line in (out + err).splitlines() if line.startswith("stopped by SIGTERM after step ")]
    assert stopped, (out + err)[-2000:]
    step = int(stopped[0].split()[5].rstrip(":"))
    found = _objects(workdir)
    assert any(f"/checkpoints/{step}/state/" in f for f in found)
    assert not any(f.endswith(lock.LOCK) for f in found)  # released on the way out
    assert not (ROOT / "gs:").exists()
    from configs import tiny

    config = tiny.get_config()  # with SMALL's values, on another mesh and rule file
    for flag in SMALL:
        key, value = flag.removeprefix("--config.").split("=")
        *parents, leaf = key.split(".")
        target = config
        for parent in parents:
            target = target[parent]
        target[leaf] = int(value)
    config.update(steps=step + 2, rules="megatron_1d", mesh="dp=4,mp=2")
    last = loop.train(config, workdir)
    assert last["step"] == step + 2
    logged = _losses(paths.of(f"{workdir}/{metrics.JSONL}").read_text())
    assert max(logged) == step + 2 and min(logged) == 1
    # A newest step damaged in the bucket is set aside there, and the run resumes from the one before.
    paths.of(f"{workdir}/checkpoints/{step + 2}/state/_METADATA").unlink()
    warnings = []
    config.update(steps=step + 3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "log", lambda line: warnings.append(line))
        assert loop.train(config, workdir)["step"] == step + 3
    assert any(f"skipping checkpoint {workdir}/checkpoints/{step + 2}: partial" in w for w in warnings), (
        warnings
    )
    assert any(f"resumed from step {step} " in w for w in warnings), warnings
    aside = [
        f for f in _objects(f"{workdir}/corrupt_checkpoints") if f"/corrupt_checkpoints/{step + 2}-" in f
    ]
    assert any("/state/ocdbt.process_0/" in f for f in aside)  # moved whole, not deleted
    # Trained again from step + 1 (checkpoint_every=2): saved whole where the damaged one was.
    assert paths.of(f"{workdir}/checkpoints/{step + 2}/state/_METADATA").exists() == ((step + 2) % 2 == 0)


def test_shards_in_a_bucket_are_fetched_a_file_at_a_time_within_the_cache_budget(
    gcs_emulator, tmp_path, monkeypatch
):
    """A budget smaller than one file: one file open at a time, each fetched when a record of it is
    read, nothing left on local disk; the tokens are the local shards'."""
    import numpy as np
    from conftest import data_config, write

    from gspmd_tp.data import pipeline, prepare, shards, tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("GSPMD_TP_SHARD_CACHE_MB", "0.0001")  # 104 bytes
    for d in range(10):
        write(tmp_path / "d" / f"{d}.txt", "".join(f"line {i} of document {d}\n" for i in range(8)))
    data = data_config(train_files=str(tmp_path / "d" / "*.txt"), eval_fraction=0.2)
    meta = prepare.prepare(data, "gs://bkt/small_shards", chunk_tokens=32, records_per_file=3)
    files = len(meta["splits"]["train"]["files"])
    assert files >= 4
    want, _ = pipeline.load_corpus(data)
    got = shards.ShardedTokens("gs://bkt/small_shards", "train", shards.read_meta("gs://bkt/small_shards"))
    assert got.dtype == tokenizer.load("bytes").dtype
    source = got._source
    assert isinstance(source, shards.BucketRecords) and source.per_file == 3 and source.fetches == 1
    # Tokens 0..95 are file 0's 3 records of 32; 96..191 file 1's.
    np.testing.assert_array_equal(got[90:100], want[90:100])  # files 0 and 1: 0 already open
    assert source.fetches == 2 and list(source._open) == [1]  # 0 closed to make room for 1
    np.testing.assert_array_equal(got[0 : len(got)], want)  # every file again, 0 first
    assert source.fetches == 2 + files and list(source._open) == [files - 1]
    np.testing.assert_array_equal(got[5:7], want[5:7])  # file 0 once more
    assert source.fetches == 3 + files
    leftover = [f for _, _, names in os.walk(tmp_path / "cache") for f in names]
    assert leftover == []  # each copy unlinked once opened
    source.close()
    # A shards.json that lists one record more than the files hold: the last file says so when read.
    meta["splits"]["train"]["records"] += 1
    meta["splits"]["train"]["tokens"] += 1
    paths.of("gs://bkt/small_shards/shards.json").write_text(json.dumps(meta))
    bad = shards.ShardedTokens("gs://bkt/small_shards", "train", meta)
    last = meta["splits"]["train"]["files"][-1]
    with pytest.raises(
        UserError, match=rf"config.data.shards=gs://bkt/small_shards: .*/{last} holds \d+ records"
    ):
        bad[len(bad) - 1 : len(bad)]
    monkeypatch.setenv("GSPMD_TP_SHARD_CACHE_MB", "lots")
    with pytest.raises(UserError, match="GSPMD_TP_SHARD_CACHE_MB=lots: give a number of MiB above 0"):
        shards.cache_bytes()


def test_a_step_in_a_bucket_without_orbaxs_commit_file_is_a_save_cut_short(gcs_emulator):
    """In a bucket orbax writes step N in place and commit_success.txt last: a step without it is
    no step for the readers (steps_on_disk, readable_checkpoints), and the next run's manager removes it
    before it saves that step again."""
    import jax.numpy as jnp

    from gspmd_tp.checkpoint import step_dirs, store

    workdir = f"gs://bkt/runs/cut-{time.time_ns()}"
    mngr = store.manager(workdir, keep=5, async_save=False)
    for step in (1, 2):
        store.save(mngr, step, {"w": jnp.full((4,), float(step))}, {"next_index": step}, {"step": step})
    mngr.close()
    ckpt = f"{workdir}/checkpoints"
    commit = f"{ckpt}/2/commit_success.txt"
    assert commit in [f"gs://{f}" for f in _objects(ckpt)]
    assert step_dirs.steps_on_disk(ckpt) == [2, 1]
    paths.of(commit).unlink()  # as a save killed before its last write leaves it
    assert step_dirs.steps_on_disk(ckpt) == [1]
    assert [s for s, _ in step_dirs.readable_checkpoints(workdir)] == [1]
    mngr = store.manager(workdir, keep=5, async_save=False)
    assert mngr.all_steps() == [1]
    store.save(mngr, 2, {"w": jnp.zeros(4)}, {"next_index": 2}, {"step": 2, "again": True})
    mngr.close()
    assert step_dirs.steps_on_disk(ckpt) == [2, 1]
    assert [m for _, m in step_dirs.readable_checkpoints(workdir)] == [
        {"step": 2, "again": True},
        {"step": 1},
    ]
    found = _objects(ckpt)
    assert not any(lock.LOCK in f or "corrupt" in f for f in found)  # nothing set aside
