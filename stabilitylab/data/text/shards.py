"""Token shards: documents -> passages -> fixed splits -> ``uint16`` ``.bin`` files + ``meta.json``.

Layout (nanoGPT's): ``{train,val,test}.bin`` hold GPT-2 token ids as little-endian ``uint16``
(ids < 50257 < 2^16), read back with ``np.memmap``; the end-of-text token 50256 closes every run
of contiguous text. ``meta.json`` records the tokenizer, the recipe, per-source and per-split
token counts and each file's sha256. ``open_shards`` checks each file against that sha256 and
its ids against the vocabulary, once per process and file version.

Splits. Each document is cut into passages of about ``passage_chars`` characters at paragraph
(else sentence, else word) boundaries. Passages are ordered by the sha256 of
``source/document/passage-number``; validation takes passages in that order until it holds
``val_tokens``, then test until ``test_tokens``, and training keeps the rest. So the splits are
disjoint, fixed by the text alone (not by the machine, the order of sources or a seed), and
spread over every source in proportion to its size. Within a split, passages keep corpus order
and neighbours from one document stay joined; an end-of-text token marks every gap.

Sizes: the paper holds out 100K validation and 1M test tokens of a 1B-token OpenWebText split
(0.01% and 0.1%). Here the same *absolute* sizes are kept — the precision of a perplexity depends
on the tokens it averages over, not on the share of the corpus — which on this ~10M-token corpus
is 1% and 10%. Each split overshoots its target by less than one passage.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from stabilitylab.data.source import DataError
from stabilitylab.data.text.fetch import sha256_file

SPLITS = ("train", "val", "test")
SHARD_FORMAT = 1
EOT_ID = 50256
VOCAB_SIZE = 50257
META_FILE = "meta.json"


@dataclass
class Passage:
    source: str
    doc: str
    index: int
    """Position within its document; consecutive indices are contiguous text."""
    tokens: np.ndarray
    """uint16 token ids."""

    @property
    def key(self) -> str:
        return f"{self.source}/{self.doc}/{self.index}"


_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")


def _cut(text: str, start: int, stop: int) -> int:
    """Where to end a passage in ``text[start:stop]``: after a paragraph break, else a sentence,
    else a space, else at ``stop``; the search looks at the window's second half."""
    half = start + (stop - start) // 2
    newline = text.rfind("\n", half, stop)
    if newline >= 0:
        end = newline + 1
        while end < len(text) and text[end] == "\n":
            end += 1
        return end
    ends = [m.end() for m in _SENTENCE_END.finditer(text, half, stop)]
    if ends:
        return ends[-1]
    space = text.rfind(" ", half, stop)
    return space + 1 if space >= 0 else stop


