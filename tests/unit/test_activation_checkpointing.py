"""Activation checkpointing (seed 3.1.2): same gradients, fewer saved bytes.

Saved bytes are measured with a saved-tensor pack hook around one forward: every tensor autograd
keeps for backward passes through it (unique by storage, parameters left out). Inside a
checkpointed region torch's own hook takes over and keeps nothing, so what the outer hook sees
there is exactly the region's boundary: its tensor arguments.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Dict, List, Tuple

import pytest
import torch
import torch.nn as nn

import hybrid_ray
from hybrid_ray import ConfigError, NotSupportedError, checkpoint_activations, load_config
from hybrid_ray.engine import activation_checkpointing as checkpointing
from hybrid_ray.engine.activation_checkpointing import (is_checkpointed, remove_checkpointing,
                                                        select_modules)
from hybrid_ray.models import GPT, GPT_SIZES

SMALL = dataclasses.replace(GPT_SIZES["small"], dropout=0.1)
TINY = dataclasses.replace(GPT_SIZES["tiny"], dropout=0.1)


# ---- helpers ----------------------------------------------------------------------------------

class SavedTensors:
    """Pack hook recording what autograd saves: bytes per storage (params excluded), dtypes, devices."""

    def __init__(self, model: nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.bytes: Dict[int, int] = {}
        self.seen: List[Tuple[Tuple[int, ...], torch.dtype]] = []
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params and t.numel() > 0:
            self.bytes[ptr] = max(self.bytes.get(ptr, 0), t.untyped_storage().nbytes())
            self.seen.append((tuple(t.shape), t.dtype))
        return t

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def __enter__(self) -> "SavedTensors":
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(*exc)


def grads(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], atol: float = 0.0,
                       rtol: float = 0.0) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=name)


def gpt_batch(cfg, n: int = 4, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (n, cfg.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def gpt_step(model: nn.Module, cfg, seed: int = 1) -> Tuple[float, Dict[str, torch.Tensor], int]:
    """loss, grads and saved bytes of one forward/backward; the dropout masks depend on `seed`."""
    idx, tgt = gpt_batch(cfg)
    torch.manual_seed(seed)
    with SavedTensors(model) as saved:
        loss = model(idx, tgt)
    loss.backward()
    return loss.item(), grads(model), saved.total


# ---- the decorator and the module wrapper ------------------------------------------------------

class M(nn.Module):
    """The seed's example (3.1.2), with dropout so that recompute must replay the RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 24)
        self.block1 = nn.Sequential(nn.Linear(24, 64), nn.GELU(), nn.Dropout(0.2), nn.Linear(64, 32))
        self.block2 = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.Dropout(0.2))
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_with_checkpoint(self.inp(x)))

    @checkpoint_activations(checkpoint_in_fp32=True)
    def forward_with_checkpoint(self, x):
        x = self.block1(x)
        x = self.block2(x)
        return x


class Unchecked(M):
    """Same computation without the checkpoint (and with the same fp32 cast at the boundary)."""

    def forward_with_checkpoint(self, x):
        return M.forward_with_checkpoint.__wrapped__(self, x.float())


def run_m(model: nn.Module, x: torch.Tensor, autocast: bool = False) -> Tuple[Dict, SavedTensors]:
    model.zero_grad()
    torch.manual_seed(3)
    with SavedTensors(model) as saved, torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        y = model(x)
    y.float().square().mean().backward()
    return grads(model), saved


def test_seed_decorator_form_recomputes_and_matches_with_dropout() -> None:
    torch.manual_seed(0)
    m = M()
    ref = Unchecked()
    ref.load_state_dict(m.state_dict())
    calls = []
    m.block1.register_forward_hook(lambda *_: calls.append(1))
    x = torch.randn(8, 16)
    g_ckpt, saved_ckpt = run_m(m, x)
    g_ref, saved_ref = run_m(ref, x)
    assert len(calls) == 2  # the forward, and its recompute in backward
    assert_grads_equal(g_ckpt, g_ref)
    assert saved_ckpt.total < saved_ref.total


