"""The text the model probes read: evaluation windows in a run's own ids, and their GPT-2 pieces.

Which windows: ``spread_indices`` draws ``n`` of a split's full evaluation windows (stride
``context_len``, ``context_len + 1`` tokens; a shorter last window is left out unless it is the
only one) evenly across the split, one per stratum of ``N / n`` windows at an offset seeded by
``seed`` (the study's ``study.seed``), so a split of several texts is read in all of them rather
than in its first. The same (split, n, seed) always gives the same windows; ``n`` at or above
the split's count gives all of them.

A text run's ``vocab.json`` says how its token ids read: GPT-2 ids as they are, or, with
``data.vocab=compact``, ``model_id_to_gpt2_id`` (model id ``i`` is GPT-2 id ``ids[i]``; see
``stabilitylab.train.task.CompactVocab``). ``probe_windows`` maps the split's GPT-2 ids to the
model's ids through that list; ``gpt2_pieces_fn`` maps them back and decodes each GPT-2 id to its
text with the lab's tokenizer (``load_gpt2``). A byte fragment of a multi-byte character decodes
to U+FFFD (``errors="replace"``); end-of-text has no surface text and gives None, which the
category tables leave out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from stabilitylab.data.text import EOT_ID, VOCAB_SIZE, EvalWindows, load_gpt2, make_lm_batch
from stabilitylab.probes.model_probes import PiecesFn


def read_vocab(cell_dir: str | Path) -> dict:
    """A run dir's ``vocab.json``; refuses a vocabulary that is not text (the cell study's)."""
    path = Path(cell_dir) / "vocab.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: not a text run dir?")
    vocab = json.loads(path.read_text())
    if "r50k_base" not in str(vocab.get("tokenizer", "")):
        raise ValueError(
            f"{path}: not a GPT-2 text vocabulary (tokenizer {vocab.get('tokenizer')!r})"
        )
    return vocab


def model_to_gpt2_ids(vocab: Mapping | None) -> np.ndarray | None:
    """``ids[i]`` = the GPT-2 id of model id ``i`` for a compact vocabulary, else None."""
    ids = None if vocab is None else vocab.get("model_id_to_gpt2_id")
    if ids is None:
        return None
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0 or ids.min() < 0 or ids.max() >= VOCAB_SIZE:
        raise ValueError(f"vocab model_id_to_gpt2_id must list GPT-2 ids in [0, {VOCAB_SIZE})")
    return ids


def gpt2_to_model_ids(tokens: torch.Tensor, vocab: Mapping | None) -> torch.Tensor:
    """GPT-2 ids -> the model's ids (unchanged without a compact vocabulary)."""
    ids = model_to_gpt2_ids(vocab)
    if ids is None:
        return tokens
    from stabilitylab.train.task import CompactVocab

    mapped = torch.from_numpy(CompactVocab(ids).index_V)[tokens]
    if (mapped < 0).any():
        missing = sorted(set(tokens[mapped < 0].tolist()))[:5]
        raise ValueError(f"GPT-2 ids {missing} are not in the run's compact vocabulary")
    return mapped


