"""zero.Init and zero.GatheredParameters on 2 gloo ranks.

Parity is bitwise: a model built under Init gets the same whole weights as one built normally
(every init call runs on the whole tensor, rank 0's values are kept), and the stage-3 engine
cuts the same local shards from them, so both runs execute the same arithmetic on the same
numbers. The GatheredParameters write-back is checked against plain torch AdamW, to the
tolerance test_zero3.py uses (the engine's reductions sum in another order than torch).
"""
from __future__ import annotations

import ctypes
import dataclasses
import gc
import resource
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import hybrid_ray
import hybrid_ray.zero
from hybrid_ray.engine import Engine, Topology
from hybrid_ray.models import GPT, GPT_SIZES
from tests.distributed import spawn

pytestmark = [pytest.mark.dist]
STEPS, MICRO, LR, WD = 3, 2, 1e-2, 0.1
CFG = dataclasses.replace(GPT_SIZES["tiny"], bias=False)


def config(stage: int = 3, bf16: bool = False) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "bf16": {"enabled": bf16},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                  "stage3_param_persistence_threshold": 1000},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}


def batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, CFG.vocab_size, (world * MICRO, CFG.seq_len + 1), generator=g)
    chunk = tokens[rank * MICRO:(rank + 1) * MICRO]
    return chunk[:, :-1], chunk[:, 1:]


def train(engine: Engine, rank: int, world: int, steps: range) -> list:
    losses = []
    for step in steps:
        loss = engine(*batch(step, rank, world))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


# ---- (a) shards only, and the same training as a model built normally ----------------------
def run_parity(rank: int, world: int) -> None:
    cfg = config(bf16=True)
    torch.manual_seed(0)
    plain = GPT(CFG)
    full_numel = sum(p.numel() for p in plain.parameters())
    normal = Engine(plain, cfg, topology=Topology.from_environment())
    losses_normal = train(normal, rank, world, range(STEPS))
    state_normal = normal.consolidated_state_dict(rank0_only=False)
    normal.close()

    torch.manual_seed(0)
    with hybrid_ray.zero.Init(config_dict_or_path=cfg):
        model = GPT(CFG)
    params = list(model.parameters())
    assert all(p.numel() == 0 and p.ds_status == hybrid_ray.zero.ZeroParamStatus.NOT_AVAILABLE
               for p in params)
    assert sum(p.ds_numel for p in params) == full_numel
    held = sum(p.ds_tensor.numel() for p in params)
    assert full_numel / 2 <= held <= full_numel / 2 + len(params)  # half, plus per-parameter padding
    torch.manual_seed(0)
    reference = GPT(CFG)
    for (name, want), p in zip(reference.named_parameters(), params):
        with hybrid_ray.zero.GatheredParameters(p):
            assert torch.equal(p.data, want), name  # the same initial weights, bitwise
    engine = Engine(model, cfg, topology=Topology.from_environment())
    assert engine.stage3 is not None
    losses = train(engine, rank, world, range(STEPS))
    assert losses == losses_normal
    state = engine.consolidated_state_dict(rank0_only=False)
    assert state.keys() == state_normal.keys()
    for name, t in state_normal.items():
        assert torch.equal(state[name], t), name


def test_init_builds_shards_and_trains_like_a_normal_model() -> None:
    spawn.run(run_parity, 2, timeout_s=120)


# ---- (b) memory: the whole model never exists on a rank ------------------------------------
MEM_D, MEM_LAYERS = 2048, 24  # 100.7M parameters: 384 MiB in fp32, 16 MiB per layer
MIB = 1 << 20


class Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(MEM_D, MEM_D, bias=False)
                                          for _ in range(MEM_LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def _status_mib(key: str) -> float:
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def peak_growth(fn) -> tuple:
    """(fn(), MiB by which this process's peak resident size rose above its size at the start);
    writing 5 to clear_refs resets the peak (VmHWM) to the current resident size."""
    Path("/proc/self/clear_refs").write_text("5")
    start = _status_mib("VmRSS")
    out = fn()
    return out, _status_mib("VmHWM") - start


def settle_process(cfg: dict) -> None:
    """Make later growth the model's alone: every allocation of 1 MiB or more its own mapping,
    returned when freed (glibc's adaptive threshold would keep freed layers in the heap); gloo's
    threads given their malloc arenas (64 MiB reservations each, at their first collective); and
    torch._dynamo imported now rather than by the optimizer's constructor inside initialize."""
    ctypes.CDLL("libc.so.6").mallopt(-3, MIB)  # M_MMAP_THRESHOLD
    import torch._dynamo  # noqa: F401
    with hybrid_ray.zero.Init(config_dict_or_path=cfg):
        torch.nn.Linear(MEM_D, MEM_D, bias=False)


def build_capped(cap_mib: float, build) -> Any:
    """build() with this process's address space capped at its current size plus cap_mib."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (int((_status_mib("VmSize") + cap_mib) * MIB), hard))
    try:
        return build()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def run_memory(rank: int, world: int, out: str) -> None:
    cfg = {**config(bf16=True), "zero_optimization": {"stage": 3, "reduce_bucket_size": MEM_D * MEM_D}}
    settle_process(cfg)
    full, layer = MEM_LAYERS * MEM_D * MEM_D * 4 / MIB, MEM_D * MEM_D * 4 / MIB
    cap = full / 2 + 4 * layer  # this rank's half and a few layers in hand: 256 MiB < 384

    def build_under_init() -> Wide:
        with hybrid_ray.zero.Init(config_dict_or_path=cfg):
            return Wide()
    model, init_peak = peak_growth(lambda: build_capped(cap, build_under_init))
    with pytest.raises((RuntimeError, MemoryError), match="allocate"):
        build_capped(cap, Wide)  # the cap is real: the model built normally does not fit
    shards = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters()) / MIB
    engine, engine_peak = peak_growth(lambda: Engine(model, cfg, topology=Topology.from_environment()))
    held = engine.memory_breakdown()
    engine.backward(engine(torch.randn(2, MEM_D)))  # it runs: units are gathered one at a time
    del engine, model
    gc.collect()  # freed now, not by a collection that lands inside the measurement below
    _, normal_peak = peak_growth(Wide)  # uncapped, measured the same way
    numbers = {"full_fp32_MiB": full, "cap_MiB": cap, "shards_MiB": shards, "init_peak_MiB": init_peak,
               "initialize_peak_MiB": engine_peak, "normal_build_peak_MiB": normal_peak,
               "engine_params_MiB": held["params"] / MIB, "engine_masters_MiB": held["master_params"] / MIB}
    assert shards == full / 2 and init_peak < cap, numbers
    # initialize trades the fp32 Init shards (1/2 of the model) for bf16 local shards (1/4) and
    # fp32 masters (1/2), one parameter at a time: at no point does the rank hold the whole model
    assert shards + engine_peak < full - 2 * layer, numbers
    assert normal_peak > 0.95 * full, numbers  # the measurement does see a whole model
    torch.save(numbers, Path(out) / f"memory{rank}.pt")


@pytest.mark.slow  # 10 s alone, up to 40 s on two busy cores
def test_init_builds_a_model_larger_than_its_share(tmp_path: Path) -> None:
    spawn.run(run_memory, 2, str(tmp_path), timeout_s=300)
    for rank in range(2):
        print(rank, {k: round(v, 1) for k, v in torch.load(tmp_path / f"memory{rank}.pt").items()})


# ---- (c) GatheredParameters: read, modify on rank 0, train on ------------------------------
def modify(model: torch.nn.Module, rank: int) -> None:
    """What rank 0 changes inside the block: a zeroed block weight, 'pretrained' values, and a
    persistent (always whole) norm weight."""
    if rank == 0:
        model.blocks[0].fc.weight.zero_()
        model.blocks[1].proj.weight.copy_(torch.arange(32 * 32, dtype=torch.float32).view(32, 32) / 1e3)
        model.ln_f.weight.fill_(2.0)


def targets(model: torch.nn.Module) -> list:
    return [model.blocks[0].fc.weight, model.blocks[1].proj.weight, model.ln_f.weight]


def same_on_all_ranks(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


def run_gathered(rank: int, world: int, out: str) -> None:
    torch.manual_seed(0)
    engine = Engine(GPT(CFG), config(), topology=Topology.from_environment())
    train(engine, rank, world, range(1))
    model = engine.module
    w = model.blocks[1].qkv.weight
    assert w.numel() == 0 and w.ds_shape == (96, 32)
    before = engine.consolidated_state_dict(rank0_only=False)
    with hybrid_ray.zero.GatheredParameters([w, model.ln_f.weight]):
        assert w.shape == (96, 32) and torch.equal(w.detach(), before["blocks.1.qkv.weight"])
    assert w.numel() == 0  # released again
    with torch.no_grad(), hybrid_ray.zero.GatheredParameters(targets(model), modifier_rank=0):
        modify(model, rank)
    with hybrid_ray.zero.GatheredParameters(targets(model)):
        assert all(same_on_all_ranks(p.detach()) for p in targets(model))
        assert not model.blocks[0].fc.weight.any() and bool((model.ln_f.weight == 2).all())
    after = engine.consolidated_state_dict(rank0_only=False)  # from the fp32 masters
    assert not after["blocks.0.fc.weight"].any()
    assert torch.equal(after["blocks.1.qkv.weight"], before["blocks.1.qkv.weight"])  # untouched
    train(engine, rank, world, range(1, STEPS))
    final = engine.consolidated_state_dict()
    if rank == 0:
        torch.save(final, Path(out) / "final.pt")


class Pretrained(torch.nn.Module):
    """Loads its weights inside its own constructor, on rank 0 only (the HF-under-Init pattern)."""

    def __init__(self, rank: int):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        with torch.no_grad(), hybrid_ray.zero.GatheredParameters(self.lin.weight, modifier_rank=0):
            if rank == 0:
                self.lin.weight.fill_(0.5)


def run_gathered_before_initialize(rank: int, world: int) -> None:
    with hybrid_ray.zero.Init():
        loaded = Pretrained(rank)
    with hybrid_ray.zero.GatheredParameters(loaded.lin.weight):
        assert bool((loaded.lin.weight == 0.5).all())
    torch.manual_seed(0)
    with hybrid_ray.zero.Init(config_dict_or_path=config()):
        model = GPT(CFG)
    with torch.no_grad(), hybrid_ray.zero.GatheredParameters(targets(model), modifier_rank=0):
        modify(model, rank)
    assert model.blocks[0].fc.weight.numel() == 0
    engine = Engine(model, config(), topology=Topology.from_environment())
    state = engine.consolidated_state_dict(rank0_only=False)
    assert not state["blocks.0.fc.weight"].any() and bool((state["ln_f.weight"] == 2).all())
    assert torch.equal(state["blocks.1.proj.weight"][0, :3], torch.tensor([0.0, 0.001, 0.002]))


def reference_with_modification(world: int) -> GPT:
    """Plain torch: one step, the same modification, then the remaining steps."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        if step == 1:
            with torch.no_grad():
                modify(model, 0)
        opt.zero_grad()
        for r in range(world):
            (model(*batch(step, r, world)) / world).backward()
        opt.step()
    return model


def test_gathered_parameters_read_and_modify(tmp_path: Path) -> None:
    spawn.run(run_gathered, 2, str(tmp_path), timeout_s=120)
    got = torch.load(tmp_path / "final.pt")
    for name, want in reference_with_modification(2).state_dict().items():
        err = ((got[name] - want).norm() / want.norm()).item()
        assert err < 5e-6, (name, err)


def test_gathered_parameters_before_initialize() -> None:
    spawn.run(run_gathered_before_initialize, 2, timeout_s=120)


# ---- (d) no-ops: stages 0-2, enabled=False, one rank ---------------------------------------
def run_noop(rank: int, world: int) -> None:
    for kwargs in ({"config_dict_or_path": config(stage=2)}, {"enabled": False}):
        torch.manual_seed(0)
        with hybrid_ray.zero.Init(**kwargs):
            model = GPT(CFG)
        assert not any(hasattr(p, "ds_numel") for p in model.parameters()), kwargs
    engine = Engine(model, config(stage=2), topology=Topology.from_environment())
    w = model.blocks[0].fc.weight
    ptr = w.data_ptr()
    with hybrid_ray.zero.GatheredParameters(w, modifier_rank=0):
        assert w.data_ptr() == ptr and w.shape == (128, 32)  # whole already: passed through
    engine.close()


def test_noop_outside_stage3() -> None:
    spawn.run(run_noop, 2, timeout_s=120)


def test_noop_at_one_rank() -> None:
    torch.manual_seed(0)
    with hybrid_ray.zero.Init(config_dict_or_path=config()):
        model = GPT(CFG)
    torch.manual_seed(0)
    for p, q in zip(model.parameters(), GPT(CFG).parameters()):
        assert not hasattr(p, "ds_numel") and torch.equal(p, q)
    with hybrid_ray.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        pass


# ---- (c) a model that makes a parameter on the meta device (torch's skip_init) --------------
def run_meta_parity(rank: int, world: int) -> None:
    """The pipelined GPT makes its head with skip_init (on meta, then tied to the embedding):
    built under Init it trains as it does built normally."""
    from hybrid_ray.lm.pipeline_model import gpt_pipeline

    def run(under_init: bool) -> tuple:
        torch.manual_seed(0)
        with hybrid_ray.zero.Init(config_dict_or_path=config(), enabled=under_init):
            model = gpt_pipeline(CFG, num_stages=1, seed_layers=True)
        engine = hybrid_ray.initialize(model, config=config())[0]
        losses = [engine.train_batch(iter([batch(s, rank, world)])).item() for s in range(STEPS)]
        state = engine.consolidated_state_dict(rank0_only=False)
        engine.close()
        return losses, state

    (want, want_state), (got, state) = run(False), run(True)
    assert got == want
    for name, t in want_state.items():
        assert torch.equal(state[name], t), name


def test_init_leaves_meta_parameters_to_initialize() -> None:
    spawn.run(run_meta_parity, 2, timeout_s=120)