def test_checkpoint_in_fp32_keeps_boundary_fp32_under_bf16_autocast() -> None:
    torch.manual_seed(0)
    m = M()
    ref = Unchecked()
    ref.load_state_dict(m.state_dict())
    x = torch.randn(8, 16)
    seen: Dict[str, torch.dtype] = {}
    def note(key: str, t: torch.Tensor) -> None:  # a hook returning None changes nothing
        seen.setdefault(key, t.dtype)

    m.inp.register_forward_hook(lambda _m, _i, out: note("inp", out))
    m.block1[0].register_forward_pre_hook(lambda _m, args: note("block1", args[0]))
    g_ckpt, saved = run_m(m, x, autocast=True)
    assert seen == {"inp": torch.bfloat16, "block1": torch.float32}  # cast up at the boundary
    # The region keeps only its boundary x, shape (8, 24): fp32, not the bf16 inp produced.
    assert [d for shape, d in saved.seen if shape == (8, 24)] == [torch.float32], saved.seen
    g_ref, _ = run_m(ref, x, autocast=True)
    assert_grads_equal(g_ckpt, g_ref)  # the same computation, recomputed


def test_bare_decorator_with_non_tensor_args_and_kwargs() -> None:
    w = torch.randn(6, 6, requires_grad=True)

    def body(x, scale, *, bias=None, extra=(), mode="relu", debug="not checkpoint's"):
        y = (x @ w) * scale + bias + sum(extra)
        assert mode == "relu" and debug == "not checkpoint's"
        return torch.relu(torch.nn.functional.dropout(y, 0.3))

    checkpointed = checkpoint_activations(body)
    assert checkpointed.__wrapped__ is body

    def run(fn) -> Tuple[List[torch.Tensor], int]:
        x, b, e = (torch.randn(4, 6, requires_grad=True) for _ in range(3))
        torch.manual_seed(5)
        with SavedTensors(nn.Module()) as saved:
            out = fn(x * 1, 2.0, bias=b * 1, extra=[e * 1], mode="relu", debug="not checkpoint's")
        out.sum().backward()
        got = [t.grad.clone() for t in (x, b, e, w)]
        w.grad = None
        return got, len(saved.bytes)

    torch.manual_seed(9)
    got, n_saved = run(checkpointed)
    torch.manual_seed(9)
    want, _ = run(body)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert n_saved == 3  # x, bias and the tensor in `extra`: all of them boundary tensors


def test_module_wrapper_keeps_structure_and_matches() -> None:
    torch.manual_seed(0)
    model = GPT(SMALL)
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    for block in model.blocks:
        assert checkpoint_activations(block) is block
    assert list(model.state_dict()) == keys and all(is_checkpointed(b) for b in model.blocks)
    loss, g, saved = gpt_step(model, SMALL)
    ref_loss, g_ref, ref_saved = gpt_step(ref, SMALL)
    assert loss == ref_loss
    assert_grads_equal(g, g_ref)
    print(f"\nGPT small (4 x 128 tokens, fp32, dropout 0.1) bytes saved for backward: "
          f"{ref_saved:,} without checkpointing, {saved:,} with every block checkpointed "
          f"({ref_saved / saved:.1f}x less)")
    assert ref_saved > 8 * saved
    copied = copy.deepcopy(model)  # the wrapper follows the copy, not the original
    assert copied.blocks[0].forward.original.__self__ is copied.blocks[0]
    for block in model.blocks:
        remove_checkpointing(block)
    assert not any(is_checkpointed(b) for b in model.blocks)


def test_no_grad_runs_without_checkpoint() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    wrapped = checkpoint_activations(copy.deepcopy(lin))
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(wrapped(x), lin(x))


