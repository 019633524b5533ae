import ast
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stabilitylab import config as C

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # scripts import this tree, whatever is installed


@pytest.mark.parametrize("name", sorted(C.PRESETS))
def test_presets_build_and_round_trip(name):
    cfg = C.PRESETS[name]()
    assert cfg.preset == name
    again = C.from_dict(json.loads(C.dumps(cfg)))
    assert again == cfg


def test_diverge_fast_is_the_measured_hunt_setting():
    """The preset must resolve to exactly the overrides the GPU hunt ran (docs/RESULTS.md, 3),
    with the eager softmax of the repeat study (SDPA's backward is not reproducible run to run),
    on the eager step (the hunt ran before train.fast existed)."""
    hunt = C.parse(
        ["--preset", "proxy", "--sigmoid_backend=sigmoid-reference", "--train.weight_decay=0.0",
         "--softmax_backend=softmax-reference",
         "--model.n_layers=8", "--model.d_model=512", "--model.n_heads=8", "--model.d_ff=2048",
         "--train.lr=0.1", "--train.seed=1", "--train.fast=False"]
    )  # fmt: skip
    preset = C.parse(["--preset", "diverge_fast"])
    strip = lambda c: {k: v for k, v in C.to_dict(c).items() if k not in ("preset", "name")}
    assert strip(preset) == strip(hunt)


def test_stress_8k_hot_is_the_measured_setting():
    """The preset must resolve to exactly the overrides the 8K runs of docs/RESULTS.md, section 8
    ran with (``experiments/sweep.py --preset stress_8k`` and these, the eager step then being
    stress_8k's default), at seed 0."""
    runs = C.parse(
        ["--preset", "stress_8k", "--train.deterministic=True", "--train.fast=False",
         "--train.weight_decay=0.0",
         "--train.warmup_steps=100", "--train.global_batch=2", "--train.micro_batch=1",
         "--data.pad_to_multiple=1",
         "--train.steps=250", "--train.checkpoint_every=0", "--train.on_divergence=stop",
         "--telemetry.log_every=1", "--telemetry.logit_every=5", "--telemetry.layer_every=10",
         "--telemetry.probe_every=50", "--train.lr=0.01", "--train.seed=0"]
    )  # fmt: skip
    preset = C.parse(["--preset", "stress_8k_hot"])
    strip = lambda c: {k: v for k, v in C.to_dict(c).items() if k not in ("preset", "name")}
    assert strip(preset) == strip(runs)
    assert preset.backend_for("softmax", cuda=True) == "softmax-triton"
    assert preset.backend_for("sigmoid", cuda=True) == "sigmoid-triton"


def test_overrides_are_typed():
    cfg = C.parse(
        [
            "--preset",
            "smoke",
            "--train.lr=3e-3",
            "--model.qk-layernorm",
            "True",
            "--model.sigmoid-bias",
            "-2.5",
            "--arm",
            "softmax",
        ]
    )
    assert cfg.train.lr == 3e-3 and isinstance(cfg.train.lr, float)
    assert cfg.model.qk_layernorm is True and cfg.model.sigmoid_bias == -2.5
    assert cfg.arms() == ["softmax"]
    assert C.parse(["--preset", "smoke"]).model.sigmoid_bias is None


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """The training entry point's argument handling in a fresh interpreter."""
    code = "import sys; from stabilitylab.cli import train_main; sys.exit(train_main())"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        env=ENV,
    )


@pytest.mark.parametrize(
    "args, key",
    [
        (["--train.lrr=3"], "train.lrr"),
        (["--train.lr=abc"], "train.lr"),
        (["--train.lr=-1"], "train.lr"),
        (["--train.lr=inf"], "train.lr"),
        (["--model.sigmoid_bias=nan"], "model.sigmoid_bias"),
        (["--train.micro_batch=5"], "train.micro_batch"),
        (["--model.n-heads=5"], "n_heads"),
        (["--data.mask-prob=1.5"], "data.mask_prob"),
        (["--arm", "relu"], "arm"),
    ],
)
def test_bad_overrides_fail_naming_the_key(args, key, capsys, monkeypatch):
    """In this process (a fresh interpreter per case cost ~5 s each; ``_cli`` keeps one such case
    below): exit code 2 and the key named on stderr; an uncaught exception fails the test."""
    from stabilitylab.cli import train_main

    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as e:
        sys.exit(train_main(["--preset", "smoke", *args]))
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert key.replace("-", "_") in err.replace("-", "_"), err


