"""Stall detection across processes, under `meshkit.init()`'s defaults with a short deadline.

Each case runs 2 processes x 4 CPU devices of a program in `ranks/stalls.py`, with
``MESHKIT_STALL_TIMEOUT`` at `DEADLINE_S`: a run that stalls must end with every process naming
the same culprit (or nobody, when nobody holds it), and a healthy run whose first compilation or
one process's lone evaluation outlasts the deadline must never end. The rank stuck in its own
Python code while the other waits for a collective is `test_guarantees.py`'s stuck case. One
more run times steps in windows of 1 s: a loader 100 ms slower in process 1 is named by process 0
while the run goes on (healthy loops name nobody: test_soak.py). A process whose checkpoint
writes outlast the deadline is saving, not stalled. All runs start at once when the
module starts: their time is mostly waiting.
"""

from __future__ import annotations

import concurrent.futures
import re
import time
from pathlib import Path

import pytest
from conftest import require
from ranks import stalls as ranks
from ranks.stalls import DEADLINE_S, SAVES, SLOW_MS, SLOW_SAVE_S, SLOW_STEPS, SOLO_S

from meshkit.testing import launch_in_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.waits]

ENV = {"MESHKIT_STALL_TIMEOUT": f"{DEADLINE_S:g}", "MESHKIT_CHECK_TIMEOUT": "60"}
PROGRAM = Path(ranks.__file__)
DEFAULT = {"MESHKIT_STALL_TIMEOUT": "300"}  # the step-time runs wait at their end
# Each run: its program, and its environment beyond ENV.
CASES = {
    "all_stuck": (ranks.all_stuck, {}),
    "dead_peer": (ranks.dead_peer, {}),
    "loader_stuck": (ranks.loader_stuck, {}),
    "healthy": (ranks.healthy, {}),
    "slow save": (ranks.slow_save, {}),
    "slow loader": (ranks.slow_loader, {"MESHKIT_STEP_WINDOW": "1", **DEFAULT}),
}
VERDICT = "meshkit: no process has made progress for"


def _line(mark: str) -> int:
    lines = PROGRAM.read_text().splitlines()
    (found,) = [i for i, text in enumerate(lines, 1) if text.endswith(f"# user line: {mark}")]
    return found


def _launch(name: str, saves: Path):
    program, env = CASES[name]
    began = time.monotonic()
    env = {**ENV, **env, "STALL_SAVE_DIR": str(saves)}
    result = launch_in_processes(program, timeout=150, env=env)
    return result, time.monotonic() - began


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    saves = tmp_path_factory.mktemp("saves")
    with concurrent.futures.ThreadPoolExecutor(len(CASES)) as pool:
        yield {name: pool.submit(_launch, name, saves) for name in CASES}


def _run(runs, name):
    result, took = runs[name].result()
    text = result.report + "".join(f"--- rank {r.rank}\n{r.stdout}{r.stderr}" for r in result.ranks)
    assert not result.timed_out, text
    return result, took, text


def _ended_for_the_stall(result, text: str) -> None:
    """The first rank to decide ended itself with status 1, saying so; the launcher stopped
    the other if it had not ended yet (under srun or mpirun each ends itself)."""
    first = result.ranks[result.first_failure]
    assert first.returncode == 1, text
    ends = f"Process {first.rank} ends with status 1 (MESHKIT_STALL_TIMEOUT=3; 0 turns"
    assert ends in first.stderr, text
    for rank in result.ranks:
        assert rank.returncode == 1 or rank.stopped_by_launcher, text


def _steps(stdout: str) -> list[int]:
    return [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("STEP ")]


