"""The LM job on a real local Ray with buddy replicas and a warm spare: a worker killed
mid-run is replaced by the spare, the group resumes from the shards the survivor holds in
memory (no checkpoint read), redoes at most one step, and ends exactly where an uninterrupted
run does."""
from __future__ import annotations

import re

import pytest

from tests.cluster.test_lm_on_ray import data, fit, job  # noqa: F401 - data is a fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def replicated(data, out, **ft) -> dict:  # noqa: F811
    raw = job(data, out)
    raw["engine"]["zero_optimization"] = {"stage": 2}
    raw["engine"]["fault_tolerance"] = {"replicas": 1, "spare_workers": 1, **ft}
    return raw


# Of 16 steps: the kill lands up to ~3 steps later. copy: the shard sent after every step;
# replay: each step's gradient, the buddy stepping its copy.
@pytest.mark.parametrize("kill_at,mode", [(4, "copy"), (8, "replay")])
def test_a_killed_worker_is_rebuilt_from_memory_by_a_warm_spare(ray_session, data, tmp_path, kill_at, mode):  # noqa: F811
    # two workers throughout (min 2): the run waits for room rather than start smaller
    plain = fit(replicated(data, tmp_path / "plain", replicas=0, spare_workers=0), min_workers=2)
    killed = fit(replicated(data, tmp_path / "killed", mode=mode), kill_at=kill_at, spares=1, min_workers=2)
    assert killed.failures == 1 and killed.world_sizes == [2, 2], killed.events
    assert "1 warm spare(s) joined" in killed.events, killed.events
    assert killed.value.val_loss == plain.value.val_loss  # bitwise: same state, data and RNG
    lost = next(e for e in killed.events if "lost" in e)
    seen = int(re.search(r"last step seen (\d+)", lost).group(1))
    resumed = [e for e in killed.events if "from the replicas in memory" in e]
    assert len(resumed) == 1, killed.events
    step = int(re.search(r"resumed at step (\d+)", resumed[0]).group(1))
    # At most one of the steps the driver saw done is redone. The replicas may hold a later
    # step than the driver saw (its poll lags the workers: seen 9, resumed at 10 in one soak
    # run); bitwise the same val loss says that step's state was whole.
    assert seen - step <= 1, (seen, step)
    steps = [r["step"] for r in killed.records if "train_loss" in r]
    assert steps[-1] == 16
