"""The KV study's gate recipe on CPU (issue 38, point 1): the budget term's normalisation and
ramp, the cosine lr, no decay on the gates, the presets' defaults and the paper's literal form,
the -ft cells (a model that starts as its backbone, trained end to end and studied), every bad
source refused in one line before any work, and dead gate layers flagged."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from stabilitylab import config as C
from stabilitylab import runs, tags
from stabilitylab.analysis.events import load_runs
from stabilitylab.cli import USAGE_ERROR, kv_main, kv_study_main
from stabilitylab.data.loader import StepBatches
from stabilitylab.eviction.cells import dense_backbone, load_cells
from stabilitylab.eviction.pairs import cell_groups
from stabilitylab.model import budget_loss, gate_mean
from stabilitylab.telemetry import StepTelemetry
from stabilitylab.train import build, checkpoint, fast, run, warmstart
from stabilitylab.train.resume import config_changes
from stabilitylab.train.step import read_numbers, train_step
from stabilitylab.train.task import text_task

pytestmark = pytest.mark.usefixtures("one_thread")

LITERAL = [
    "--train.budget_norm=mean", "--train.budget_ramp=0", "--train.lr_decay=none",
    "--train.gate_weight_decay=True",
]  # fmt: skip
"""The paper's literal form (and the lab's before the recipe)."""
GOLDEN = Path(__file__).resolve().parent / "golden"
QUIET = ["--report=False", "--telemetry.probe_every=0", "--telemetry.layer_every=0"]


def tiny(out_dir, *overrides) -> C.Config:
    return C.parse(["--preset", "tiny", f"--out_dir={out_dir}", *overrides])


# ---- the schedule and the budget term (pure) --------------------------------------------------


def test_the_ramp_starts_at_zero_and_is_full_at_its_end():
    cfg = tiny("/unused", "--train.steps=100", "--train.budget_ramp=0.25")
    lam = [build.budget_lambda_at(cfg, s) for s in range(100)]
    assert lam[0] == 0.0 and lam[25] == lam[99] == 0.03
    assert lam[10] == pytest.approx(0.03 * 10 / 25)
    assert all(a < b for a, b in zip(lam[:26], lam[1:26], strict=False)), "rises every step"
    literal = tiny("/unused", "--train.steps=100", "--train.budget_ramp=0")
    assert build.budget_lambda_at(literal, 0) == 0.03


def _gates(means: list[float], B: int = 2, T: int = 5) -> list[torch.Tensor]:
    """One gate layer per mean, every valid position at that value; leaves with gradients."""
    return [torch.full((B, T), m, requires_grad=True) for m in means]


@pytest.mark.parametrize("n_layers", [6, 12])
def test_per_gate_pulls_one_gate_layer_as_the_papers_12_layers_do(n_layers):
    means = [0.1 * (i + 1) for i in range(n_layers - 1)]
    lengths_B = torch.tensor([5, 3])
    gates = _gates(means)
    mean_term = budget_loss(gates, lengths_B, 0.03, "mean")
    per_gate = budget_loss(gates, lengths_B, 0.03, "per_gate", ref_layers=12)
    assert mean_term.item() == pytest.approx(0.03 * sum(means) / (n_layers - 1))
    assert per_gate.item() == pytest.approx(0.03 * sum(means) / 11)
    if n_layers == 12:  # the paper's depth: one term
        assert per_gate.item() == pytest.approx(mean_term.item())
    # The pull on one gate layer's mean gate: lambda/11 under per_gate at any depth.
    (grad,) = torch.autograd.grad(per_gate, gates[0])
    pull = grad[0, 0].item() * lengths_B.sum().item()  # d term / d mean of layer 0
    assert pull == pytest.approx(0.03 / 11)


def test_the_cosine_falls_from_the_peak_after_warmup_to_the_floor_at_the_last_step():
    cfg = tiny("/unused", "--train.steps=100", "--train.warmup_steps=10", "--train.lr=1e-3")
    cfg.train.lr_decay, cfg.train.min_lr_ratio = "cosine", 0.1
    lr = [build.lr_at(cfg, s) for s in range(100)]
    assert lr[0] == pytest.approx(1e-4) and lr[9] == lr[10] == pytest.approx(1e-3)
    assert lr[99] == pytest.approx(1e-4)
    assert lr[55] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 45 / 89)))
    decay = lr[10:]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False)), "falls every step"
    cfg.train.lr_decay = "none"  # the schedule before: constant after the warmup
    assert [build.lr_at(cfg, s) for s in (10, 50, 99)] == pytest.approx([1e-3] * 3)


def _decay_of(model, optimizer) -> dict[str, float]:
    """Each parameter's weight decay in ``optimizer``, by name."""
    by_id = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    return {name: by_id[id(p)] for name, p in model.named_parameters()}