def test_every_process_stuck_in_its_own_code_is_said_and_the_run_ends(runs):
    result, took, text = _run(runs, "all_stuck")
    _ended_for_the_stall(result, text)
    for rank in result.ranks:
        assert _steps(rank.stdout) == [1, 2, 3], text
        said = rank.stderr
        assert "Every process is stuck in its own code; none waits for another" in said, text
        where = f"{PROGRAM.name}:{_line('all stuck')} in all_stuck, in wait (threading.py:"
        assert re.search(rf"  processes 0, 1 are in Python at \S*{re.escape(where)}", said), text
        # The steps counted (the launcher may stop a rank before it ends its line).
        assert "), its 3rd call of meshkit.spmd(total)" in said, text
        assert said.count(VERDICT) == 1, text  # the report; the end refers to it
    assert "The run stalled, and no rank held it" in result.report, text
    assert took < 60, text


def test_a_peer_killed_in_a_collective_is_fail_fasts_case_not_a_stall(runs):
    result, _, text = _run(runs, "dead_peer")
    assert result.ranks[1].returncode == -9, text
    assert _steps(result.ranks[0].stdout) == [1, 2, 3], text
    assert VERDICT not in text, text  # process 1 never posted: no verdict names anyone
    assert "rank 1 failed first (killed by SIGKILL)" in result.report, text


def test_a_loader_stuck_inside_global_batches_holds_the_run(runs):
    result, took, text = _run(runs, "loader_stuck")
    _ended_for_the_stall(result, text)
    loader = f"{PROGRAM.name}:{_line('loader')} in loader"
    for rank in result.ranks:
        said = rank.stderr
        assert "Process 1 holds the run: the others wait for a collective or an agreement" in (
            said
        ), text
        assert re.search(rf"  process 1 is in Python at \S*{re.escape(loader)}, in wait ", said), (
            text
        )
        assert "in meshkit-global-batches" in said, text  # the loader's thread
        assert "  process 0 wait" in said, text
        assert "Process 1's main thread (most recent call last):" in said, text
    assert "The evidence points to rank 1: the run stalled" in result.report, text
    assert "Where each rank was when the run stalled:" in result.report, text
    assert took < 90, text


def test_a_long_first_compile_and_a_lone_evaluation_do_not_end_a_healthy_run(runs):
    result, _, text = _run(runs, "healthy")
    assert result.returncode == 0, text
    assert VERDICT not in text, text
    (compiling0, solo), (compiling1, _) = result.values
    assert min(compiling0, compiling1) > DEADLINE_S, result.values  # longer than the deadline
    assert solo >= SOLO_S, result.values
    for rank in result.ranks:
        assert _steps(rank.stdout) == [1, 2], text


def test_a_process_slow_only_in_its_checkpoint_writes_does_not_end_the_run(runs):
    require("orbax.checkpoint", "orbax")  # the slow save's checkpointer
    result, _, text = _run(runs, "slow save")
    assert result.returncode == 0, text
    assert VERDICT not in text, text
    _, slow = result.values
    assert len(slow) == SAVES, result.values
    assert min(slow) >= SLOW_SAVE_S > DEADLINE_S, result.values  # each save outlasts it
    for rank in result.ranks:
        assert _steps(rank.stdout) == list(range(1, SAVES + 1)), text


def test_a_slower_loader_is_named_while_the_run_goes_on_and_ranked(runs):
    result, _, text = _run(runs, "slow loader")
    assert result.returncode == 0, text
    said = result.ranks[0].stderr
    assert "meshkit: slower than the other processes, two windows in a row: process 1: " in said
    assert re.search(
        r"process 1: \d+\.\dx the median step's own work, \+\d+ ms in its data loader", said
    )
    assert "slower than the other" not in result.ranks[1].stderr, text  # process 0 says it
    # The run's rows, slowest own work first, in the launcher's result and its report.
    first, second = result.steps
    assert (first.process, first.steps, second.process, second.steps) == (
        1,
        SLOW_STEPS,
        0,
        SLOW_STEPS,
    )
    assert first.loader_ms - second.loader_ms > 0.7 * SLOW_MS, result.steps
    assert "Slower than the others, as process 0 said during the run: rank 1: " in result.report
    assert f"  rank 1: {SLOW_STEPS} steps, " in result.report, result.report
    # The program's own view: every process's latest window, process 1 first, on both.
    for table in result.values:
        assert [process for process, *_ in table] == [1, 0], result.values
