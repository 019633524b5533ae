"""The engine's decode step as one CUDA graph (gpt-fast's recipe): static inputs copied in, the
whole step replayed, so the host does not set the pace.

Captured at the first step after a prefill, so that the kernels are tuned on the cache as it is
(the autotuner cannot run inside a capture): two eager warm-up steps on a side stream tune and
compile, the cache state they changed is put back (``PagedKV.snapshot``), and the step is
captured. Every buffer the step touches is updated in place by the engine (reset, prefill,
drops), so the graph stays valid across batches of the same engine. The logits come back in the
graph's static buffer.
"""

from __future__ import annotations

import torch

WARMUP_STEPS = 2


class StepGraph:
    def __init__(self, engine) -> None:
        self.engine = engine
        B, dev = engine.batch, engine.device
        self.tokens_B = torch.zeros(B, dtype=torch.long, device=dev)
        self.pos_B = torch.zeros(B, dtype=torch.long, device=dev)
        self.active_B = torch.zeros(B, dtype=torch.bool, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits_BV: torch.Tensor | None = None

    def _step(self) -> torch.Tensor:
        return self.engine._static_step(self.tokens_B, self.pos_B, self.active_B)

    def capture(self) -> None:
        """Warm up, put the state back, capture (on the current inputs)."""
        e = self.engine
        saved = [c.snapshot() for c in e.caches]
        keys_read = e.keys_read_BL.clone()
        side = torch.cuda.Stream(e.device)
        side.wait_stream(torch.cuda.current_stream(e.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._step()
        torch.cuda.current_stream(e.device).wait_stream(side)
        for cache, state in zip(e.caches, saved, strict=True):
            cache.restore(state)
        e.keys_read_BL.copy_(keys_read)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits_BV = self._step()
        self.graph = graph

    def __call__(self, tokens_B, pos_B, active_B) -> torch.Tensor:
        self.tokens_B.copy_(tokens_B)
        self.pos_B.copy_(pos_B)
        self.active_B.copy_(active_B)
        if self.graph is None:
            self.capture()
        self.graph.replay()
        return self.logits_BV
