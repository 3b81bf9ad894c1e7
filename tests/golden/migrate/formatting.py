#!/usr/bin/env python
# -*- coding: utf-8 -*-
"""Formatting and comments survive the rewrite; so do strings that name jax.pmap."""
from __future__ import annotations

import os  # stays

# The helpers of the old input pipeline.
from flax.jax_utils import (
    replicate,  # params to every device
    unreplicate,
)
import jax

LABEL = "jax.pmap"  # a string, not code: unchanged


def step(x):
    """Called through jax.pmap below."""
    return x


p_step = jax.pmap(
    step,  # the per-device function
    axis_name="batch",
    # donate the state
    donate_argnums=(0,),
)
naïve = "é"; q = jax.pmap(step)  # a non-ASCII line: columns count characters
state = replicate(  # before
    {"w": 1.0}
)  # after
kept = jax.pmap(step)  # meshkit: ignore[MK001]
also_kept = jax.pmap(step)  # meshkit: ignore
print(unreplicate(state), os.sep, LABEL, naïve, q, kept, also_kept, p_step)
