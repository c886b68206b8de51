"""The repository's package folders and the names they install under, for the tests
that walk the source tree (packaging, the import graph)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Top-level packages installed under their own names; every other package folder at the
# repository root installs as glmport.<folder>.
OWN_NAME = {"glmport", "pytest_glmport"}


def package_folders(root: Path = REPO) -> list[Path]:
    """The folders at ``root`` holding an ``__init__.py``, sorted."""
    return sorted(p for p in root.iterdir() if (p / "__init__.py").is_file())


def installed_name(folder: Path) -> str:
    """The dotted name the package folder installs as."""
    return folder.name if folder.name in OWN_NAME else f"glmport.{folder.name}"
