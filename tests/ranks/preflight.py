"""What the processes of `tests/test_preflight.py` run: each function is one program's body.

The launched processes import this module, not the test module: they need meshkit and JAX, not
pytest and hypothesis.
"""

from __future__ import annotations

import os
import warnings

import jax

import meshkit


def x64_on_process_1():
    if os.environ["MESHKIT_PROCESS_ID"] == "1":
        jax.config.update("jax_enable_x64", True)
    meshkit.init()
    return "ran on"


def optimization_level_on_process_1():
    if os.environ["MESHKIT_PROCESS_ID"] == "1":
        jax.config.update("jax_optimization_level", "O1")
    meshkit.init()


def x64_on_process_1_of_3():
    if os.environ["MESHKIT_PROCESS_ID"] == "1":
        jax.config.update("jax_enable_x64", True)
    meshkit.init()


def same_everywhere():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        meshkit.init()
    return jax.process_count(), [str(w.message) for w in seen]
