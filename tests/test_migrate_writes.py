"""`meshkit migrate --fix` writes nothing half-way.

Every new text is computed before any file is written; each file is replaced whole (a
temporary file in its directory, then os.replace) with its permission bits; a file that cannot
be written is an error of its own (exit 2), left as it was, and the others are still written.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
from pathlib import Path

import libcst
import pytest

from meshkit._src.migrate import command as migrate_cli
from meshkit._src.migrate import files as _migrate_files
from meshkit._src.migrate.files import write_atomic
from meshkit.cli import main

LEGACY = "import jax\n\nstep = jax.pmap(f)\nx = jax.jit(f)\n"
FIXED = "import jax\nimport meshkit\n\nstep = meshkit.pmap_compat(f)\nx = jax.jit(f)\n"


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["migrate", *args])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def work(tmp_path, monkeypatch):
    for name in ("a.py", "b.py", "c.py"):
        (tmp_path / name).write_text(LEGACY)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_a_file_whose_write_fails_is_an_error_and_the_others_are_written(work, monkeypatch):
    written: list[str] = []

    def failing(path: Path, data: bytes) -> None:
        if path.name == "b.py":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_atomic(path, data)
        written.append(path.name)

    monkeypatch.setattr(migrate_cli, "write_atomic", failing)
    code, out, err = run_cli("--fix", "--concise", "a.py", "b.py", "c.py")
    assert code == 2
    assert err == "b.py: error: cannot write: No space left on device (the file is unchanged)\n"
    assert written == ["a.py", "c.py"]
    assert (work / "a.py").read_text() == (work / "c.py").read_text() == FIXED
    assert (work / "b.py").read_text() == LEGACY
    # The report counts b.py's finding as remaining: the file still holds it.
    assert out == (
        "b.py:3:8: MK001 jax.pmap call\n"
        "Fixed 2 of 3 findings in 2 files; 1 remains.\n"
        "1 path not scanned (errors on stderr).\n"
    )


def test_every_new_text_is_computed_before_any_file_is_written(work, monkeypatch):
    from meshkit._src.migrate import fix as _migrate_fix

    events: list[str] = []
    real_fix = _migrate_fix.fix_source

    def fix(source, edits, *rest):
        events.append("fix")
        return real_fix(source, edits, *rest)

    def write(path: Path, data: bytes) -> None:
        events.append("write")
        write_atomic(path, data)

    monkeypatch.setattr(_migrate_fix, "fix_source", fix)
    monkeypatch.setattr(migrate_cli, "write_atomic", write)
    code, _, err = run_cli("--fix", "a.py", "b.py", "c.py")
    assert (code, err) == (0, "")
    assert events == ["fix"] * 3 + ["write"] * 3


def test_a_file_in_a_read_only_directory_is_reported_unchanged(work):
    if os.geteuid() == 0:
        pytest.skip("runs as root, which may write into a read-only directory")
    locked = work / "locked"
    locked.mkdir()
    (locked / "d.py").write_text(LEGACY)
    locked.chmod(0o555)
    try:
        code, _, err = run_cli("--fix", "--concise", "a.py", "locked/d.py", "c.py")
    finally:
        locked.chmod(0o755)
    assert code == 2
    assert err == "locked/d.py: error: cannot write: Permission denied (the file is unchanged)\n"
    assert (locked / "d.py").read_text() == LEGACY
    assert (work / "a.py").read_text() == (work / "c.py").read_text() == FIXED
    assert leftovers(locked) == []


def test_a_file_libcst_cannot_parse_is_left_and_the_others_are_fixed(work, monkeypatch):
    # ast and libcst accept the same files on these Pythons, so libcst's refusal is simulated.
    real_parse = libcst.parse_module

    def parse(source, *args, **kwargs):
        if "refused" in source:
            raise libcst.ParserSyntaxError(
                "tokenizer error", lines=source.splitlines(), raw_line=3, raw_column=0
            )
        return real_parse(source, *args, **kwargs)

    monkeypatch.setattr(libcst, "parse_module", parse)
    (work / "b.py").write_text(LEGACY + "# refused\n")
    code, out, err = run_cli("--fix", "--concise", "a.py", "b.py", "c.py")
    assert code == 2
    assert err == "b.py: error: cannot rewrite: libcst: tokenizer error (line 3)\n"
    assert (work / "b.py").read_text() == LEGACY + "# refused\n"
    assert (work / "a.py").read_text() == (work / "c.py").read_text() == FIXED
    assert out.startswith("b.py:3:8: MK001 jax.pmap call\n")


def test_write_atomic_keeps_the_mode_and_a_symlink(tmp_path):
    target = tmp_path / "real.py"
    target.write_text("old\n")
    target.chmod(0o750)
    link = tmp_path / "link.py"
    link.symlink_to("real.py")
    write_atomic(link, b"new\n")
    assert link.is_symlink()
    assert target.read_text() == "new\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o750
    assert leftovers(tmp_path) == []


def test_write_atomic_leaves_the_file_and_no_temporary_when_the_rename_fails(tmp_path, monkeypatch):
    target = tmp_path / "a.py"
    target.write_text("old\n")

    def replace(src, dst):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(_migrate_files.os, "replace", replace)
    with pytest.raises(OSError, match="Input/output error"):
        write_atomic(target, b"new\n")
    assert target.read_text() == "old\n"
    assert leftovers(tmp_path) == []


def test_fix_keeps_the_permission_bits(work):
    (work / "a.py").chmod(0o741)
    code, _, _ = run_cli("--fix", "a.py")
    assert code == 0
    assert stat.S_IMODE((work / "a.py").stat().st_mode) == 0o741
    assert (work / "a.py").read_text() == FIXED
