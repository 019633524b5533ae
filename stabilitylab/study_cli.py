"""Each study's command line: its own presets and keys, the other study's left out.

    cls, default = cli_type("stress"), as_cli(base, cli_type("stress"))
    cfg = plain(tyro.cli(cls, default=default, ...))       # back to a plain Config

One ``Config`` serves both studies, so a plain ``tyro.cli(Config)`` lists every preset and key of
both: ``stress_8k.py --help`` would show ``--cells`` and ``study.*``, ``kv_study.py --help`` the
cell generator's keys. ``cli_type(study)`` is ``Config`` with the other study's keys marked
``tyro.conf.Suppress`` (not shown, not accepted: an unknown key stops the run, naming it) and
``--preset`` / ``data.source`` narrowed to the study's own. Each section is a subclass of its own
class under the same name and module, so tyro still reads the fields' docstrings from the
source for the help; ``plain`` turns the parsed object back into the dataclasses every other
module uses (``config.from_dict``, which checks it again).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Annotated, Literal, get_type_hints

from stabilitylab.config import Config, from_dict, to_dict

STUDIES = ("stress", "kv")
"""stress: paired softmax / sigmoid encoders on cells (``stress_8k.py``); kv: the KV-eviction
study's causal decoder cells on text (``kv_eviction.py``, ``kv_study.py``)."""

KV_ONLY = (
    "cells", "study",
    "model.gates", "model.gate_injection", "model.gate_per_head", "model.gate_in_kernel",
    "model.gate_bias_init",
    "data.text", "data.text_files", "data.hf_dataset", "data.hf_split", "data.hf_text_column",
    "data.vocab", "train.budget_lambda", "telemetry.val_every", "telemetry.val_batches",
)  # fmt: skip
"""Keys of the KV study only: its cells, their evaluation, the gates, text data, validation."""
STRESS_ONLY = (
    "arm", "model.gates", "model.position", "data.source",
    "data.h5ad_path", "data.h5ad_layer", "data.n_genes", "data.n_cell_types", "data.n_programs",
    "data.genes_per_program", "data.min_genes", "data.mask_prob", "data.dispersion",
    "data.dropout_rate",
)  # fmt: skip
"""Keys the KV study has no use for: the stress arms, the cell data and its masking, and the two
model keys each cell sets itself (``model.gates``, ``model.position``)."""
HIDDEN = {"stress": KV_ONLY, "kv": STRESS_ONLY}
STRESS_SOURCES = ("synthetic", "h5ad")
"""The stress study's ``data.source`` (text belongs to the KV study)."""


@functools.cache
def study_presets(study: str) -> tuple[str, ...]:
    """The presets of ``study``, in ``PRESETS``' order."""
    from stabilitylab.presets import KV_PRESETS, STRESS_PRESETS

    return tuple({"stress": STRESS_PRESETS, "kv": KV_PRESETS}[study])


def study_of(preset: str) -> str:
    """The study a preset belongs to."""
    return next(s for s in STUDIES if preset in study_presets(s))


def _variant(cls: type, hidden: tuple[str, ...], narrowed: dict, prefix: str = "") -> type:
    """``cls`` with the fields in ``hidden`` suppressed and those in ``narrowed`` retyped
    (dotted keys, sections recursively); a subclass of the same name and module."""
    from tyro.conf import Suppress

    hints = get_type_hints(cls, include_extras=True)
    fields = []
    for f in dataclasses.fields(cls):
        key, typ = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(typ) and any(k.startswith(key + ".") for k in (*hidden, *narrowed)):  # fmt: skip
            typ = _variant(typ, hidden, narrowed, key + ".")
        typ = narrowed.get(key, typ)
        if key in hidden:
            typ = Annotated[typ, Suppress]
        if typ is not hints[f.name]:
            fields.append((f.name, typ, dataclasses.field(default=None)))
    variant = dataclasses.make_dataclass(cls.__name__, fields, bases=(cls,))
    variant.__module__, variant.__qualname__ = cls.__module__, cls.__qualname__
    return variant


@functools.cache
def cli_type(study: str) -> type:
    """``Config`` as ``study``'s command line parses it (module docstring)."""
    narrowed = {"preset": Literal[study_presets(study)]}
    if study == "stress":
        narrowed["data.source"] = Literal[STRESS_SOURCES]
    return _variant(Config, HIDDEN[study], narrowed)


def as_cli(obj, cls: type):
    """``obj`` (a Config or a section) as an instance of its variant ``cls``."""
    hints = get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        sub = hints[f.name]
        if dataclasses.is_dataclass(value) and isinstance(sub, type) and sub is not type(value):
            value = as_cli(value, sub)
        values[f.name] = value
    return cls(**values)


def plain(obj) -> Config:
    """A parsed variant back as a plain ``Config`` (checked again on the way)."""
    return from_dict(to_dict(obj))
