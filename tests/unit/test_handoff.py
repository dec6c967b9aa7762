"""A lone worker's replica copy handed to another process's keeper (engine/replicas/handoff.py),
without Ray: what travels is plain arrays and bytes, the receiver's recovery plan finds the
copy, a leased snapshot's buffers are not reused while it is copied out, and a keeper that
saw the run's checkpoint but holds nothing says so plainly."""
from __future__ import annotations

import pickle

import numpy as np
import torch

from hybrid_ray.engine.replicas import handoff
from hybrid_ray.engine.replicas.keeper import Keeper, plan
from hybrid_ray.engine.replicas.snapshot import Snapshot


def worker_keeper(step: int = 5) -> Keeper:
    k = Keeper()
    k.start("/run")
    token = k.begin()
    tensors = [{"master": torch.arange(4, dtype=torch.float32), "exp_avg": torch.ones(3, dtype=torch.bfloat16) / 3}]
    k.put_own(Snapshot(step, 0, 1, tensors, b"small", "/run"), token)
    k.commit(step, token)
    return k


def test_a_copy_travels_as_plain_data_and_the_receivers_plan_finds_it():
    sender, receiver = worker_keeper(), Keeper()
    assert handoff.newest_step(sender) == 5 and handoff.newest_step(receiver) == -1
    with handoff.exported(-1, sender) as sent:
        wire = pickle.loads(pickle.dumps(sent))  # as another process gets it
    assert all(isinstance(a, np.ndarray) for ts in wire["tensors"] for _, a in ts.values())
    assert handoff.import_copy(wire, receiver) == 5 and handoff.import_copy(None, receiver) == 5
    got = receiver.get("held", 5).tensors[0]
    assert torch.equal(got["master"], torch.arange(4, dtype=torch.float32))
    assert got["exp_avg"].dtype == torch.bfloat16 and torch.equal(got["exp_avg"], torch.ones(3, dtype=torch.bfloat16) / 3)
    p, why = plan([receiver.summary()], "/run")
    assert why == "ok" and p.step == 5 and p.sources == {0: (0, "held")}
    with handoff.exported(5, sender) as nothing:
        assert nothing is None  # nothing newer than what was sent


def test_an_exported_snapshot_is_not_reused_by_the_next_copy_until_it_is_sent():
    k = worker_keeper()
    token = k.begin()
    with handoff.exported(-1, k) as wire:  # its arrays are views of step 5's buffers
        k.put_own(Snapshot(6, 0, 1, [{"master": torch.zeros(4)}], b"s", "/run"), token)
        k.commit(6, token)
        assert k.recycled("own") is None  # step 5's buffers are still being read
        assert np.array_equal(wire["tensors"][0]["master"][1], np.arange(4, dtype=np.float32))
    k.put_own(Snapshot(7, 0, 1, [{"master": torch.zeros(4)}], b"s", "/run"), token)
    k.commit(7, token)
    assert k.recycled("own").step == 6


def test_a_replay_modes_live_entry_is_never_handed_out():
    k = Keeper()
    k.start("/run")
    token = k.begin()
    k.set_live(Snapshot(3, 0, 1, [{"master": torch.zeros(2)}], b"s", "/run", live=True), token)
    k.commit(3, token)
    with handoff.exported(-1, k) as nothing:
        assert handoff.newest_step(k) == -1 and nothing is None


def test_a_run_seen_on_disk_with_nothing_held_is_not_a_lost_buddy():
    k = Keeper()
    k.saw_disk("/run", 8)
    assert plan([k.summary()], "/run") == (None, "no worker holds replicas of this run")


def test_a_received_copy_is_kept_without_copying_and_its_memory_is_never_reused():
    sender, receiver = worker_keeper(), Keeper()
    with handoff.exported(-1, sender) as sent:
        wire = pickle.loads(pickle.dumps(sent))
    for ts in wire["tensors"]:  # as Ray hands them over: read-only views of its object store
        for _, a in ts.values():
            a.flags.writeable = False
    handoff.import_copy(wire, receiver)
    held = receiver.get("held", 5)
    assert held.borrowed and np.shares_memory(held.tensors[0]["master"].numpy(), wire["tensors"][0]["master"][1])
    token = receiver.begin()
    receiver.put_own(Snapshot(6, 0, 1, [{"master": torch.zeros(4)}], b"s", "/run"), token)
    receiver.commit(6, token)  # the held step-5 copy is dropped, not recycled for a later copy
    assert receiver.recycled("held") is None
