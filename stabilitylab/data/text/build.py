"""Build token shards from the offline corpus, from local text files, or from a Hugging Face
dataset; open the shipped tiny sample.

    prepare_corpus()                          # `make data`: data/text/{train,val,test}.bin
    shards_for_files(["a.txt", "b.txt"])      # cached under data/cache/files-<hash>/
    shards_for_hf("path/or/name")             # cached under data/cache/hf-<hash>/
    open_sample()                             # stabilitylab/data/text/sample/, no tokenizer

Every builder holds the whole text and its tokens in memory (about 10 bytes per token): fine for
this corpus and for files or datasets up to a few hundred million tokens. OpenWebText at the
paper's 1B tokens would need a streaming writer (nanoGPT's ``datasets.map`` + memmap pattern),
which is not built here.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from tqdm.auto import tqdm

from stabilitylab.data.source import DataError
from stabilitylab.data.text.corpus import CLEANING_VERSION, SOURCES, decode, normalise
from stabilitylab.data.text.fetch import FETCH_COMMAND, data_root, fetch, sha256_file
from stabilitylab.data.text.shards import (
    META_FILE,
    SPLITS,
    Shards,
    auto_passage_chars,
    open_shards,
    read_meta,
    tokenize_passages,
    write_shards,
)
from stabilitylab.data.text.tokenizer import R50K_BASE_SHA256, fetch_gpt2_bpe, load_gpt2

CORPUS_DIR = "text"
VAL_TOKENS = 100_000
TEST_TOKENS = 1_000_000
CORPUS_PASSAGE_CHARS = 4000
SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
SAMPLE_TEXT = Path(__file__).resolve().parent / "sample.txt"
SAMPLE_FRACTION = 0.1
"""Validation and test shares of the tiny sample (each ~10%, whole passages)."""


def _fingerprint(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


def corpus_recipe() -> dict:
    """Everything the corpus shards depend on; a change in any of it rebuilds them."""
    return {
        "sources": [
            [s.label, s.package.registry, s.package.spec, s.package.sha256] for s in SOURCES
        ],
        "tokenizer": R50K_BASE_SHA256,
        "cleaning": CLEANING_VERSION,
        "passage_chars": CORPUS_PASSAGE_CHARS,
        "val_tokens": VAL_TOKENS,
        "test_tokens": TEST_TOKENS,
    }


def corpus_state(out_dir: Path) -> str | None:
    """None when the shards are current: they exist, match the current recipe, and have the
    sizes, sha256 and id range their meta records (``open_shards``); else why not, in a line."""
    try:
        meta = read_meta(out_dir, "")
        open_shards(out_dir, "rebuilding it")
    except DataError as e:
        return str(e)
    if meta.get("recipe") != _fingerprint(corpus_recipe()):
        return f"{out_dir} was built by another recipe; rebuilding it"
    return None


def prepare_corpus(
    root: str | os.PathLike | None = None, force: bool = False, log: Callable = print
) -> dict:
    """Fetch, clean, tokenise and shard the corpus under ``<root>/text``; idempotent."""
    root = data_root(root)
    out_dir = root / CORPUS_DIR
    why = corpus_state(out_dir)
    if not force and why is None:
        meta = read_meta(out_dir, "")
        log(f"{out_dir} is up to date ({_summary(meta)}); nothing to do")
        return meta
    if why is not None and (out_dir / META_FILE).exists():
        log(why)  # a changed recipe, a missing, truncated or corrupted file: it is named
    started = time.perf_counter()
    encoder = load_gpt2(fetch_gpt2_bpe(root))
    paths = {}
    for source in tqdm(SOURCES, desc="fetch", unit="package"):
        paths[source.label] = fetch(source.package, root / "raw")
    docs, documents = [], {}
    for source in tqdm(SOURCES, desc="clean", unit="source"):
        before = len(docs)
        docs += [(source.label, d, t) for d, t in source.documents(paths[source.label]) if t]
        documents[source.label] = len(docs) - before
    passages = tokenize_passages(docs, encoder, CORPUS_PASSAGE_CHARS)
    meta = write_shards(
        out_dir,
        passages,
        val_tokens=VAL_TOKENS,
        test_tokens=TEST_TOKENS,
        meta={
            "recipe": _fingerprint(corpus_recipe()),
            "tokenizer": {"name": "r50k_base", "sha256": R50K_BASE_SHA256},
            "passage_chars": CORPUS_PASSAGE_CHARS,
            "sources": [
                {
                    "label": s.label,
                    "registry": s.package.registry,
                    "package": s.package.spec,
                    "sha256": s.package.sha256,
                    "licence": s.package.licence,
                    "content": s.content,
                    "documents": documents[s.label],
                }
                for s in SOURCES
            ],
        },
    )
    log(f"wrote {out_dir} in {time.perf_counter() - started:.0f} s ({_summary(meta)})")
    return meta


def _summary(meta: dict) -> str:
    return ", ".join(f"{s} {meta['splits'][s]['tokens']:,}" for s in SPLITS) + " tokens"


def open_corpus(root: str | os.PathLike | None = None) -> Shards:
    """The offline corpus's shards; missing ones name the command that builds them."""
    return open_shards(data_root(root) / CORPUS_DIR, f"fetch and build it with `{FETCH_COMMAND}`")


