"""A lone worker's replica copies held by a warm spare (cluster/spare_copies.py), on a real
local Ray: the LM job with one worker, `fault_tolerance.replicas` and one warm spare; the worker
is killed once the spare holds its copy of a given step, the spare replaces it and recovers
from the copy in its own memory (no checkpoint read: the only checkpoint is the run's last),
at that step or a newer one, and the run ends exactly where an uninterrupted one does. On one
node the copies after the first push go into slots shared with the spare (slots.py)."""
from __future__ import annotations

import os
import re

import pytest

from hybrid_ray.cluster import ElasticTrainer, FailureConfig, ScalingConfig
from hybrid_ray.lm.elastic import LMTrainFn
from tests.cluster.test_lm_on_ray import data, fit_killing, job  # noqa: F401 - data is a fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


STEPS = 600  # long enough for the spare to warm up and take copies while the worker trains


def lone(data, out, spares: int, later: int = None, mode: str = "copy"):  # noqa: F811
    raw = job(data, out, steps=STEPS)
    raw["train"].update(save_interval=STEPS, eval_interval=STEPS)  # nothing on disk to fall back to
    raw["engine"]["zero_optimization"] = {"stage": 2}
    raw["engine"]["fault_tolerance"] = {"replicas": 1, "spare_workers": spares, "mode": mode}
    trainer = ElasticTrainer(LMTrainFn(raw), ScalingConfig(min_workers=1, max_workers=1, spare_workers=spares),
                             FailureConfig(max_failures=2, collective_timeout_s=10.0),
                             storage_path=os.path.dirname(out), run_name=os.path.basename(out))
    if later is None:
        return trainer.fit()
    seen = {"first": -1, "held": -1, "slots": False}

    def ready(controller) -> bool:  # `later` steps after the spare's first copy
        import ray
        if not controller.group.spares:
            return False
        spare = controller.group.spares[0].handle
        seen["held"] = ray.get(spare.hold_copy.remote(None), timeout=200)
        seen["slots"] = ray.get(spare.holds_slots.remote(), timeout=200)
        if seen["first"] < 0:
            seen["first"] = seen["held"]
        return seen["first"] >= 0 and seen["held"] >= seen["first"] + later
    return fit_killing(trainer, ready, victim=0), seen


@pytest.fixture(scope="module")
def plain(ray_session, data, tmp_path_factory):  # noqa: F811
    return lone(data, str(tmp_path_factory.mktemp("spare") / "plain"), spares=0)


@pytest.mark.parametrize("later,mode", [(2, "copy"), (20, "copy"), (20, "replay")])
def test_a_lone_workers_spare_recovers_it_from_the_copy_it_holds(ray_session, data, plain, tmp_path, later, mode):  # noqa: F811
    # replay: a lone worker has nobody to replay to; for its spare it copies every step instead
    killed, seen = lone(data, str(tmp_path / "killed"), spares=1, later=later, mode=mode)
    held = seen["held"]
    assert killed.failures == 1 and killed.world_sizes == [1, 1], killed.events
    assert "1 warm spare(s) joined" in killed.events, killed.events
    assert killed.value.val_loss == plain.value.val_loss  # bitwise: same state, data and RNG
    resumed = [e for e in killed.events if "from the replicas in memory" in e]
    assert len(resumed) == 1, killed.events
    step = int(re.search(r"resumed at step (\d+)", resumed[0]).group(1))
    assert STEPS > step >= held, (step, held)  # the copy it held when the worker died, or newer
    assert [r["step"] for r in killed.records if "train_loss" in r][-1] == STEPS
    # One node: after the first push, the worker's copies went into memory shared with the spare.
    assert seen["slots"] or later == 2, seen
