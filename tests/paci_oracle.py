"""An independent float64 model of PACI / asynchronous 1F1B, from the paper's equations alone.

Nothing here touches the project's schedules, workers or emulator: it is numpy, the tiny
pipeline's model (stage ``s`` = a chain of ``tanh(x W^T)`` layers, squared-error loss scaled by
``1/a``, plain SGD with the tiny pipeline's learning rate) and two facts from the PACI paper
(``../shared/papers/paci.txt`` next to the repository):

* Algorithm 1 with unit-time passes: a stage runs a ready forward before a ready backward and
  admits a forward only while ``q_i <= N - i`` (1-based ``i``; ``w = N - 1 - s`` for 0-based
  ``s``) earlier forwards are unresolved. So the forward of micro-batch ``m`` on stage ``s`` is
  preceded by exactly ``max(0, m - w)`` local backwards, and its backward by ``m`` (backwards
  resolve in order). With an update after every ``a`` backwards, the forward reads version
  ``floor(max(0, m - w) / a)`` and the backward version ``floor(m / a)``; their difference is
  at most ``ceil(w / a)`` (eq. 2) and reaches it.
* Eq. 1: the backward evaluates the gradient with the activations saved by the forward but
  at the weights current at backward time: for ``y = tanh(x W^T)`` the weight gradient is
  ``((g * (1 - y^2))^T x)`` from the saved ``x, y``, and the input gradient passed upstream is
  ``(g * (1 - y^2)) W_B`` with the backward's ``W_B``.

:class:`Oracle` computes lazily, with memoisation, every stage's weight history and the weights
each forward and backward reads.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache

import numpy as np


def forward_version(num_stages: int, stage: int, a: int, microbatch: int) -> int:
    """Updates of 0-based ``stage`` before the forward of ``microbatch`` (module docstring)."""
    return max(0, microbatch - (num_stages - 1 - stage)) // a


def backward_version(a: int, microbatch: int) -> int:
    """Updates of a stage before the backward of ``microbatch``."""
    return microbatch // a


def drift_bound(num_stages: int, stage: int, a: int) -> int:
    """PACI's eq. 2 with 1-based ``i = stage + 1``: ``ceil((N - i) / a)``."""
    return math.ceil((num_stages - (stage + 1)) / a)


Batch = tuple[np.ndarray, np.ndarray]  # (x, y)


class Oracle:
    """PACI with ``a`` micro-batches per update on ``len(weights)`` stages (``a = 1``:
    asynchronous 1F1B). ``weights[s]`` are stage ``s``'s initial layer weights, ``batch(m)``
    micro-batch ``m``'s ``(x, y)``, ``lr(k)`` the rate of a stage's ``k``-th update (1-based)."""

    def __init__(self, weights: list[list[np.ndarray]], a: int, batch: Callable[[int], Batch],
                 lr: Callable[[int], float]):
        self.initial, self.a, self.batch, self.lr = weights, a, batch, lr
        self.n = len(weights)
        self.weights = cache(self._weights)
        self.forward = cache(self._forward)
        self.backward = cache(self._backward)

    def forward_weights(self, stage: int, mb: int) -> list[np.ndarray]:
        return self.weights(stage, forward_version(self.n, stage, self.a, mb))

    def backward_weights(self, stage: int, mb: int) -> list[np.ndarray]:
        return self.weights(stage, backward_version(self.a, mb))

    def _weights(self, stage: int, version: int) -> list[np.ndarray]:
        """Stage ``stage``'s layer weights after ``version`` updates: SGD on the window's sum."""
        if version == 0:
            return self.initial[stage]
        prev = self.weights(stage, version - 1)
        window = range((version - 1) * self.a, version * self.a)
        grads = [sum(self.backward(stage, mb)[1][layer] for mb in window) for layer in range(len(prev))]
        return [w - self.lr(version) * g for w, g in zip(prev, grads)]

    def _forward(self, stage: int, mb: int) -> list[np.ndarray]:
        """Activations ``[x_0, y_0 = x_1, ..., y_last]`` of the stage's layers (saved for backward)."""
        h = self.batch(mb)[0] if stage == 0 else self.forward(stage - 1, mb)[-1]
        acts = [h]
        for w in self.forward_weights(stage, mb):
            acts.append(np.tanh(acts[-1] @ w.T))
        return acts

    def _backward(self, stage: int, mb: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """(gradient w.r.t. the stage's input, gradients of its layers' weights)."""
        acts = self.forward(stage, mb)
        if stage == self.n - 1:
            g = 2.0 * (acts[-1] - self.batch(mb)[1]) / self.a
        else:
            g = self.backward(stage + 1, mb)[0]
        weights = self.backward_weights(stage, mb)
        grads: list[np.ndarray] = [np.empty(0)] * len(weights)
        for layer in reversed(range(len(weights))):
            dz = g * (1.0 - acts[layer + 1] ** 2)
            grads[layer] = dz.T @ acts[layer]
            g = dz @ weights[layer]
        return g, grads
