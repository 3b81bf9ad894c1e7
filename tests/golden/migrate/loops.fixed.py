"""Host reads of pmap outputs in and out of loops, and ahead-of-time compiled pmaps."""

import meshkit
import numpy as np

p_step = meshkit.pmap_compat(lambda s, b: (s + b, (s * b).sum()), axis_name="batch")
evaluate = meshkit.pmap_compat(lambda s: s.mean())


def train(state, batches):
    losses = []
    for batch in batches:
        state, loss = p_step(state, batch)
        losses.append(meshkit.unreplicate(loss))  # MK010: a gather every step
        host = meshkit.unreplicate(state)  # MK010
    first = meshkit.unreplicate(state)  # MK010 outside a loop too
    while len(losses) < 10:
        losses.append(meshkit.unreplicate(evaluate(state)))  # MK010: evaluate returns one output, not a tuple
        score = evaluate(state)
        print(meshkit.unreplicate(score))  # MK010
    return [meshkit.unreplicate(score) for _ in range(2)], host, first  # MK010: a comprehension loops too


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
