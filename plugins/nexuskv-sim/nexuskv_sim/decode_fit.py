"""What one running decode adds to a request's time to first token, learned from measured TTFTs.

A scheduler sees each node's running decodes when it routes and each request's measured TTFT when it completes;
it does not see how an engine interleaves decodes with prefill chunks. This fits, per model, the part of the
prediction error that grows with the decodes the node was running: an exponentially weighted least-squares line
`error = a + b * decodes` over (decodes, measured TTFT - prediction without decodes) pairs. `b` (never negative) is
the `decode_ms` a `NodeState` carries. It reads observables only: nothing of the simulator's engine model.
"""

from __future__ import annotations

__all__ = ["DecodeFit"]


class DecodeFit:
    """An exponentially weighted fit of TTFT error against running decodes (one per model)."""

    def __init__(self, decay: float = 0.995, min_samples: int = 32) -> None:
        self.decay = decay
        self.min_samples = min_samples
        self.samples = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, decodes: int, error_ms: float) -> None:
        """One completed request: the decodes its node ran when it was routed, and its TTFT error (ms)."""
        d = self.decay
        x = float(decodes)
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + error_ms
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * error_ms
        self.samples += 1

    @property
    def decode_ms(self) -> float:
        """The fitted slope: ms one running decode adds (0 until `min_samples` samples with spread in decodes)."""
        if self.samples < self.min_samples or self._w <= 0:
            return 0.0
        mx = self._x / self._w
        var = self._xx / self._w - mx * mx
        if var <= 1e-9:
            return 0.0
        cov = self._xy / self._w - mx * self._y / self._w
        return max(0.0, cov / var)
