"""Checkpoints written by 2 ranks, damaged every way we could think of, loaded by 2 ranks.

The corpus: each file of the newest checkpoint truncated, flipped and deleted; garbage manifests;
`latest` missing, empty, non-UTF-8, pointing outside; a pickle payload that would run code if
unpickled; and the same damage to both checkpoints. Every case must load the newest checkpoint
that is still good, bitwise, on both ranks (0 silent wrong loads, 0 refusals while a good one
exists), refuse with one CheckpointError line on both ranks when none is, and never run the
payload. Also: ranks whose tags differ save under rank 0's with a warning, and a rank killed
mid-save is noticed by its peer within seconds."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from hybrid_ray.engine import CheckpointError
from tests.distributed import spawn
from tests.distributed.test_checkpoint_commit_kills import ZERO1, KillingFS
from tests.unit.test_checkpoint import make, state, train
from tests.unit.test_checkpoint_garbage import RunsCode, _replace_file as _vouch

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def digest(engine) -> str:
    """The engine's full training state (every parameter's master and optimizer state, counters)."""
    h = hashlib.sha256(str(engine.global_steps).encode())
    for name, tensors in sorted(state(engine).items()):
        for key, t in sorted(tensors.items()):
            h.update(f"{name}/{key}".encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_two(rank: int, world: int, root: str) -> None:
    engine = make(cfg=ZERO1)
    for step in range(2):
        train(engine, range(step, step + 1))
        engine.save_checkpoint(root)


def load_each(rank: int, world: int, cases: list, out: str) -> None:
    """Load every case's root; write what each rank got: (directory, digest) or the error."""
    got = {}
    for case in cases:
        engine = make(seed=3, cfg=ZERO1)
        try:
            path, _ = engine.load_checkpoint(case["root"], **case.get("kwargs", {}))
            got[case["name"]] = {"path": path and Path(path).name, "digest": digest(engine)}
        except CheckpointError as e:
            got[case["name"]] = {"error": str(e)}
    Path(f"{out}/rank{rank}.json").write_text(json.dumps(got))


def damage(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 3] ^= 0x5A
        path.write_bytes(bytes(data))


def corpus(base: Path, work: Path) -> list:
    """[{name, root, expect: 'global_step2' | 'global_step1' | 'error'}] on copies of base."""
    cases = []

    def case(name: str, expect: str, change, **kwargs) -> None:
        root = work / name
        shutil.copytree(base, root)
        change(root)
        cases.append({"name": name, "root": str(root), "expect": expect, "kwargs": kwargs})

    files = sorted(p.name for p in (base / "global_step2").iterdir())
    assert len(files) >= 6  # 2 ranks: params and rng each, meta, extras or not, manifest
    for name in files:
        for how in ("truncate", "flip", "delete"):
            case(f"{name}-{how}", "global_step1",
                 lambda r, n=name, h=how: damage(r / "global_step2" / n, h))
            case(f"both-{name}-{how}", "error",
                 lambda r, n=name, h=how: [damage(r / t / n, h) for t in ("global_step1", "global_step2")])
    for name, text in {"manifest-null-steps": '{"format": "hybrid_ray.checkpoint/1", "global_steps": null}',
                       "manifest-list": "[]", "manifest-garbage": "\x00\x01"}.items():
        case(f"{name}", "global_step1",
             lambda r, t=text: (r / "global_step2" / "manifest.json").write_text(t))
        case(f"junk-dir-{name}", "global_step2",
             lambda r, t=text: ((r / "junk").mkdir(), (r / "junk" / "manifest.json").write_text(t)))
    for name, data in {"missing": None, "empty": b"", "non-utf8": b"\xff\xfe\xfd",
                       "outside": b"../../etc", "absolute": b"/tmp", "older": b"global_step1"}.items():
        expect = "global_step1" if name == "older" else "global_step2"
        case(f"latest-{name}", expect, lambda r, d=data: (r / "latest").unlink() if d is None
             else (r / "latest").write_bytes(d))
    params = next(p.name for p in (base / "global_step2").iterdir() if p.name.startswith("params-rank00001"))
    case("pickle-payload", "global_step1", lambda r: _vouch(
        r / "global_step2", params, pickle.dumps({"w": RunsCode()}), params.rsplit(".", 1)[0] + ".pt"))
    case("pickle-payload-tagged", "error", lambda r: _vouch(
        r / "global_step2", params, pickle.dumps({"w": RunsCode()}), params.rsplit(".", 1)[0] + ".pt"),
         tag="global_step2")
    return cases


