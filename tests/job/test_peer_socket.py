"""Process 0 checks every process's job flags before jax.distributed joins them (threads stand in
for the processes; tests/test_multiprocess.py starts real ones)."""

import socket
import struct
import threading
import time

import pytest

from gspmd_tp.job import peer_socket
from gspmd_tp.job.errors import UserError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(port, *flags):
    """Runs process 0 (num_processes flags[0][1]) and the others (process id, num_processes) in
    threads; each one's outcome: None where it returned, else the UserError's text."""
    address = f"127.0.0.1:{port}"
    calls = [lambda: peer_socket.gather(port, flags[0][1], address)]
    calls += [
        lambda pid=pid, n=n: peer_socket.report("127.0.0.1", port, pid, n, address) for pid, n in flags[1:]
    ]
    outcomes = [""] * len(calls)

    def run(i):
        try:
            calls[i]()
            outcomes[i] = None
        except UserError as e:
            outcomes[i] = str(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), outcomes
    return outcomes


def test_processes_that_agree_all_go_on():
    assert job(free_port(), (0, 3), (2, 3), (1, 3)) == [None, None, None]


def test_another_process_count_is_named_on_both():
    port = free_port()
    want = (
        f"process 1 was started with --num_processes=3 and process 0 (the coordinator, 127.0.0.1:{port}) "
        "with --num_processes=2: start every process with the same count"
    )
    assert job(port, (0, 2), (1, 3)) == [want, want]


def test_two_processes_with_one_id_are_named_on_every_process():
    port = free_port()
    want = (
        f"two processes of the job at 127.0.0.1:{port} were started with --process_id=1: give each its own "
        "id, from 0 to 2"
    )
    assert job(port, (0, 3), (1, 3), (1, 3)) == [want, want, want]


def test_a_stray_connection_does_not_stall_the_join():
    port = free_port()
    address = f"127.0.0.1:{port}"
    done = []
    t = threading.Thread(target=lambda: done.append(peer_socket.gather(port, 2, address)), daemon=True)
    t.start()
    while True:  # a port scan: connects and says something else
        try:
            with socket.create_connection(("127.0.0.1", port)) as stray:
                stray.sendall(b"GET / HTTP/1.0\n")
            break
        except ConnectionRefusedError:
            pass
    peer_socket.report("127.0.0.1", port, 1, 2, address)
    t.join(20)
    assert done == [None]


