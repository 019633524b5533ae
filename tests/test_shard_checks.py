"""Token shards are checked when opened: a file changed in place (same size) against the
sha256 meta.json records, and every id against the vocabulary; one ``error:`` line naming the
file, before any training. A run records the sha256 of the file it read."""

import os
import shutil

import numpy as np
import pytest

from stabilitylab import config as C
from stabilitylab.cli import kv_main
from stabilitylab.data.source import DataError
from stabilitylab.data.text.build import SAMPLE_DIR, _fingerprint, corpus_recipe, corpus_state
from stabilitylab.data.text.fetch import sha256_file
from stabilitylab.data.text.shards import META_FILE, Passage, open_shards, write_shards
from stabilitylab.train.task import text_task


def flip_bytes(file, at: int = 6) -> None:
    """Change two bytes in place: same size, other content (and a later mtime, as any write)."""
    with open(file, "r+b") as f:
        f.seek(at)
        old = f.read(2)
        f.seek(at)
        f.write(bytes(b ^ 0x01 for b in old))
    st = os.stat(file)
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def sample_copy(dest):
    shutil.copytree(SAMPLE_DIR, dest)
    return dest


def test_a_shard_changed_in_place_is_refused_naming_the_file(tmp_path):
    d = sample_copy(tmp_path / "text")
    size = (d / "val.bin").stat().st_size
    open_shards(d, "rebuild it")  # fine, and its scan is cached
    flip_bytes(d / "val.bin")
    assert (d / "val.bin").stat().st_size == size
    with pytest.raises(DataError, match=r"val\.bin: sha256 \w+\.\.\. differs from") as e:
        open_shards(d, "rebuild it")
    assert "\n" not in str(e.value) and str(e.value).endswith("rebuild it")


def test_the_run_refuses_a_corrupted_corpus_with_one_line(tmp_path, monkeypatch, capsys):
    sample_copy(tmp_path / "data" / "text")
    flip_bytes(tmp_path / "data" / "text" / "train.bin", at=100)
    monkeypatch.setenv("STABILITYLAB_DATA", str(tmp_path / "data"))
    argv = ["--preset", "tiny", "--data.text=corpus", f"--out_dir={tmp_path / 'runs'}"]
    with pytest.raises(SystemExit) as e:
        kv_main([*argv, "--cells", "sm-rope", "--train.steps=1"])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {tmp_path / 'data' / 'text'}/train.bin")
    assert not (tmp_path / "runs" / "kv_tiny" / "sm-rope").exists(), "refused before any work"


def test_a_corrupted_corpus_is_not_up_to_date(tmp_path):
    d = sample_copy(tmp_path / "text")
    meta = (d / META_FILE).read_text()
    (d / META_FILE).write_text(meta.replace("{", f'{{"recipe": "{_fingerprint(corpus_recipe())}",', 1))  # fmt: skip
    assert corpus_state(d) is None, "the sample under the corpus recipe reads as current"
    flip_bytes(d / "test.bin")
    why = corpus_state(d)
    assert why is not None and why.startswith(f"{d}/test.bin: sha256")


def test_an_id_outside_the_vocabulary_is_refused_when_opened(tmp_path):
    rng = np.random.default_rng(0)
    passages = [
        Passage("s", f"d{p}", 0, rng.integers(0, 50_000, size=30).astype(np.uint16))
        for p in range(40)
    ]
    passages[7].tokens[3] = 60_000  # a uint16 the tokenizer never makes
    write_shards(tmp_path / "a", passages, val_tokens=100, test_tokens=200, meta={})
    with pytest.raises(
        DataError, match=r"\.bin: token id 60000 .* outside the vocabulary of 50257"
    ):
        open_shards(tmp_path / "a", "rebuild it")


def test_a_run_records_the_sha256_of_the_file_it_read():
    cfg = C.parse(["--preset", "tiny", "--telemetry.val_every=0"])
    shards = open_shards(SAMPLE_DIR, "")
    shards.meta["splits"]["train"]["sha256"] = "what meta.json says"
    facts = text_task(cfg, shards).facts
    assert facts["train_sha256"] == sha256_file(SAMPLE_DIR / "train.bin")
