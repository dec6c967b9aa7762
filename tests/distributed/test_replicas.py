"""Buddy replicas: a rank killed mid-run is rebuilt from its buddy's copy in memory.

Three processes: two train with `fault_tolerance.replicas: 1` (each sends its ZeRO shard to the
other after every step); one of them is killed at a chosen step and point; the survivor and a
spare form a new group, load the run with load_checkpoint (which finds the replicas in the
survivor's memory, no checkpoint on disk at all) and train to the end. The final parameters
must equal, bit for bit, those of a run that was never interrupted, and at most one completed
step may be redone.
"""
from __future__ import annotations

import datetime
import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from hybrid_ray.engine import Engine, Topology
from hybrid_ray.engine.topology import gloo_on_loopback
from tests.distributed import spawn

pytestmark = [pytest.mark.dist, pytest.mark.slow]
STEPS, D = 8, 16


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(3))
        self.norm = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x).pow(2).mean()


def config(stage: int, extra: dict) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 300,
                                 "stage3_param_persistence_threshold": 20},
           "fault_tolerance": {"replicas": 1}}
    for key, value in extra.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def engine(stage: int, extra: dict) -> Engine:
    torch.manual_seed(0)
    return Engine(Blocks(), config(stage, extra), topology=Topology.from_environment())


