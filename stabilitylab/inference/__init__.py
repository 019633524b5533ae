"""The decode engine: the lab's decoder decoding over a paged KV cache whose cost follows the
live entries (issue 40). The research loop (``stabilitylab.eviction``) stays the reference the
engine is tested against.

    from stabilitylab.inference import DecodeEngine
    engine = DecodeEngine(model, batch=32, max_entries=512, policy=GateThreshold(tau))
    out = engine.teacher_forced(tokens_BS, prefill=256)

Modules: ``paged`` (one layer's pages, free list, drops without copying the cache), ``layers``
(one block: prefill through the training backend, a decode step over the pages), ``engine``
(batched ragged decode, eviction, the static step), ``forced`` (the research protocol through
the engine), ``graph`` (the step as a CUDA graph), ``evaluate`` (the study's evaluations through
the engine, for the decode-speed table), ``bench`` and ``bench_steps`` (experiments/bench/bench_decode.py's logic).
The attention kernel is ``stabilitylab.kernels.decode_attention``.
"""

from stabilitylab.inference.engine import DecodeEngine, EngineOutput
from stabilitylab.inference.paged import PagedKV

__all__ = ["DecodeEngine", "EngineOutput", "PagedKV"]
