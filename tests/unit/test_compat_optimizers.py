"""`deepspeed.ops.adam`: DeepSpeedCPUAdam and FusedAdam step exactly as torch's AdamW (or Adam
with L2 decay in their non-AdamW modes), train through initialize(optimizer=), and refuse what
they cannot honour."""
from __future__ import annotations

import pytest
import torch

import hybrid_ray as deepspeed
from hybrid_ray.config import NotSupportedError
from hybrid_ray.ops.adam import DeepSpeedCPUAdam, FusedAdam


def _trajectory(make) -> list:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    opt = make(net.parameters())
    for i in range(5):
        opt.zero_grad()
        net(torch.full((2, 4), float(i))).pow(2).sum().backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("ours,theirs", [
    (lambda p: DeepSpeedCPUAdam(p, lr=0.01, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
    (lambda p: DeepSpeedCPUAdam(p, lr=0.01, weight_decay=0.1, adamw_mode=False),
     lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1)),
    (lambda p: FusedAdam(p, lr=0.01, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
    (lambda p: FusedAdam(p, lr=0.01, weight_decay=0.1, adam_w_mode=False),
     lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1)),
])
def test_steps_as_torchs_adam(ours, theirs) -> None:
    for a, b in zip(_trajectory(ours), _trajectory(theirs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_refuses_what_it_cannot_honour() -> None:
    params = torch.nn.Linear(2, 2).parameters()
    with pytest.raises(NotSupportedError, match="bias_correction=False"):
        DeepSpeedCPUAdam(params, bias_correction=False)
    with pytest.raises(NotSupportedError, match="AMSGrad"):
        FusedAdam(torch.nn.Linear(2, 2).parameters(), amsgrad=True)


def test_trains_as_a_client_optimizer_with_offload() -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    config = {"train_batch_size": 8, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    engine, opt, _, _ = deepspeed.initialize(model=net, optimizer=DeepSpeedCPUAdam(net.parameters(), lr=0.01),
                                             config=config)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses
    assert opt.param_groups[0]["lr"] == 0.01
