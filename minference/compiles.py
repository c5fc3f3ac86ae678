"""Which Triton kernels a piece of work compiled: :class:`CompileCounter`, around Triton's JIT hooks.

A kernel variant compiles (or loads from Triton's disk cache) the first time this process launches
it with a new specialisation key. Inside a timed prefill that is seconds of compile in a TTFT (the
1.5B at 130K: one 17.0 s prompt against a 2.6 s median, docs/kernels.md). The eval records, per
timed prompt, what compiled while it ran, so a slow prompt is explained by measurement; the test
plugin's ``--compile-report`` counts them per test. The interpreter (``TRITON_INTERPRET=1``)
compiles nothing: the hooks never fire there.
"""

from __future__ import annotations

import time

__all__ = ["CompileCounter"]


class CompileCounter:
    """Installs Triton's ``jit_cache_hook`` / ``jit_post_compile_hook`` (chaining any hooks already
    set) and records ``(kernel name, seconds)`` per compile of this process; compiles follow each
    other (Triton compiles synchronously). :meth:`close` puts the previous hooks back."""

    def __init__(self) -> None:
        from triton import knobs

        self.compiles: list[tuple[str, float]] = []
        self._started: float | None = None
        self._prev = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._before, self._after

    def _before(self, **kwargs) -> bool:
        self._started = time.perf_counter()
        return bool(self._prev[0] and self._prev[0](**kwargs))  # False: compile as usual

    def _after(self, **kwargs) -> None:
        if self._started is not None:
            self.compiles.append((kwargs["fn"].name, time.perf_counter() - self._started))
        self._started = None
        if self._prev[1]:
            self._prev[1](**kwargs)

    def take(self) -> list[tuple[str, float]]:
        """The compiles recorded since the last call (or since installed), and forget them."""
        out, self.compiles = self.compiles, []
        return out

    def close(self) -> None:
        """Put back the hooks that were set before this counter."""
        from triton import knobs

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._prev
