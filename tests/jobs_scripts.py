"""Import a script under jobs/ (not a package) as a module, for tests that call its functions."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

JOBS = Path(__file__).resolve().parents[1] / "jobs"


def load_script(name: str) -> ModuleType:
    """jobs/<name>.py as module `name` (registered in sys.modules: dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(name, JOBS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
