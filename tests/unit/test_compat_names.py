"""DeepSpeed's module-level names and import paths: `import hybrid_ray as deepspeed`."""
from __future__ import annotations

import argparse
import warnings

import pytest
import torch
import torch.nn as nn

import hybrid_ray as deepspeed
from hybrid_ray.cli import main
from hybrid_ray.config import NotSupportedError


def test_seed_import_paths() -> None:
    from hybrid_ray.profiling.flops_profiler import get_model_profile
    from hybrid_ray.profiling.speedometer import Speedometer
    from hybrid_ray.runtime.fp16.layer import FP16_Layer, FP16_Module
    from hybrid_ray.runtime.utils import checkpoint_activations

    assert FP16_Layer is deepspeed.FP16Layer and FP16_Module is deepspeed.FP16Module
    assert checkpoint_activations is deepspeed.checkpoint_activations
    assert get_model_profile is deepspeed.get_model_profile and Speedometer is deepspeed.Speedometer
    assert FP16_Layer(nn.Linear(2, 2)) is not None


def test_version_and_cli(capsys) -> None:
    assert isinstance(deepspeed.__version__, str) and deepspeed.__version__[0].isdigit()
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"hybrid-ray {deepspeed.__version__}"


def test_add_config_arguments() -> None:
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json"
    assert parser.parse_args([]).deepspeed_config is None


def test_subpackages_are_attributes_after_import() -> None:
    assert deepspeed.comm.get_rank() == 0 and deepspeed.checkpointing.is_configured() in (True, False)
    assert deepspeed.accelerator.get_accelerator() is deepspeed.accelerator.get_accelerator()
    with pytest.raises(AttributeError):
        deepspeed.no_such_thing  # noqa: B018


def test_comm_without_a_group_is_a_world_of_one(monkeypatch) -> None:
    import hybrid_ray.comm as dist

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    deepspeed.init_distributed()  # single process without env: no group
    assert not dist.is_initialized()
    assert (dist.get_rank(), dist.get_world_size(), dist.get_local_rank()) == (0, 1, 0)
    t = torch.tensor([3.0])
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    dist.broadcast(t, src=0)
    dist.reduce(t, dst=0)
    dist.barrier()
    assert dist.all_reduce(t, async_op=True).wait()
    out = [torch.zeros(1)]
    dist.all_gather(out, t)
    assert t.item() == 3.0 and out[0].item() == 3.0
    objs = [None]
    dist.all_gather_object(objs, {"a": 1})
    assert objs == [{"a": 1}]


def test_accelerator_on_this_machine() -> None:
    acc = deepspeed.accelerator.get_accelerator()
    cuda = torch.cuda.is_available()
    assert acc.device_name() == ("cuda" if cuda else "cpu")
    assert acc.device_name(0) == ("cuda:0" if cuda else "cpu")
    assert acc.current_device_name() == ("cuda:0" if cuda else "cpu")
    assert acc.communication_backend_name() == ("nccl" if cuda else "gloo")
    assert acc.is_available() and acc.device_count() >= 1 and acc.is_fp16_supported()
    assert isinstance(acc.is_bf16_supported(), bool) and isinstance(acc.current_device(), int)
    acc.synchronize()
    acc.empty_cache()
    acc.set_device(0)
    assert acc.memory_allocated() >= 0 and acc.max_memory_allocated() >= acc.memory_allocated() - 1
    acc.manual_seed(3)
    a = torch.rand(2)
    acc.manual_seed(3)
    assert torch.equal(a, torch.rand(2))
    assert acc.on_accelerator(torch.zeros(1, device=acc.device_name()))
    with pytest.raises(NotSupportedError, match="custom kernels"):
        acc.create_op_builder("FusedAdamBuilder")


def test_moe_is_importable_and_refused() -> None:
    from hybrid_ray.moe.layer import MoE

    with pytest.raises(NotSupportedError, match=r"mixture-of-experts"):
        MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2)


def test_checkpointing_api() -> None:
    ckpt = deepspeed.checkpointing
    ckpt.configure(None, checkpoint_in_cpu=True, synchronize=True)
    assert ckpt.is_configured()
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    ckpt.checkpoint(layer, x).sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    layer.zero_grad()
    grad_ckpt = x.grad.clone()
    layer(ref_x).sum().backward()
    assert torch.allclose(grad_ckpt, ref_x.grad)
    with pytest.raises(NotSupportedError, match="partition_activations"):
        ckpt.configure(None, partition_activations=True)
    with pytest.raises(NotSupportedError, match="model parallelism"):
        ckpt.configure(type("MPU", (), {"get_model_parallel_world_size": staticmethod(lambda: 2)})())
    with pytest.warns(UserWarning, match="contiguous_checkpointing=True accepted"):
        ckpt.configure(None, deepspeed_config={"train_batch_size": 1, "activation_checkpointing": {
            "contiguous_memory_optimization": True, "cpu_checkpointing": True}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.configure(None)  # nothing to warn about
