"""The launchers' meeting point (`Hub`) and their connection to it (`Link`), in one process.

Each launcher of a run on several machines is a `Link` here, over 127.0.0.1: the join and its
checks, the stop of every machine on one's failure, a machine lost, the one report. The real
thing, one launcher per simulated host, is in test_hosts.py.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

from meshkit import LaunchError
from meshkit._src.launch.hub import Hub
from meshkit._src.launch.link import Link, Over, reach
from meshkit._src.launch.machines import placement
from meshkit._src.launch.nodes import Hello, Stop, parse_address, program_digest, serve
from meshkit._src.launch.ports import ephemeral_range, free_ports, port_in_use
from meshkit._src.launch.report import LaunchAttempt, RankResult


def _hello(node: int, **changes: object) -> Hello:
    base = Hello(
        node=node, nnodes=2, hostname=f"m{node}", processes=2, devices=4, platform="cpu",
        program="abc", version="1.0",
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


class _Run:
    """A hub on a free port of 127.0.0.1 and the links that join it, each joining in a thread."""

    def __init__(
        self,
        nnodes: int = 2,
        join_timeout: float = 10.0,
        lost_after: float = 10.0,
        history: tuple[LaunchAttempt, ...] = (),
        max_restarts: int = 0,
    ):
        self.port = free_ports(2)  # PORT and PORT+1, as machine 0 serves them
        self.hub = Hub(
            serve("127.0.0.1", self.port),
            nnodes=nnodes,
            host="127.0.0.1",
            jax_port=self.port + 1,
            join_timeout=join_timeout,
            lost_after=lost_after,
            history=history,
            max_restarts=max_restarts,
        )
        self.links: list[Link] = []
        self.joined: dict[int, object] = {}

    def join(self, *hellos: Hello) -> dict[int, object]:
        """Each hello joins from its own thread; what each `Link.join` returned or raised."""

        def one(i: int, hello: Hello) -> None:
            sock = reach("127.0.0.1", self.port, hello.node, 10, lambda: False)
            assert sock is not None
            link = Link(sock, hello)
            self.links.append(link)
            try:
                self.joined[i] = link.join(lambda line: None, lambda: False, time.monotonic())
            except LaunchError as e:
                self.joined[i] = e

        threads = [threading.Thread(target=one, args=(i, h)) for i, h in enumerate(hellos)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        return self.joined

    def close(self) -> None:
        for link in self.links:
            link.close()
        self.hub.close()


@pytest.fixture
def run():
    runs: list[_Run] = []

    def make(**kwargs: object) -> _Run:
        runs.append(_Run(**kwargs))  # type: ignore[arg-type]
        return runs[-1]

    yield make
    for r in runs:
        r.close()


def _link_of(r: _Run, node: int) -> Link:
    return next(link for link in r.links if link.hello.node == node)


def test_machines_that_join_get_one_run(run):
    r = run()
    joined = r.join(_hello(0), _hello(1))
    for go in joined.values():
        assert go.coordinator == f"127.0.0.1:{r.port + 1}"
        assert go.num_processes == 4
        assert go.machines == {0: "m0", 1: "m1"}


@pytest.mark.parametrize(
    ("field", "value", "word"),
    [
        ("processes", 3, "-n"),
        ("devices", None, "-d"),
        ("program", "xyz", "program"),
        ("version", "2.0", "meshkit version"),
        ("nnodes", 3, "--nnodes"),
        ("max_restarts", 2, "--max-restarts"),
        ("allow_unjoined", True, "--allow-unjoined"),
    ],
)
def test_machines_that_differ_are_named_with_both_values(run, field, value, word):
    joined = run().join(_hello(0), _hello(1, **{field: value}))
    ours = getattr(_hello(0), field)
    for error in joined.values():
        assert isinstance(error, LaunchError)
        text = str(error)
        assert f"the machines differ in {word}" in text, text
        assert f"has {'none' if ours is None else ours}" in text, text
        assert f"has {'none' if value is None else value}" in text, text
        assert "machine 0 (m0, 127.0.0.1)" in text, text
        assert "machine 1 (m1, 127.0.0.1)" in text, text


def test_two_machines_with_one_node_rank_are_named(run):
    joined = run(nnodes=3).join(
        _hello(0, nnodes=3), _hello(1, nnodes=3), _hello(1, nnodes=3, hostname="m2")
    )
    for error in joined.values():
        assert "machine 1 (m1, 127.0.0.1) and machine 1 (m2, 127.0.0.1) both say --node-rank 1" in (
            str(error)
        ) or "machine 1 (m2, 127.0.0.1) and machine 1 (m1, 127.0.0.1) both say" in str(error)


def test_machine_0_hears_of_a_join_that_failed_before_it_joined(run):
    # The others may reach machine 0's hub before machine 0's own launcher does.
    r = run(nnodes=3)
    early = r.join(_hello(1, nnodes=3), _hello(1, nnodes=3, hostname="m2"))
    late = r.join(_hello(0, nnodes=3))
    for error in [*early.values(), *late.values()]:
        assert isinstance(error, LaunchError), error
        assert "both say --node-rank 1" in str(error), error


def test_a_machine_that_never_joins_is_named(run):
    start = time.monotonic()
    joined = run(nnodes=3, join_timeout=1.0).join(_hello(0, nnodes=3), _hello(1, nnodes=3))
    assert time.monotonic() - start < 8
    for error in joined.values():
        assert (
            "machine 2 did not join within 1 s. Joined: machine 0 (m0, 127.0.0.1), machine 1"
            in (str(error))
        ), error


def test_a_launcher_of_another_meshkit_is_named(run):
    r = run()
    with socket.create_connection(("127.0.0.1", r.port)) as other:
        fields = {**dataclasses.asdict(_hello(1)), "version": "9.9", "slices": 4}
        other.sendall((json.dumps({"kind": "hello", "hello": fields}) + "\n").encode())
        other.settimeout(10)
        answer = json.loads(other.makefile().readline())
    assert answer["kind"] == "error"
    assert "speaks another protocol (meshkit 9.9; machine 0 runs" in answer["text"], answer


def _result(rank: int, code: int, stderr: str = "", stopped: bool = False) -> RankResult:
    return RankResult(rank, code, "", stderr, stopped, stderr)


def _end_all(r: _Run, ended: dict[int, tuple]) -> dict[int, Over]:
    """Each machine's `Link.end` at once, from its own thread (each waits for the verdict)."""
    verdicts: dict[int, Over] = {}

    def one(node: int, args: tuple) -> None:
        verdict = _link_of(r, node).end(*args)
        assert verdict is not None
        verdicts[node] = verdict

    threads = [threading.Thread(target=one, args=(n, a)) for n, a in ended.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert verdicts[0] == verdicts[1]
    return verdicts


def test_a_failure_stops_every_machine_and_each_gets_one_report(run):
    r = run()
    r.join(_hello(0), _hello(1))
    one = _link_of(r, 1)
    one.tell("failed", 3, rank=3, text="rank 3 failed (exit code 3)", after=2.5)
    stop = _wait_stop(_link_of(r, 0))
    assert stop == Stop(
        1, "failed", 3, "machine 1 (m1, 127.0.0.1): rank 3 failed (exit code 3)", 3, 2.5
    )
    verdicts = _end_all(r, {
        0: ([_result(0, -15, stopped=True), _result(1, -15, stopped=True)], []),
        1: ([_result(2, -15, stopped=True), _result(3, 3, "ValueError: bad step")], []),
    })  # fmt: skip
    code, report = verdicts[0].returncode, verdicts[0].report
    assert code == 3
    assert report.startswith("meshkit launch: rank 3 failed first (exit code 3) after 2.5 s."), (
        report
    )
    assert "Rank 3 ran on machine 1 (m1)." in report, report
    assert "  | ValueError: bad step" in report, report


def test_machine_0_counts_the_starts_and_sends_them_with_the_verdict(run):
    before = LaunchAttempt(0, 1, "meshkit launch: machine 1 (m1) was lost", restartable=True)
    r = run(history=(before,), max_restarts=2)
    joined = r.join(_hello(0, max_restarts=2), _hello(1, max_restarts=2))
    assert [go.attempt for go in joined.values()] == [1, 1]
    _link_of(r, 1).tell("failed", 3, rank=3, text="rank 3 failed (exit code 3)", after=1.0)
    _wait_stop(_link_of(r, 0))
    verdicts = _end_all(r, {
        0: ([_result(0, -15, stopped=True), _result(1, -15, stopped=True)], [], 0.5),
        1: ([_result(2, -15, stopped=True), _result(3, 3, "ValueError: bad step")], [], 0.5),
    })  # fmt: skip
    attempts = verdicts[0].attempts
    assert [a.number for a in attempts] == [0, 1]
    # The attempt before, as it was, but for where its time went (until this one started).
    assert dataclasses.replace(attempts[0], goodput=before.goodput) == before
    assert (attempts[1].returncode, attempts[1].restartable, attempts[1].stopped_s) == (
        3,
        True,
        0.5,
    )
    assert attempts[1].cause.startswith("meshkit launch: rank 3 failed first (exit code 3)")
    report = verdicts[0].report.splitlines()
    assert "meshkit launch: 1 restart (at most 2):" in report
    assert report[-1].startswith("  attempt 1: not every rank joined; rank 3 failed first (exit")


@pytest.mark.parametrize("allowed", [False, True])
def test_ranks_that_never_joined_fail_the_run_on_every_machine(run, allowed):
    r = run()
    r.join(_hello(0, allow_unjoined=allowed), _hello(1, allow_unjoined=allowed))
    verdicts = _end_all(r, {
        0: ([_result(0, 0), _result(1, 0)], [], None, [0, 1]),
        1: ([_result(2, 0), _result(3, 0)], [], None, [3]),
    })  # fmt: skip
    if allowed:
        assert (verdicts[0].returncode, verdicts[0].report) == (0, "")
        return
    assert verdicts[0].returncode == 1
    assert verdicts[0].report.startswith(
        "meshkit launch: every rank exited 0, but ranks 0-1, 3 never joined the program (no "
        "meshkit.init() call): each of those ran alone"
    ), verdicts[0].report
    assert "not the answer of one 4-process program" in verdicts[0].report


def test_every_machine_hears_which_machines_still_form_the_cluster(run):
    r = run()
    r.join(_hello(0), _hello(1))
    zero, one = _link_of(r, 0), _link_of(r, 1)

    def others_seen_by(link: Link, stages: dict[int, str], want: dict[str, str]) -> None:
        deadline = time.monotonic() + 10
        while (seen := link.share_stages(stages)) != want:
            assert time.monotonic() < deadline, seen
            link.stop_requested()  # reads what the hub sent
            time.sleep(0.05)

    others_seen_by(zero, {0: "joining", 1: "joining"}, {"machine 1 (m1)": "ranks 2-3 starting"})
    others_seen_by(one, {2: "joining", 3: "starting"}, {"machine 0 (m0)": "ranks 0-1 joining"})
    others_seen_by(zero, {0: "joining", 1: "joining"},
                   {"machine 1 (m1)": "rank 2 joining; rank 3 starting"})  # fmt: skip
    others_seen_by(one, {2: "joined", 3: "joined"}, {"machine 0 (m0)": "ranks 0-1 joining"})
    others_seen_by(zero, {0: "joined", 1: "joined"}, {})  # nothing left to say


def _wait_stop(link: Link, limit: float = 10.0) -> object:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        stop = link.stop_requested()
        if stop is not None:
            return stop
        time.sleep(0.02)
    raise AssertionError("no stop came")


def test_a_machine_whose_connection_closes_is_lost(run):
    r = run()
    r.join(_hello(0), _hello(1))
    _link_of(r, 1).close()
    stop = _wait_stop(_link_of(r, 0))
    assert (stop.why, stop.node) == ("lost", 1), stop
    assert stop.text == "machine 1 (m1, 127.0.0.1) was lost: its launcher's connection closed."
    over = _link_of(r, 0).end([_result(0, -15, stopped=True), _result(1, -15, stopped=True)], [])
    code, report = over.returncode, over.report
    assert code == 1
    assert "s: its launcher's connection closed. Ranks 2-3 ran there;" in report, report


def test_a_machine_that_goes_silent_is_lost(run):
    r = run(lost_after=1.5)
    r.join(_hello(0), _hello(1))
    silent = _link_of(r, 1)
    silent.closed.set()  # its heartbeats stop; the connection stays open
    stop = _wait_stop(_link_of(r, 0))
    assert stop.text == "machine 1 (m1, 127.0.0.1) was lost: its launcher said nothing for 1.5 s."


def test_a_lost_hub_is_told_to_every_machine(run):
    r = run()
    r.join(_hello(0), _hello(1))
    r.hub.close()
    stop = _wait_stop(_link_of(r, 1))
    assert stop == "machine 0, which serves the coordinator, was lost: its connection closed."
    start = time.monotonic()
    assert _link_of(r, 1).end([_result(2, -15, stopped=True)], []) is None  # no report comes
    assert time.monotonic() - start < 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, 2, "h:1", None, 9.0), "--node-rank 2 is outside 0..1 (--nnodes 2)"),
        ((2, -1, "h:1", None, 9.0), "--node-rank -1 is outside 0..1"),
        ((2, None, "h:1", None, 9.0), "--nnodes 2 needs this machine's --node-rank R in 0..1"),
        ((0, 0, "h:1", None, 9.0), "--nnodes must be an int >= 1; got 0"),
        ((2, 0, None, None, 9.0), "--nnodes 2 needs --coordinator HOST:PORT"),
        ((2, 0, "h:1", 80, 9.0), "--port is for a run on one machine"),
        ((2, 0, "h", None, 9.0), "--coordinator must be HOST:PORT with PORT in 1..65534"),
        ((2, 0, "h:65535", None, 9.0), "got 'h:65535'"),
        ((2, 0, "h:1", None, 0.0), "--join-timeout must be a finite number > 0; got 0.0"),
    ],
)
def test_bad_machine_settings_are_named(args, message):
    with pytest.raises(LaunchError) as info:
        placement(*args)
    assert message in str(info.value), info.value


