"""The LM job split by tensor parallelism on a real local Ray: the group is whole model
replicas (T=2: two workers each, one placement group per replica); a lost worker takes its
replica's other worker with it, the group re-forms at one replica with the global batch kept,
and the run ends exactly as a one-replica run resumed from the same checkpoint does."""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from hybrid_ray.cluster import ElasticTrainer, FailureConfig, ScalingConfig
from hybrid_ray.lm.elastic import LMTrainFn
from tests.cluster.test_lm_on_ray import data, job  # noqa: F401 - data is a fixture
from tests.distributed.test_split_checkpoints import assert_same

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def split_job(data_path: Path, out: Path) -> dict:
    raw = job(data_path, out, steps=16)
    raw["engine"]["tensor_model_parallel_size"] = 2
    raw["train"]["save_interval"] = 2
    return raw


def trainer(raw: dict, workers: int) -> ElasticTrainer:
    out = raw["train"]["out_dir"]
    return ElasticTrainer(LMTrainFn(raw), ScalingConfig(min_workers=2, max_workers=workers, replica_size=2),
                          FailureConfig(max_failures=2, collective_timeout_s=10.0),
                          storage_path=os.path.dirname(out), run_name=os.path.basename(out))


def resumed_from(root: Path, world: int) -> str:
    steps = {}
    for ckpt in root.glob("global_step*"):
        meta = ckpt / "meta.json"
        if meta.exists() and json.loads(meta.read_text())["world_size"] == world:
            steps[int(ckpt.name[len("global_step"):])] = ckpt.name
    return steps[max(steps)]


class Holder:
    """Takes the room a lost replica frees, so the group cannot get its replica back."""

    def ping(self) -> bool:
        return True


def test_a_lost_worker_drops_its_replica_and_the_run_ends_as_one_replica_from_its_checkpoint(
        ray_session, data, tmp_path):  # noqa: F811 - the fixture
    import ray

    raw = split_job(data, tmp_path / "killed")
    t = trainer(raw, 4)
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("r", t.fit()))
    thread.start()
    deadline = time.monotonic() + 300
    while t.controller is None or t.controller._last_step < 5:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.05)
    holder = ray.remote(num_cpus=2)(Holder).remote()  # pending: the 4 workers hold every CPU
    ray.kill(t.controller.group.members[1].handle, no_restart=True)
    thread.join(600)
    killed = box["r"]
    assert ray.get(holder.ping.remote(), timeout=60)  # it got the lost replica's room
    ray.kill(holder)
    assert killed.world_sizes == [4, 2] and killed.failures == 1, killed.events
    assert killed.value.steps == 16
    # The one-replica generation resumed from the newest checkpoint the two replicas committed
    # (each checkpoint records the world that wrote it).
    name = resumed_from(tmp_path / "killed" / "checkpoints", world=4)
    ref_raw = split_job(data, tmp_path / "ref")
    (tmp_path / "ref" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "killed" / "checkpoints" / name, tmp_path / "ref" / "checkpoints" / name)
    ref = trainer(ref_raw, 2).fit()
    assert ref.world_sizes == [2] and ref.value.steps == 16
    assert ref.value.val_loss == killed.value.val_loss  # bitwise: the same layout from the same state
    final = [(r["step"], r["train_loss"]) for r in killed.records if "train_loss" in r][-1]
    assert final == [(r["step"], r["train_loss"]) for r in ref.records if "train_loss" in r][-1]
    assert_same(tmp_path / "killed" / "checkpoints" / "global_step16", tmp_path / "ref" / "checkpoints" / "global_step16")
