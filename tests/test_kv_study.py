"""The KV-eviction study on the lab's trainer, on CPU: the 8 tiny cells end to end (once), the
golden curve of a gated sigmoid cell, the loss terms and gate tags, identical initial weights, the
next-token step's scaling, and the refusals."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from stabilitylab import config as C
from stabilitylab import tags
from stabilitylab.analysis.events import load_runs
from stabilitylab.data.loader import StepBatches
from stabilitylab.data.source import DataError
from stabilitylab.data.text import EOT_ID, open_sample
from stabilitylab.model import gate_mean, next_token_loss_sum
from stabilitylab.probes.gates import gate_stats_LBT
from stabilitylab.telemetry import StepTelemetry
from stabilitylab.train import build, run
from stabilitylab.train.checkpoint import read_state
from stabilitylab.train.step import read_numbers, train_step
from stabilitylab.train.task import CompactVocab, NextTokenBatches, text_task

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "kv_tiny_sig_g_rope_loss.json"
STEPS = 30  # the golden curve's length (tests/golden/make_golden_kv.py)
GATED = [c for c in C.CELLS if "-g-" in c]


def tiny(out_dir, *overrides) -> C.Config:
    return C.parse(["--preset", "tiny", f"--out_dir={out_dir}", *overrides])


@pytest.fixture(scope="module")
def eight_cells(tmp_path_factory):
    """The one full 8-cell run of the suite: the tiny preset cut to the golden's 30 steps, with
    validation every 10 steps (the golden was made with the preset's 25: validation must not
    change the trajectory)."""
    out = tmp_path_factory.mktemp("kv")
    cfg = tiny(out, f"--train.steps={STEPS}", "--telemetry.val_every=10")
    return cfg, out / "kv_tiny", run(cfg)


def test_all_eight_cells_train_and_learn(eight_cells):
    cfg, run_dir, summaries = eight_cells
    assert list(summaries) == list(C.CELLS)
    for cell, s in summaries.items():
        d = run_dir / cell
        assert s["status"] == "stable" and s["steps"] == STEPS, cell
        # The preset's cosine decays the lr over the 30 steps (to 10% at the last): 6.4 -> 5.5.
        assert s["final_loss"] < s["initial_loss"] - 0.8, cell
        assert s["final_val_ppl"] < 0.7 * s["first_val_ppl"], cell
        hist = read_state(d / "checkpoints" / "last")["history"]
        assert hist["val_steps"] == [0, 10, 20, STEPS - 1]
        assert hist["val_loss"][-1] < hist["val_loss"][0]
        conf = json.loads((d / "config.json").read_text())
        kind, gates, position = C.cell_settings(cell)
        assert conf["arm"] == cell and conf["model"]["causal"] is True
        assert (conf["model"]["gates"], conf["model"]["position"]) == (gates, position)
        assert conf["backend"] == ("softmax" if kind == "softmax" else "sigmoid-reference")
        vocab = json.loads((d / "vocab.json").read_text())
        assert len(vocab["model_id_to_gpt2_id"]) == conf["data"]["vocab_size"] == 595
        assert vocab["model_id_to_gpt2_id"][vocab["eot"]] == EOT_ID
        assert len(list(d.glob("events.out.tfevents.*"))) == 1
        if gates:
            assert 0.9 < s["gate_mean"] < 0.995 and s["gate_frac_binary"] > 0.9
        else:
            assert "gate_mean" not in s
    report = (run_dir / "report" / "report.md").read_text()
    assert all(f"arm `{cell}`" in report for cell in C.CELLS)


def test_the_gated_sigmoid_cell_matches_the_golden_curve(eight_cells):
    """Regenerate deliberately when the model, data or optimizer change:
    python tests/golden/make_golden_kv.py"""
    _, run_dir, _ = eight_cells
    golden = json.loads(GOLDEN.read_text())
    assert golden["cell"] == "sig-g-rope" and len(golden["loss"]) == STEPS
    loss = read_state(run_dir / "sig-g-rope" / "checkpoints" / "last")["history"]["loss"]
    torch.testing.assert_close(
        torch.tensor(loss), torch.tensor(golden["loss"]), rtol=1e-4, atol=1e-4
    )


def _wide(df, tag_names):
    return df[df.tag.isin(tag_names)].pivot(index="step", columns="tag", values="value")


def test_loss_terms_and_gate_statistics_are_logged_apart(eight_cells):
    cfg, run_dir, _ = eight_cells
    cell = cfg.arm_config("sig-g-nope")
    one_gate_layer = 1 / (cell.train.budget_ref_layers - 1)  # per_gate: lambda/11 at any depth
    gated = load_runs([run_dir / "sig-g-nope"])
    found = set(gated.tag)
    per_layer = [tags.GATE_MEAN_LAYER, tags.GATE_LOW_LAYER, tags.GATE_HIGH_LAYER]
    expected = {tags.layer(t, 0) for t in per_layer} | {
        tags.CE_LOSS, tags.BUDGET_LOSS, tags.GATE_MEAN, tags.VAL_LOSS, tags.VAL_PPL,
        tags.layer(tags.MAX_LOGIT_LAYER, 1), tags.layer(tags.JACOBIAN_LAYER, 1),
        tags.layer(tags.GRAD_NORM_LAYER, 1),
    }  # fmt: skip
    assert expected <= found
    assert tags.layer(tags.GATE_MEAN_LAYER, 1) not in found, "the last layer emits no gate"
    w = _wide(gated, [tags.LOSS, tags.CE_LOSS, tags.BUDGET_LOSS, tags.GATE_MEAN])
    assert len(w) == STEPS // cfg.telemetry.log_every
    np.testing.assert_allclose(w[tags.LOSS], w[tags.CE_LOSS] + w[tags.BUDGET_LOSS], rtol=1e-6)
    lam = np.array([build.budget_lambda_at(cell, int(step)) for step in w.index])
    assert lam[0] == 0.0 and w[tags.BUDGET_LOSS].iloc[0] == 0.0  # the ramp starts at 0
    np.testing.assert_allclose(
        w[tags.BUDGET_LOSS], lam * one_gate_layer * w[tags.GATE_MEAN], rtol=1e-4
    )
    assert (
        w[tags.GATE_MEAN].iloc[-1] < w[tags.GATE_MEAN].iloc[0] < 0.9934
    )  # sigmoid(5), pushed down
    val = _wide(gated, [tags.VAL_LOSS, tags.VAL_PPL])
    np.testing.assert_allclose(val[tags.VAL_PPL], np.exp(val[tags.VAL_LOSS]), rtol=1e-5)

    dense = load_runs([run_dir / "sig-nope"])
    assert tags.CE_LOSS in set(dense.tag) and tags.BUDGET_LOSS not in set(dense.tag)
    assert not [t for t in dense.tag.unique() if t.startswith("gate/")]
    w = _wide(dense, [tags.LOSS, tags.CE_LOSS])
    np.testing.assert_array_equal(w[tags.LOSS], w[tags.CE_LOSS])


def test_a_rerun_finds_every_cell_finished(eight_cells, capsys):
    cfg, run_dir, summaries = eight_cells
    before = {c: (run_dir / c / "summary.json").stat().st_mtime_ns for c in C.CELLS}
    again = run(cfg)
    assert again == {c: json.loads(json.dumps(s)) for c, s in summaries.items()}
    assert {c: (run_dir / c / "summary.json").stat().st_mtime_ns for c in C.CELLS} == before
    assert capsys.readouterr().out.count("nothing to do") == len(C.CELLS)


# ---- without a training run -------------------------------------------------------------------


def test_every_cell_starts_from_the_same_weights_where_they_coincide(tmp_path):
    cfg = tiny(tmp_path)
    vocab = text_task(cfg).vocab_size
    models = {
        c: build.build_model(cfg.arm_config(c), cfg.backend_for(c, cuda=False), vocab)
        for c in C.CELLS
    }
    reference = models["sm-rope"].state_dict()
    gate_keys = {"blocks.0.gate_out.weight_GC", "blocks.0.gate_out.bias_G"}
    for cell, model in models.items():
        state = model.state_dict()
        extra = set(state) - set(reference)
        assert extra == (gate_keys if cell in GATED else set()), cell
        assert set(reference) <= set(state), cell
        for name, t in reference.items():
            assert torch.equal(t, state[name]), (cell, name)
        if cell in GATED:
            assert (state["blocks.0.gate_out.weight_GC"] == 0).all()
            assert (state["blocks.0.gate_out.bias_G"] == 5.0).all()


def test_text_batches_follow_the_global_index_whatever_the_process_count():
    shards = open_sample()
    cfg = tiny("/unused")
    make = text_task(cfg, shards).make_micro
    one = StepBatches(make, global_batch=8, micro_batch=2, rank=0, world=1)[3]
    halves = [StepBatches(make, global_batch=8, micro_batch=2, rank=r, world=2)[3] for r in (0, 1)]
    rows = [b for h in halves for b in h.micro]
    assert [b.indices for b in one.micro] == [b.indices for b in rows]
    assert [i for b in one.micro for i in b.indices] == list(range(24, 32))
    for a, b in zip(one.micro, rows, strict=True):
        assert torch.equal(a.tokens_BT, b.tokens_BT) and torch.equal(a.labels_BT, b.labels_BT)
    assert one.counts_2.tolist() == [8 * 64, 8 * 64]


def test_the_compact_vocabulary_renumbers_ids_and_keeps_ignored_labels():
    compact = CompactVocab(np.array([7, 3, 7, 900]))
    assert compact.gpt2_ids_N.tolist() == [3, 7, 900, EOT_ID] and len(compact) == 4
    windows = _Fixed(np.array([3, 7, 900, 7, EOT_ID]))
    b = NextTokenBatches(windows, context_len=8, compact=compact)([0, 1])
    assert b.tokens_BT.tolist() == [[0, 1, 2, 1], [0, 1, 3, 3]]  # row 1 padded with end-of-text
    assert b.labels_BT.tolist() == [[1, 2, 1, 3], [1, 2, -100, -100]]
    assert b.lengths_B.tolist() == [4, 2] and b.n_masked == 6


class _Fixed:
    """Two windows: the whole array, and its first three tokens (so the batch pads row 1)."""

    def __init__(self, tokens):
        self.tokens = tokens

    def sample(self, index):
        return self.tokens if index == 0 else self.tokens[:3]


def test_the_step_loss_is_the_global_mean_ce_plus_lambda_mean_gate():
    """Two micro-batches of 4 (accumulation 2) give the same terms as one pass over all 8."""
    from accelerate import Accelerator

    cfg = tiny("/unused", "--train.global_batch=8", "--train.micro_batch=4", "--train.lr=1e-3")
    cell = cfg.arm_config("sig-g-rope")
    data = text_task(cell)
    model = build.build_model(cell, "sigmoid-reference", data.vocab_size)
    t = build.prepare(cell, Accelerator(cpu=True), model, accum=2)
    tel = StepTelemetry(cell, t.raw, world=1, cuda=False)
    step = StepBatches(data.make_micro, global_batch=8, micro_batch=4, rank=0, world=1)[0]
    tokens_BT = torch.cat([b.tokens_BT for b in step.micro])
    labels_BT = torch.cat([b.labels_BT for b in step.micro])
    lengths_B = torch.cat([b.lengths_B for b in step.micro])
    with torch.no_grad():
        ce = next_token_loss_sum(t.raw(tokens_BT, lengths_B), labels_BT) / labels_BT.numel()
        g = gate_mean(t.raw.gates, lengths_B)
        stats = gate_stats_LBT(t.raw.gates, lengths_B)
    numbers = read_numbers(train_step(t, step, 1e-3, cell.train.clip_grad, tel))
    lam = 0.03 / 11  # the full lambda (no ramp passed), per_gate with one gate layer
    assert numbers.terms_2 == pytest.approx([ce.item(), lam * g.item()], rel=1e-5)
    assert numbers.loss == pytest.approx(ce.item() + lam * g.item(), rel=1e-6)
    want_3L = torch.stack([stats["mean_L"], stats["frac_low_L"], stats["frac_high_L"]])
    got_3L = torch.tensor(numbers.gate_3L, dtype=torch.float64)
    torch.testing.assert_close(got_3L, want_3L, rtol=1e-6, atol=1e-7)
    assert numbers.gate_3L[0][0] > 0.99 and numbers.gate_3L[2] == [1.0]


def test_validation_does_not_change_the_trajectory(tmp_path):
    def losses(name, val_every):
        run(
            tiny(
                tmp_path / name, "--cells", "sig-g-nope", "--train.steps=6", "--report=False",
                f"--telemetry.val_every={val_every}",
            )
        )  # fmt: skip
        return read_state(tmp_path / name / "kv_tiny" / "sig-g-nope" / "checkpoints" / "last")

    off, on = losses("off", 0), losses("on", 2)
    assert off["history"]["val_steps"] == [] and on["history"]["val_steps"] == [0, 2, 4, 5]
    assert on["history"]["loss"] == off["history"]["loss"]
    for name, t in off["model"].items():
        assert torch.equal(t, on["model"][name]), name


# ---- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--preset", "tiny", "--model.causal=False"], "model.causal: data.source=text needs a causal"),
        (["--preset", "smoke", "--model.causal=True"], "model.causal: data.source=synthetic needs the bidirectional"),
        (["--preset", "smoke", "--cells", "sm-rope"], "config cells: picks the KV-eviction"),
        (["--preset", "smoke", "--telemetry.val_every=5"], "config telemetry.val_every"),
        (["--preset", "tiny", "--arm", "softmax"], "config arm: picks the stress study"),
        (["--preset", "tiny", "--cells", "sm-rope", "sm-rope"], "config cells: repeats"),
        (["--preset", "tiny", "--train.budget_lambda=-0.1"], "config train.budget_lambda"),
        (["--preset", "tiny", "--data.text=files"], "config data.text_files: is required"),
        (["--preset", "tiny", "--model.d_model=66"], "model.position: rope needs an even"),
    ],
)  # fmt: skip
def test_a_config_that_contradicts_its_task_is_refused_by_key(argv, match):
    with pytest.raises(C.ConfigError, match=match):
        C.parse(argv)


@pytest.mark.parametrize(
    "override, key", [("--model.gates=True", "model.gates"), ("--model.position=none", "model.position")]
)  # fmt: skip
def test_keys_the_cells_own_are_refused_before_any_work(tmp_path, override, key):
    with pytest.raises(C.ConfigError, match=f"config {key}: each cell sets it"):
        run(tiny(tmp_path, override))
    assert not (tmp_path / "kv_tiny").exists()


def test_a_missing_corpus_names_the_command_that_builds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("STABILITYLAB_DATA", str(tmp_path / "nothing"))
    cfg = C.parse(["--preset", "reduced", f"--out_dir={tmp_path}"])
    with pytest.raises(DataError, match="make data"):
        run(cfg)
    assert not (tmp_path / "kv_reduced").exists()


def _script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"}  # one line per option
    return subprocess.run(
        [sys.executable, "experiments/kv_eviction.py", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=120, env=env,
    )  # fmt: skip


def test_the_script_help_lists_presets_and_cells():
    proc = _script("--preset", "tiny", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.replace("\u2502", " ").split())
    for name in ("tiny", "reduced", "paper"):
        assert f"{name} {C.preset_summary(name)}" in text
    # The choices wrap (and at 400 columns interleave with a second column) as tyro lays them
    # out: each name must be offered, the paper's 8 first.
    compact = "".join(text.split())
    start = compact.index("--cells[{" + ",".join(C.CELLS[:4]))
    for cell in (*C.CELLS, *C.FT_CELLS):
        assert f"{cell}," in compact[start:] or f"{cell}}}" in compact[start:], cell
    assert "(default: 150)" in text  # tiny's steps: the chosen preset's values


@pytest.mark.skipif(torch.cuda.is_available(), reason="machine has CUDA")
def test_the_script_refuses_a_gpu_preset_on_a_cpu_naming_tiny():
    proc = _script("--preset", "reduced")
    assert proc.returncode == 2
    assert "--preset tiny" in proc.stderr and "CUDA" in proc.stderr