def test_gate_parameters_are_not_decayed_unless_asked():
    cfg = tiny("/unused").arm_config("sig-g-rope")
    model = build.build_model(cfg, "sigmoid-reference", 595)
    gates = {"blocks.0.gate_out.weight_GC", "blocks.0.gate_out.bias_G"}
    assert {n for n, _ in model.named_parameters() if "gate_out" in n} == gates
    off = _decay_of(model, build.make_optimizer(cfg, model))  # the preset's recipe: False
    assert {n: off[n] for n in gates} == dict.fromkeys(gates, 0.0)
    assert off["blocks.0.attn.qkv.weight"] == off["blocks.1.ff.0.weight"] == 0.1
    cfg.train.gate_weight_decay = True
    on = _decay_of(model, build.make_optimizer(cfg, model))
    assert on["blocks.0.gate_out.weight_GC"] == 0.1 and on["blocks.0.gate_out.bias_G"] == 0.0
    assert {n: v for n, v in on.items() if n not in gates} == {
        n: v for n, v in off.items() if n not in gates
    }


# ---- the presets ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "reduced", "paper"])
def test_the_kv_presets_take_the_recipe_and_the_literal_form_is_four_keys(name):
    t = C.parse(["--preset", name]).train
    assert (t.budget_norm, t.budget_ramp, t.lr_decay, t.min_lr_ratio, t.gate_weight_decay) == (
        "per_gate", 0.25, "cosine", 0.1, False
    )  # fmt: skip
    literal = C.parse(["--preset", name, *LITERAL]).train
    default = C.TrainConfig()  # the keys' own defaults: the behaviour before them
    for key in ("budget_norm", "budget_ramp", "lr_decay", "gate_weight_decay", "init_from"):
        assert getattr(literal, key) == getattr(default, key), key


def test_a_config_saved_before_the_keys_resumes_as_the_paper_literal_form():
    current = C.to_dict(tiny("/unused", *LITERAL))
    saved = json.loads(json.dumps(current))
    for key in ("budget_norm", "budget_ref_layers", "budget_ramp", "lr_decay", "min_lr_ratio"):
        del saved["train"][key]
    for key in ("gate_weight_decay", "init_from", "finetune_steps"):
        del saved["train"][key]
    del saved["telemetry"]["dead_gate_below"]
    assert config_changes(saved, current) == {}
    changes = config_changes(saved, C.to_dict(tiny("/unused")))
    assert set(changes) == {
        "train.budget_norm", "train.budget_ramp", "train.lr_decay", "train.gate_weight_decay"
    }  # fmt: skip
    assert changes["train.budget_norm"] == ["mean", "per_gate"]


def test_the_paper_literal_keys_reproduce_the_curve_recorded_before_the_recipe(tmp_path):
    """tests/golden/kv_tiny_sig_g_rope_literal_loss.json: the tiny preset's sig-g-rope over 30
    steps as the lab trained it before these keys existed."""
    golden = json.loads((GOLDEN / "kv_tiny_sig_g_rope_literal_loss.json").read_text())
    argv = ["--preset", "tiny", f"--out_dir={tmp_path}", "--cells", "sig-g-rope",
            f"--train.steps={len(golden['loss'])}", *LITERAL, *QUIET]  # fmt: skip
    run(C.parse(argv))
    state = checkpoint.read_state(tmp_path / "kv_tiny" / "sig-g-rope" / "checkpoints" / "last")
    torch.testing.assert_close(
        torch.tensor(state["history"]["loss"]), torch.tensor(golden["loss"]), rtol=1e-4, atol=1e-4
    )