def test_a_damaged_checkpoint_never_loads_wrong_and_a_good_one_always_loads(tmp_path):
    base, work, out = tmp_path / "base", tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    spawn.run(save_two, 2, str(base), timeout_s=60)
    RunsCode.marker = str(tmp_path / "payload-ran")
    cases = corpus(base, work)
    pristine = [{"name": t, "root": str(base), "expect": t, "kwargs": {"tag": t}}
                for t in ("global_step1", "global_step2")]
    spawn.run(load_each, 2, pristine + cases, str(out), timeout_s=60)
    got = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    want = {t: got[0][t]["digest"] for t in ("global_step1", "global_step2")}
    assert want["global_step1"] != want["global_step2"]
    wrong = []
    for c in cases:
        for r in (0, 1):
            g = got[r][c["name"]]
            if c["expect"] == "error":
                ok = "error" in g and "\n" not in g["error"]
            else:
                ok = g.get("path") == c["expect"] and g.get("digest") == want[c["expect"]]
            if not ok:
                wrong.append((c["name"], r, c["expect"], g))
    assert not wrong, wrong
    assert not os.path.exists(RunsCode.marker), "the pickle payload ran"
    assert len(cases) >= 50  # 6 files x 3 kinds of damage x (newest, both), manifests, latest, payloads


def mismatched_places(rank: int, world: int, root: str) -> None:
    engine = make(cfg=ZERO1)
    train(engine, range(1))
    path = engine.save_checkpoint(root, tag=f"loss-{0.5 + rank}")  # per-rank, as loss.item() is
    assert Path(path).name == "loss-0.5"
    # a directory named after each rank's clock, as HelloDeepSpeed's experiment folder is
    path = engine.save_checkpoint(f"{root}/exp-{rank}", tag="second")
    assert Path(path) == Path(root) / "exp-0" / "second"


def test_ranks_whose_tags_or_directories_differ_save_under_rank_0s(tmp_path):
    spawn.run(mismatched_places, 2, str(tmp_path), timeout_s=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp-0", "latest", "loss-0.5"]
    engine = make(seed=4, cfg=ZERO1)
    assert Path(engine.load_checkpoint(str(tmp_path))[0]).name == "loss-0.5"
    assert Path(engine.load_checkpoint(str(tmp_path / "exp-0"))[0]).name == "second"


def dies_mid_save(rank: int, world: int, root: str, victim: int, out: str) -> None:
    """`victim` SIGKILLs itself right after its first file write of a save; the other rank writes
    how long its save took to fail and why, then leaves at once (its peer is gone)."""
    from hybrid_ray.engine.checkpoint import storage as cio
    fs = KillingFS()
    fs.kill_at = 2 if rank == victim else 0  # rank 0's first operation is the staging mkdir
    cio.filesystem = lambda path: (fs, os.path.abspath(os.fspath(path)))
    engine = make(cfg={**ZERO1, "checkpoint": {"write_threads": 1, "peer_timeout_s": 3}})
    train(engine, range(1))
    fs.armed = True
    t0 = time.monotonic()
    try:
        engine.save_checkpoint(root)
        result = {"error": None}
    except CheckpointError as e:  # anything else escapes: the survivor's exit code says so
        result = {"error": str(e)}
    result["seconds"] = time.monotonic() - t0
    Path(out).write_text(json.dumps(result))
    os._exit(0)


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_mid_save_is_noticed_in_seconds(tmp_path, victim):
    out = tmp_path / "survivor.json"
    ctx = mp.start_processes(spawn._entry, args=(dies_mid_save, 2, spawn.free_port(),
                                                 (str(tmp_path / "ckpt"), victim, str(out)), 60, "gloo",
                                                 spawn.caller_state()),
                             nprocs=2, join=False, start_method=spawn.START_METHOD)
    survivor, dead = ctx.processes[1 - victim], ctx.processes[victim]
    survivor.join(90)
    alive = survivor.is_alive()
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    assert not alive, "the surviving rank was still waiting after 90 s"
    assert dead.exitcode == -signal.SIGKILL and survivor.exitcode == 0
    result = json.loads(out.read_text())
    assert result["error"] and result["seconds"] < 20, result
    assert "\n" not in result["error"]
    if victim == 1:  # rank 0 hosts the store: it sees rank 1's heartbeat stop
        assert "rank 1 stopped answering during the save" in result["error"], result
    else:  # the store went with rank 0
        assert "lost the process group's store" in result["error"] or "a peer left" in result["error"]
