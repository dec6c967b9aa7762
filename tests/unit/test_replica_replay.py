"""Replay mode's parts without a process group: the buddy's optimizer, the keeper's pending
step, and the plan over copies that hold only their rank's part."""
from __future__ import annotations

import torch

from hybrid_ray.engine.replicas import Keeper, Snapshot, plan
from hybrid_ray.engine.replicas import snapshot as snap
from hybrid_ray.engine.replicas.replay import Pending, Stepper, hyperparameters
from hybrid_ray.engine.zero.offload import cpu_optimizer_kwargs, frozen_hyperparameters

RUN = "/runs/a/checkpoints"


def owner(n: int = 1000):
    torch.manual_seed(0)
    masters = [torch.nn.Parameter(torch.randn(n)), torch.nn.Parameter(torch.randn(n // 2))]
    opt = torch.optim.AdamW([{"params": [masters[0]], "weight_decay": 0.1},
                             {"params": [masters[1]], "weight_decay": 0.0}], lr=1e-2,
                            **cpu_optimizer_kwargs(torch.optim.AdamW))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (i + 1))
    return masters, opt, sched


def spec_of(masters, opt) -> dict:
    from hybrid_ray.engine.replicas.replay import optimizer_spec

    class TS:  # what optimizer_spec reads of a TrainState
        pass
    ts = TS()
    ts.optimizer, ts.masters = opt, masters
    return optimizer_spec(ts)


def step_owner(masters, opt, sched, grads, coef):
    view = frozen_hyperparameters(opt)  # as ZeroOptimizer.prepare: frozen, then the scheduler steps
    sched.step()
    torch._foreach_mul_(grads, coef)
    for m, g in zip(masters, grads):
        m.grad = g
    view.step()
    for m in masters:
        m.grad = None
    return view


def test_the_buddys_optimizer_steps_its_copy_bitwise_as_the_owner_steps_the_shard() -> None:
    masters, opt, sched = owner()
    gen = torch.Generator().manual_seed(1)
    step_owner(masters, opt, sched, [torch.randn(m.shape, generator=gen) for m in masters], 0.5)
    copy = [{"master": m.detach().clone(), **{k: v.clone() for k, v in sorted(opt.state[m].items())
                                               if v.shape == m.shape}} for m in masters]
    stepper = Stepper(spec_of(masters, opt), copy)
    for i in range(4):
        grads = [torch.randn(m.shape, generator=gen) for m in masters]
        sent = [g.clone() for g in grads]
        hyper = hyperparameters(frozen_hyperparameters(opt))  # before the scheduler moves
        step_owner(masters, opt, sched, grads, 0.25 + i)
        stepper.apply(Pending(i + 2, sent, 0.25 + i, hyper, b""))
        for m, c in zip(masters, copy):
            assert torch.equal(m.detach(), c["master"]), i
            assert torch.equal(opt.state[m]["exp_avg_sq"], c["exp_avg_sq"]), i
    assert opt.param_groups[0]["lr"] != hyper[0]["lr"]  # the schedule did move: the step used the frozen lr


def test_on_the_owners_kernel_the_copy_keeps_a_foreach_owners_implementation_and_stays_equal() -> None:
    # replay_on device: the copy steps as the owner does (here foreach, where the host copy
    # would take the fused CPU kernel), so it stays bitwise equal to a foreach owner.
    torch.manual_seed(0)
    masters = [torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(70))]
    opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, foreach=True)
    gen = torch.Generator().manual_seed(1)
    for m in masters:
        m.grad = torch.randn(m.shape, generator=gen)
    opt.step()
    copy = [{"master": m.detach().clone(), **{k: v.clone() for k, v in sorted(opt.state[m].items())
                                               if v.shape == m.shape}} for m in masters]
    stepper = Stepper(spec_of(masters, opt), copy, owners_kernel=True)
    assert stepper.optimizer.param_groups[0]["foreach"] is True
    assert not stepper.optimizer.param_groups[0].get("fused")
    assert stepper.stream is None  # host tensors: stepped on the calling thread
    for i in range(3):
        grads = [torch.randn(m.shape, generator=gen) for m in masters]
        sent = [g.clone() for g in grads]
        hyper = hyperparameters(opt)
        torch._foreach_mul_(grads, 0.5)
        for m, g in zip(masters, grads):
            m.grad = g
        opt.step()
        stepper.apply(Pending(i + 2, sent, 0.5, hyper, b""))
        for m, c in zip(masters, copy):
            assert torch.equal(m.detach(), c["master"]) and torch.equal(opt.state[m]["exp_avg"], c["exp_avg"]), i


