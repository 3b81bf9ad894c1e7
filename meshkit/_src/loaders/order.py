"""The shuffled order of `grain_batches` and `hf_batches`: a permutation computed per index.

A keyed Feistel network over the smallest ``4**k >= n``, walked until it lands in ``range(n)``:
no table of ``n`` entries, vectorized over positions, and the same on every machine and numpy
version (64-bit integer arithmetic), which a saved position needs.
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 6
_MASK = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit finalizer (xor-shift-multiply): every input bit reaches every output bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _keys(seed: int, epoch: int) -> list[np.uint64]:
    """One key per round, from the seed and the epoch."""
    base = np.array([seed & _MASK, (epoch * 0x9E3779B97F4A7C15 + 1) & _MASK], np.uint64)
    keys = []
    for r in range(_ROUNDS):
        mixed = _mix(base + np.uint64(r * 0x632BE59BD9B4E019 & _MASK))
        keys.append(mixed[0] ^ _mix(mixed[1:])[0])
    return keys


def _feistel(x: np.ndarray, half: int, keys: list[np.uint64]) -> np.ndarray:
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    left, right = x >> shift, x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & mask)
    return (left << shift) | right


def permute(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """The rows read at ``positions`` of epoch ``epoch``: a bijection of ``range(n)``, as int64."""
    positions = np.asarray(positions, np.int64)
    if n <= 1 or positions.size == 0:
        return positions.copy()
    half = max(1, ((n - 1).bit_length() + 1) // 2)  # 4**half >= n
    keys = _keys(seed, epoch)
    with np.errstate(over="ignore"):  # the products wrap modulo 2**64, as they must
        out = _feistel(positions.astype(np.uint64), half, keys)
        outside = out >= np.uint64(n)
        while outside.any():
            out[outside] = _feistel(out[outside], half, keys)
            outside = out >= np.uint64(n)
    return out.astype(np.int64)
