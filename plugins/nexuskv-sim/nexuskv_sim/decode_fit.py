"""What running decodes add to a request's time to first token, learned from measured TTFTs.

An engine with chunked prefill (vLLM, SGLang; the simulated one too) runs the decodes of every running request in
each prefill iteration, so a node with many decodes prefills slower, and more so the more prefill is ahead of a
request's first token. A scheduler sees each node's running decodes and queued prefill when it routes, and each
request's measured TTFT when it completes; it does not see the engine's timing. This fits, per model, the part of
the prediction error that grows with `x = decodes x (prefill tokens ahead of the first token) / 1000`: an
exponentially weighted least-squares line `error = a + b * x` over (x, measured TTFT - the prediction without
decodes) pairs. `b` (never negative) is the ms one running decode adds per 1,000 tokens of prefill ahead. It reads
observables only: nothing of the simulator's engine model or its constants.
"""

from __future__ import annotations

__all__ = ["DecodeFit"]


class DecodeFit:
    """An exponentially weighted fit of TTFT error against decodes x prefill ahead (one per model)."""

    def __init__(self, decay: float = 0.995, min_samples: int = 32) -> None:
        self.decay = decay
        self.min_samples = min_samples
        self.samples = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, x: float, error_ms: float) -> None:
        """One completed request: its `x` when it was routed (decodes x prefill ahead), and its TTFT error (ms)."""
        d = self.decay
        x = float(x)
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + error_ms
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * error_ms
        self.samples += 1

    @property
    def decode_ms(self) -> float:
        """The fitted slope: ms one running decode adds per 1,000 prefill tokens ahead.

        0 until `min_samples` samples, and while `x` has no spread.
        """
        if self.samples < self.min_samples or self._w <= 0:
            return 0.0
        mx = self._x / self._w
        var = self._xx / self._w - mx * mx
        if var <= 1e-9:
            return 0.0
        cov = self._xy / self._w - mx * self._y / self._w
        return max(0.0, cov / var)