def test_replay_on_outside_replay_mode_is_refused_naming_the_key() -> None:
    import pytest

    from hybrid_ray.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"fault_tolerance\.replay_on: applies to mode 'replay' only"):
        load_config({"train_batch_size": 2, "fault_tolerance": {"replicas": 1, "replay_on": "device"}})
    cfg = load_config({"train_batch_size": 2,
                       "fault_tolerance": {"replicas": 1, "mode": "replay", "replay_on": "device"}})
    assert cfg.fault_tolerance.replay_on == "device"


def test_a_frozen_view_steps_with_the_frozen_lr_even_under_a_scheduler() -> None:
    # An LR scheduler binds a wrapper of `step` to the optimizer instance: a view copying the
    # instance's attributes stepped the live groups, i.e. the next step's lr.
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 if i == 0 else 0.0)
    view = frozen_hyperparameters(opt)
    sched.step()  # the live lr is now 0
    p.grad = torch.ones(2)
    view.step()
    assert torch.equal(p.detach(), torch.zeros(2))


def held(step: int, stepper=None) -> Snapshot:
    s = Snapshot(step, 2, 3, [{"master": torch.zeros(4)}], b"", RUN)
    s.stepper = stepper
    return s


class Counting:
    def __init__(self):
        self.applied = []

    def apply(self, pending):
        self.applied.append(pending.step)


def test_the_pending_step_is_applied_once_and_survives_its_own_commit() -> None:
    k = Keeper()
    k.start(RUN)
    t = k.begin()
    stepper = Counting()
    base = held(4, stepper)
    base.small = b"full"
    k.put_held(base, t)
    k.commit(4, t)
    k.set_pending(Pending(5, None, 1.0, None, b"part5"), t)
    k.commit(5, t)  # the commit of step 5 keeps the base the pending step applies to
    assert k.summary()["held"] == {4: (2, 3), 5: (2, 3)}
    got = k.get("held", 5)  # a recovery that needs step 5 brings the copy there
    assert got.step == 5 and got.part == b"part5" and not got.full and stepper.applied == [5]
    k.advance()
    assert stepper.applied == [5] and sorted(k.held) == [5]


def summary(own: dict, held_: dict, full: list) -> dict:
    return {"run": RUN, "disk_step": -1, "own": {v: (r, 3) for v, r in own.items()},
            "held": {v: (r, 3) for v, r in held_.items()}, "full": full}


def test_a_version_is_used_only_where_a_survivor_holds_its_counters() -> None:
    # Rank 2 was lost after the commit of step 5; rank 0 (its buddy) holds its copy at 4 and the
    # pending step 5. Rank 0 updated to 5; rank 1 too. Counters of step 5: ranks 0 and 1's own.
    survivors = [summary({5: 0}, {4: 2, 5: 2}, [("own", 5)]), summary({5: 1}, {4: 0, 5: 0}, [("own", 5)])]
    p, why = plan(survivors, RUN)
    assert why == "ok" and p.step == 5 and p.sources[2] == (0, "held") and p.meta_source == (0, "own")
    # Both survivors lost their own entries (cut off between the commit and the capture): the
    # replayed copies cannot stand in for the step's counters.
    p, why = plan([summary({}, {5: 2}, []), summary({}, {5: 0}, [])], RUN)
    assert p is None


def test_a_rank_part_joins_another_ranks_counters() -> None:
    meta = snap.SmallState({"counters": {"global_steps": 5}}, {"torch": torch.get_rng_state()}, {}, [], {"c": 1})
    part = snap.pack({"rng": {"torch": torch.zeros(3)}, "rank": {"c": 2}})
    got = snap.with_part(meta, part)
    assert got.meta == meta.meta and got.rank == {"c": 2} and torch.equal(got.rng["torch"], torch.zeros(3))


def test_one_rank_keeps_its_live_state_by_reference_and_drops_it_on_a_load(tmp_path) -> None:
    from hybrid_ray.engine import Engine, Topology
    from hybrid_ray.engine.replicas import KEEPER

    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2}, "fault_tolerance": {"replicas": 1, "mode": "replay"}}
    torch.manual_seed(0)
    e = Engine(torch.nn.Linear(4, 4), cfg, topology=Topology(0, 1, torch.device("cpu")))
    for _ in range(3):
        e.backward(e(torch.randn(2, 4)).square().mean())
        e.step()
        e.replicas.wait()
        got = KEEPER.get("own", e.global_steps)
        assert got.full and sorted(KEEPER.own) == [e.global_steps]
        assert got.tensors[0]["master"].data_ptr() == e.zero.masters[0].data_ptr()  # no copy
    e.save_checkpoint(str(tmp_path))
    e.load_checkpoint(str(tmp_path), tag="global_step3")  # written into the live tensors in place
    assert KEEPER.own == {}
    e.destroy()