def test_the_address_forms():
    assert parse_address("node0:29500") == ("node0", 29500)
    assert parse_address("[fe80::1]:29500") == ("fe80::1", 29500)


def test_the_program_digest_reads_the_script(tmp_path):
    script = tmp_path / "p.py"
    script.write_text("print(1)\n")
    first = program_digest([str(script), "--x"], None)
    assert first == program_digest([str(script), "--x"], None)
    assert first != program_digest([str(script), "--y"], None)
    script.write_text("print(2)\n")
    assert first != program_digest([str(script), "--x"], None)


def test_a_coordinator_that_is_not_this_machine_is_named():
    with pytest.raises(LaunchError) as info:
        serve("198.18.0.77", free_ports(1))
    assert "the coordinator '198.18.0.77' is not an address of machine 0" in str(info.value)


def test_reaching_a_hub_that_is_not_up_gives_up_after_the_join_timeout_or_a_signal():
    port = free_ports(1)  # nothing listens there
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        reach("127.0.0.1", port, 1, 0.5, lambda: False)
    assert f"machine 1 could not reach the coordinator 127.0.0.1:{port} within 0.5 s" in str(
        info.value
    )
    assert time.monotonic() - start < 5
    signals = [15]
    assert reach("127.0.0.1", port, 1, 60, lambda: bool(signals)) is None


