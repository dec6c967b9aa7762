"""Retention: keep_last good checkpoints, every keep_every-th step, latest; never the only good one."""
from __future__ import annotations

from pathlib import Path

from hybrid_ray.engine.checkpoint.retention import Candidate, to_delete
from tests.unit.test_checkpoint import CFG, make, train


def found(*specs: tuple) -> list:
    return [Candidate(f"s{step}", step, good) for step, good in specs]


def test_keep_last_counts_good_checkpoints_only() -> None:
    five = found((1, True), (2, True), (3, True), (4, True), (5, True))
    assert to_delete(five, "s5", keep_last=2) == ["s1", "s2", "s3"]
    # the two newest are corrupt: they do not count, the newest good ones stay
    broken = found((1, True), (2, True), (3, True), (4, False), (5, False))
    assert to_delete(broken, "s5", keep_last=2) == ["s1", "s4"]
    # nothing good but the oldest: it is never deleted
    assert to_delete(found((1, True), (2, False), (3, False)), "s3", keep_last=1) == ["s2"]


def test_keep_every_and_latest_are_kept() -> None:
    ten = found(*[(s, True) for s in range(1, 11)])
    assert to_delete(ten, "s10", keep_last=2, keep_every=4) == ["s1", "s2", "s3", "s5", "s6", "s7"]
    # latest names an older checkpoint (a user saved under another tag since): it stays
    assert to_delete(ten, "s3", keep_last=1) == ["s1", "s2", "s4", "s5", "s6", "s7", "s8", "s9"]


def test_retention_on_disk(tmp_path: Path) -> None:
    engine = make(cfg={**CFG, "checkpoint": {"keep_last": 2, "keep_every": 3}})
    (tmp_path / "notes").mkdir()  # not a checkpoint: never touched
    (tmp_path / "global_step0.tmp-dead").mkdir()  # left by a killed save: removed
    for step in range(1, 6):
        train(engine, range(step - 1, step))
        engine.save_checkpoint(tmp_path, async_save=step % 2 == 0)
    engine.wait_checkpoint()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step3", "global_step4", "global_step5", "latest", "notes"]
    # truncate the newest: the next commit keeps the new one and the newest good older one
    params = next((tmp_path / "global_step5").glob("params-rank*"))
    params.write_bytes(params.read_bytes()[:-4])
    train(engine, range(5, 6))
    engine.save_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step3", "global_step4", "global_step6", "latest", "notes"]


def test_no_retention_by_default(tmp_path: Path) -> None:
    engine = make()
    for step in range(1, 4):
        train(engine, range(step - 1, step))
        engine.save_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step1", "global_step2", "global_step3", "latest"]
