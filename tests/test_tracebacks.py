"""Tracebacks of meshkit's errors show the user's frames; the classes print as ``meshkit.*``."""

from __future__ import annotations

import os
import pickle
import traceback

import numpy as np
import pytest

import meshkit
from meshkit._src.core.frames import filtered

SRC = os.path.join(os.path.dirname(meshkit.__file__), "_src") + os.sep


def _frames(error: BaseException) -> list[traceback.FrameSummary]:
    return traceback.extract_tb(error.__traceback__)


def _not_divisible() -> meshkit.MeshkitError:
    """The error of a part that does not split, raised deep in the planner of the assembly."""
    mesh = meshkit.make_mesh({"data": 8})
    with pytest.raises(meshkit.MeshkitError, match="does not split") as caught:
        meshkit.global_array_from_local(np.ones((7, 2), np.float32), mesh, "data")
    return caught.value


def test_an_error_from_deep_inside_global_array_from_local_shows_only_the_users_frames():
    error = _not_divisible()
    frames = _frames(error)
    assert [f.name for f in frames] == ["_not_divisible"]
    assert frames[0].filename == __file__
    assert not [f.filename for f in frames if f.filename.startswith(SRC)]
    shown = "".join(traceback.format_exception(error))
    assert "meshkit/_src" not in shown.replace(os.sep, "/")
    assert "\nmeshkit.MeshkitError: meshkit.global_array_from_local: the local array" in shown


def test_with_filtering_off_every_frame_is_shown(monkeypatch):
    monkeypatch.setenv("MESHKIT_TRACEBACK_FILTERING", "off")
    files = [f.filename for f in _frames(_not_divisible())]
    assert files[0] == __file__
    # The public entry point, the assembly, and the planner that raised.
    assert os.path.join(SRC, "arrays", "assembly.py") in files
    assert files[-1] == os.path.join(SRC, "arrays", "blocks.py")


def test_errors_that_are_not_meshkits_keep_their_whole_traceback():
    class Unreadable:
        def __array__(self, dtype=None, copy=None):
            raise RuntimeError("cannot read")

    mesh = meshkit.make_mesh({"data": 8})
    with pytest.raises(RuntimeError, match="cannot read") as caught:
        meshkit.global_array_from_local({"x": Unreadable()}, mesh, "data")
    files = [f.filename for f in _frames(caught.value)]
    assert any(f.startswith(SRC) for f in files)  # a bug's trail goes through meshkit


def test_a_bad_filtering_setting_is_named(monkeypatch):
    monkeypatch.setenv("MESHKIT_TRACEBACK_FILTERING", "sometimes")
    mesh = meshkit.make_mesh({"data": 8})
    with pytest.raises(
        meshkit.MeshkitError, match="MESHKIT_TRACEBACK_FILTERING='sometimes' is not"
    ) as caught:
        meshkit.global_array_from_local(np.ones((7, 2), np.float32), mesh, "data")
    # The error the setting was asked for stays in view, as the context of this one.
    assert "does not split" in str(caught.value.__context__)


def test_errors_in_other_public_functions_are_filtered_too():
    mesh = meshkit.make_mesh({"data": 8})
    with pytest.raises(meshkit.MeshkitError, match=r"not a jax\.Array") as caught:
        meshkit.gather(np.zeros(3))
    assert not [f for f in _frames(caught.value) if f.filename.startswith(SRC)]
    with pytest.raises(meshkit.MeshkitError) as caught:
        meshkit.make_mesh({"data": 3})
    assert not [f for f in _frames(caught.value) if f.filename.startswith(SRC)]
    with pytest.raises(meshkit.MeshkitError) as caught:
        meshkit.process_slice(mesh, "model", (8,))
    assert not [f for f in _frames(caught.value) if f.filename.startswith(SRC)]


def test_filtered_keeps_the_other_frames_in_their_order():
    def inner():
        raise ValueError("x")

    def outer():
        inner()

    with pytest.raises(ValueError, match="x") as caught:
        outer()
    names = [f.name for f in traceback.extract_tb(filtered(caught.value.__traceback__))]
    assert names[-2:] == ["outer", "inner"]
    assert names[0] == "test_filtered_keeps_the_other_frames_in_their_order"
    assert filtered(None) is None


@pytest.mark.parametrize(
    "cls",
    [
        meshkit.MeshkitError,
        meshkit.LaunchError,
        meshkit.DivergenceError,
        meshkit.MeshkitTypeError,
        meshkit.MeshkitIndexError,
        meshkit.MeshkitNameError,
        meshkit.DtypeWarning,
    ],
)
def test_public_classes_print_under_their_public_name(cls):
    assert repr(cls) == f"<class 'meshkit.{cls.__name__}'>"
    assert getattr(meshkit, cls.__name__) is cls
    assert pickle.loads(pickle.dumps(cls)) is cls


def _spmd_bad_spec():
    mesh = meshkit.make_mesh({"data": 8})
    f = meshkit.spmd(lambda x: x, mesh=mesh, in_specs="nope", out_specs="data")
    f(np.ones(8, np.float32))


def _pmap_bad_axes():
    meshkit.pmap_compat(lambda x: x, in_axes=(0, 0))(np.ones((8, 2), np.float32))


def _psum_unbound_axis():
    mesh = meshkit.make_mesh({"data": 8})
    meshkit.spmd(lambda x: meshkit.collectives.psum(x, "model"), mesh=mesh, in_specs="data",
                 out_specs="data")(np.ones(8, np.float32))  # fmt: skip


def _replicate_too_many_devices():
    meshkit.replicate(np.ones(2), devices=[object()])


@pytest.mark.parametrize(
    "call", [_spmd_bad_spec, _pmap_bad_axes, _psum_unbound_axis, _replicate_too_many_devices]
)
def test_spmd_pmap_collectives_and_legacy_errors_show_no_meshkit_frame(call):
    with pytest.raises(meshkit.MeshkitError) as caught:
        call()
    frames = _frames(caught.value)
    assert call.__name__ in [f.name for f in frames]
    assert not [f.filename for f in frames if f.filename.startswith(SRC)], frames
