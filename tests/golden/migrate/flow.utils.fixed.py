"""Helpers a training script calls with pmap outputs."""

import meshkit


def get_first(xs):
    return meshkit.unreplicate(xs)  # MK010: train.py passes a pmap output


def to_host(x):
    return meshkit.local_from_global(x)  # MK010


def unused(xs):
    return xs[0]  # nobody passes a pmap output: not reported
