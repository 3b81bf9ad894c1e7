"""Restore targets arranged in a template's structure (``restore(..., like=state)``)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _step(key: Any) -> str | int:
    """One step of a key path, as the checkpoint's dicts and lists name it."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            value = getattr(key, attr)
            return value if isinstance(value, int) else str(value)
    return str(key)


def _show(path: tuple[str | int, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f"[{p!r}]" for p in path) or "the top"


def _key(node: Any, step: str | int) -> str | int | None:
    """The key of ``node``'s child at ``step`` (a tuple's item may be ``"0"``); None: no child."""
    if isinstance(node, dict):
        return next((key for key in (step, str(step)) if key in node), None)
    if isinstance(node, list | tuple) and isinstance(step, int) and 0 <= step < len(node):
        return step
    return None


def _has(node: Any) -> str:
    if isinstance(node, dict):
        return f"the keys {sorted(map(str, node))}"
    if isinstance(node, list | tuple):
        return f"a sequence of {len(node)}"
    return f"a leaf ({type(node).__name__})"


def into(targets: Any, like: Any, what: str) -> tuple[Any, str | None]:
    """``targets`` (orbax's dicts and lists) in ``like``'s structure; or None and the difference."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    out = []
    wanted: set[tuple[str | int, ...]] = set()
    for keys, leaf in flat:
        path = tuple(_step(k) for k in keys)
        node: Any = targets
        reached: list[str | int] = []  # the path in the checkpoint's own keys
        for depth, step in enumerate(path):
            key = _key(node, step)
            if key is None:
                return None, (
                    f"{what}: like= has {_show(path)}, which the checkpoint lacks: at "
                    f"{_show(path[:depth])} the checkpoint has {_has(node)}.\n"
                    "Consider as like= the state as the run that saved it built it (same "
                    "model, same optimizer)."
                )
            reached.append(key)
            node = node[key]
        saved_shape = tuple(np.shape(node))
        if hasattr(leaf, "shape") and tuple(leaf.shape) != saved_shape:
            return None, (
                f"{what}: like= has {_show(path)} of shape {tuple(leaf.shape)}; the checkpoint's "
                f"is of shape {saved_shape}.\nConsider as like= the state of the model that was "
                "saved (the same sizes)."
            )
        wanted.add(tuple(reached))
        out.append(node)
    for keys, _ in jax.tree_util.tree_flatten_with_path(targets)[0]:
        path = tuple(_step(k) for k in keys)
        if path not in wanted:
            return None, (
                f"{what}: the checkpoint has {_show(path)}, which like= lacks; a restore into "
                "like= would drop it.\nConsider as like= the whole state that was saved, or "
                "restore without like= and pick what you need."
            )
    return jax.tree_util.tree_unflatten(treedef, out), None