def test_a_bad_override_in_a_fresh_interpreter_is_one_error_without_traceback():
    proc = _cli("--preset", "smoke", "--train.lr=-1")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "train.lr" in proc.stderr


def _float_fields() -> list[str]:
    """``section.key`` of every float field (``float`` or ``float | None``) of every section."""
    keys = []
    for section in dataclasses.fields(C.Config):
        cls = getattr(C, str(section.type), None)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            continue
        keys += [f"{section.name}.{f.name}" for f in dataclasses.fields(cls) if "float" in f.type]
    return keys


def test_every_float_key_is_found():
    keys = _float_fields()
    assert {"train.lr", "model.sigmoid_bias", "train.clip_grad", "data.mask_prob"} <= set(keys)


@pytest.mark.parametrize("key", _float_fields())
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_nonfinite_numbers_are_refused_by_name(key, value):
    with pytest.raises(C.ConfigError, match=rf"config {key}: must be a finite number"):
        C.parse(["--preset", "smoke", f"--{key}={value}"])


def test_a_section_added_later_is_checked_too():
    @dataclasses.dataclass
    class Extra:
        tau: float = 0.5

    @dataclasses.dataclass
    class WithExtra(C.Config):
        extra: Extra = dataclasses.field(default_factory=Extra)

    with pytest.raises(C.ConfigError, match="config extra.tau: must be a finite number"):
        WithExtra(preset="smoke", extra=Extra(tau=math.nan))


HEAD_DIM_64 = ("--model.d_model=128", "--model.n_heads=2")
"""The smoke preset at a head dim the Triton kernels take (its own is 16)."""


def test_auto_takes_a_triton_kernel_only_for_a_head_dim_it_runs():
    """The smoke preset (head dim 16) on a GPU: the eager references under auto, for both arms,
    deterministic or not; a Triton backend named for it is
    refused before any work, naming the key. The config's list is the kernels' own."""
    from stabilitylab.kernels.triton_support import SUPPORTED_HEAD_DIMS

    assert C.TRITON_HEAD_DIMS == SUPPORTED_HEAD_DIMS
    for det in ("False", "True"):
        smoke = C.parse(["--preset", "smoke", f"--train.deterministic={det}"])
        assert smoke.model.head_dim == 16
        assert smoke.backend_for("sigmoid", cuda=True) == "sigmoid-reference"
        want = "softmax-reference" if det == "True" else "softmax"
        assert smoke.backend_for("softmax", cuda=True) == want
        wide = C.parse(["--preset", "smoke", f"--train.deterministic={det}", *HEAD_DIM_64])
        assert wide.backend_for("sigmoid", cuda=True) == "sigmoid-triton"
    for key, name in (("sigmoid_backend", "sigmoid-triton"), ("sigmoid_backend", "sigmoid-triton-exact"),
                      ("softmax_backend", "softmax-triton")):  # fmt: skip
        with pytest.raises(C.ConfigError, match=f"config {key}: '{name}' runs head dims"):
            C.parse(["--preset", "smoke", f"--{key}={name}"])
        C.parse(["--preset", "smoke", f"--{key}={name}", *HEAD_DIM_64])


