#!/usr/bin/env python
# -*- coding: utf-8 -*-
"""Formatting and comments survive the rewrite; so do strings that name jax.pmap."""
from __future__ import annotations

import os  # stays

# The helpers of the old input pipeline.
import jax
import meshkit

LABEL = "jax.pmap"  # a string, not code: unchanged


def step(x):
    """Called through jax.pmap below."""
    return x


p_step = meshkit.pmap_compat(
    step,  # the per-device function
    axis_name="batch",
    # donate the state
    donate_argnums=(0,),
)
naïve = "é"; q = meshkit.pmap_compat(step)  # a non-ASCII line: columns count characters
state = meshkit.replicate(  # before
    {"w": 1.0}
)  # after
kept = jax.pmap(step)  # meshkit: ignore[MK001]
also_kept = jax.pmap(step)  # meshkit: ignore
print(meshkit.unreplicate(state), os.sep, LABEL, naïve, q, kept, also_kept, p_step)
