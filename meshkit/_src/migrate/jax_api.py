"""The checks of ``meshkit migrate`` for JAX's 2025-26 API moves (MK013 to MK017).

* MK013 ``jax.experimental.shard_map.shard_map`` -> ``jax.shard_map``, whose mesh, specs and
  ``check_vma`` are keywords: a call's positional ``mesh, in_specs, out_specs, check_rep`` are
  named, ``check_rep=`` renamed;
* MK014 ``check_rep=`` -> ``check_vma=`` on ``jax.shard_map`` (and in MK013's rewrite); a
  ``check_rep`` the codemod cannot rename (a key of a dict passed with ``**``) is reported;
* MK015 ``jax.sharding.use_mesh(mesh)`` and ``with mesh:`` -> ``jax.set_mesh(mesh)``;
* MK016 ``jax.cloud_tpu_init()``, removed: a call standing alone as a statement is deleted;
* MK017 ``nnx.pmap`` and ``eqx.filter_pmap``: reported.

The facts were checked on JAX 0.12 (``jax.experimental.shard_map``'s shim, ``jax.shard_map``'s
signature, ``Mesh.__enter__``'s deprecation, ``use_mesh`` and ``cloud_tpu_init`` absent) and
Flax 0.12 (``nnx.pmap``).
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from typing import Any

from .bindings import dotted_name
from .findings import Edit
from .resolve import PARTIAL, ResolvedFile

OLD_SHARD_MAP = "jax.experimental.shard_map.shard_map"
NEW_SHARD_MAP = "jax.shard_map"
USE_MESH = "jax.sharding.use_mesh"
CLOUD_TPU_INIT = "jax.cloud_tpu_init"
PMAP_WRAPPERS = {
    "flax.nnx.pmap": "nnx.shard_map (or nnx.jit with shardings)",
    "equinox.filter_pmap": "eqx.filter_jit with shardings, or jax.shard_map",
}
MESH_MAKERS = frozenset({"jax.sharding.Mesh", "jax.make_mesh", "meshkit.make_mesh"})
# The legacy shard_map's positional parameters after f, as jax.shard_map's keywords.
_POSITIONAL = ("mesh", "in_specs", "out_specs", "check_vma")
_CHECK_REP_KWARGS = (
    "check_rep is passed through **{name}: the codemod cannot rename a key it does not see "
    "written at the call; rename it to check_vma where {name} is built"
)

_TPU_NOTE = (
    "not fixed: not a call standing alone as a statement with others in its block; remove it "
    "by hand (JAX initializes TPUs itself)"
)
_SHARD_MAP_NOTES = {
    "reference": "not fixed: a reference outside a call; pass mesh, specs and check_vma by "
    "keyword to jax.shard_map",
    "star": "not fixed: arguments passed with * or **; name them for jax.shard_map, then edit",
    "many": "not fixed: positional arguments jax.shard_map does not take; name them, then edit",
    "auto": "not fixed: auto= has no one-to-one replacement (jax.shard_map's axis_names= names "
    "the manual axes, the complement)",
}

Add = Callable[..., None]


class JaxApiChecks:
    """MK013 to MK017 on one resolved file.

    Args:
        file: the file, its names resolved.
        add: how a finding is recorded (`meshkit._src.migrate.checks.Checks._add`).
        col: a node's column in characters.
    """

    def __init__(self, file: ResolvedFile, add: Add, col: Callable[[Any], int]) -> None:
        self.file = file
        self.add = add
        self.col = col
        self._dicts: dict[str, ast.expr] | None = None
        self._meshes: set[str] | None = None
        self._jax = next((n for n, t in file.bindings.items() if t == "jax"), "jax")

    def scan(self) -> None:
        """Every finding of these rules in the file."""
        for node in self.file.nodes:
            if isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Load):
                qual = self.file.qual(node)
                if qual == OLD_SHARD_MAP:
                    self._old_shard_map(node)
                elif qual == NEW_SHARD_MAP:
                    self._check_rep(node, self._call_of(node))
                elif qual == USE_MESH:
                    self.add(
                        node,
                        "MK015",
                        f"{USE_MESH}{self._written(node, qual)}",
                        **self._rename(node, "set_mesh"),
                    )
                elif qual == CLOUD_TPU_INIT:
                    self._cloud_tpu_init(node)
                elif qual in PMAP_WRAPPERS:
                    self.add(
                        node,
                        "MK017",
                        f"{qual}{self._written(node, qual)}: use {PMAP_WRAPPERS[qual]}",
                    )
            elif isinstance(node, ast.With | ast.AsyncWith):
                for item in node.items:
                    self._with_mesh(item)

    # ---- helpers ------------------------------------------------------------------------------

    def _written(self, node: ast.AST, qual: str) -> str:
        text = dotted_name(node)
        return "" if text == qual else f" (written `{text}`)"

    def _binding(self, node: ast.AST) -> tuple[str, str] | None:
        root = node
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in self.file.bindings:
            return (root.id, self.file.bindings[root.id])
        return None

    def _rename(self, node: ast.Name | ast.Attribute, attr: str) -> dict[str, object]:
        """The edit that makes a reference ``jax.<attr>`` (the file's own name for jax)."""
        edit = Edit(
            node.lineno,
            self.col(node),
            dotted_name(node) or "",
            f"{self._jax}.{attr}",
            self._binding(node),
        )
        return {"fixable": True, "edit": edit}

    def _span(
        self,
        node: ast.AST,
        form: str,
        new: str,
        old: str = "",
        keep: int = 0,
        binding: tuple[str, str] | None = None,
    ) -> Edit:
        """An edit of a whole call, with-item or statement, found by its start and end."""
        end_line = node.end_lineno or node.lineno  # type: ignore[attr-defined]
        raw = self.file.lines[end_line - 1].encode("utf-8")[: node.end_col_offset or 0]  # type: ignore[attr-defined]
        end_col = len(raw.decode("utf-8", "replace"))
        line = node.lineno  # type: ignore[attr-defined]
        return Edit(line, self.col(node), old, new, binding, form, end_line, end_col, keep)

    def _call_of(self, ref: ast.expr) -> tuple[ast.Call, int] | None:
        """The call that passes a shard_map its arguments, and where they start after ``f``."""
        parent = self.file.parents.get(ref)
        if isinstance(parent, ast.Call) and parent.func is ref:
            return parent, 1
        if (
            isinstance(parent, ast.Call)
            and parent.args
            and parent.args[0] is ref
            and self.file.qual(parent.func) == PARTIAL
        ):
            return parent, 1  # partial(shard_map, mesh, ...): f comes later, mesh is 1 too
        return None

    def _splatted(self, call: ast.Call) -> list[str]:
        """The names of dicts passed with ``**`` whose written keys include check_rep (or "")."""
        out = []
        for kw in call.keywords:
            if kw.arg is not None:
                continue
            value = kw.value
            name = dotted_name(value)
            if name is not None:
                value = self._dict_values().get(name, value)
            if _has_check_rep(value):
                out.append(name or ast.unparse(kw.value))
        return out

    def _dict_values(self) -> dict[str, ast.expr]:
        if self._dicts is None:
            self._dicts = {}
            for node in self.file.nodes:
                if isinstance(node, ast.Assign) and len(node.targets) == 1:
                    name = dotted_name(node.targets[0])
                    if name is not None:
                        self._dicts[name] = node.value
        return self._dicts

    # ---- MK013, MK014 -------------------------------------------------------------------------

    def _old_shard_map(self, ref: ast.Name | ast.Attribute) -> None:
        message = f"{OLD_SHARD_MAP}{self._written(ref, OLD_SHARD_MAP)}"
        found = self._call_of(ref)
        note = ""
        if found is None:
            note = _SHARD_MAP_NOTES["reference"]
        else:
            call, first = found
            named = call.args[first:]
            if any(isinstance(a, ast.Starred) for a in named) or any(
                kw.arg is None for kw in call.keywords
            ):
                note = _SHARD_MAP_NOTES["star"]
            elif len(named) > len(_POSITIONAL):
                note = _SHARD_MAP_NOTES["many"]
            elif any(kw.arg == "auto" for kw in call.keywords):
                note = _SHARD_MAP_NOTES["auto"]
        if note:
            self.add(ref, "MK013", message, note=note)
            if found is not None:
                self._check_rep(ref, found, fixed_by_call=False)
            return
        assert found is not None
        call, first = found
        self.add(ref, "MK013", message, fixable=True, edit=self._rename(ref, "shard_map")["edit"])
        names = _POSITIONAL[: len(call.args) - first]
        if names:
            edit = self._span(call, "keywords", ",".join(names), "check_rep=check_vma", first)
            what = f"positional {', '.join(names)}: keywords of jax.shard_map"
            self.add(call.args[first], "MK013", what, fixable=True, edit=edit)
        self._check_rep(ref, found, fixed_by_call=True if names else None)

    def _check_rep(
        self,
        ref: ast.expr,
        found: tuple[ast.Call, int] | None,
        fixed_by_call: bool | None = False,
    ) -> None:
        """MK014 at a check_rep= keyword (or a **dict with that key) of a shard_map call.

        ``fixed_by_call``: True where MK013's edit of the call renames it, None where the call
        is rewritten without one (it gets its own), False where the call is not rewritten.
        """
        if found is None:
            return
        call, first = found
        for kw in call.keywords:
            if kw.arg != "check_rep":
                continue
            text = f"check_rep={ast.unparse(kw.value)}"
            if fixed_by_call:
                self.add(kw, "MK014", f"{text}, renamed check_vma", fixable=True)
            elif not any(k.arg is None for k in call.keywords) and (
                self.file.qual(ref) == NEW_SHARD_MAP or fixed_by_call is None
            ):
                edit = self._span(call, "keywords", "", "check_rep=check_vma", keep=first)
                self.add(kw, "MK014", f"{text}, renamed check_vma", fixable=True, edit=edit)
            else:
                self.add(
                    kw,
                    "MK014",
                    text,
                    note="not fixed: this shard_map call is not rewritten (see MK013)",
                )
        for name in self._splatted(call):
            self.add(
                call,
                "MK014",
                "check_rep in keywords passed with **",
                note="not fixed: " + _CHECK_REP_KWARGS.format(name=name),
            )

    # ---- MK015, MK016 -------------------------------------------------------------------------

    def _with_mesh(self, item: ast.withitem) -> None:
        expr = item.context_expr
        if not self._is_mesh(expr):
            return
        text = ast.unparse(expr)
        message = f"`with {text}:` (a Mesh as a context manager)"
        if item.optional_vars is not None:
            bound = ast.unparse(item.optional_vars)
            note = (
                f"not fixed: `as {bound}` binds the mesh; bind it before the with, then write "
                f"`with jax.set_mesh({text}):`"
            )
            self.add(expr, "MK015", message, note=note)
            return
        self.add(
            expr,
            "MK015",
            message,
            fixable=True,
            edit=self._span(expr, "with", f"{self._jax}.set_mesh"),
        )

    def _is_mesh(self, expr: ast.expr) -> bool:
        if isinstance(expr, ast.Call):
            return self.file.qual(expr.func) in MESH_MAKERS
        name = dotted_name(expr)
        return name is not None and name in self._mesh_names()

    def _mesh_names(self) -> set[str]:
        """Names the file binds to a new Mesh, or annotates as one (a parameter ``mesh: Mesh``)."""
        if self._meshes is None:
            self._meshes = set()
            for node in self.file.nodes:
                if (
                    isinstance(node, ast.Assign)
                    and isinstance(node.value, ast.Call)
                    and self.file.qual(node.value.func) in MESH_MAKERS
                ):
                    self._meshes.update(
                        n for t in node.targets if (n := dotted_name(t)) is not None
                    )
                elif (
                    isinstance(node, ast.arg | ast.AnnAssign)
                    and node.annotation is not None
                    and self.file.qual(node.annotation) == "jax.sharding.Mesh"
                ):
                    name = node.arg if isinstance(node, ast.arg) else dotted_name(node.target)
                    if name is not None:
                        self._meshes.add(name)
        return self._meshes

    def _cloud_tpu_init(self, ref: ast.Name | ast.Attribute) -> None:
        message = f"{CLOUD_TPU_INIT}{self._written(ref, CLOUD_TPU_INIT)}, removed from JAX"
        call = self.file.parents.get(ref)
        stmt = self.file.parents.get(call) if call is not None else None
        block = self.file.parents.get(stmt) if stmt is not None else None
        alone = (
            isinstance(call, ast.Call)
            and call.func is ref
            and not call.args
            and not call.keywords
            and isinstance(stmt, ast.Expr)
            and block is not None
            and any(
                stmt in getattr(block, f, ()) and len(getattr(block, f)) > 1
                for f in ("body", "orelse", "finalbody")
            )
            and _own_line(self.file.lines, stmt)
        )
        if not alone:
            note = _TPU_NOTE
            self.add(ref, "MK016", message, note=note)
            return
        assert stmt is not None
        edit = self._span(stmt, "delete", "", binding=self._binding(ref))
        self.add(ref, "MK016", message, fixable=True, edit=edit)


def _has_check_rep(value: ast.expr) -> bool:
    if isinstance(value, ast.Dict):
        return any(isinstance(k, ast.Constant) and k.value == "check_rep" for k in value.keys)
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict":
        return any(kw.arg == "check_rep" for kw in value.keywords)
    return False


def _own_line(lines: list[str], stmt: ast.stmt) -> bool:
    """Whether a statement is the only one on its lines (no ``a(); b()``)."""
    first = lines[stmt.lineno - 1]
    last = lines[(stmt.end_lineno or stmt.lineno) - 1]
    before = first.encode("utf-8")[: stmt.col_offset].strip()
    after = last.encode("utf-8")[stmt.end_col_offset or 0 :].strip()
    return not before and (not after or after.startswith(b"#"))
