"""stabilitylab: a training-stability stress-test lab for attention.

Top-level folders of the repository map to subpackages of this one name:
``kernels/`` -> ``stabilitylab.kernels``, ``probes/`` -> ``stabilitylab.probes``,
``analysis/`` -> ``stabilitylab.analysis``.
"""

import os as _os

__version__ = "0.1.0"

# In a source checkout (run without installing, e.g. on a GPU box with its own torch), let the
# top-level folders resolve as subpackages too. Installed copies carry them inside the package.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(
    _os.path.join(_root, "kernels")
):
    __path__.append(_root)  # type: ignore[name-defined]  # noqa: F821