def test_a_process_that_finds_another_program_on_the_port_is_one_line():
    """As a second process with an id already taken, which finds JAX's coordination service of the
    job that joined without it: before, the service aborted every process of that job."""
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]

        def answer_otherwise():
            conn, _ = other.accept()
            with conn:
                conn.recv(100)  # read first: a close with bytes unread would reset the connection
                conn.sendall(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")  # an HTTP/2 SETTINGS frame

        threading.Thread(target=answer_otherwise, daemon=True).start()
        with pytest.raises(UserError) as e:
            peer_socket.report("127.0.0.1", port, 1, 2, f"127.0.0.1:{port}")
    assert str(e.value) == (
        f"--coordinator_address=127.0.0.1:{port}: process 0 there takes no more processes (its job has all "
        "joined: is this a second process with --process_id=1?), or another program listens on that port"
    )


def test_a_second_process_0_is_named_on_both():
    """Before, the second found the port taken ('another job's coordinator?') and the first waited
    out the join timeout for a line that named no cause."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    outcomes = {}

    def first():
        try:
            peer_socket.gather(port, 2, address)
        except UserError as e:
            outcomes["first"] = str(e)

    t = threading.Thread(target=first, daemon=True)
    t.start()
    while True:
        try:
            socket.create_connection(("127.0.0.1", port)).close()  # listening: a stray, dropped
            break
        except ConnectionRefusedError:
            pass
    with pytest.raises(UserError) as e:
        peer_socket.ask_the_first_process_0("127.0.0.1", port, 2)
    t.join(20)
    want = (
        f"two processes of the job at {address} were started with --process_id=0: give each its own id, "
        "from 0 to 1"
    )
    assert outcomes == {"first": want} and str(e.value) == want


def test_a_stop_right_behind_the_answer_is_not_lost(monkeypatch):
    """Process 0, signalled as the job's flags agreed, sends its stop right behind its answer: the
    answer's read left it for the thread that follows the stops (it took both, and the stop was lost)."""
    alone(monkeypatch)
    with socket.create_server(("127.0.0.1", 0)) as zero:
        port = zero.getsockname()[1]

        def answer_and_stop():
            conn, _ = zero.accept()
            conn.recv(100)
            conn.sendall(b"ok\nstop 15 0\n")
            conn.recv(1)  # until the other end closes

        threading.Thread(target=answer_and_stop, daemon=True).start()
        peer_socket.report("127.0.0.1", port, 1, 2, f"127.0.0.1:{port}")
        told = threading.Event()
        stops = []
        peer_socket.follow(
            lambda signum, process: (stops.append((signum, process)), told.set()), print, print
        )
        told.wait(10)
        for conn in peer_socket._peers:
            conn.close()
    assert stops == [(15, 0)]


def alone(monkeypatch, peers=None, process_id=0):
    """This test's own handshake state: `peers` (connection: process id) as _keep leaves them."""
    monkeypatch.setattr(peer_socket, "_peers", {})
    monkeypatch.setattr(peer_socket, "_telling", threading.Event())
    monkeypatch.setattr(peer_socket, "_began", threading.Event())
    monkeypatch.setattr(peer_socket, "_ended", threading.Event())
    monkeypatch.setattr(peer_socket, "_death", threading.Event())
    monkeypatch.setattr(peer_socket, "_following", None)
    if peers is not None:
        peer_socket._keep(peers, process_id)


def fake_peers(monkeypatch, process_id, others):
    """This process (`process_id`) and a socket pair per process of `others`: {process: its end}."""
    pairs = {p: socket.socketpair() for p in others}
    alone(monkeypatch, {mine: p for p, (mine, _) in pairs.items()}, process_id)
    return {p: theirs for p, (_, theirs) in pairs.items()}


def follow():
    """Follows the fake peers: what they told, once the thread ended (within 10 s)."""
    heard = []
    thread = peer_socket._follow(
        lambda signum, process: heard.append(("stop", signum, process)),
        lambda process: heard.append(("died", process)),
        lambda process, message: heard.append(("error", process, message)),
    )
    return heard, thread


def test_a_process_that_closes_without_a_word_died_and_process_0_tells_the_others(monkeypatch):
    """As a SIGKILL or a crash before training: before, the others waited for it in a collective
    until the heartbeat timeout."""
    ends = fake_peers(monkeypatch, 0, [1, 2])
    heard, thread = follow()
    ends[1].close()
    assert ends[2].recv(100) == b"died 1\n"
    assert thread.is_alive()  # process 0 leaves last: it waits for process 2 to close first
    ends[2].close()
    thread.join(10)
    assert heard == [("died", 1)] and peer_socket._death.is_set()


def test_a_reset_connection_is_a_death_too(monkeypatch):
    """A process killed with bytes still unread resets its connection instead of closing it."""
    ends = fake_peers(monkeypatch, 0, [1])
    heard, thread = follow()
    peer_socket._send(peer_socket._peers, b"something unread\n")
    ends[1].setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    ends[1].close()
    thread.join(10)
    assert heard == [("died", 1)]


@pytest.mark.parametrize(
    "words, loop, heard",
    [
        ([b"bye\n"], "not begun", []),  # an error every process reports, or a run with nothing to train
        ([b"bye\n"], "running", []),  # an error every process reports, found in the loop
        ([b"training\n"], "ended", []),  # the run's end: both loops are over
        ([b"training\n", b"bye\n"], "running", []),
        # Its loop waits for this process's in a collective: it cannot have ended on purpose.
        ([b"training\n"], "not begun", [("died", 1)]),
        # This process's loop runs: its next collective would wait for the dead one.
        ([b"training\n"], "running", [("died", 1)]),
        ([b"trai", b"ning\n"], "ended", []),  # a word that comes in two pieces
        ([b"training"], "ended", [("died", 1)]),  # not a whole line: not a word
    ],
)
def test_a_close_after_bye_or_once_both_loops_ended_is_no_death(monkeypatch, words, loop, heard):
    ends = fake_peers(monkeypatch, 0, [1])
    if loop != "not begun":
        peer_socket.training_began()
    if loop == "ended":
        peer_socket.training_ended()
    got, thread = follow()
    for word in words:
        ends[1].sendall(word)
        time.sleep(0.05)
    ends[1].close()
    thread.join(10)
    assert not thread.is_alive() and got == heard


@pytest.mark.parametrize("failed, heard", [(False, []), (True, [("died", 1)])])
def test_a_close_after_this_loop_failed_is_a_death(monkeypatch, failed, heard):
    """A failed step (gloo saw the peer's connection close) ends this process's loop, often before
    the handshake socket shows the close: that close is still a death. It was taken for the peer's
    own exit, and the failed step's line guessed ("another process of the job has probably died"),
    in 1 of 5 runs of a killed peer on a busy machine."""
    from gspmd_tp.job import signals

    ends = fake_peers(monkeypatch, 0, [1])
    with signals.StopSignal(lambda message: None) as stop:  # the loop begins: `training` to the peers
        stop.finishing(failed)
    got, thread = follow()
    ends[1].sendall(b"training\n")
    time.sleep(0.05)
    ends[1].close()
    thread.join(10)
    assert not thread.is_alive() and got == heard


def test_process_0_closing_without_a_word_is_its_death_on_the_others(monkeypatch):
    ends = fake_peers(monkeypatch, 1, [0])
    heard, thread = follow()
    ends[0].sendall(b"training\n")  # its loop began, but this one's has not
    ends[0].close()
    thread.join(10)
    assert heard == [("died", 0)]


@pytest.mark.parametrize(
    "line, news",
    [(b"died 2\n", ("died", 2)), (b"error 0 RuntimeError: boom\n", ("error", 0, "RuntimeError: boom"))],
)
def test_what_process_0_tells_is_heard_once(monkeypatch, line, news):
    ends = fake_peers(monkeypatch, 1, [0])
    heard, thread = follow()
    ends[0].sendall(line)
    thread.join(10)
    ends[0].close()
    assert heard == [news]


def test_a_stop_is_passed_on_and_then_no_death(monkeypatch):
    """Process 1 stopped by SIGTERM tells it and exits: its close right behind is not its death."""
    ends = fake_peers(monkeypatch, 0, [1, 2])
    heard, thread = follow()
    ends[1].sendall(b"stop 15 1\n")
    ends[1].close()
    assert ends[2].recv(100) == b"stop 15 1\n"
    ends[2].close()
    thread.join(10)
    assert heard == [("stop", 15, 1)]


def test_a_process_says_training_and_bye_to_its_peers(monkeypatch):
    ends = fake_peers(monkeypatch, 0, [1, 2])
    peer_socket.training_began()
    peer_socket.leave()
    for end in ends.values():
        end.settimeout(5)
        assert end.recv(100) == b"training\nbye\n"
    assert peer_socket._began.is_set() and not peer_socket._telling.is_set()


def test_following_before_the_flags_agree_starts_once_they_do(monkeypatch):
    """train.py follows from the start: a process may die while JAX joins the job."""
    alone(monkeypatch)
    died = threading.Event()
    peer_socket.follow(print, lambda process: died.set(), print)
    assert not died.wait(0.2)  # no peers yet: nothing to follow
    mine, theirs = socket.socketpair()
    peer_socket._keep({mine: 1}, 0)
    theirs.close()
    assert died.wait(10)


def test_an_error_of_one_process_is_passed_on_and_then_no_death(monkeypatch):
    """Process 1 stops with an error of its own host before training (a UserError there alone, or a
    bug): before, it said `bye` (or nothing), and the others waited for it in a collective until the
    heartbeat timeout."""
    ends = fake_peers(monkeypatch, 0, [1, 2])
    heard, thread = follow()
    ends[1].sendall(b"error 1 config.data.train_files: cannot read /data/a.txt (Permission denied)\n")
    ends[1].close()
    ends[2].settimeout(5)
    assert (
        ends[2].recv(200) == b"error 1 config.data.train_files: cannot read /data/a.txt (Permission denied)\n"
    )
    assert thread.is_alive()  # process 0 leaves last
    ends[2].close()
    thread.join(10)
    assert heard == [("error", 1, "config.data.train_files: cannot read /data/a.txt (Permission denied)")]
    assert peer_socket._death.is_set()  # a collective that failed on the closed connection waits for it


@pytest.mark.parametrize("line", [b"error\n", b"error x boom\n", b"errors 1 boom\n"])
def test_a_line_that_is_no_error_is_not_taken_for_one(monkeypatch, line):
    ends = fake_peers(monkeypatch, 0, [1])
    heard, thread = follow()
    ends[1].sendall(line)
    ends[1].close()
    thread.join(10)
    assert heard == [("died", 1)]


def test_a_process_tells_the_first_line_of_its_error(monkeypatch):
    ends = fake_peers(monkeypatch, 1, [0])
    assert peer_socket.tell_error("the compiled train step needs more\nthan this host has\n")
    ends[0].settimeout(5)
    assert ends[0].recv(200) == b"error 1 the compiled train step needs more\n"


def test_process_0_tells_its_error_and_leaves_last(monkeypatch):
    """Process 0 hosts JAX's coordination service: the others must exit first, or their JAX clients
    abort them with a stack trace."""
    ends = fake_peers(monkeypatch, 0, [1, 2])
    told = []
    thread = threading.Thread(target=lambda: told.append(peer_socket.tell_error("boom")), daemon=True)
    thread.start()
    for process, end in ends.items():
        end.settimeout(5)
        assert end.recv(100) == b"error 0 boom\n"
        assert thread.is_alive(), process
        end.close()
    thread.join(10)
    assert told == [True]


def test_no_error_is_told_once_training_began_or_alone(monkeypatch):
    """The loop's own errors every process sees; a one-process job has nobody to tell."""
    alone(monkeypatch)
    assert not peer_socket.tell_error("boom")
    ends = fake_peers(monkeypatch, 1, [0])
    peer_socket.training_began()
    assert not peer_socket.tell_error("boom")
    ends[0].settimeout(5)
    assert ends[0].recv(100) == b"training\n"