def test_remove_restores_an_instance_forward_it_wrapped() -> None:
    lin = nn.Linear(2, 2)
    custom = CustomForward()
    lin.forward = custom
    checkpoint_activations(lin)
    checkpoint_activations(lin, cpu_checkpointing=True)  # re-wrapping replaces, never nests
    assert lin.forward.original is custom and lin.forward.options.cpu_checkpointing
    assert remove_checkpointing(lin).forward is custom
    assert remove_checkpointing(lin).forward is custom  # nothing left to undo


class CustomForward:
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_checkpoint_activations_rejects_a_class() -> None:
    with pytest.raises(TypeError, match="expected a function, a method or an nn.Module"):
        checkpoint_activations(nn.Linear)


class SpySaveOnCpu(torch.autograd.graph.save_on_cpu):
    """save_on_cpu that records where its pack put each tensor."""

    packed: List[Tuple[torch.device, torch.device]] = []

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
        super().__init__(pin_memory, device_type)
        inner = self.pack_hook

        def pack(t: torch.Tensor):
            device, host = inner(t)
            if t.numel() > 0:  # torch's own empty placeholder input is packed too (torch 2.11)
                SpySaveOnCpu.packed.append((device, host.device))
            return device, host

        self.pack_hook = pack


def test_cpu_checkpointing_packs_boundary_tensors_to_host(monkeypatch) -> None:
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", SpySaveOnCpu)
    SpySaveOnCpu.packed = []
    torch.manual_seed(0)
    model = GPT(TINY)
    ref = copy.deepcopy(model)
    for block in model.blocks:
        checkpoint_activations(block, cpu_checkpointing=True)
    _, g, _ = gpt_step(model, TINY)
    _, g_ref, _ = gpt_step(ref, TINY)
    assert_grads_equal(g, g_ref)
    # One boundary tensor per block (its input x), packed into host memory.
    assert len(SpySaveOnCpu.packed) == TINY.n_layer
    assert all(host.type == "cpu" for _, host in SpySaveOnCpu.packed)


# ---- the engine: config section ----------------------------------------------------------------

def engine_config(base: str = "fp32", **ac: object) -> dict:
    out: dict = {"train_micro_batch_size_per_gpu": 4,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    if base != "fp32":
        out[base] = {"enabled": True}
    if ac:
        out["activation_checkpointing"] = ac
    return out


def engine_grads(cfg_model, config: dict, seed: int = 1) -> Tuple[hybrid_ray.Engine, float, Dict]:
    torch.manual_seed(0)
    engine, *_ = hybrid_ray.initialize(GPT(cfg_model), config=config)
    idx, tgt = (t.to(engine.device) for t in gpt_batch(cfg_model))
    torch.manual_seed(seed)
    loss = engine(idx, tgt)
    engine.backward(loss)
    return engine, loss.item(), grads(engine.module)


@pytest.mark.parametrize("base", ["fp32", "bf16", "fp16"])
def test_engine_config_checkpoints_blocks_with_same_grads(base: str) -> None:
    engine, loss, g = engine_grads(TINY, engine_config(base, enabled=True))
    _, ref_loss, g_ref = engine_grads(TINY, engine_config(base))
    assert engine.checkpointing.names == ["blocks.0", "blocks.1"]
    if base != "fp32" and engine.device.type == "cpu":  # norms inside blocks: fp32 regions
        assert engine.precision_plan.regions and "forward" in vars(engine.module.blocks[0].ln1)
    assert loss == ref_loss
    # Recompute replays the RNG and the autocast state: the same ops in the same dtypes.
    assert_grads_equal(g, g_ref)
    engine.close()
    assert not any(is_checkpointed(b) for b in engine.module.blocks)
    assert "forward" not in vars(engine.module.blocks[0].ln1)  # the region unwrapped too


def test_engine_cpu_checkpointing_matches(monkeypatch) -> None:
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", SpySaveOnCpu)
    SpySaveOnCpu.packed = []
    _, loss, g = engine_grads(TINY, engine_config("bf16", enabled=True, cpu_checkpointing=True))
    _, ref_loss, g_ref = engine_grads(TINY, engine_config("bf16"))
    assert loss == ref_loss
    assert_grads_equal(g, g_ref)
    assert len(SpySaveOnCpu.packed) == TINY.n_layer


def test_engine_wrapping_keeps_state_dict_keys() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    keys = list(model.state_dict())
    engine, *_ = hybrid_ray.initialize(model, config=engine_config(enabled=True))
    assert list(engine.state_dict()) == keys
    assert [type(m) for m in model.modules()] == [type(m) for m in GPT(TINY).modules()]


class Stack(nn.Module):
    def __init__(self, n: int = 10) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4)]))
                                    for _ in range(n))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer[1][0](layer[0](x))
        return self.head(x)


