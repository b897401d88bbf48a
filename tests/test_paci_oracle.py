"""PACI and asynchronous 1F1B against an independent float64 oracle (tests/paci_oracle.py):
the weights every forward and backward actually read (recorded by autograd's saved-tensor
hooks, not the worker's version counters) and every stage's weight trajectory, for N in
{3, 4, 6}, several accumulations ``a`` and uneven layer splits; the drift measured on those
reads reaches PACI's bound ceil((N - i) / a) (1-based i) and never exceeds it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests import paci_oracle as oracle
from tests import tiny_pipeline as tiny

CASES = [  # (schedule, N, a, layers per stage)
    ("async-1f1b", 3, 1, [2, 1, 1]),
    ("paci", 3, 2, [1, 3, 1]),
    ("async-1f1b", 4, 1, [1, 2, 1, 2]),
    ("paci", 4, 3, [3, 1, 1, 1]),
    ("paci", 6, 2, [1, 1, 2, 1, 1, 2]),
    ("paci", 6, 4, [2, 1, 1, 1, 1, 1]),
    ("async-1f1b", 6, 1, [1, 2, 1, 1, 1, 1]),
]
TOL = 1e-11


def _oracle(layers: list[int], a: int) -> oracle.Oracle:
    def batch(mb: int) -> oracle.Batch:
        b = tiny.batch(mb)
        return b["x"].numpy(), b["y"].numpy()

    weights = [[w.numpy() for w in ws] for ws in tiny.split_weights(layers)]
    return oracle.Oracle(weights, a, batch, tiny.ScaledLR().lr)


def _close(ours: list[torch.Tensor | None], ref: list[np.ndarray]) -> bool:
    return all(t is not None and np.allclose(t.numpy(), r, rtol=TOL, atol=TOL) for t, r in zip(ours, ref))


def _version(history: list[list[torch.Tensor]], read: list[torch.Tensor | None]) -> int:
    """The index of the one trajectory entry equal (bitwise) to the weights a pass read."""
    hits = [k for k, ws in enumerate(history) if all(torch.equal(w, r) for w, r in zip(ws, read))]
    assert len(hits) == 1, hits
    return hits[0]


@pytest.mark.parametrize("name,n,a,layers", CASES)
def test_reads_and_trajectory_match_the_paper_oracle(name: str, n: int, a: int, layers: list[int]) -> None:
    iterations = -(-2 * n // a) + 2  # past the pipeline's fill on every stage
    run = tiny.run(name, n, a, iterations, layers=layers)
    ref = _oracle(layers, a)
    microbatches = range(iterations * a)
    for s, (module, opt) in enumerate(zip(run.modules, run.optimizers)):
        assert len(opt.history) == iterations + 1
        for k, weights in enumerate(opt.history):
            assert _close(weights, ref.weights(s, k)), (s, k)
        assert module.saved_layers.keys() == module.read_layers.keys() == set(microbatches)
        drifts = []
        for mb in microbatches:
            assert _close(module.saved_layers[mb], ref.forward_weights(s, mb)), ("forward", s, mb)
            assert _close(module.read_layers[mb], ref.backward_weights(s, mb)), ("backward", s, mb)
            drifts.append(_version(opt.history, module.read_layers[mb]) - _version(opt.history, module.saved_layers[mb]))
        assert max(drifts) == oracle.drift_bound(n, s, a), (s, drifts)
        assert min(drifts) >= 0


def test_oracle_tells_paci_from_a_stashing_pipeline() -> None:
    """Control: the oracle's backward weights differ from its forward weights where drift > 0, so
    a pipeline whose backward re-read the forward's weights would fail the test above."""
    ref = _oracle([1, 2, 1], 1)
    differs = [not all(np.array_equal(f, b) for f, b in zip(ref.forward_weights(s, mb), ref.backward_weights(s, mb)))
               for s in range(3) for mb in range(8)]
    assert any(differs)
    assert all(np.array_equal(f, b) for mb in range(8)
               for f, b in zip(ref.forward_weights(2, mb), ref.backward_weights(2, mb)))
