"""Draw ``timeline.svg``: the picture `meshkit launch --log-dir` draws of a real run.

Runs ``examples/straggler.py`` (2 processes, process 1's loader 80 ms slower per batch) under
``meshkit launch --log-dir`` and keeps the run's ``timeline.svg``. Run
``python docs/images/timeline.py`` to redraw it (about 10 s).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).with_name("timeline.svg")

if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="meshkit-timeline-") as logs:
        subprocess.run(
            [sys.executable, "-m", "meshkit", "launch", "-n", "2", "-d", "2", "--log-dir", logs,
             str(ROOT / "examples" / "straggler.py")],
            check=True, timeout=300,
        )  # fmt: skip
        shutil.copy(Path(logs) / "timeline.svg", OUT)
    print(f"wrote {OUT}")
