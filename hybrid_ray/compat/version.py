"""The package version, as `deepspeed.__version__` gives DeepSpeed's."""
from __future__ import annotations

from importlib import metadata

FALLBACK = "0.0.0+unknown"  # a source checkout that was never installed has no metadata


def package_version() -> str:
    """The installed distribution's version (pyproject.toml), else FALLBACK."""
    try:
        return metadata.version("hybrid_ray")
    except metadata.PackageNotFoundError:
        return FALLBACK


__version__ = package_version()