# ---- the step: the ramp through the eager and the compiled forward ----------------------------


@pytest.mark.parametrize("fast_step", [False, True])
def test_each_steps_lambda_reaches_the_loss_and_recompiles_nothing(monkeypatch, fast_step):
    from accelerate import Accelerator
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(fast, "COMPILE_BACKEND", counter)
    cfg = tiny("/unused", f"--train.fast={fast_step}", "--telemetry.logit_every=0")
    cell = cfg.arm_config("sig-g-rope")
    data = text_task(cell)
    model = build.build_model(cell, "sigmoid-reference", data.vocab_size)
    t = build.prepare(cell, Accelerator(cpu=True), model, accum=1)
    tel = StepTelemetry(cell, t.raw, world=1, cuda=False)
    batches = StepBatches(data.make_micro, global_batch=8, micro_batch=8, rank=0, world=1)
    for step, lam in enumerate((0.0, 0.01, 0.03)):
        b = batches[step]
        with torch.no_grad():  # the gates the step's forward will see (no dropout)
            t.raw(b.micro[0].tokens_BT, b.micro[0].lengths_B)
            g = gate_mean(t.raw.gates, b.micro[0].lengths_B).item()
        numbers = read_numbers(train_step(t, b, 1e-3, 1.0, tel, budget_lambda=lam))
        # per_gate at 2 layers: lambda * (1 gate layer) / 11
        assert numbers.terms_2[1] == pytest.approx(lam * g / 11, rel=1e-5, abs=1e-12), step
    assert counter.frame_count == (1 if fast_step else 0)


# ---- the -ft cells ----------------------------------------------------------------------------


def _dense_checkpoint(cfg: C.Config, cell: str, *, steps: int | None = None) -> Path:
    """A finished dense cell on disk as the trainer leaves it: config.json, summary.json and
    checkpoints/last (perturbed initial weights, so the gates' effect is not hidden by zeros)."""
    from accelerate import Accelerator

    arm_cfg = cfg.arm_config(cell)
    model = build.build_model(arm_cfg, "sigmoid-reference", 595)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    d = runs.arm_dir(cfg, cell)
    config = runs.resolved_config(arm_cfg, cell, "sigmoid-reference", "no", {"vocab_size": 595})
    runs.start_arm(d, config, {})
    optimizer = build.make_optimizer(arm_cfg, model)
    checkpoint.save(
        d / "checkpoints", checkpoint.LAST, Accelerator(cpu=True), model, optimizer,
        step=cfg.train.steps, history={}, config=config,
    )  # fmt: skip
    runs.write_summary(d, status="stable", steps=steps or cfg.train.steps)
    return d


@pytest.mark.parametrize("bias, atol", [(30.0, 1e-5), (5.0, None)])
def test_an_ft_model_at_step_0_is_its_backbone_up_to_the_gate_factor(tmp_path, bias, atol):
    cfg = tiny(tmp_path, f"--model.gate_bias_init={bias}")
    d = _dense_checkpoint(cfg, "sig-rope")
    backbone = build.build_model(cfg.arm_config("sig-rope"), "sigmoid-reference", 595)
    backbone.load_state_dict(checkpoint.read_state(d / "checkpoints" / "last")["model"])
    ft_cfg = cfg.arm_config("sig-g-rope-ft")
    assert ft_cfg.train.init_from == str(d) and ft_cfg.model.gates
    ft = build.build_model(ft_cfg, "sigmoid-reference", 595)
    info = warmstart.load_init(ft, ft_cfg, "sig-g-rope-ft")
    assert info["step"] == cfg.train.steps
    state = ft.state_dict()
    assert state["blocks.0.gate_out.bias_G"].item() == bias
    assert not state["blocks.0.gate_out.weight_GC"].any()
    for name, t in backbone.state_dict().items():
        assert torch.equal(t, state[name]), name
    tokens_BT = torch.randint(0, 595, (2, 64))
    lengths_B = torch.tensor([64, 40])
    with torch.no_grad():
        want, got = backbone(tokens_BT, lengths_B), ft(tokens_BT, lengths_B)
    gap = (got - want).abs().max().item()
    if atol is not None:  # g = sigmoid(30) = 1 in float32: the dense model
        assert gap <= atol
    else:  # g = sigmoid(5) = 0.9933 on every key's value and logit: close, not equal
        assert 0 < gap < 0.05 * want.abs().max().item()


