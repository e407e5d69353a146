"""Output paths are checked before any work, and the checks write nothing."""

import os
import re

import pytest

from gspmd_tp.job.errors import UserError
from gspmd_tp.storage import outputs


def _whole(message: str) -> str:
    """A pattern that matches exactly `message`."""
    return f"^{re.escape(message)}$"


def test_a_directory_that_exists_or_can_be_created_passes_and_nothing_is_written(tmp_path):
    outputs.check_dir(str(tmp_path), "--workdir")
    outputs.check_dir(str(tmp_path / "runs" / "a" / "b"), "--workdir")
    outputs.check_file(str(tmp_path / "out" / "bench.json"), "--json_out")
    assert list(tmp_path.iterdir()) == []


def test_a_file_in_the_way_is_named(tmp_path):
    blocker = tmp_path / "runs"
    blocker.write_text("")
    why = f"{blocker} is a file, not a directory"
    with pytest.raises(UserError, match=_whole(f"--workdir={blocker}/tiny: {why}")):
        outputs.check_dir(str(blocker / "tiny"), "--workdir")
    with pytest.raises(UserError, match=_whole(f"--workdir={blocker}: {why}")):
        outputs.check_dir(str(blocker), "--workdir")
    with pytest.raises(UserError, match=_whole(f"--chart={blocker}/a/c.png: {why}")):
        outputs.check_file(str(blocker / "a" / "c.png"), "--chart")


def test_a_probe_writes_but_leaves_nothing_behind_and_creates_no_directory(tmp_path):
    kept = tmp_path / "report.json"
    kept.write_text("kept")
    outputs.check_file(str(kept), "--json_out", probe=True)
    outputs.check_file(str(tmp_path / "new" / "bench.json"), "--json_out", probe=True)
    outputs.check_dir(str(tmp_path / "profiles" / "a"), "--profile_dir", probe=True)
    outputs.check_dir(str(tmp_path), "--profile_dir", probe=True)
    assert list(tmp_path.iterdir()) == [kept] and kept.read_text() == "kept"


@pytest.mark.skipif(os.geteuid() != 0, reason="os.access already refuses /proc to a user other than root")
def test_a_probe_finds_what_the_filesystem_refuses_though_os_access_allows_it():
    for path in ("/proc/bench.json", "/proc/gspmd_tp_none/bench.json"):  # where it would be created
        outputs.check_file(path, "--json_out")  # os.access says yes to root
        with pytest.raises(
            UserError, match=_whole(f"--json_out={path}: cannot write it (No such file or directory)")
        ):
            outputs.check_file(path, "--json_out", probe=True)
    with pytest.raises(UserError, match=r"^--profile_dir=/proc/gspmd_tp_none/p: cannot write there \("):
        outputs.check_dir("/proc/gspmd_tp_none/p", "--profile_dir", probe=True)
    # A chart is written after the work: always probed.
    with pytest.raises(UserError, match=r"^--plot=/proc/loss.png: cannot write it \("):
        outputs.check_image("/proc/loss.png", "--plot")
    assert not os.path.exists("/proc/gspmd_tp_none")


def test_a_directory_where_a_file_goes_is_refused(tmp_path):
    with pytest.raises(UserError, match=_whole(f"OUT={tmp_path}: is a directory, not a file")):
        outputs.check_file(str(tmp_path), "OUT")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_a_read_only_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(UserError, match="cannot create it: .*locked is not writable"):
            outputs.check_dir(str(locked / "run"), "--workdir")
        with pytest.raises(UserError, match="locked is not writable"):
            outputs.check_file(str(locked / "x.npz"), "OUT")
    finally:
        locked.chmod(0o755)


def test_an_empty_path_is_refused_not_taken_for_the_current_directory():
    with pytest.raises(UserError, match=_whole("--workdir is empty")):
        outputs.check_dir("", "--workdir")
    with pytest.raises(UserError, match=_whole("--json_out is empty")):
        outputs.check_file("", "--json_out")


def test_a_chart_needs_an_image_format_matplotlib_writes(tmp_path):
    for name in ("loss.png", "loss.SVG", "loss.pdf"):
        outputs.check_image(str(tmp_path / name), "--plot")
    with pytest.raises(UserError, match=r"^--plot=.*loss.jpgg: the extension .jpgg is not an image format"):
        outputs.check_image(str(tmp_path / "loss.jpgg"), "--plot")
    with pytest.raises(
        UserError, match=r"^--chart=.*chart: no file extension; name it \*.png, \*.svg or \*.pdf"
    ):
        outputs.check_image(str(tmp_path / "chart"), "--chart")
    assert list(tmp_path.iterdir()) == []


def test_a_file_written_whole_replaces_the_old_one_only_when_done(tmp_path):
    path = tmp_path / "out.npz"
    path.write_text("old")
    with pytest.raises(OSError), outputs.whole_file(str(path)) as partial:
        open(partial, "w").write("half")
        raise OSError(28, "No space left on device")
    assert os.listdir(tmp_path) == ["out.npz"] and path.read_text() == "old"
    with outputs.whole_file(str(path)) as partial:
        open(partial, "w").write("new")
    assert os.listdir(tmp_path) == ["out.npz"] and path.read_text() == "new"
    with outputs.whole_file(str(tmp_path / "a" / "b" / "report.json")) as partial:  # made on the way
        open(partial, "w").write("{}")
    assert (tmp_path / "a" / "b" / "report.json").read_text() == "{}"


@pytest.mark.parametrize("existed", [False, True])
def test_what_a_write_cut_short_added_to_a_directory_is_removed_and_nothing_else(tmp_path, existed):
    directory = tmp_path / "hf"
    if existed:
        directory.mkdir()
        (directory / "kept.txt").write_text("there before")
    with pytest.raises(KeyboardInterrupt), outputs.removed_if_cut_short(str(directory)):
        (directory / "sub").mkdir(parents=True)
        (directory / "sub" / "model.safetensors").write_text("weights")
        (directory / "config.json").write_text("{}")
        raise KeyboardInterrupt
    assert (os.listdir(directory) == ["kept.txt"]) if existed else not directory.exists()
    with outputs.removed_if_cut_short(str(directory)):  # done: everything stays
        (directory / "sub").mkdir(parents=True)
    assert (directory / "sub").is_dir()