def test_a_connection_to_itself_is_not_taken_for_the_hub(monkeypatch):
    # With nothing listening yet on a local port, the kernel may pick that very port as the
    # connection's source: the launcher is then connected to itself (and holds machine 0's
    # port). Made here on purpose (bound to the port it connects to), then the real hub.
    from meshkit._src.launch import link

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        hub_port = server.getsockname()[1]
        lonely = free_ports(1)
        made = []
        real = socket.create_connection

        def connect(address, timeout):
            if not made:
                sock = socket.socket()
                sock.bind(("127.0.0.1", lonely))
                sock.connect(("127.0.0.1", lonely))  # a TCP simultaneous open with itself
                assert sock.getsockname() == sock.getpeername()
                made.append(sock)
                return sock
            return real(("127.0.0.1", hub_port), timeout=timeout)

        monkeypatch.setattr(link.socket, "create_connection", connect)
        sock = reach("127.0.0.1", hub_port, 1, 10, lambda: False)
        assert sock is not None
        try:
            assert made[0].fileno() == -1  # the connection to itself was let go
            assert sock.getpeername()[1] == hub_port
        finally:
            sock.close()


def test_a_report_that_came_before_the_hub_closed_is_read():
    # The hub sends its report, then closes: a launcher that reads both before it asks for the
    # report must still get it (it once saw only the closed connection, and exited with 1).
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        sock = reach("127.0.0.1", server.getsockname()[1], 1, 10, lambda: False)
        assert sock is not None
        hub, _ = server.accept()
        link = Link(sock, _hello(1))
        try:
            hub.makefile().readline()  # the hello
            hub.sendall(b'{"kind": "over", "returncode": 0, "report": ""}\n')
            hub.close()
            deadline = time.monotonic() + 10
            while not link.lost and time.monotonic() < deadline:
                time.sleep(0.01)
            assert link.lost == "its connection closed"
            assert link.end([_result(2, 0)], []) == Over(0, "", [])
        finally:
            link.close()


def test_a_taken_port_plus_one_on_machine_0_is_named_before_anything_starts(tmp_path):
    # JAX's coordinator will serve PORT+1: held by anything else (here a plain bound socket, as
    # an outgoing connection's source port would be), machine 0 refuses at once, with status 2.
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('the program started')\n")
    port = free_ports(2)
    with socket.socket() as taken:
        taken.bind(("", port + 1))
        out = subprocess.run(
            [sys.executable, "-m", "meshkit", "launch", "--nnodes", "2", "--node-rank", "0",
             "--coordinator", f"127.0.0.1:{port}", "--join-timeout", "5", "-n", "1",
             str(script)],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert (
        f"meshkit launch: machine 0 cannot hold port {port + 1} (the coordinator's PORT+1, for "
        "JAX's coordinator): Address already in use.\nConsider another PORT in --coordinator, "
        f"below this machine's ephemeral ports (from {ephemeral_range()[0]}), which any outgoing "
        "connection may take." in out.stderr
    )
    assert "the program started" not in out.stderr
    assert not port_in_use(port)  # machine 0's meeting point was let go
