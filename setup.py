"""The package list for the wheel; the rest of the metadata is in pyproject.toml.

Each top-level folder installs as one package of the ``glmport`` namespace (never as a
bare ``core`` or ``model``), and every package folder below it is discovered, so a new
one (``backends/cuda/kernels/``) cannot be left out of the wheel.
"""

from setuptools import find_packages, setup

# Installed name -> folder. Subpackages need no entry: setuptools maps
# ``glmport.core.specs`` to ``core/specs`` through the longest mapped prefix.
PACKAGE_DIR = {
    "glmport": "glmport",
    "glmport.core": "core",
    "glmport.backends": "backends",
    "glmport.model": "model",
    "glmport.rl": "rl",
    "glmport.conformance": "conformance",
    "glmport.export": "export",
    "pytest_glmport": "pytest_glmport",
}


def _packages(package_dir: dict[str, str]) -> list[str]:
    return [
        name
        for top, folder in package_dir.items()
        for name in (top, *(f"{top}.{sub}" for sub in find_packages(folder)))
    ]


# Data files inside packages: the conformance suite's mustpass lists.
PACKAGE_DATA = {"glmport.conformance": ["mustpass/*.json"]}

setup(package_dir=PACKAGE_DIR, packages=_packages(PACKAGE_DIR), package_data=PACKAGE_DATA)
