"""Which tokens the gates keep: GPT-2 pieces sorted into coarse categories, mean gate per category.

The paper buckets GPT-2 surface tokens into content words, stopwords, punctuation, newline,
whitespace and digits (confirmed); its rules and word list are not given, so these are ours.
A *piece* is one token decoded to text: GPT-2's byte-level 'Ġ' prefix is then a real leading
space (' the'). ``token_category`` applies the first rule that matches:

1. newline      the piece is all whitespace and holds at least one '\\n' ('\\n', '\\n\\n', ' \\n')
2. whitespace   the piece is all whitespace otherwise (spaces, tabs)
3. digits       after dropping one leading space, the rest is ASCII digits only (' 1999', '42')
4. punctuation  after stripping whitespace, every character is Unicode punctuation or symbol
                (categories P*, S*: ',', ' (', '$', '--'); U+FFFD is not (see below)
5. stopword     the stripped, lowercased piece is in ``STOPWORDS`` (' the', 'The', "'s")
6. content      everything else (' cat', 'ing', ' Paris', 'x2')

Limits: the rule sees one piece, not its neighbours, so a word-internal fragment that spells a
stopword (the 'in' of a word split as 'in' + 'gest') counts as a stopword. A byte fragment of a
multi-byte character decodes to U+FFFD and counts as content; all such fragments share that one
piece string, so ``extreme_tokens`` groups them together.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch

CATEGORIES = ("content", "stopword", "punctuation", "newline", "whitespace", "digits")

# Common English function words, written for this probe: articles and determiners, pronouns,
# prepositions, conjunctions, auxiliary and modal verbs, frequent adverbs, and the clitics and
# contraction stems that GPT-2 splits off ("don" + "'t", "it" + "'s").
STOPWORDS = frozenset(
    """
    a an the this that these those each every either neither some any no all both few many much
    more most other another such own same several
    i me my mine myself we us our ours ourselves you your yours yourself yourselves he him his
    himself she her hers herself it its itself they them their theirs themselves one
    who whom whose which what whatever whoever whichever
    of in on at by for with without from to into onto upon about above below over under
    between among through throughout during before after since until till against toward
    towards across along around behind beyond near off out up down within via per than like
    and or but nor so yet if unless because although though while whereas whether as
    be is am are was were been being have has had having do does did doing
    will would shall should can could may might must
    not also just only very too then there here when where why how now again ever never still
    even ago else once rather quite perhaps
    's 't 're 've 'll 'd 'm
    don doesn didn isn aren wasn weren hasn haven hadn couldn wouldn shouldn
    """.split()
)


def _is_punctuation_char(c: str) -> bool:
    return c != "\ufffd" and unicodedata.category(c)[0] in "PS"


def token_category(piece: str) -> str:
    """The category of one decoded GPT-2 piece, by the rules of the module doc."""
    if not isinstance(piece, str) or piece == "":
        raise ValueError(f"a token piece must be a non-empty string, got {piece!r}")
    if piece.isspace():
        return "newline" if "\n" in piece else "whitespace"
    unspaced = piece[1:] if piece.startswith(" ") else piece
    if unspaced and all(c in "0123456789" for c in unspaced):
        return "digits"
    stripped = piece.strip()
    if all(_is_punctuation_char(c) for c in stripped):
        return "punctuation"
    if stripped.lower() in STOPWORDS:
        return "stopword"
    return "content"


def _gates_per_position(pieces: Sequence[str], gates) -> np.ndarray:
    """Gates as a float64 vector aligned with ``pieces``; a ``(layers, N)`` input is averaged
    over layers first, so each position counts once."""
    g = gates.detach().cpu().double().numpy() if isinstance(gates, torch.Tensor) else gates
    g = np.asarray(g, dtype=np.float64)
    if g.ndim == 2:
        g = g.mean(axis=0)
    if g.ndim != 1 or g.shape[0] != len(pieces):
        raise ValueError(
            f"gates must have shape (N,) or (layers, N) with N = {len(pieces)} pieces, "
            f"got {tuple(np.shape(gates))}"
        )
    return g


def gate_by_category(pieces: Sequence[str], gates) -> pd.DataFrame:
    """Mean gate per category: ``category, count, mean_gate``, one row per category in
    ``CATEGORIES`` order (a category with no token has count 0 and a NaN mean).

    ``pieces[n]`` is the decoded token at position n and ``gates[..., n]`` its gate (tensor or
    array, shape ``(N,)`` or ``(layers, N)``); pass valid positions only.
    """
    g = _gates_per_position(pieces, gates)
    frame = pd.DataFrame(dict(category=[token_category(p) for p in pieces], gate=g))
    grouped = frame.groupby("category")["gate"].agg(["count", "mean"])
    grouped = grouped.reindex(list(CATEGORIES))
    return pd.DataFrame(
        dict(
            category=list(CATEGORIES),
            count=grouped["count"].fillna(0).astype(int).to_numpy(),
            mean_gate=grouped["mean"].to_numpy(),
        )
    )


def extreme_tokens(pieces: Sequence[str], gates, k: int = 10, min_count: int = 1) -> pd.DataFrame:
    """The ``k`` token types with the lowest and the ``k`` with the highest mean gate.

    A token type is a distinct piece string; types seen fewer than ``min_count`` times are left
    out. Columns: ``end`` ('lowest' | 'highest'), ``rank`` (1 = most extreme), ``piece``,
    ``category``, ``count``, ``mean_gate``. Ties break by piece, so the table is deterministic.
    """
    if k < 1 or min_count < 1:
        raise ValueError(f"k and min_count must be >= 1, got k={k}, min_count={min_count}")
    g = _gates_per_position(pieces, gates)
    frame = pd.DataFrame(dict(piece=list(pieces), gate=g))
    types = frame.groupby("piece")["gate"].agg(count="count", mean_gate="mean").reset_index()
    types = types[types["count"] >= min_count]
    types.insert(1, "category", [token_category(p) for p in types["piece"]])
    parts = []
    for end, ascending in (("lowest", True), ("highest", False)):
        part = types.sort_values(["mean_gate", "piece"], ascending=[ascending, True]).head(k)
        part = part.assign(end=end, rank=np.arange(1, len(part) + 1))
        parts.append(part)
    out = pd.concat(parts, ignore_index=True)
    return out[["end", "rank", "piece", "category", "count", "mean_gate"]]
