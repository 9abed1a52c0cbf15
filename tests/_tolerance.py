"""Float32 tolerances derived from rounding analysis, for tests that compare two evaluations of the
same function that differ only in the order of their reductions.

Such pairs are everywhere here: the cached decode against the full forward, micro-batched gradient
accumulation against one micro-batch, a sharded reduction against an unsharded one. XLA:CPU picks the
blocking of a dot or a sum from the shapes, the host CPU's vector width and the thread count, so the
order (and therefore the last bits) changes from machine to machine and even from run to run under
load; a tolerance read off one machine's output is not a bound.

The bound used instead (Higham, "Accuracy and Stability of Numerical Algorithms", section 3.1): a
float32 sum or dot product of ``n`` terms, computed in any order, is within ``gamma_n * sum |terms|``
of the exact value, ``gamma_n = n u / (1 - n u)`` with unit roundoff ``u = 2**-24``. Two orders are
therefore within ``2 gamma_n * sum |terms|`` of each other. These worst-case bounds are loose (typical
errors grow like sqrt(n) u), which is what makes them safe on any machine; they stay far below the
size of the bugs the tests exist to catch (a wrong position, temperature, mask or weighting moves the
compared values by 1e-2 or more).
"""

from __future__ import annotations

import numpy as np

UNIT_ROUNDOFF = 2.0 ** -24


def gamma(n: int) -> float:
    """Higham's gamma_n: relative bound on the rounding error of an n-term float32 reduction."""
    nu = n * UNIT_ROUNDOFF
    return nu / (1.0 - nu)


def reorder_bound(n: int, abs_sum) -> np.ndarray:
    """Largest difference between two float32 evaluation orders of an n-term sum whose terms' absolute
    values add up to ``abs_sum``."""
    return 2.0 * gamma(n) * np.asarray(abs_sum, np.float64)


def logit_tolerance(logits: np.ndarray, longest_reduction: int, depth: int) -> np.ndarray:
    """Bound on |z_a - z_b| for the logits of two reduction orders of the same transformer forward.

    logits: f32[..., V] (one evaluation, used for its scale). Each logit is a dot product whose terms
    carry the errors of every reduction before it; the error of each of the ``depth`` reductions on the
    residual path (at most ``longest_reduction`` terms each: the MLP's intermediate width, the attended
    length, the hidden size) is bounded by ``2 gamma_n`` relative to the scale of what it produces. The
    logits' scale ``max(1, max |z|)`` stands in for ``sum |terms|`` of the last dot, with the stack's
    earlier errors added linearly: ``depth * 2 gamma_n * max(1, max |z|)``.  Returns f64[...].
    """
    scale = np.maximum(1.0, np.max(np.abs(np.asarray(logits, np.float64)), axis=-1))
    return depth * reorder_bound(longest_reduction, scale)


def logprob_entropy_tolerance(logits: np.ndarray, temperature: float, logit_tol: np.ndarray):
    """(tolerance of log p(token), tolerance of the entropy) given the logits' tolerance.

    With s = z / T, p = softmax(s): log p_k = s_k - logsumexp(s), so |d log p_k| <= 2 max |ds|; and
    dH/ds_k = -p_k (s_k - E_p[s]), so |dH| <= max |ds| * E_p|s - E_p[s]|. A factor 2 covers the
    second-order terms and the rounding of the softmax's own length-V sums.  logits: f32[..., V].
    """
    s = np.asarray(logits, np.float64) / temperature
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    spread = np.sum(p * np.abs(s - np.sum(p * s, axis=-1, keepdims=True)), axis=-1)
    ds = np.asarray(logit_tol, np.float64) / temperature
    return 2.0 * 2.0 * ds, 2.0 * ds * (1.0 + spread)
