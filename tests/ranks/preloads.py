"""What the fork servers of the ecosystem tests import before they fork (``preload=``).

The ranks of the training-loop, checkpoint and loader tests import orbax, flax nnx, optax and
grain: their fork server imports them once and each rank skips it. test_resume and test_restarts
together, Python 3.11, took 92 and 95 CPU-s of the machine with this preload, 134 and 124
without. One tuple for every such test, so that a pytest worker keeps one server for them all.
Its own module, without pytest or conftest: the launched processes import the test modules
that name it.
"""

ECOSYSTEM = ("orbax.checkpoint", "flax.nnx", "optax", "grain")