@pytest.fixture(scope="module")
def ft_run(tmp_path_factory):
    """sig-rope, then sig-g-rope-ft from it, trained by the trainer; then the study command."""
    out = tmp_path_factory.mktemp("ft")
    argv = ["--preset", "tiny", f"--out_dir={out}", "--train.steps=4", "--train.finetune_steps=2",
            "--telemetry.val_every=2", *QUIET, "--cells", "sig-rope", "sig-g-rope-ft"]  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summaries = run(C.parse(argv))
        study = ["--study.val_windows=1", "--study.test_windows=1", "--study.batch_size=2",
                 "--study.prefill=16", "--study.window=16", "--study.probe_windows=1",
                 "--study.timing=False"]  # fmt: skip
        code = kv_study_main([*argv, *study])
    finally:
        torch.set_num_threads(threads)
    return C.parse(argv), out / "kv_tiny", summaries, code


def test_the_ft_cell_starts_from_its_trained_backbone_and_trains_its_own_steps(ft_run):
    cfg, run_dir, summaries, _ = ft_run
    assert list(summaries) == ["sig-rope", "sig-g-rope-ft"]
    dense, ft = summaries["sig-rope"], summaries["sig-g-rope-ft"]
    assert dense["steps"] == 4 and ft["steps"] == 2 and ft["status"] == "stable"
    saved = json.loads((run_dir / "sig-g-rope-ft" / "config.json").read_text())
    assert saved["train"]["steps"] == 2 and saved["model"]["gates"] is True
    assert saved["train"]["init_from"] == str(run_dir / "sig-rope")
    provenance = json.loads((run_dir / "sig-g-rope-ft" / "provenance.json").read_text())
    assert provenance["init_from"]["step"] == 4
    # The ft cell's initial weights: the backbone's final ones, gates at w = 0, b = 5.
    model = build.build_model(cfg.arm_config("sig-g-rope-ft"), "sigmoid-reference", 595)
    last = checkpoint.read_state(run_dir / "sig-rope" / "checkpoints" / "last")["model"]
    model.load_state_dict(last, strict=False)
    assert build.weights_hash(model) == ft["init_hash"] != dense["init_hash"]
    assert ft["dead_gate_layers"] == [] and "dead_gate_layers" not in dense
    # Its own ramp: lambda 0 at its step 0, full from step 0.25 * 2 on.
    logged = load_runs([run_dir / "sig-g-rope-ft"])
    budget = logged[logged.tag == tags.BUDGET_LOSS].set_index("step")["value"]
    assert budget[0] == 0.0
    hist = checkpoint.read_state(run_dir / "sig-g-rope-ft" / "checkpoints" / "last")["history"]
    assert hist["last"]["budget_loss"] > 0  # step 1


def test_the_study_loads_the_ft_cell_as_a_gated_cell_on_its_backbone(ft_run):
    import pandas as pd

    cfg, run_dir, _, code = ft_run
    assert code == 0
    cells = load_cells(run_dir, expect=cfg)
    assert list(cells) == ["sig-rope", "sig-g-rope-ft"]
    assert cells["sig-g-rope-ft"].gated and dense_backbone("sig-g-rope-ft") == "sig-rope"
    t2 = pd.read_csv(run_dir / "study" / "table2.csv")
    assert t2["cell"].tolist() == ["sig-g-rope-ft"] and t2["backbone"].tolist() == ["sig-rope"]
    assert t2["h2o_test_ppl"].notna().all()


