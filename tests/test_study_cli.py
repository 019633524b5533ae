"""Each study's command shows and takes its own presets and keys: ``stress_8k.py --help`` no
``--cells`` and no ``study.*``, ``kv_study.py`` / ``kv_eviction.py --help`` no stress arm and no
cell generator; a preset or key of the other study stops the command with exit code 2."""

import re

import pytest

from stabilitylab import config as C
from stabilitylab.cli import kv_main, kv_study_main, train_main
from stabilitylab.presets import KV_PRESETS, STRESS_PRESETS


def help_text(main, capsys) -> tuple[str, str]:
    """(the presets listed in the description, the options) of ``main(["--help"])``."""
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    listed, _, options = out.split("Presets (--preset NAME):")[1].partition("\n\n")
    return listed, options


def preset_names(listed: str) -> set[str]:
    """The presets the description lists, each on a line of its own, two spaces in."""
    every = (*STRESS_PRESETS, *KV_PRESETS)
    return {n for n in every if re.search(rf"^  {n} ", listed, flags=re.MULTILINE)}


def option_names(options: str) -> set[str]:
    """The options the help lists (each opens a line; their descriptions are indented deeper)."""
    return set(re.findall(r"^[ │]{1,3}(--[\w.]+)", options, flags=re.MULTILINE))


def test_the_stress_help_shows_its_presets_and_keys_only(capsys):
    listed, options = help_text(train_main, capsys)
    assert preset_names(listed) == set(STRESS_PRESETS)
    names = option_names(options)
    assert {"--arm", "--data.n_genes", "--data.mask_prob", "--train.lr"} <= names
    kv_keys = {n for n in names if n.startswith(("--study.", "--data.text", "--data.hf", "--model.gate"))}  # fmt: skip
    assert kv_keys == set() and "--cells" not in names and "--train.budget_lambda" not in names
    assert "tiny" not in options.split("--preset")[1].split("--name")[0], "the preset choices"


@pytest.mark.parametrize("main", [kv_study_main, kv_main], ids=["kv_study", "kv_eviction"])
def test_the_kv_help_shows_its_presets_and_keys_only(main, capsys):
    listed, options = help_text(main, capsys)
    assert preset_names(listed) == set(KV_PRESETS)
    names = option_names(options)
    assert {"--cells", "--study.batch_size", "--data.text", "--train.budget_lambda"} <= names
    assert not names & {"--arm", "--data.n_genes", "--data.mask_prob", "--data.h5ad_path"}
    assert "smoke" not in options.split("--preset")[1].split("--name")[0]


def test_the_other_studys_preset_is_refused_naming_the_script(capsys):
    with pytest.raises(SystemExit) as e:
        train_main(["--preset", "tiny"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'tiny' is the other study's preset" in err[0]
    assert "kv_eviction.py" in err[0]


@pytest.mark.parametrize(
    "main, argv",
    [
        (train_main, ["--preset", "smoke", "--cells", "sm-rope"]),
        (train_main, ["--preset", "smoke", "--study.batch_size=4"]),
        (kv_main, ["--preset", "tiny", "--arm", "softmax"]),
    ],
)
def test_the_other_studys_key_is_refused(main, argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert argv[2].split("=")[0] in capsys.readouterr().err


def test_a_study_parses_to_a_plain_config():
    cfg = C.parse(["--preset", "tiny", "--train.lr=0.01"], study="kv")
    assert type(cfg) is C.Config and type(cfg.model) is C.ModelConfig
    assert cfg == C.parse(["--preset", "tiny", "--train.lr=0.01"])
