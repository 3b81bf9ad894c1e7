"""The picture of a run (`meshkit._src.launch.timeline`): drawn from the ranks' events, every
attempt kept. A real run with a restart draws it in test_restarts.py."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from meshkit._src.core import events
from meshkit._src.core.events import Event
from meshkit._src.launch import timeline

NS = "{http://www.w3.org/2000/svg}"


def _run() -> list[tuple[int, Event]]:
    """Two attempts of two ranks: the first ends in rank 1's failure, the second finishes."""
    e = Event
    return [
        (0, e(0, events.JOINED, 100.0)),
        (0, e(1, events.JOINED, 100.2)),
        (0, e(0, events.STEPS, 110.0, {"steps": 10})),
        (0, e(1, events.STEPS, 110.1, {"steps": 10})),
        (0, e(0, events.SAVED, 111.0, {"step": 10})),
        (0, e(1, events.FAILED, 112.0, {"cause": "exception", "error": "KeyError", "where": "<x>"})),
        (1, e(0, events.JOINED, 120.0)),
        (1, e(1, events.JOINED, 120.1)),
        (1, e(0, events.RESTORED, 121.0, {"step": 10, "seconds": 0.4})),
        (1, e(0, events.STEPS, 130.0, {"steps": 30})),
        (1, e(1, events.STEPS, 130.0, {"steps": 30})),
        (1, e(0, events.STRAGGLER, 130.5, {"processes": [1], "said": ["process 1: 1.8x"]})),
    ]  # fmt: skip


def _groups(root, kind):
    return [g for g in root.iter(f"{NS}g") if g.get("class") == kind]


def test_a_run_of_two_attempts_draws_a_lane_per_rank_and_a_band_per_attempt():
    root = ET.fromstring(timeline.draw(_run(), [0, 1]))
    assert root.tag == f"{NS}svg"
    title = next(root.iter(f"{NS}text")).text
    assert title == "meshkit launch: 2 ranks, 2 attempt(s), 30.5 s"
    lanes = [t.text for t in root.iter(f"{NS}text") if t.get("class") == "lane"]
    assert lanes == ["rank 0", "rank 1 (slow)"]  # process 0 named rank 1 a straggler
    bands = [r for r in root.iter(f"{NS}rect") if r.get("class") == "attempt"]
    assert [b.find(f"{NS}title").text for b in bands] == ["attempt 0", "attempt 1"]
    assert float(bands[1].get("x")) > float(bands[0].get("x")) + float(bands[0].get("width"))
    assert len(_groups(root, "joined")) == 4
    assert len(_groups(root, "saved")) == len(_groups(root, "restored")) == 1
    (failed,) = _groups(root, "failed")
    tip = failed.find(f"{NS}title").text
    assert tip.startswith("rank 1: failed ")
    assert '"where": "<x>"' in tip
    # A steps line per rank and attempt, its last point the highest (30 of 30 steps).
    lines = [p for p in root.iter(f"{NS}polyline") if p.get("class") == "steps"]
    assert len(lines) == 4
    assert lines[-1].find(f"{NS}title").text == "rank 1: 30 steps"
    assert len(_groups(root, "legend")) == len(timeline._MARKS)


def test_the_record_keeps_every_attempt_and_redraws(tmp_path):
    run = _run()
    for attempt in (0, 1):
        timeline.record(tmp_path, attempt, [e for a, e in run if a == attempt], [0, 1])
    assert timeline.read(tmp_path / timeline.EVENTS) == run
    root = ET.parse(tmp_path / timeline.PICTURE).getroot()
    assert len([r for r in root.iter(f"{NS}rect") if r.get("class") == "attempt"]) == 2
    timeline.record(tmp_path, 0, [e for _, e in run[:2]], [0, 1])  # a new run starts over
    assert timeline.read(tmp_path / timeline.EVENTS) == run[:2]
