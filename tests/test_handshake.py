"""Process 0 checks every process's job flags before jax.distributed joins them (threads stand in
for the processes; tests/test_multiprocess.py starts real ones)."""

import socket
import threading

import pytest

from gspmd_tp import handshake
from gspmd_tp.errors import UserError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(port, *flags):
    """Runs process 0 (num_processes flags[0][1]) and the others (process id, num_processes) in
    threads; each one's outcome: None where it returned, else the UserError's text."""
    address = f"127.0.0.1:{port}"
    calls = [lambda: handshake.gather(port, flags[0][1], address)]
    calls += [
        lambda pid=pid, n=n: handshake.report("127.0.0.1", port, pid, n, address) for pid, n in flags[1:]
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
    t = threading.Thread(target=lambda: done.append(handshake.gather(port, 2, address)), daemon=True)
    t.start()
    while True:  # a port scan: connects and says something else
        try:
            with socket.create_connection(("127.0.0.1", port)) as stray:
                stray.sendall(b"GET / HTTP/1.0\n")
            break
        except ConnectionRefusedError:
            pass
    handshake.report("127.0.0.1", port, 1, 2, address)
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
            handshake.report("127.0.0.1", port, 1, 2, f"127.0.0.1:{port}")
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
            handshake.gather(port, 2, address)
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
        handshake.ask_the_first_process_0("127.0.0.1", port, 2)
    t.join(20)
    want = (
        f"two processes of the job at {address} were started with --process_id=0: give each its own id, "
        "from 0 to 1"
    )
    assert outcomes == {"first": want} and str(e.value) == want


def test_a_stop_right_behind_the_answer_is_not_lost(monkeypatch):
    """Process 0, signalled as the job's flags agreed, sends its stop right behind its answer: the
    answer's read left it for the thread that follows the stops (it took both, and the stop was lost)."""
    monkeypatch.setattr(handshake, "_peers", [])
    monkeypatch.setattr(handshake, "_telling", threading.Event())
    with socket.create_server(("127.0.0.1", 0)) as zero:
        port = zero.getsockname()[1]

        def answer_and_stop():
            conn, _ = zero.accept()
            conn.recv(100)
            conn.sendall(b"ok\nstop 15 0\n")
            conn.recv(1)  # until the other end closes

        threading.Thread(target=answer_and_stop, daemon=True).start()
        handshake.report("127.0.0.1", port, 1, 2, f"127.0.0.1:{port}")
        told = threading.Event()
        stops = []
        handshake.follow_stops(lambda signum, process: (stops.append((signum, process)), told.set()))
        told.wait(10)
        for conn in handshake._peers:
            conn.close()
    assert stops == [(15, 0)]