def split_passages(text: str, passage_chars: int) -> list[str]:
    """``text`` cut into consecutive pieces of at most ~``passage_chars``; their join is ``text``."""
    if passage_chars < 1:
        raise ValueError(f"passage_chars must be >= 1, got {passage_chars}")
    pieces, start = [], 0
    while len(text) - start > passage_chars:
        end = _cut(text, start, start + passage_chars)
        pieces.append(text[start:end])
        start = end
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def auto_passage_chars(total_chars: int) -> int:
    """About 100 passages for a small text, at most 4,000 characters (~1K tokens) each."""
    return int(min(4000, max(256, total_chars // 100)))


def _hash_order(keys: Sequence[str]) -> np.ndarray:
    digests = [int.from_bytes(hashlib.sha256(k.encode()).digest()[:8], "big") for k in keys]
    return np.argsort(np.array(digests, dtype=np.uint64), kind="stable")


def assign_splits(
    keys: Sequence[str], lengths: Sequence[int], val_tokens: int, test_tokens: int
) -> np.ndarray:
    """Split id per passage (0 train, 1 val, 2 test) by the hash order described above."""
    if val_tokens < 0 or test_tokens < 0:
        raise ValueError(f"split sizes must be >= 0, got val={val_tokens} test={test_tokens}")
    total = int(np.sum(lengths))
    if val_tokens + test_tokens >= total:
        raise DataError(
            f"val ({val_tokens}) + test ({test_tokens}) tokens leave no training text "
            f"out of {total}"
        )
    split_P = np.zeros(len(keys), dtype=np.int8)
    held = [0, 0, 0]
    for p in _hash_order(keys):
        for split, target in ((1, val_tokens), (2, test_tokens)):
            if held[split] < target:
                split_P[p] = split
                held[split] += int(lengths[p])
                break
    return split_P


def _runs(passages: Sequence[Passage]) -> Iterable[list[Passage]]:
    """Maximal groups of passages that are contiguous text of one document."""
    run: list[Passage] = []
    for p in passages:
        if run and (p.source, p.doc, p.index) != (run[-1].source, run[-1].doc, run[-1].index + 1):
            yield run
            run = []
        run.append(p)
    if run:
        yield run


def write_split(path: Path, passages: Sequence[Passage]) -> int:
    """Passages (corpus order) as one ``uint16`` file, EOT after each contiguous run; token count."""
    eot = np.array([EOT_ID], dtype=np.uint16)
    n = 0
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        for run in _runs(passages):
            for p in run:
                p.tokens.astype(np.uint16, copy=False).tofile(f)
                n += p.tokens.shape[0]
            eot.tofile(f)
            n += 1
    os.replace(tmp, path)
    return n


def tokenize_passages(
    docs: Iterable[tuple[str, str, str]], encoder, passage_chars: int, desc: str = "tokenise"
) -> list[Passage]:
    """(source, doc id, text) -> passages with GPT-2 ids; tiktoken runs on every core."""
    pending = [
        (source, doc, i, piece)
        for source, doc, text in docs
        for i, piece in enumerate(split_passages(text, passage_chars))
    ]
    passages: list[Passage] = []
    batch = 512
    threads = max(1, os.cpu_count() or 1)
    with tqdm(total=len(pending), desc=desc, unit="passage", leave=False) as bar:
        for lo in range(0, len(pending), batch):
            chunk = pending[lo : lo + batch]
            ids = encoder.encode_ordinary_batch([c[3] for c in chunk], num_threads=threads)
            for (source, doc, i, _), toks in zip(chunk, ids, strict=True):
                passages.append(Passage(source, doc, i, np.asarray(toks, dtype=np.uint16)))
            bar.update(len(chunk))
    return passages


def write_shards(
    out_dir: Path,
    passages: Sequence[Passage],
    *,
    val_tokens: int,
    test_tokens: int,
    meta: dict,
) -> dict:
    """Carve the splits, write ``{train,val,test}.bin`` and ``meta.json``; returns the meta."""
    split_P = assign_splits(
        [p.key for p in passages], [p.tokens.shape[0] for p in passages], val_tokens, test_tokens
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    splits, per_source = {}, {}
    for s, name in enumerate(SPLITS):
        chosen = [p for p, sp in zip(passages, split_P, strict=True) if sp == s]
        path = out_dir / f"{name}.bin"
        n = write_split(path, chosen)
        splits[name] = {"file": path.name, "tokens": n, "passages": len(chosen)}
        for p in chosen:
            counts = per_source.setdefault(p.source, dict.fromkeys(SPLITS, 0))
            counts[name] += p.tokens.shape[0]
    for name in SPLITS:
        splits[name]["sha256"] = sha256_file(out_dir / f"{name}.bin")
    meta = {
        "format": SHARD_FORMAT,
        "dtype": "uint16",
        "eot": EOT_ID,
        "vocab_size": VOCAB_SIZE,
        **meta,
        "val_tokens_target": val_tokens,
        "test_tokens_target": test_tokens,
        "splits": splits,
        "tokens_by_source": per_source,
    }
    # meta.json last: its presence means the shards beside it are complete.
    tmp = out_dir / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out_dir / META_FILE)
    return meta


@dataclass
class Shards:
    """The three splits of one shard folder, memory-mapped read-only, and its meta."""

    path: Path
    meta: dict
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    sha256: dict[str, str] = field(default_factory=dict)
    """Each split's sha256 as computed from its file when opened (equal to meta.json's, which
    ``open_shards`` checked): what a run records as the data it trained on."""

    def split(self, name: str) -> np.ndarray:
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; choose one of {SPLITS}")
        return getattr(self, name)


def read_meta(path: Path, missing_hint: str) -> dict:
    meta_path = path / META_FILE
    if not meta_path.exists():
        raise DataError(f"no token shards at {path} (no {META_FILE}); {missing_hint}")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{meta_path}: not valid JSON ({e}); {missing_hint}") from None
    if meta.get("format") != SHARD_FORMAT or meta.get("dtype") != "uint16":
        raise DataError(
            f"{meta_path}: shard format {meta.get('format')!r}/{meta.get('dtype')!r} is not "
            f"{SHARD_FORMAT}/uint16; {missing_hint}"
        )
    return meta


_scanned: dict[tuple, tuple[str, int]] = {}
"""(file, size, mtime, inode) -> (sha256, largest id): each file is read once per process."""


def scan_split(file: Path) -> tuple[str, int]:
    """``(sha256, largest token id)`` of a ``uint16`` split file (-1 when empty); computed once
    per process and file version (its size, mtime and inode), so the corpus is read in full
    once per run however often it is opened (~0.1 s for the 21 MB corpus)."""
    st = file.stat()
    key = (str(file.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _scanned:
        ids = np.memmap(file, dtype=np.uint16, mode="r") if st.st_size else np.zeros(0, np.uint16)
        _scanned[key] = (sha256_file(file), int(ids.max()) if ids.size else -1)
    return _scanned[key]


def verify_split(file: Path, meta: dict, name: str, hint: str) -> str:
    """The split file's sha256, after checking it against meta.json's (a file changed in place,
    at the same size, is refused) and its ids against the vocabulary (an id >= ``vocab_size``
    would index past the embedding hours later, at the first step that draws it): one-line
    ``DataError`` naming the file."""
    digest, top = scan_split(file)
    recorded = meta["splits"][name].get("sha256")
    if recorded and digest != recorded:
        raise DataError(
            f"{file}: sha256 {digest[:16]}... differs from the {recorded[:16]}... that "
            f"{META_FILE} records: the file was changed or corrupted after it was written; {hint}"
        )
    vocab_size = int(meta.get("vocab_size", VOCAB_SIZE))
    if top >= vocab_size:
        at = int(np.argmax(np.memmap(file, dtype=np.uint16, mode="r") >= vocab_size))
        raise DataError(
            f"{file}: token id {top} (first out-of-range id at position {at}) is outside the "
            f"vocabulary of {vocab_size} ids that {META_FILE} records; {hint}"
        )
    return digest


def open_shards(path: str | os.PathLike, missing_hint: str) -> Shards:
    """Memory-map a shard folder. A missing or truncated file, one whose sha256 is not the one
    meta.json records, or an id outside the vocabulary is a one-line ``DataError``."""
    path = Path(path)
    meta = read_meta(path, missing_hint)
    arrays, digests = {}, {}
    for name in SPLITS:
        file = path / f"{name}.bin"
        expected = meta["splits"][name]["tokens"]
        if not file.exists() or file.stat().st_size != 2 * expected:
            size = file.stat().st_size if file.exists() else None
            raise DataError(
                f"{file}: expected {2 * expected} bytes ({expected} uint16 tokens), found "
                f"{'no file' if size is None else f'{size} bytes'}; {missing_hint}"
            )
        digests[name] = verify_split(file, meta, name, missing_hint)
        arrays[name] = (
            np.memmap(file, dtype=np.uint16, mode="r") if expected else np.zeros(0, np.uint16)
        )
    return Shards(path=path, meta=meta, **arrays, sha256=digests)