def spread_indices(n_available: int, n: int | None, seed: int) -> list[int]:
    """``n`` distinct indices of ``range(N)``, ``N = n_available``, spread evenly, in order::

        index_k = floor((k * N + o) / n),   k = 0 .. n - 1,   o uniform in [0, N) from ``seed``

    A systematic sample: pick k lies in ``[floor(k N / n), (k + 1) N / n)``, the k-th of n strata
    of ``N / n >= 1`` indices, at the same relative offset ``o / N`` in each; consecutive picks
    differ by ``floor(N / n)`` or one more, so they are distinct, and the first lies in the
    first stratum, the last in the last. Integer arithmetic: the largest pick is ``N - 1`` at
    most. ``n`` None or ``>= N``: every index."""
    if n_available < 1:
        raise ValueError(f"n_available must be >= 1, got {n_available}")
    if n is not None and n < 1:
        raise ValueError(f"n must be >= 1 or None, got {n}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if n is None or n >= n_available:
        return list(range(n_available))
    o = int(np.random.default_rng(seed).integers(0, n_available))
    return [(k * n_available + o) // n for k in range(n)]


def full_window_count(windows: EvalWindows) -> int:
    """The windows holding ``context_len + 1`` tokens (all but a shorter last one); the one
    window when the split is shorter than that."""
    n = len(windows)
    short_last = len(windows.sample(n - 1)) < windows.context_len + 1
    return n - 1 if short_last and n > 1 else n


def probe_window_indices(windows: EvalWindows, n_windows: int | None, seed: int = 0) -> list[int]:
    """``spread_indices`` over the full windows of ``windows`` (module doc)."""
    return spread_indices(full_window_count(windows), n_windows, seed)


def probe_windows(
    data_cfg, vocab: Mapping | None, split: str = "test", n_windows: int | None = 50, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n_windows`` (None: all) full evaluation windows of ``split`` drawn across it with
    ``seed`` (module doc; ``EvalWindows``: stride ``context_len``) as ``(tokens_BT, lengths_B)``
    in the model's ids. ``data_cfg`` is a run's ``DataConfig`` (what it trained on)."""
    from stabilitylab.train.task import open_text  # the data stack, only when windows are read

    if n_windows is not None and n_windows < 1:
        raise ValueError(f"n_windows must be >= 1 or None, got {n_windows}")
    shards = open_text(data_cfg)
    T = data_cfg.context_len
    windows = EvalWindows(shards.split(split), T, name=f"{split} ({shards.path})")
    batch = make_lm_batch(windows, probe_window_indices(windows, n_windows, seed), T)
    return gpt2_to_model_ids(batch.tokens_BT, vocab), batch.lengths_B


def shared_vocab(
    vocabs: Mapping[str, dict], where: str, error: type[Exception] = ValueError
) -> dict:
    """The one vocab.json that the cells ``vocabs`` (cell -> vocab.json) share; ``error`` naming
    the cells whose vocabulary differs from the first's (their ids would not agree)."""
    if not vocabs:
        raise error(f"{where}: no cells to read a vocabulary from")
    first = next(iter(vocabs))
    differ = [c for c, v in vocabs.items() if v != vocabs[first]]
    if differ:
        raise error(f"{where}: cells {differ} have another vocab.json than {first!r}")
    return vocabs[first]


def cell_windows(
    run_dir: str | Path,
    cells: Sequence[str],
    data_cfg,
    split: str = "test",
    n_windows: int | None = 50,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``probe_windows`` for the cells ``<run_dir>/<cell>/`` of one study: ``(tokens_BT,
    lengths_B, vocab)``, refusing cells whose vocab.json differ (their ids would not agree)."""
    if not cells:
        raise ValueError(f"{run_dir}: no cells to read windows for")
    vocab = shared_vocab({c: read_vocab(Path(run_dir) / c) for c in cells}, str(run_dir))
    tokens_BT, lengths_B = probe_windows(data_cfg, vocab, split, n_windows, seed)
    return tokens_BT, lengths_B, vocab


def _sample_pieces() -> dict[int, str]:
    """The GPT-2 pieces of the shipped sample's ids (``sample/pieces.json``, made with the
    tokenizer), so that the tiny study's probes read pieces where the tokenizer file is absent."""
    from stabilitylab.data import text

    path = Path(text.__file__).parent / "sample"
    table = json.loads((path / "pieces.json").read_text())["pieces"]
    return {int(k): v for k, v in table.items()}


def _decoder(encoding):
    """GPT-2 id -> its text: the tokenizer when given or on disk, else the sample's pieces."""
    from stabilitylab.data.source import DataError

    if encoding is None:
        try:
            encoding = load_gpt2()
        except DataError:
            table = _sample_pieces()

            def from_sample(gpt2_id: int) -> str:
                if gpt2_id not in table:
                    raise DataError(
                        f"GPT-2 id {gpt2_id} is not in the shipped sample and the tokenizer "
                        "file is missing: fetch it with `make data`"
                    )
                return table[gpt2_id]

            return from_sample
    return lambda gpt2_id: encoding.decode_single_token_bytes(gpt2_id).decode(
        "utf-8", errors="replace"
    )


def gpt2_pieces_fn(vocab: Mapping | None = None, encoding=None) -> PiecesFn:
    """Model ids -> GPT-2 pieces (module doc); ``encoding`` defaults to ``load_gpt2()``, or,
    where the tokenizer file is absent, the pieces of the shipped sample's ids."""
    ids = model_to_gpt2_ids(vocab)
    decode = _decoder(encoding)
    cache: dict[int, str | None] = {}

    def piece(gpt2_id: int) -> str | None:
        if gpt2_id not in cache:
            cache[gpt2_id] = None if gpt2_id == EOT_ID else decode(gpt2_id)
        return cache[gpt2_id]

    def pieces(model_ids: Sequence[int]) -> list[str | None]:
        gpt2 = model_ids if ids is None else ids[np.asarray(model_ids, dtype=np.int64)].tolist()
        return [piece(int(g)) for g in gpt2]

    return pieces