def test_the_parallel_study_trains_an_ft_cell_after_its_backbone_in_one_process():
    groups = cell_groups(["sig-g-rope-ft", "sm-rope", "sig-g-rope", "sig-rope", "sm-g-nope-ft"])
    assert groups == [
        ["sig-rope", "sig-g-rope-ft", "sig-g-rope"], ["sm-rope"], ["sm-g-nope-ft"]
    ]  # fmt: skip


def test_the_default_cells_are_the_papers_eight_and_each_ft_cell_has_its_backbone():
    assert C.parse(["--preset", "tiny"]).cells == list(C.CELLS) and len(C.CELLS) == 8
    assert C.FT_CELLS == ("sm-g-rope-ft", "sig-g-rope-ft", "sm-g-nope-ft", "sig-g-nope-ft")
    for ft in C.FT_CELLS:
        kind, gates, position = C.cell_settings(ft)
        assert gates and C.cell_settings(C.backbone_of(ft)) == (kind, False, position)
    cfg = tiny("/unused", "--train.steps=800", "--train.warmup_steps=100")
    ft = cfg.arm_config("sm-g-nope-ft").train
    assert (ft.steps, ft.warmup_steps, ft.init_from) == (200, 25, "/unused/kv_tiny/sm-nope")
    assert cfg.arm_config("sm-g-nope").train == cfg.train


# ---- bad sources: one error line, exit 2, nothing trained -------------------------------------


def _fake_source(path: Path, cfg: C.Config, cell: str, **changes) -> Path:
    """A checkpoint dir holding only the manifest the checks read: ``cell``'s resolved config of
    ``cfg`` with ``changes`` (``section.key``: value)."""
    resolved = runs.resolved_config(cfg.arm_config(cell), cell, "x", "no", {"vocab_size": 595})
    for key, value in changes.items():
        section, name = key.split(".") if "." in key else (None, key)
        (resolved[section] if section else resolved)[name] = value
    path.mkdir(parents=True)
    manifest = {"format": checkpoint.FORMAT, "step": 1, "files": {}, "config": resolved}
    (path / checkpoint.MANIFEST_FILE).write_text(json.dumps(manifest))
    return path


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        kv_main(argv)
    assert exit_info.value.code == USAGE_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: config "), err
    return err


SHAPES = [
    ({"model.n_layers": 4}, "model.n_layers=4 there, 2 here"),
    ({"model.d_model": 96}, "model.d_model=96 there, 64 here"),
    ({"model.n_heads": 4}, "model.n_heads=4 there, 2 here"),
    ({"data.context_len": 128}, "data.context_len=128 there, 64 here"),
    ({"model.position": "none"}, "model.position='none' there, 'rope' here"),
    ({"arm": "sm-rope"}, "attention softmax there, sigmoid here"),
    ({"model.gates": True}, "is a gated model"),
    ({"data.vocab_size": 600}, "a vocabulary of 600 tokens, this run's data 595"),
]


@pytest.mark.parametrize("changes, match", SHAPES)
def test_an_init_from_of_another_shape_is_refused_before_any_work(tmp_path, capsys, changes, match):
    source = _fake_source(tmp_path / "src", tiny(tmp_path), "sig-rope", **changes)
    argv = ["--preset", "tiny", f"--out_dir={tmp_path}", "--cells", "sig-g-rope",
            f"--train.init_from={source}"]  # fmt: skip
    err = _refused(argv, capsys)
    assert "config train.init_from:" in err and match in err
    assert not (tmp_path / "kv_tiny").exists()


def test_an_init_from_that_is_missing_or_holds_no_checkpoint_is_refused(tmp_path, capsys):
    argv = ["--preset", "tiny", f"--out_dir={tmp_path}", "--cells", "sig-g-rope"]
    err = _refused([*argv, f"--train.init_from={tmp_path / 'nothing'}"], capsys)
    assert "does not exist" in err
    (tmp_path / "empty").mkdir()
    err = _refused([*argv, f"--train.init_from={tmp_path / 'empty'}"], capsys)
    assert "holds no checkpoint" in err
    assert not (tmp_path / "kv_tiny").exists()


