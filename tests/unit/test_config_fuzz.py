"""Config fuzzing: seeded mutations of real configs through load_config, `hybrid-ray config check`
and `initialize`, each against the outcome the corpus states for it (config_fuzz_corpus.py).

What must hold, for every mutation:
- load_config (given the dict and given the file) returns or raises ConfigError /
  NotSupportedError: no other exception escapes; the same for initialize and the CLI;
- it is refused exactly when the corpus says so, with the error class and the message start the
  corpus names (0 wrong acceptances, 0 wrong refusals);
- `config check FILE` says ok exactly when load_config does, else prints its message, exit 2;
- `config check FILE --world-size 1` and initialize on a tiny model at world size 1 agree: both
  accept, or both refuse with the same message (the batch sizes some other world size can run
  are the only configs the two forms of `config check` answer differently).

Run with -s to see the counts line.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn as nn

import hybrid_ray
from hybrid_ray.cli import main
from hybrid_ray.config import ConfigError, NotSupportedError, load_config
from hybrid_ray.engine import Topology

from tests.unit import config_fuzz_mutations as mut
from tests.unit.config_fuzz_corpus import FILE, Mutation, bases, garbage, rng

ONE = Topology(0, 1, torch.device("cpu"), None)
Outcome = Tuple[str, str]  # ("ok", "") | ("ConfigError" | "NotSupportedError" | "escape", message)


class Tiny(nn.Module):
    """Blocks in an nn.ModuleList, so activation checkpointing has something to select."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def corpus() -> List[Mutation]:
    r, known, out = rng(), mut.known_keys(), []
    for name, base in bases():
        out += mut.key_typos(name, base, r, known)
        out += mut.wrong_types(name, base, r)
        out += mut.nulls(name, base)
        out += mut.out_of_range(name, base)
        out += mut.huge_values(name, base, r)
        out += mut.literal_values(name, base)
        out += mut.batches(name, base)
        out += mut.contradictions(name, base)
    return out + list(garbage())


def outcome(fn: Callable[[], Any]) -> Outcome:
    try:
        fn()
    except ConfigError as exc:  # NotSupportedError included; type() tells them apart
        return type(exc).__name__, str(exc)
    except Exception as exc:  # noqa: BLE001 - an escape is what this test counts
        return "escape", f"{type(exc).__name__}: {str(exc)[:200]}"
    return "ok", ""


def check(*argv: str) -> Outcome:
    """`hybrid-ray config check ...` as ("ok", "") or ("exit N", stderr)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(["config", "check", *argv])
    except Exception as exc:  # noqa: BLE001
        return "escape", f"{type(exc).__name__}: {exc}"
    return ("ok", "") if code == 0 else (f"exit {code}", err.getvalue())


@dataclasses.dataclass
class Report:
    total: int = 0
    accepted: int = 0  # by load_config
    refused: int = 0
    world_only: int = 0  # accepted, but refused by initialize at world size 1 (batch split)
    initialized: int = 0  # initialize calls (dict and file)
    checked: int = 0  # `config check` calls
    problems: Dict[str, List[str]] = dataclasses.field(default_factory=lambda: {
        k: [] for k in ("escapes", "wrong_acceptances", "wrong_refusals", "wrong_errors",
                        "disagreements")})

    def add(self, kind: str, m: Mutation, detail: str) -> None:
        self.problems[kind].append(f"{m.name}: {detail}")

    def compare(self, m: Mutation, what: str, a: Outcome, b: Outcome) -> None:
        """Both accept, or both refuse with the same message."""
        if "escape" in (a[0], b[0]):
            self.add("escapes", m, f"{what}: {a} / {b}")
        elif (a[0] == "ok") != (b[0] == "ok") or a[1] != b[1]:
            self.add("disagreements", m, f"{what}: {a} / {b}")

    def line(self) -> str:
        counts = ", ".join(f"{k.replace('_', ' ')} {len(v)}" for k, v in self.problems.items())
        return (f"config fuzz: {self.total} mutations: {self.accepted} accepted ({self.world_only} "
                f"of them refused at world size 1 only), {self.refused} refused; "
                f"{self.initialized} initialize and {self.checked} config check runs; {counts}")


def judge(m: Mutation, got: Outcome, prefix: str, report: Report, where: str) -> None:
    """One load_config outcome against the mutation's expected one."""
    refused = got[0] != "ok"
    if got[0] == "escape":
        report.add("escapes", m, f"{where}: {got[1]}")
    elif m.expect in ("accept", "world"):
        if refused:
            report.add("wrong_refusals", m, f"{where}: {got[1]}")
    elif not refused:
        report.add("wrong_acceptances", m, where)
    else:
        cls = (NotSupportedError if m.expect == "unsupported" else ConfigError).__name__
        if got[0] != cls or not got[1].startswith(prefix) or "\n" in got[1]:
            report.add("wrong_errors", m, f"{where}: {got[0]} {got[1][:160]!r}, "
                                          f"expected {cls} {prefix!r}")