def micro_batch(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(2, D, generator=torch.Generator().manual_seed(10_000 * step + 100 * micro + rank))


def train(e: Engine, kill: tuple = (), save_to: Optional[str] = None) -> None:
    """Train to STEPS from the engine's step; `kill` = (step, point): die there; `save_to`: a
    checkpoint after every step."""
    while e.global_steps < STEPS:
        step = e.global_steps
        train_one(e, kill == (step, "backward"), kill == (step, "committed"))
        if kill == (step, "after_step"):
            os._exit(3)
        if save_to is not None:
            e.save_checkpoint(save_to)


def train_one(e: Engine, die_in_backward: bool = False, die_committed: bool = False) -> None:
    step = e.global_steps
    if die_committed:  # replay mode: the step's gradient reached the buddy, the update did not run
        e.zero.apply = lambda update: os._exit(3)
    for micro in range(2):
        loss = e(micro_batch(step, micro, e.topology.rank))
        if die_in_backward and micro == 1:
            next(e.module.parameters()).register_hook(lambda g: os._exit(3))
        e.backward(loss)
        e.step()


def join(port: int, rank: int, world: int, timeout_s: float = 60) -> None:
    gloo_on_loopback("127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def state(e: Engine) -> dict:
    return {k: v.tolist() for k, v in e.consolidated_state_dict(rank0_only=False).items()}


@dataclass(frozen=True)
class Role:
    """One process: its rank in the first group and in the second (None: not in it), and
    where it dies in the first (None: it survives)."""

    first: Optional[int]
    second: Optional[int]
    kill: tuple = ()


def member(i: int, roles: List[Role], ports: tuple, out: str, stage: int, extra: dict,
           save_every_step: bool) -> None:
    torch.set_num_threads(1)
    me, run = roles[i], os.path.join(out, "ckpt")
    worlds = [sum(getattr(r, g) is not None for r in roles) for g in ("first", "second")]
    result: dict = {}
    if me.first is not None:
        join(ports[0], me.first, worlds[0], timeout_s=30)
        e = engine(stage, extra)
        e.load_checkpoint(run)  # nothing there: a fresh start
        try:
            train(e, me.kill, run if save_every_step else None)
            raise AssertionError("a survivor finished although a peer was killed")
        except RuntimeError:
            result["done_before"] = e.global_steps
            e._end(collective=False)
            dist.destroy_process_group()
    if me.second is not None:
        join(ports[1], me.second, worlds[1])
        e = engine(stage, extra)
        path, _ = e.load_checkpoint(run)
        result.update(path=path, resumed=e.global_steps, recovery=e.replicas.last_recovery)
        train(e)
        result["state"] = state(e)
        Path(out, f"member{i}.json").write_text(json.dumps(result))
        e.destroy()
        dist.destroy_process_group()


def uninterrupted(rank: int, world: int, out: str, stage: int, extra: dict, tag: Optional[str] = None) -> None:
    """The reference: from the start (or from the checkpoint `tag` of the run) to the end."""
    e = engine(stage, extra)
    if tag is not None:
        assert e.load_checkpoint(os.path.join(out, "ckpt"), tag=tag)[0] is not None
    train(e)
    final = state(e)  # collective
    if rank == 0:
        Path(out, "reference.json").write_text(json.dumps(final))
    e.destroy()


def run_members(tmp_path: Path, roles: List[Role], stage: int, extra: dict, save_every_step: bool = False
                ) -> List[Optional[dict]]:
    """Run the roles; every killed one must exit 3 and every other 0. Their results by index."""
    ports = (spawn.rendezvous_port(), spawn.rendezvous_port())
    ctx = mp.start_processes(member, args=(roles, ports, str(tmp_path), stage, extra, save_every_step),
                             nprocs=len(roles), start_method=spawn.START_METHOD, join=False)
    for proc in ctx.processes:
        proc.join(150)
    codes = [proc.exitcode for proc in ctx.processes]
    for proc in ctx.processes:
        if proc.is_alive():
            proc.kill()
    errors = [str(pickle.loads(Path(f).read_bytes()))[-3000:] for f in ctx.error_files
              if os.path.exists(f) and os.path.getsize(f)]
    assert codes == [3 if r.kill else 0 for r in roles], (codes, *errors)
    return [json.loads((tmp_path / f"member{i}.json").read_text()) if r.second is not None else None
            for i, r in enumerate(roles)]


def assert_state(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(torch.tensor(got[k]), torch.tensor(v)), k


def run_with_loss(tmp_path: Path, stage: int, kill: tuple, extra: dict = {}) -> None:
    """0 survives, 1 is killed at `kill`, 2 is the spare that takes its place: the run ends as
    the uninterrupted one does, bit for bit."""
    spawn.run(uninterrupted, 2, str(tmp_path), stage, extra, timeout_s=60)
    want = json.loads((tmp_path / "reference.json").read_text())
    results = run_members(tmp_path, [Role(0, 0), Role(1, None, kill), Role(None, 1)], stage, extra)
    for got in (results[0], results[2]):
        assert got["path"].startswith("memory:"), got["path"]
        assert_state(got["state"], want)
    survivor = results[0]
    assert survivor["done_before"] - survivor["resumed"] <= 1, survivor


@pytest.mark.parametrize("stage,kill", [(1, (3, "backward")), (2, (5, "after_step")), (3, (4, "backward"))])
def test_a_killed_rank_is_rebuilt_from_its_buddys_copy(tmp_path: Path, stage: int, kill: tuple) -> None:
    run_with_loss(tmp_path, stage, kill)


OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
TOPK = {"gradient_compression": {"type": "topk", "topk_ratio": 0.1, "warmup_steps": 2}}
POWERSGD = {"gradient_compression": {"type": "powersgd", "rank": 2}}
ONEBIT = {"gradient_compression": {"type": "onebit", "warmup_steps": 2}}  # the momentum form from step 2
FP16_THEN_FP32 = {"fp16": {"enabled": True, "initial_scale_power": 8},
                  "precision": {"schedule": [{"step": 4, "dtype": "fp32"}]}}


@pytest.mark.parametrize("stage,kill,extra", [
    (2, (4, "backward"), OFFLOAD), (2, (5, "after_step"), TOPK), (1, (3, "backward"), POWERSGD),
    (2, (5, "backward"), FP16_THEN_FP32), (3, (2, "after_step"), OFFLOAD), (2, (4, "after_step"), ONEBIT)],
    ids=["offload", "topk", "powersgd", "fp16-schedule", "stage3-offload", "onebit"])
def test_recovery_keeps_offload_compression_and_precision_state(tmp_path: Path, stage: int, kill: tuple,
                                                                extra: dict) -> None:
    run_with_loss(tmp_path, stage, kill, extra)


REPLAY = {"fault_tolerance": {"mode": "replay"}}
ON_DEVICE = {"fault_tolerance": {"mode": "replay", "replay_on": "device"}}


@pytest.mark.parametrize("stage,kill,extra", [
    (1, (3, "backward"), REPLAY), (2, (5, "after_step"), REPLAY), (3, (4, "committed"), REPLAY),
    (2, (4, "backward"), {**OFFLOAD, **REPLAY}), (2, (3, "committed"), {**TOPK, **REPLAY}),
    (2, (5, "backward"), {**FP16_THEN_FP32, **REPLAY}),
    (3, (3, "committed"), {"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}, **REPLAY}),
    (2, (5, "committed"), {**ONEBIT, **REPLAY}), (2, (3, "committed"), ON_DEVICE),
    (3, (4, "backward"), {"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}, **ON_DEVICE})],
    ids=["stage1", "stage2", "stage3-committed", "offload", "topk-committed", "fp16-schedule",
         "stage3-partial-offload-committed", "onebit-committed", "on-device-committed",
         "on-device-stage3-partial-offload"])
def test_replay_mode_rebuilds_a_killed_rank_from_the_copy_its_buddy_stepped(
        tmp_path: Path, stage: int, kill: tuple, extra: dict) -> None:
    # The buddy's copy was never sent whole after the first step: it was stepped with the
    # owner's gradients. "committed": the killed rank died after its buddy had its gradient and
    # before its own update, so the survivor is a step ahead of the copy, which must catch up.
    run_with_loss(tmp_path, stage, kill, extra)


@pytest.mark.parametrize("extra,kill", [({}, (4, "backward")), (REPLAY, (4, "backward"))], ids=["copy", "replay"])
def test_survivors_go_on_at_a_smaller_size_from_memory(tmp_path: Path, extra: dict, kill: tuple) -> None:
    # Three ranks lose one and go on as two, with no spare: the shards are cut anew for two
    # ranks in memory. The same state read from the checkpoint of that step (saved every
    # step by the first group) and trained on at two ranks gives the same final weights.
    roles = [Role(0, 0), Role(1, 1), Role(2, None, kill)]
    results = run_members(tmp_path, roles, 2, extra, save_every_step=True)
    got = results[0]
    assert got["path"].startswith("memory:") and got["recovery"]["source"] == "memory", got["path"]
    assert got["done_before"] - got["resumed"] <= 1
    spawn.run(uninterrupted, 2, str(tmp_path), 2, extra, f"global_step{got['resumed']}", timeout_s=60)
    want = json.loads((tmp_path / "reference.json").read_text())
    for r in (results[0], results[1]):
        assert_state(r["state"], want)


@pytest.mark.parametrize("extra", [{}, REPLAY], ids=["copy", "replay"])
def test_a_rank_lost_with_its_buddy_falls_back_to_the_checkpoint(tmp_path: Path, extra: dict) -> None:
    # Ranks 1 and 2 die together: rank 1's copy lived on rank 2. The survivor alone has its
    # own shard and rank 2's copy, not rank 1's: it must load the newest checkpoint instead.
    roles = [Role(0, 0), Role(1, None, (5, "backward")), Role(2, None, (5, "backward"))]
    got = run_members(tmp_path, roles, 1, extra, save_every_step=True)[0]
    assert not got["path"].startswith("memory:"), got["path"]
    assert got["recovery"]["source"] == "disk" and "lack rank(s) [1]" in got["recovery"]["reason"], got
    assert got["resumed"] == 5  # the checkpoint of the last step every rank finished
    spawn.run(uninterrupted, 1, str(tmp_path), 1, extra, "global_step5", timeout_s=60)
    assert_state(got["state"], json.loads((tmp_path / "reference.json").read_text()))


def buddy_copies(rank: int, world: int, out: str, mode: str, compression: str = "topk") -> None:
    from hybrid_ray.engine.replicas import KEEPER

    gc = ONEBIT["gradient_compression"] if compression == "onebit" else {"type": "topk", "topk_ratio": 0.2}
    ft = {"mode": "replay", "replay_on": "device"} if mode == "replay-on-device" else {"mode": mode}
    e = engine(2, {"gradient_compression": gc, "fault_tolerance": ft})
    carriers, batch = [], dist.batch_isend_irecv

    def recording(ops):  # which group carried the gradient shards (tags from 1000 on)
        carriers.extend(op.group for op in ops if op.tag >= 1000)
        return batch(ops)

    dist.batch_isend_irecv = recording
    while e.global_steps < STEPS:
        train_one(e)
        e.replicas.wait()  # the exchange of this step has committed (replay: and been applied)
        mine = torch.cat([m.detach().reshape(-1) for m in e.zero.masters]
                         + [v.reshape(-1) for m in e.zero.masters for k, v in sorted(e.optimizer.state[m].items())
                            if torch.is_tensor(v) and v.shape == m.shape])
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        held = KEEPER.get("held", e.global_steps)
        copy = torch.cat([t.reshape(-1) for t in held.tensors[0].values()])
        assert held.rank == (rank - 1) % world and len(held.tensors) == 1
        assert torch.equal(copy, everyone[(rank - 1) % world]), e.global_steps
        assert sorted(KEEPER.own) == [e.global_steps] and sorted(KEEPER.held) == [e.global_steps]
    dist.batch_isend_irecv = batch
    if mode != "copy":  # replay on the device: over the training group, not the ring's
        want = e.topology.group if mode == "replay-on-device" else e.replicas.group
        assert carriers and all(g is want for g in carriers), (mode, len(carriers))
    e.destroy()


@pytest.mark.parametrize("mode,compression", [("copy", "topk"), ("replay", "topk"), ("replay", "onebit"),
                                              ("replay-on-device", "topk")])
def test_the_buddys_copy_equals_the_owners_shard_after_every_step(tmp_path: Path, mode: str, compression: str) -> None:
    # onebit: after its warm-up the buddy steps its copy with the averaged momentum and the
    # variance frozen, as the owner does
    spawn.run(buddy_copies, 3, str(tmp_path), mode, compression, timeout_s=60)


def restart_at_the_same_size(rank: int, world: int, out: str) -> None:
    """Every rank's own copy survives: a new engine at the same size loads its own shard
    straight into place (no resharding), and goes on exactly as the first would have."""
    from hybrid_ray.engine.replicas import KEEPER
    from hybrid_ray.engine.zero import relayout

    def shard(e: Engine) -> torch.Tensor:  # this rank's masters and optimizer state
        return torch.cat([m.detach().reshape(-1) for m in e.zero.masters]
                         + [v.reshape(-1) for m in e.zero.masters for _, v in sorted(e.optimizer.state[m].items())
                            if torch.is_tensor(v) and v.shape == m.shape])
    direct, whole = [], relayout.import_shards
    relayout.import_shards = lambda *a: (direct.append(1), whole(*a))
    KEEPER.clear()
    first = engine(2, {"fault_tolerance": {"mode": "copy"}})
    first.save_checkpoint(out)
    train(first)  # to STEPS; the last copy committed by the engine's close
    first.replicas.wait()
    want, mine = state(first), shard(first)
    first.destroy()
    again = engine(2, {})
    again.load_checkpoint(out)
    assert again.replicas.last_recovery["source"] == "memory" and again.global_steps == STEPS
    assert direct, "not loaded straight into place"
    assert torch.equal(shard(again), mine)
    assert_state(state(again), want)
    again.destroy()


def test_a_same_size_restart_loads_each_ranks_own_copy(tmp_path: Path) -> None:
    spawn.run(restart_at_the_same_size, 2, str(tmp_path), timeout_s=60)
