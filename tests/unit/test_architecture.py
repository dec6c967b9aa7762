"""The shape of the source tree, checked on every run: no import cycles, small files and
functions, and the layer rule (the engine knows neither Ray nor MLflow, the Ray layer knows no job).

Imports are read with `ast` from every module of `hybrid_ray/`, function-local ones included
(an import inside a function still ties the two modules together); only imports under
`if TYPE_CHECKING:` are left out, since they never run.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hybrid_ray"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60

# Which top-level parts of hybrid_ray each part may import ("" is hybrid_ray/__init__.py and the
# top-level modules). Lower layers first: config and models import nothing of ours; the engine
# only config; the Ray layer (cluster) the engine but no job; the LM job anything below it.
ALLOWED: Dict[str, Set[str]] = {
    "config": set(),
    "models": set(),
    "engine": {"config"},
    "data": {"config"},
    "profiling": {"config", "engine"},
    "tracking": {"config"},
    "cluster": {"config", "engine", "tracking"},
    "lm": {"", "config", "engine", "data", "models", "profiling", "tracking", "cluster"},
    # DeepSpeed's names: compat adapts the engine; the modules at DeepSpeed's import paths
    # re-export compat and nothing else.
    "compat": {"config", "engine", "data", "profiling"},
    **{alias: {"compat"} for alias in ("comm", "accelerator", "zero", "checkpointing", "runtime",
                                       "utils", "moe", "ops", "pipe")},
    "": {"config", "engine", "data", "profiling", "lm", "models", "tracking", "compat", "comm",
         "accelerator", "zero", "checkpointing", "runtime", "utils", "moe", "ops", "pipe"},
}
# Third-party packages only one part of hybrid_ray may import.
OWNERS = {"ray": "cluster", "mlflow": "tracking"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: Dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_lines(tree: ast.AST) -> Set[int]:
    lines: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, child.end_lineno + 1))
    return lines


def imports(name: str) -> List[Tuple[str, int]]:
    """(imported module, line) for every import in module `name`: ours resolved to the most
    specific module (a name imported from a package is an edge to the package's __init__),
    third-party ones by their top-level name."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: List[Tuple[str, int]] = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name if a.name in MODULES else a.name.split(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source not in MODULES:
                out.append((source.split(".")[0], node.lineno))
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                out.append((sub if sub in MODULES else source, node.lineno))
    return out


GRAPH: Dict[str, List[Tuple[str, int]]] = {m: imports(m) for m in MODULES}


def part(name: str) -> str:
    """'engine' for hybrid_ray.engine.zero.reducer; '' for hybrid_ray and hybrid_ray.cli."""
    parts = name.split(".")
    if len(parts) == 1 or MODULES[".".join(parts[:2])].name != "__init__.py":
        return ""
    return parts[1]


def cycles() -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w, _ in GRAPH[v]:
            if w not in MODULES or w == v:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in MODULES:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    assert cycles() == []


def test_layers_import_only_downwards() -> None:
    wrong = []
    for name, deps in GRAPH.items():
        mine = part(name)
        for dep, line in deps:
            if dep in MODULES and part(dep) != mine and part(dep) not in ALLOWED[mine]:
                wrong.append(f"{MODULES[name].relative_to(ROOT)}:{line} imports {dep}")
            owner = OWNERS.get(dep)
            if owner is not None and mine != owner:
                wrong.append(f"{MODULES[name].relative_to(ROOT)}:{line} imports {dep} "
                             f"(only hybrid_ray.{owner} may)")
    assert wrong == []


def test_files_and_functions_are_small() -> None:
    big = []
    for name, path in MODULES.items():
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            big.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert big == []


def test_every_module_says_what_it_holds() -> None:
    silent = [str(p.relative_to(ROOT)) for p in MODULES.values()
              if p.read_text().strip() and ast.get_docstring(ast.parse(p.read_text())) is None]
    assert silent == []


BLOCKED_IMPORT = """
import sys
sys.modules["ray"] = None      # any `import ray` now raises ImportError
sys.modules["mlflow"] = None
import importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
print("imported")
"""


def test_engine_config_data_and_policies_import_without_ray_or_mlflow() -> None:
    names = ["hybrid_ray", "hybrid_ray.engine", "hybrid_ray.config", "hybrid_ray.data",
             "hybrid_ray.cluster.policy", "hybrid_ray.cluster.compression_policy",
             "hybrid_ray.cluster.compression_follower", "hybrid_ray.cluster.records",
             "hybrid_ray.lm.loop"]
    names += [m for m in MODULES if part(m) in ("engine", "config", "data", "models", "profiling")]
    done = subprocess.run([sys.executable, "-c", BLOCKED_IMPORT, *names], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-2000:]
