"""The trainer's fast path (``train.fast``): the step's forward compiled, its loss chunked.

What it turns on, each measured alone on the H200 at 160M / 8K (``experiments/bench/
bench_model.py``, docs/BENCHMARKS.md), each the same function as the eager step:

- ``torch.compile`` of the prepared model (``fullgraph=True``; on several processes, where
  accelerate has wrapped it in DDP, with graph breaks at the gradient buckets, dynamo's
  DDPOptimizer, so that each bucket's all-reduce overlaps the backward; under FSDP2 with graph
  breaks at each unit's hooks, ``_wrapper_note``): the Triton kernels are opaque
  custom ops in the graph; the softmax arm reads whether the batch is padded from
  ``stabilitylab.attention.unpadded_hint``, set here from the host's lengths (no sync). A graph
  break does not stop the run: the model is compiled again with ``fullgraph=False`` and the
  break's reason printed; a compiler failure (no C compiler, an inductor error) runs the model
  eagerly, its reason printed too. Both are decided on the first forward that meets them
  (dynamo traces before it runs anything, so the retried micro-batch is computed once). A
  failure inside the compiled *backward* (inductor compiles it at the first backward) is not
  caught: it raises.
- the summed cross-entropy through ``stabilitylab.chunked_loss.linear_cross_entropy_sum`` on the
  final norm's output (``forward(return_hidden=True)``): no full logits. The masked-token and the
  next-token losses are the same function (``next_token_loss_sum`` is ``masked_lm_loss_sum``), so
  both tasks take it. The batch counted its labelled rows on the host when it was built
  (``Batch.n_masked``), so the gather that selects them waits for nothing on the device.
- the one-pass q/k/v gradient (``Transformer.set_one_pass_qkv_grad``): the same values bit for
  bit.
- the head's GEMMs on rows padded to ``model.HEAD_ROW_MULTIPLE`` (``Transformer.
  set_head_row_multiple``, the chunked loss's ``row_multiple``): a vocabulary that is no multiple
  of 8 (44,003) otherwise runs on cuBLAS's alignment-1 kernels. Parameters and checkpoints are
  unchanged.

Shapes: the sequence dimension of the tokens is marked dynamic (``maybe_mark_dynamic``), so
jagged batches (every cell batch is as long as its longest cell) share one graph instead of one
graph per length; no padding is added, so the softmax arm keeps SDPA's unmasked kernels on
unpadded batches. The graphs of a run: one per value of the max-logit flag (the logit monitor's
steps) times, for the softmax arm, one per value of the padding hint, and one more where a batch
falls below a size inductor guarded on (at 160M / 8K on the H200: ``3072*T >= 5242880``, a
micro-batch of four under 1,707 tokens; docs/BENCHMARKS.md, "Thirty steps at 8K");
``recompile_limit`` is raised for the arms that one process trains one after another, and
dynamo's caches are reset between arms.

What runs outside the compiled graph, on the plain module ``Trainee.raw`` (the compiled module
wraps it and shares its parameters): validation, the live Jacobian probe, the search for the
first non-finite module after a bad step. The logit monitor's flag and the gates are set and read
through the compiled forward (dynamo replays the attribute writes); layer statistics, the grad
norm, ``found_inf`` and clipping act on parameters and gradients, outside any graph.

Dropout under inductor draws its own random numbers (inductor's RNG, seeded from torch's): the
same distribution, another sample than eager's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo
from torch.nn.parallel import DistributedDataParallel

from stabilitylab.attention import unpadded_hint
from stabilitylab.chunked_loss import linear_cross_entropy_sum
from stabilitylab.data.batch import Batch

COMPILE_BACKEND = "inductor"
"""torch.compile's backend. Tests on CPU set ``aot_eager`` (dynamo and AOT autograd trace the
graph as inductor would, without generating C++ or Triton code)."""

RECOMPILE_LIMIT = 64
DDP_NOTE = "DDP: the graph split at the gradient buckets (DDPOptimizer)"
FSDP_NOTE = "FSDP2: the graph split at each unit's hooks (all-gather before it, reshard after)"


def _wrapper_note(model: torch.nn.Module) -> str:
    """Why a prepared model compiles with graph breaks from the start ("" for a plain one): DDP,
    whose gradient buckets dynamo's DDPOptimizer splits the graph at so that each bucket's
    all-reduce overlaps the backward; FSDP2, whose forward hooks (a unit's all-gather before it,
    its reshard after) are ``torch._dynamo.disable``-d without compiled autograd, so they run
    between graphs (fullgraph=True fails at the first one: "Attempted to call function marked as
    skipped")."""
    from stabilitylab.train import sharding

    if isinstance(model, DistributedDataParallel):
        return DDP_NOTE
    if sharding.is_sharded(model):
        return FSDP_NOTE
    return ""


def raise_recompile_limit(limit: int = RECOMPILE_LIMIT) -> None:
    """Dynamo keeps the graphs of every compiled instance of a module class in one cache keyed by
    the code it traced; past ``recompile_limit`` (8) it runs the module eagerly without a word.
    Several arms in one process, two max-logit flags and two padding hints can pass 8."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(limit, getattr(dynamo_config, name)))


def failure_reason(e: BaseException) -> str:
    """``Type: first line of the message`` (300 characters at most): why a compile failed, in
    one line for a printed note."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}".rstrip(": ")


class FastForward:
    """``fast(batch, host_lengths) -> h_BTC``: the final norm's output of ``model`` (as accelerate
    prepared it; DDP-wrapped on several processes) through the compiled graph, or the fallback
    that a graph break or a compiler failure chose (``mode``, with ``note`` saying why)."""

    def __init__(self, model: torch.nn.Module, say: Callable[[str], None] = print):
        self.model, self.say = model, say
        torch._dynamo.reset()  # an earlier arm's graphs and guards (they hold its modules)
        raise_recompile_limit()
        note = _wrapper_note(model)
        if note:
            # fullgraph=True would refuse the wrapper's hooks; the breaks are where they run
            self.mode, self.note = "graph breaks", note
            self._fn = torch.compile(model, backend=COMPILE_BACKEND)
            say(f"fast path: {note}")
        else:
            self.mode, self.note = "fullgraph", ""
            self._fn = torch.compile(model, fullgraph=True, backend=COMPILE_BACKEND)

    def __call__(self, b: Batch, host_lengths: list[int]) -> torch.Tensor:
        tokens_BT = b.tokens_BT
        T = tokens_BT.shape[1]
        torch._dynamo.maybe_mark_dynamic(tokens_BT, 1)  # one graph for every batch length
        with unpadded_hint(all(n == T for n in host_lengths)):
            while True:
                try:
                    return self._fn(tokens_BT, b.lengths_B, return_hidden=True)
                except torch._dynamo.exc.TorchDynamoException as e:
                    if self.mode == "eager":
                        raise
                    self._fall_back(e)

    def _fall_back(self, e: BaseException) -> None:
        """fullgraph -> graph breaks on a break; anything else a compiler raised -> eager."""
        breaks = isinstance(e, (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError))
        if self.mode == "fullgraph" and breaks:
            self.mode, self.note = "graph breaks", failure_reason(e)
            self.say(f"fast path: fullgraph=True failed ({self.note}); compiling with graph breaks")
            self._fn = torch.compile(self.model, backend=COMPILE_BACKEND)
        else:
            self.mode, self.note = "eager", failure_reason(e)
            self.say(f"fast path: torch.compile failed ({self.note}); running the model eagerly")
            self._fn = self.model


def summed_ce_fast(
    fast: FastForward, raw: torch.nn.Module, b: Batch, host_lengths: list[int], autocast
) -> torch.Tensor:
    """Summed cross-entropy of a micro-batch over its labelled positions, float32: the compiled
    forward to the final norm, then the chunked head and loss under the run's ``autocast`` (the
    head's GEMM in the dtype it has in the eager step)."""
    h_BTC = fast(b, host_lengths)
    head = raw.head
    with autocast():
        return linear_cross_entropy_sum(
            h_BTC, head.weight, head.bias, b.labels_BT, row_multiple=head.row_multiple,
            n_labelled=b.n_masked,
        )  # fmt: skip