def open_sample() -> Shards:
    """The tiny sample shipped in the package (pre-tokenised: needs no tokenizer, no network)."""
    return open_shards(SAMPLE_DIR, "rebuild it with `python experiments/prepare_text.py --sample`")


def _small_text_shards(
    out_dir: Path,
    docs: Sequence[tuple[str, str, str]],
    val_fraction: float,
    test_fraction: float,
    meta: dict,
    encoder=None,
) -> Shards:
    """Shards of a small text collection with fractional split sizes (files, HF, the sample)."""
    for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if not 0.0 < value < 0.5:
            raise ValueError(f"{name} must be in (0, 0.5), got {value}")
    docs = [d for d in docs if d[2]]
    if not docs:
        raise DataError(f"no text to tokenise for {out_dir.name}")
    passage_chars = auto_passage_chars(sum(len(t) for _, _, t in docs))
    encoder = encoder if encoder is not None else load_gpt2()
    passages = tokenize_passages(docs, encoder, passage_chars)
    total = sum(p.tokens.shape[0] for p in passages)
    write_shards(
        out_dir,
        passages,
        val_tokens=max(1, round(val_fraction * total)),
        test_tokens=max(1, round(test_fraction * total)),
        meta={
            **meta,
            "tokenizer": {"name": "r50k_base", "sha256": R50K_BASE_SHA256},
            "passage_chars": passage_chars,
        },
    )
    return open_shards(out_dir, "")


def _cached(
    kind: str,
    key: dict,
    root: str | os.PathLike | None,
    docs: Callable[[], Sequence[tuple[str, str, str]]],
    val_fraction: float,
    test_fraction: float,
) -> Shards:
    key = {**key, "tokenizer": R50K_BASE_SHA256, "val": val_fraction, "test": test_fraction}
    out_dir = data_root(root) / "cache" / f"{kind}-{_fingerprint(key)[:16]}"
    if (out_dir / META_FILE).exists():
        return open_shards(out_dir, f"delete {out_dir} to rebuild it")
    return _small_text_shards(out_dir, docs(), val_fraction, test_fraction, {"source": key})


def shards_for_files(
    paths: Iterable[str | os.PathLike],
    root: str | os.PathLike | None = None,
    val_fraction: float = 0.05,
    test_fraction: float = 0.05,
) -> Shards:
    """Local UTF-8 (or Latin-1) text files, one document each, tokenised once and cached.

    The cache key holds each file's sha256, so an edited file is tokenised again.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise DataError("data.text_files is empty: give at least one text file")
    for p in paths:
        if not p.is_file():
            raise DataError(f"data.text_files: {p} is not a file")
    key = {"files": [[p.name, sha256_file(p)] for p in paths]}
    return _cached(
        "files",
        key,
        root,
        lambda: [("files", p.name, normalise(decode(p.read_bytes()))) for p in paths],
        val_fraction,
        test_fraction,
    )


def _import_datasets():
    try:
        import datasets
    except ImportError:
        raise DataError(
            "data.hf_dataset needs the Hugging Face `datasets` package: pip install datasets"
        ) from None
    return datasets


def shards_for_hf(
    name_or_path: str,
    split: str = "train",
    text_column: str = "text",
    root: str | os.PathLike | None = None,
    val_fraction: float = 0.05,
    test_fraction: float = 0.05,
) -> Shards:
    """A Hugging Face dataset's ``text_column``, one document per row, tokenised once and cached.

    A local folder written by ``Dataset.save_to_disk`` is opened with ``load_from_disk``; any
    other name goes to ``datasets.load_dataset(name, split=split)`` (the Hub, or its cache).
    The paper's corpus is ``openwebtext``; see this module's docstring for the memory limit.
    """
    datasets = _import_datasets()
    if Path(name_or_path).is_dir():
        dataset = datasets.load_from_disk(name_or_path)
        if isinstance(dataset, datasets.DatasetDict):
            if split not in dataset:
                raise DataError(f"data.hf_split: {name_or_path} has no split {split!r}")
            dataset = dataset[split]
    else:
        try:
            dataset = datasets.load_dataset(name_or_path, split=split)
        except Exception as e:  # the Hub's errors vary by version; keep the first line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"data.hf_dataset {name_or_path!r}: {first}") from None
    if text_column not in dataset.column_names:
        raise DataError(
            f"data.hf_text_column: {name_or_path} has no column {text_column!r} "
            f"(columns: {', '.join(dataset.column_names)})"
        )
    key = {"hf": name_or_path, "split": split, "column": text_column, "id": dataset._fingerprint}
    return _cached(
        "hf",
        key,
        root,
        lambda: [("hf", str(i), normalise(t or "")) for i, t in enumerate(dataset[text_column])],
        val_fraction,
        test_fraction,
    )


def build_sample(encoder=None, out_dir: Path = SAMPLE_DIR) -> Shards:
    """Re-tokenise the shipped ``sample.txt`` into ``sample/`` (run when the text changes)."""
    text = normalise(SAMPLE_TEXT.read_text(encoding="utf-8"))
    return _small_text_shards(
        Path(out_dir),
        [("sample", "sample", text)],
        SAMPLE_FRACTION,
        SAMPLE_FRACTION,
        {"source": {"file": SAMPLE_TEXT.name, "sha256": sha256_file(SAMPLE_TEXT)}},
        encoder=encoder,
    )
