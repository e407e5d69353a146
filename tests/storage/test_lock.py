"""The run directory's lock on local disk (the lease in a bucket: test_bucket.py)."""

import os
import re

import pytest

from gspmd_tp.job.errors import UserError
from gspmd_tp.storage import lock


def _whole(message: str) -> str:
    """A pattern that matches exactly `message`."""
    return f"^{re.escape(message)}$"


def test_a_workdir_that_cannot_be_written_is_one_line_when_the_lock_is_taken(tmp_path):
    """os.access, which check_dir asks, says yes to root where the filesystem refuses (/proc), and a
    train.lock in the way is no file: the lock, the run's first write, named the path in a traceback."""
    in_the_way = tmp_path / "run" / lock.LOCK
    in_the_way.mkdir(parents=True)
    message = f"--workdir={tmp_path / 'run'}: cannot write there (Is a directory: {in_the_way})"
    with pytest.raises(UserError, match=_whole(message)):
        with lock.workdir_lock(str(tmp_path / "run")):
            pass
    with pytest.raises(UserError, match=r"^--workdir=/proc/gspmd_tp_none/run: cannot write there \("):
        with lock.workdir_lock("/proc/gspmd_tp_none/run"):
            pass
    assert not os.path.exists("/proc/gspmd_tp_none")


@pytest.mark.parametrize(
    "made, removed",
    [
        ((), True),
        (("checkpoints/",), True),  # orbax makes it before the first save: still nothing written
        (("checkpoints/2/",), False),  # not empty: a step on its way
        (("metrics.jsonl",), False),
    ],
)
def test_a_stopped_run_removes_its_new_workdir_where_nothing_was_written(
    tmp_path, monkeypatch, made, removed
):
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / lock.LOCK).write_text("pid 1\n")
    for name in made:
        (workdir / name).mkdir(parents=True) if name.endswith("/") else (workdir / name).write_text("")
    monkeypatch.setattr(lock, "_created", [str(workdir)])
    lock.remove_created_workdirs()
    assert workdir.exists() != removed