def test_an_ft_cell_without_its_backbone_is_refused_before_any_work(tmp_path, capsys):
    argv = ["--preset", "tiny", f"--out_dir={tmp_path}"]
    err = _refused([*argv, "--cells", "sig-g-rope-ft"], capsys)
    assert "config cells: sig-g-rope-ft starts from its backbone sig-rope" in err
    assert "neither earlier in --cells nor trained" in err
    err = _refused([*argv, "--cells", "sig-g-rope-ft", "sig-rope"], capsys)
    assert "list sig-rope before sig-g-rope-ft" in err
    assert not (tmp_path / "kv_tiny").exists()


@pytest.mark.parametrize(
    "changes, summary_steps, match",
    [
        ({"model.n_layers": 3}, None, "model.n_layers=3 there, 2 here"),
        ({"model.gates": True}, None, "is a gated model"),
        ({}, 3, "is not a finished dense cell (step 3 of 150"),
    ],
)
def test_an_ft_backbone_on_disk_of_another_shape_or_unfinished_is_refused(
    tmp_path, capsys, changes, summary_steps, match
):
    cfg = tiny(tmp_path)
    d = runs.arm_dir(cfg, "sig-rope")
    _fake_source(d / "checkpoints" / "last", cfg, "sig-rope", **changes)
    runs.write_summary(d, status="stable", steps=summary_steps or cfg.train.steps)
    err = _refused(
        ["--preset", "tiny", f"--out_dir={tmp_path}", "--cells", "sig-g-rope-ft"], capsys
    )
    assert "config cells: sig-g-rope-ft starts from its backbone sig-rope" in err and match in err
    assert not runs.arm_dir(cfg, "sig-g-rope-ft").exists()


# ---- dead gate layers -------------------------------------------------------------------------


def test_dead_gates_reads_the_last_logged_means():
    assert runs.dead_gates([0.5, 1e-4, float("nan"), 2e-3], 1e-3)["dead_gate_layers"] == [1]
    assert runs.dead_gates([], 1e-3)["dead_gate_layers"] is None


def test_a_dead_gate_layer_is_flagged_in_the_summary_and_the_report(tmp_path):
    """A gate born shut (b = -20, g = 2e-9) stays below 1e-3 over two steps."""
    argv = ["--preset", "tiny", f"--out_dir={tmp_path}", "--cells", "sig-g-rope",
            "--train.steps=2", "--model.gate_bias_init=-20", "--telemetry.log_every=1",
            "--telemetry.val_every=0", "--telemetry.probe_every=0"]  # fmt: skip
    summary = run(C.parse(argv))["sig-g-rope"]
    assert summary["dead_gate_layers"] == [0] and summary["gate_mean_layers"][0] < 1e-3
    saved = json.loads((tmp_path / "kv_tiny" / "sig-g-rope" / "summary.json").read_text())
    assert saved["dead_gate_layers"] == [0] and saved["dead_gate_below"] == 1e-3
    report = (tmp_path / "kv_tiny" / "report" / "report.md").read_text()
    assert "## Dead gate layers" in report and "**DEAD gate layers: 0 (mean " in report


def test_bad_recipe_values_are_refused_by_key():
    for override, key in [
        ("--train.budget_ramp=1.5", "train.budget_ramp"),
        ("--train.min_lr_ratio=-0.1", "train.min_lr_ratio"),
        ("--train.budget_ref_layers=1", "train.budget_ref_layers"),
        ("--train.finetune_steps=-1", "train.finetune_steps"),
        ("--telemetry.dead_gate_below=1.0", "telemetry.dead_gate_below"),
    ]:
        with pytest.raises(C.ConfigError, match=f"config {key}:"):
            C.parse(["--preset", "tiny", override])
    with pytest.raises(C.ConfigError, match="config train.lr_decay: unknown kind 'linear'"):
        dataclasses.replace(C.TrainConfig(), lr_decay="linear")
