import ast
import dataclasses
import json
import math
import os
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
def test_bad_overrides_fail_naming_the_key(args, key):
    proc = _cli("--preset", "smoke", *args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    err = proc.stderr.replace("-", "_")
    assert key.replace("-", "_") in err, proc.stderr


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