def names(model: nn.Module, pattern=None, number=None) -> List[str]:
    return [n for n, _ in select_modules(model, pattern, number)]


def test_selection_rules() -> None:
    model = Stack(10)
    # Default: children of ModuleLists, outermost only (layers.i.1.0 is inside layers.i).
    assert names(model) == [f"layers.{i}" for i in range(10)]
    assert names(model, number=4) == ["layers.0", "layers.2", "layers.5", "layers.7"]
    assert names(model, number=2) == ["layers.0", "layers.5"]
    assert names(model, number=10) == names(model, number=50) == names(model)
    assert names(model, r"layers\.\d+\.0") == [f"layers.{i}.0" for i in range(10)]
    assert names(model, r"layers\.[13]") == ["layers.1", "layers.3"]  # fullmatch: not layers.1.0
    # Never the root or a ModuleList (never called); nothing inside a match.
    assert names(model, r".*") == [f"layers.{i}" for i in range(10)] + ["head"]
    checkpoint_activations(model.layers[0])
    assert names(model)[0] == "layers.1"  # already checkpointing itself: left alone


def test_number_checkpoints_through_the_engine() -> None:
    engine, *_ = hybrid_ray.initialize(Stack(10), config=engine_config(enabled=True, number_checkpoints=4))
    assert engine.checkpointing.names == ["layers.0", "layers.2", "layers.5", "layers.7"]
    assert [i for i, layer in enumerate(engine.module.layers) if is_checkpointed(layer)] == [0, 2, 5, 7]


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"^activation_checkpointing.module_pattern: matches no "
                       r"module; got 'block\\\\.\\\\d'; a regex .*: wte, wpe, blocks, blocks.0"):
        hybrid_ray.initialize(GPT(TINY), config=engine_config(enabled=True, module_pattern=r"block\.\d"))
    with pytest.raises(ConfigError, match=r"^activation_checkpointing.module_pattern: no module to "
                       r"checkpoint: the model has no nn.ModuleList"):
        hybrid_ray.initialize(nn.Sequential(nn.Linear(2, 2)), config=engine_config(enabled=True))
    with pytest.raises(NotSupportedError, match=r"^activation_checkpointing.partition_activations: "
                       r"not supported yet; got True; .*tensor parallelism"):
        load_config(engine_config(enabled=True, partition_activations=True))
    cfg = load_config(engine_config(enabled=True, cpu_checkpointing=True, number_checkpoints=2,
                                    module_pattern=r"blocks\.\d+"))
    assert cfg.activation_checkpointing.number_checkpoints == 2


def test_no_effect_and_inert_keys_are_logged_once(caplog) -> None:
    checkpointing._logged.clear()
    config = engine_config(enabled=True, profile=True, contiguous_memory_optimization=True)
    with caplog.at_level(logging.INFO, logger="hybrid_ray"):
        for _ in range(2):
            hybrid_ray.initialize(GPT(TINY), config=config)
        hybrid_ray.initialize(GPT(TINY), config=engine_config(cpu_checkpointing=True))
    text = [r.getMessage() for r in caplog.records]
    assert sum("activation_checkpointing.profile=True" in t for t in text) == 1
    assert sum("contiguous_memory_optimization=True" in t for t in text) == 1
    assert any("cpu_checkpointing set but enabled is false" in t for t in text)
