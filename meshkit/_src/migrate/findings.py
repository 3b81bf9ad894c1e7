"""What ``meshkit migrate`` finds: a `Finding` per legacy pattern, and the `Edit` that fixes it.

The scanner (`meshkit._src.migrate.scan`) makes them, the fixer (`meshkit._src.migrate.fix`)
applies the edits, and the reports (`meshkit._src.migrate.formats`) print the findings.
"""

from __future__ import annotations

from dataclasses import dataclass

from .rules import RULES, Rule


@dataclass(frozen=True)
class Edit:
    """One mechanical rewrite, for the fixer.

    Attributes:
        line: 1-based line of the reference.
        col: 0-based column of the reference, in characters.
        old: the reference as written (``"jax.pmap"``, ``"ju.replicate"``); empty when the edit
            only drops an import that nothing uses.
        new: what replaces it (``"meshkit.pmap_compat"``).
        binding: the imported name the reference went through and what the import binds it to
            (``("ju", "flax.jax_utils")``): that import is dropped once nothing uses it.
        form: what is replaced: ``"name"`` (the reference ``old``), ``"subscript"`` (``x[0]``
            becomes ``new(x)``) or ``"call"`` (``f(a, x)`` becomes ``new(x)``, ``x`` being
            argument ``keep``); a subscript or call is found by its start and end.
        end_line: for a subscript or call, the 1-based line of its end.
        end_col: for a subscript or call, the 0-based column (characters) of its end.
        keep: for a call, the argument that the new call takes.
    """

    line: int
    col: int
    old: str
    new: str
    binding: tuple[str, str] | None
    form: str = "name"
    end_line: int = 0
    end_col: int = 0
    keep: int = 0


@dataclass(frozen=True)
class Finding:
    """One legacy pattern found.

    Attributes:
        path: the file, as given or found.
        line: 1-based line.
        col: 1-based column, in characters.
        code: the rule's code (``MK001`` ...).
        message: what was found, as written in the file.
        fixable: whether ``--fix`` removes this finding.
        note: for a rule ``--fix`` handles, why this finding is left alone.
        edit: the rewrite ``--fix`` makes, if any (nested pmap is fixed by its MK001 edits).
    """

    path: str
    line: int
    col: int
    code: str
    message: str
    fixable: bool = False
    note: str = ""
    edit: Edit | None = None

    @property
    def rule(self) -> Rule:
        """The rule this finding breaks."""
        return RULES[self.code]