def test_deterministic_picks_deterministic_backends_and_refuses_the_others_by_name():
    """train.deterministic: the auto backends resolve to deterministic kernels (the references on
    CPU); an explicit softmax backend that can differ run to run is refused before any work."""
    plain = C.parse(["--preset", "smoke"])
    assert plain.train.deterministic is False
    assert plain.backend_for("softmax", cuda=True) == "softmax"
    det = C.parse(["--preset", "smoke", "--train.deterministic=True", *HEAD_DIM_64])
    assert det.backend_for("softmax", cuda=True) == "softmax-triton"
    assert det.backend_for("softmax", cuda=False) == "softmax-reference"
    assert det.backend_for("sigmoid", cuda=True) == "sigmoid-triton"
    assert det.backend_for("sigmoid", cuda=False) == "sigmoid-reference"
    assert det.backend_for("sm-g-rope", cuda=True) == "softmax-triton"
    for name in ("softmax", "softmax-flex"):
        with pytest.raises(C.ConfigError, match=f"config softmax_backend: '{name}' cannot be det"):
            C.parse(
                ["--preset", "smoke", "--train.deterministic=True", f"--softmax_backend={name}"]
            )
    for name in ("softmax-triton", "softmax-flash", "softmax-reference"):
        cfg = C.parse(
            ["--preset", "smoke", "--train.deterministic=True", f"--softmax_backend={name}",
             *HEAD_DIM_64]
        )  # fmt: skip
        assert cfg.backend_for("softmax", cuda=True) == name
    with pytest.raises(C.ConfigError, match="config train.deterministic: must be True or False"):
        C.TrainConfig(deterministic="yes")
    saved = C.to_dict(det)
    saved["softmax_backend"] = "softmax-fast"
    with pytest.raises(C.ConfigError, match="config softmax_backend: unknown kind 'softmax-fast'"):
        C.from_dict(saved)


def test_deterministic_sets_torch_for_the_arm_and_off_again(monkeypatch):
    import torch

    from stabilitylab.train import build

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        build.apply_determinism(C.parse(["--preset", "smoke", "--train.deterministic=True"]))
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        build.apply_determinism(C.parse(["--preset", "smoke"]))
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_micro_batch_must_divide_global_batch_before_any_work():
    with pytest.raises(C.ConfigError, match="train.micro_batch.*global_batch=16"):
        C.parse(["--preset", "smoke", "--train.micro_batch=5"])
    assert C.parse(["--preset", "smoke", "--train.micro_batch=4"]).train.micro_batch == 4


def _field_docstrings() -> dict[str, str]:
    """``Class.field -> docstring`` of the config dataclasses, read from the source."""
    tree = ast.parse(Path(C.__file__).read_text())
    docs = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        body = cls.body
        for stmt, nxt in zip(body, body[1:] + [None], strict=True):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                doc = nxt.value.value if isinstance(nxt, ast.Expr) else None
                docs[f"{cls.name}.{stmt.target.id}"] = doc if isinstance(doc, str) else ""
    return docs


