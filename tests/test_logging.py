"""meshkit's messages go through `logging` under "meshkit", with today's stderr text by default.

The tests of the default handler run in a fresh interpreter: pytest puts its own handlers on the
root logger, which is the case of a program that configured logging.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest

from meshkit._src.arrays import batches as _batches
from meshkit._src.coord import agree as _agree
from meshkit._src.core import log as _log
from meshkit._src.debug import mode as _mode
from meshkit._src.lifecycle import exit as _exit
from meshkit._src.lifecycle import failfast as _failfast
from meshkit._src.lifecycle import preemption as _preemption
from meshkit._src.lifecycle import stall as _stall


def _python(code: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out


def test_nothing_is_installed_at_import():
    out = _python(
        """
        import logging
        import meshkit, meshkit.debug, meshkit.checkpoint, meshkit.collectives, meshkit.loaders
        meshkit.global_batches, meshkit.spmd  # the lazy face's modules, loaded
        print(logging.getLogger("meshkit").handlers, logging.getLogger("meshkit").level)
        """
    )
    assert out.stdout.split() == ["[]", "0"]


def test_without_logging_configured_the_stderr_text_is_as_before():
    out = _python(
        """
        import logging
        from meshkit._src.core.log import logger, say
        from meshkit._src.lifecycle import exit as _exit

        say(logger("coord"), logging.ERROR, "meshkit: one\\ntwo lines\\n")
        say(logger("arrays"), logging.INFO, "meshkit.global_batches: done, step 3\\n")

        def broken():
            raise RuntimeError("disk gone")

        _exit.on_exit("write the log", broken, order=_exit.STOP)
        _exit.run_exit_handlers()
        """
    )
    assert out.stderr == (
        "meshkit: one\ntwo lines\n"
        "meshkit.global_batches: done, step 3\n"
        "meshkit: the exit handler 'write the log' failed: RuntimeError: disk gone\n"
    )


def test_a_programs_own_logging_takes_the_messages_once():
    out = _python(
        """
        import logging, sys
        from meshkit._src.core.log import logger, say

        say(logger("coord"), logging.ERROR, "meshkit: before the program's configuration\\n")
        logging.basicConfig(stream=sys.stdout, format="%(name)s|%(levelname)s|%(message)s")
        say(logger("coord"), logging.ERROR, "meshkit: after it\\n")
        """
    )
    assert out.stderr == "meshkit: before the program's configuration\n"
    assert out.stdout == "meshkit.coord|ERROR|meshkit: after it\n"


def test_under_a_root_logger_configured_first_the_asked_for_info_still_shows():
    out = _python(
        """
        import logging, sys
        from meshkit._src.core.log import logger, say

        logging.basicConfig(stream=sys.stdout)  # as absl does the first time it logs
        say(logger("arrays"), logging.INFO, "meshkit.global_batches: done, step 3\\n")
        print(logging.getLogger("meshkit").handlers)
        """
    )
    assert out.stderr == ""
    assert out.stdout == "INFO:meshkit.arrays:meshkit.global_batches: done, step 3\n[]\n"


def test_set_level_silences_them():
    out = _python(
        """
        import logging
        from meshkit._src.core.log import logger, say

        logging.getLogger("meshkit").setLevel(logging.ERROR)
        say(logger("guards"), logging.WARNING, "meshkit: silenced\\n")
        say(logger("debug"), logging.INFO, "meshkit debug: silenced\\n")
        say(logger("guards"), logging.ERROR, "meshkit: still said\\n")
        """
    )
    assert out.stderr == "meshkit: still said\n"


def test_a_handler_on_the_meshkit_logger_receives_them(caplog):
    caplog.set_level(logging.INFO, logger="meshkit")
    _log.say(_log.logger("arrays"), logging.INFO, "meshkit.global_batches: running\n")
    [record] = [r for r in caplog.records if r.name.startswith("meshkit")]
    assert (record.name, record.levelno) == ("meshkit.arrays", logging.INFO)
    assert record.getMessage() == "meshkit.global_batches: running"  # the handler ends the line
    assert record.filename == "test_logging.py"  # where it was said, not the helper


@pytest.mark.parametrize(
    ("module", "name"),
    [
        (_agree, "meshkit.coord"),
        (_mode, "meshkit.debug"),
        (_batches, "meshkit.arrays"),
        (_exit, "meshkit.guards"),
        (_failfast, "meshkit.guards"),
        (_preemption, "meshkit.guards"),
        (_stall, "meshkit.guards"),
    ],
)
def test_each_concept_logs_under_its_own_child(module, name):
    assert module._LOG.name == name
    assert module._LOG.parent is logging.getLogger("meshkit")


def test_a_failing_handler_does_not_raise(caplog):
    class Broken(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            raise OSError("closed")

        def handleError(self, record: logging.LogRecord) -> None:
            raise OSError("closed")  # logging.raiseExceptions would print; worse: it raises

    broken = Broken()
    logging.getLogger("meshkit").addHandler(broken)
    try:
        _log.say(_log.logger("guards"), logging.ERROR, "meshkit: said while exiting\n")
    finally:
        logging.getLogger("meshkit").removeHandler(broken)


def test_a_message_said_just_before_the_exit_leaves_a_buffering_handler():
    code = """
        import logging, logging.handlers, sys
        from meshkit._src.lifecycle import exit as _exit

        target = logging.StreamHandler(sys.stdout)
        held = logging.handlers.MemoryHandler(100, logging.CRITICAL, target)  # flushed when full
        logging.getLogger("meshkit").addHandler(held)
        _exit.now(3, "meshkit: exiting with status 3\\n")
        """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (out.returncode, out.stdout, out.stderr) == (3, "meshkit: exiting with status 3\n", "")