def at_world_one(m: Mutation, source: Any, loaded: Outcome, report: Report) -> Outcome:
    """What initialize at world size 1 must answer: load_config's answer, or for batch sizes
    only other world sizes can run, resolve_batch(1)'s refusal (naming dp_size 1), or for a
    replica split over several processes, data_parallel_size(1)'s (naming world size 1)."""
    if m.expect != "world" or loaded[0] != "ok":
        return loaded
    expected = outcome(lambda: (cfg := load_config(source)).resolve_batch(cfg.data_parallel_size(1)))
    if expected[0] != "ConfigError" or not ("with dp_size 1" in expected[1] or "with world size 1" in expected[1]):
        report.add("wrong_errors", m, f"resolve_batch(1): {expected}")
    return expected


def initialize(source: Any, report: Report) -> Outcome:
    report.initialized += 1
    return outcome(lambda: hybrid_ray.initialize(Tiny(), config=source, topology=ONE))


def config_check(report: Report, *argv: str) -> Outcome:
    """The CLI's answer in load_config's terms: exit 2 with one line 'error: <message>' is a
    refusal with that message (ConfigError or NotSupportedError: the CLI prints both alike)."""
    report.checked += 1
    cli = check(*argv)
    if cli[0] == "exit 2" and cli[1].startswith("error: ") and cli[1].count("\n") == 1:
        return "refused", cli[1][len("error: "):-1]
    return cli


def run_one(m: Mutation, path: Path, report: Report) -> None:
    loaded = None
    if m.in_dict:
        loaded = outcome(lambda: load_config(m.raw))
        judge(m, loaded, m.prefix, report, "dict")
        report.compare(m, "initialize(dict) vs the rule", at_world_one(m, m.raw, loaded, report),
                       initialize(m.raw, report))
    if m.in_file:
        path.write_bytes(m.file_bytes())
        by_file = outcome(lambda: load_config(str(path)))
        judge(m, by_file, m.prefix.replace(FILE, str(path)), report, "file")
        if loaded is not None and m.same_message:
            report.compare(m, "dict vs file", loaded, by_file)
        loaded = by_file
        report.compare(m, "config check vs load_config", by_file, config_check(report, str(path)))
        at_one = config_check(report, str(path), "--world-size", "1")
        report.compare(m, "config check --world-size 1 vs the rule",
                       at_world_one(m, str(path), by_file, report), at_one)
        report.compare(m, "config check --world-size 1 vs initialize", at_one,
                       initialize(str(path), report))
    report.total += 1
    report.accepted += loaded[0] == "ok"
    report.refused += loaded[0] != "ok"
    report.world_only += loaded[0] == "ok" and m.expect == "world"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Report:
    out, folder = Report(), tmp_path_factory.mktemp("fuzz")
    for i, m in enumerate(corpus()):
        run_one(m, folder / f"{i}.json", out)
    print("\n" + out.line())
    return out


def test_corpus_is_large_and_covers_every_outcome(report: Report) -> None:
    kinds = {m.expect for m in corpus()}
    assert report.total >= 500 and kinds == {"accept", "refuse", "unsupported", "world"}
    assert report.accepted + report.refused == report.total


@pytest.mark.parametrize("kind", ["escapes", "wrong_acceptances", "wrong_refusals",
                                  "wrong_errors", "disagreements"])
def test_no_problem_of_this_kind(report: Report, kind: str) -> None:
    found = report.problems[kind]
    assert not found, f"{len(found)} {kind}; first: " + "\n".join(found[:8])