def test_help_lists_the_presets_and_explains_every_key(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    with pytest.raises(SystemExit) as exit_info:
        C.parse(["--preset", "smoke", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.replace("\u2502", " ").split())
    for name in C.PRESETS:
        assert f"{name} {C.preset_summary(name)}" in text
    # The choice list, read where tyro draws one column (at 250 it wraps inside a column).
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        C.parse(["--preset", "smoke", "--help"])
    one_column = " ".join(capsys.readouterr().out.replace("\u2502", " ").split())
    assert "--preset {" + ",".join(C.PRESETS) + "}" in one_column
    sections = {
        f.name: type(getattr(C.Config(), f.name)).__name__ for f in dataclasses.fields(C.Config)
    }
    classes = {cls: section for section, cls in sections.items() if cls.endswith("Config")}
    docs = _field_docstrings()
    for key, doc in docs.items():
        cls, name = key.split(".")
        if cls != "Config" and cls not in classes:
            continue
        flag = f"--{name}" if cls == "Config" else f"--{classes[cls]}.{name}"
        assert doc, f"{key} has no docstring, so --help says nothing about {flag}"
        assert flag in text
        assert " ".join(doc.split())[:40] in text, key
    assert "(default: 16)" in text  # smoke's global_batch: the chosen preset's values


def test_unknown_preset_is_one_line_before_any_work():
    with pytest.raises(C.ConfigError, match="bogus"):
        C.parse(["--preset", "bogus"])
    proc = _cli("--preset", "bogus")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: config preset: unknown preset 'bogus'")
    assert proc.stderr.count("\n") == 1 and all(p in proc.stderr for p in C.PRESETS)


def test_data_errors_are_one_line_before_any_work(tmp_path):
    proc = _cli(
        "--preset", "smoke", "--data.source=h5ad", f"--data.h5ad_path={tmp_path / 'nope.h5ad'}",
        f"--out_dir={tmp_path / 'runs'}",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.strip().splitlines()[-1]
        == f"error: h5ad file not found: {tmp_path / 'nope.h5ad'}"
    )
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_cli_errors_turns_our_errors_into_one_line(capsys):
    from stabilitylab.cli import cli_errors
    from stabilitylab.data import DataError

    for err in (
        DataError("h5ad file x.h5ad: X holds negative values"),
        C.ConfigError("config a: b"),
    ):
        with pytest.raises(SystemExit) as exit_info, cli_errors():
            raise err
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == f"error: {err}\n"
    with pytest.raises(KeyError), cli_errors():
        raise KeyError("a bug keeps its traceback")


def test_stress_script_refuses_without_cuda_and_names_cpu_preset():
    import torch

    if torch.cuda.is_available():
        pytest.skip("machine has CUDA")
    proc = subprocess.run(
        [sys.executable, "experiments/stress_8k.py"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env=ENV,
    )
    assert proc.returncode == 2
    assert "--preset smoke" in proc.stderr and "CUDA" in proc.stderr


# ---- packaging ---------------------------------------------------------------------------------


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_installed():
    """A subpackage missing from the list installs nowhere with ``pip install .`` (not editable).
    A folder of data files only (the sample shards) is listed too, with its files, or setuptools
    warns that it would be ignored."""
    tool = _pyproject()["tool"]["setuptools"]
    found = set()
    for package, folder in tool["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join([package, *init.parent.relative_to(ROOT / folder).parts]))
    data_only = set(tool["package-data"]) - found
    assert data_only == {"stabilitylab.data.text.sample"}
    assert (ROOT / "stabilitylab" / "data" / "text" / "sample" / "meta.json").is_file()
    assert found | data_only == set(tool["packages"])


def test_console_entry_points_resolve_and_answer_help(capsys):
    import importlib

    scripts = _pyproject()["project"]["scripts"]
    assert {"stabilitylab-train", "stabilitylab-report", "stabilitylab-sweep"} <= set(scripts)
    for name, target in scripts.items():
        module, func = target.split(":")
        main = getattr(importlib.import_module(module), func)
        with pytest.raises(SystemExit) as exit_info:
            main(["--help"])
        assert exit_info.value.code == 0, name
        assert "usage:" in capsys.readouterr().out, name


def test_requires_python_matches_the_lock():
    """Every pin of requirements/cpu.txt admits the lowest Python the project claims, and at
    least one excludes the minor below it (else the claim could be lower)."""
    import importlib.metadata as md

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    claimed = SpecifierSet(_pyproject()["project"]["requires-python"])
    (low,) = [Version(s.version) for s in claimed if s.operator == ">="]
    below = Version(f"{low.major}.{low.minor - 1}")
    pins = [
        line.split("==")
        for line in (ROOT / "requirements" / "cpu.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    excluding, checked = [], 0
    for name, version in pins:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        if dist.version != version or not dist.metadata.get("Requires-Python"):
            continue
        spec = SpecifierSet(dist.metadata["Requires-Python"])
        checked += 1
        assert spec.contains(f"{low}.0"), f"{name}=={version} needs Python {spec}"
        if not spec.contains(f"{below}.99"):
            excluding.append(name)
    assert checked > 20, "too few pins are installed here to judge"
    assert excluding, f"no pin needs more than Python {below}: requires-python could be lower"


# Every `_check` of config.py, each with a value just past its bound (or the one combination it
# refuses): (key the error must name, the construction that must raise). For a bound `> 0` the
# value is the bound itself; for `>= 0` the nearest value below it; intervals get both ends.
# Removing a check makes its case construct without error, or fail naming another key.
TEXT = {"source": "text"}
LM = {"data": C.DataConfig(**TEXT), "model": C.ModelConfig(causal=True)}
CHECKED = [
    *[(f"model.{k}", C.ModelConfig, {k: 0}) for k in ("n_layers", "d_model", "n_heads", "d_ff")],
    ("model.n_heads", C.ModelConfig, {"d_model": 768, "n_heads": 5}),
    ("model.dropout", C.ModelConfig, {"dropout": 1.0}),
    ("model.dropout", C.ModelConfig, {"dropout": -1e-9}),
    ("model.ln_eps", C.ModelConfig, {"ln_eps": 0.0}),
    ("model.init_std", C.ModelConfig, {"init_std": 0.0}),
    ("model.init_scale", C.ModelConfig, {"init_scale": 0.0}),
    *[(f"model.{k}", C.ModelConfig, {k: 1}) for k in ("causal", "gates", "gate_per_head", "gate_in_kernel")],
    ("model.qk_layernorm", C.ModelConfig, {"qk_layernorm": 1}),
    ("model.qk_layernorm", C.ModelConfig, {"qk_layernorm": True, "qk_norm": "rmsnorm"}),
    ("model.position", C.ModelConfig, {"position": "rope", "d_model": 12, "n_heads": 4}),
    ("model.rope_base", C.ModelConfig, {"rope_base": 1.0}),
    ("model.gates", C.ModelConfig, {"gates": True, "n_layers": 1}),
    ("model.gate_bias_init", C.ModelConfig, {"gate_bias_init": math.inf}),  # check_finite's too
    ("data.context_len", C.DataConfig, {"context_len": 1}),
    ("data.pad_to_multiple", C.DataConfig, {"pad_to_multiple": 0}),
    ("data.pad_to_multiple", C.DataConfig, {"context_len": 64, "pad_to_multiple": 3}),
    ("data.pad_to_multiple", C.DataConfig, {**TEXT, "context_len": 64, "pad_to_multiple": 2}),
    ("data.text_files", C.DataConfig, {**TEXT, "text": "files"}),
    ("data.hf_dataset", C.DataConfig, {**TEXT, "text": "hf"}),
    ("data.n_genes", C.DataConfig, {"n_genes": 7, "genes_per_program": 4}),
    ("data.mask_prob", C.DataConfig, {"mask_prob": 0.0}),
    ("data.mask_prob", C.DataConfig, {"mask_prob": 1.0}),
    ("data.min_genes", C.DataConfig, {"min_genes": 0}),
    ("data.min_genes", C.DataConfig, {"context_len": 64, "min_genes": 65}),
    ("data.n_cell_types", C.DataConfig, {"n_cell_types": 0}),
    ("data.n_programs", C.DataConfig, {"n_programs": 0}),
    ("data.genes_per_program", C.DataConfig, {"genes_per_program": 0}),
    ("data.genes_per_program", C.DataConfig, {"n_genes": 100, "genes_per_program": 101}),
    ("data.dispersion", C.DataConfig, {"dispersion": 0.0}),
    ("data.dropout_rate", C.DataConfig, {"dropout_rate": 1.0}),
    ("data.dropout_rate", C.DataConfig, {"dropout_rate": -1e-9}),
    ("data.h5ad_layer", C.DataConfig, {"h5ad_layer": " X"}),
    ("data.h5ad_path", C.DataConfig, {"source": "h5ad"}),
    *[(f"train.{k}", C.TrainConfig, {k: 0}) for k in ("steps", "global_batch", "micro_batch")],
    ("train.micro_batch", C.TrainConfig, {"global_batch": 8, "micro_batch": 3}),
    ("train.lr", C.TrainConfig, {"lr": 0.0}),
    ("train.lr_scale", C.TrainConfig, {"lr_scale": 0.0}),
    ("train.warmup_steps", C.TrainConfig, {"warmup_steps": -1}),
    ("train.weight_decay", C.TrainConfig, {"weight_decay": -1e-9}),
    ("train.beta1/beta2", C.TrainConfig, {"beta1": 1.0}),
    ("train.beta1/beta2", C.TrainConfig, {"beta1": -1e-9}),
    ("train.beta1/beta2", C.TrainConfig, {"beta2": 1.0}),
    ("train.beta1/beta2", C.TrainConfig, {"beta2": -1e-9}),
    ("train.eps", C.TrainConfig, {"eps": 0.0}),
    ("train.clip_grad", C.TrainConfig, {"clip_grad": 0.0}),
    ("train.checkpoint_every", C.TrainConfig, {"checkpoint_every": -1}),
    ("train.peak_tflops", C.TrainConfig, {"peak_tflops": 0.0}),
    ("train.budget_lambda", C.TrainConfig, {"budget_lambda": -1e-9}),
    *[
        (f"train.{k}", C.TrainConfig, {k: 1})
        for k in ("deterministic", "fast", "compile", "group_by_length", "gate_weight_decay")
    ],
    ("train.compile", C.TrainConfig, {"fast": True, "compile": True}),
    ("train.budget_ref_layers", C.TrainConfig, {"budget_ref_layers": 1}),
    ("train.budget_ramp", C.TrainConfig, {"budget_ramp": -1e-9}),
    ("train.budget_ramp", C.TrainConfig, {"budget_ramp": 1.0 + 1e-9}),
    ("train.min_lr_ratio", C.TrainConfig, {"min_lr_ratio": -1e-9}),
    ("train.min_lr_ratio", C.TrainConfig, {"min_lr_ratio": 1.0 + 1e-9}),
    ("train.finetune_steps", C.TrainConfig, {"finetune_steps": -1}),
    ("train.init_from", C.TrainConfig, {"init_from": 3}),
    ("telemetry.dead_gate_below", C.TelemetryConfig, {"dead_gate_below": 1.0}),
    ("telemetry.dead_gate_below", C.TelemetryConfig, {"dead_gate_below": -1e-9}),
    ("train.fast", C.TrainConfig, {"fast": True, "deterministic": True}),
    *[
        (f"telemetry.{k}", C.TelemetryConfig, {k: -1})
        for k in ("log_every", "layer_every", "logit_every", "probe_every", "val_every")
    ],
    ("telemetry.val_batches", C.TelemetryConfig, {"val_batches": -1}),
    ("telemetry.probe_samples", C.TelemetryConfig, {"probe_samples": 0}),
    ("telemetry.probe_tokens", C.TelemetryConfig, {"probe_tokens": 1}),
    ("telemetry.probe_iters", C.TelemetryConfig, {"probe_iters": 0}),
    ("telemetry.flush_secs", C.TelemetryConfig, {"flush_secs": 0}),
    *[
        (f"study.{k}", C.StudyConfig, {k: -1})
        for k in ("prefill", "window", "val_windows", "test_windows", "seed")
    ],
    ("study.batch_size", C.StudyConfig, {"batch_size": 0}),
    ("study.timing_repeats", C.StudyConfig, {"timing_repeats": 0}),
    ("study.probe_windows", C.StudyConfig, {"probe_windows": 0}),
    ("study.probe_ps", C.StudyConfig, {"probe_ps": ()}),
    ("study.probe_ps", C.StudyConfig, {"probe_ps": (0.1, "0.3")}),
    ("study.probe_ps", C.StudyConfig, {"probe_ps": (0.0,)}),
    ("study.probe_ps", C.StudyConfig, {"probe_ps": (1.0,)}),
    ("study.max_delta_log_ppl", C.StudyConfig, {"max_delta_log_ppl": -1e-9}),
    ("study.max_delta_ppl", C.StudyConfig, {"max_delta_ppl": 0.0}),
    ("study.baselines", C.StudyConfig, {"baselines": ("h2o", "lru")}),
    ("study.baselines", C.StudyConfig, {"baselines": ("h2o", "h2o")}),
    ("study.baseline_windows", C.StudyConfig, {"baseline_windows": -1}),
    ("study.bootstrap", C.StudyConfig, {"bootstrap": 99}),
    ("study.heldout_shards", C.StudyConfig, {"heldout_files": ["a.txt"], "heldout_shards": "d"}),
    # decode_split, run by Config for text data: a 64-token context.
    ("study.prefill", C.Config, {**LM, "data": C.DataConfig(**TEXT, context_len=64),
                                 "study": C.StudyConfig(prefill=64)}),
    ("study.window", C.Config, {**LM, "data": C.DataConfig(**TEXT, context_len=64),
                                "study": C.StudyConfig(prefill=32, window=33)}),
    ("preset", C.Config, {"preset": "bogus"}),
    ("name", C.Config, {"name": "a/b"}),
    ("model.causal", C.Config, {"data": C.DataConfig(**TEXT)}),
    ("cells", C.Config, {"cells": ["sm-rope", "sm-rope2"]}),
    ("cells", C.Config, {**LM, "cells": ["sm-rope", "sm-rope"]}),
    ("cells", C.Config, {**LM, "cells": []}),
    ("cells", C.Config, {"cells": ["sm-rope"]}),
    ("arm", C.Config, {**LM, "arm": "softmax"}),
    ("telemetry.val_every", C.Config, {"telemetry": C.TelemetryConfig(val_every=10)}),
    ("softmax_backend", C.Config, {"softmax_backend": "softmax-triton",
                                   "model": C.ModelConfig(d_model=96, n_heads=3)}),
    ("sigmoid_backend", C.Config, {"sigmoid_backend": "sigmoid-triton",
                                   "model": C.ModelConfig(d_model=96, n_heads=3)}),
    ("softmax_backend", C.Config, {"softmax_backend": "softmax",
                                   "train": C.TrainConfig(deterministic=True)}),
]  # fmt: skip


def _checked_keys_in_source() -> set[str]:
    """The key of every ``_check(ok, key, msg)`` in config.py's classes; a key that is a loop's
    variable (``key``, ``f"model.{k}"``) expanded over the loop's tuple in the same method."""
    tree = ast.parse((ROOT / "stabilitylab" / "config.py").read_text())
    methods = [
        f
        for cls in tree.body
        if isinstance(cls, ast.ClassDef)
        for f in cls.body
        if isinstance(f, ast.FunctionDef)
    ]
    keys = set()
    for method in methods:
        loops = {
            node.target.id: [e.value for e in node.iter.elts]
            for node in ast.walk(method)
            if isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple)
        }
        for call in ast.walk(method):
            if not (isinstance(call, ast.Call) and getattr(call.func, "id", "") == "_check"):
                continue
            key = call.args[1]
            if isinstance(key, ast.Constant):
                keys.add(key.value)
            elif isinstance(key, ast.Name):
                keys |= set(loops[key.id])
            else:  # f"section.{k}"
                prefix, var = key.values[0].value, key.values[1].value.id
                keys |= {f"{prefix}{k}" for k in loops[var]}
    return keys


def test_every_check_in_config_py_has_a_case():
    """A range check added to config.py without a case in CHECKED fails here; so does a case
    whose check is gone."""
    assert _checked_keys_in_source() == {key for key, _, _ in CHECKED}


@pytest.mark.parametrize("key, cls, kwargs", CHECKED, ids=[f"{key}={kw}" for key, _, kw in CHECKED])
def test_a_value_just_past_each_bound_is_refused_by_name(key, cls, kwargs):
    with pytest.raises(C.ConfigError, match=rf"^config {re.escape(key)}: "):
        cls(**kwargs)
