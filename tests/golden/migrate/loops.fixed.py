"""x[0] on pmap outputs in loops, and ahead-of-time compiled pmaps."""

import jax
import meshkit
import numpy as np

p_step = meshkit.pmap_compat(lambda s, b: (s + b, (s * b).sum()), axis_name="batch")
evaluate = meshkit.pmap_compat(lambda s: s.mean())


def train(state, batches):
    losses = []
    for batch in batches:
        state, loss = p_step(state, batch)
        losses.append(loss[0])  # MK010: a gather every step
        host = jax.tree_util.tree_map(lambda a: a[0], state)  # MK010
    first = state[0]  # outside the loop: paid once, not reported
    while len(losses) < 10:
        losses.append(evaluate(state)[0])  # a call's own [0] may pick an output: not reported
        score = evaluate(state)
        print(score[0])  # MK010
    return [score[0] for _ in range(2)], host, first  # MK010: a comprehension loops too


def other(batches):
    loss = np.zeros(3)
    for _ in batches:
        print(loss[0])  # not a pmap output in this function: not reported


def unrep(state, batches):
    for batch in batches:
        state, _ = p_step(state, batch)
        print(meshkit.unreplicate(state))  # MK005, rewritten to meshkit.unreplicate


lowered = p_step.lower(np.zeros((8, 2)), np.zeros((8, 2)))
compiled = lowered.compile()  # MK011 in two steps
fast = meshkit.pmap_compat(lambda x: x).lower(np.zeros(8)).compile()  # MK011 in one
