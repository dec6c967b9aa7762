"""The torch-native layout baseline (jobs/torch_native.py: FSDP2 + DTensor tensor parallelism +
torch.distributed.pipelining) trains the GPT as one process trains it, at tensor 2 x pipeline 2
x data 2 on 8 gloo processes; and jobs/bench_layouts.py measures both stacks at a layout.

A baseline that computed something else would make every ratio against it meaningless, so it is
held to the same standard as the engine: the loss of each step and the weights after three
steps equal a single-process AdamW run of gpt_reference (fp32, clip 1.0)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hybrid_ray.models import GPT_SIZES
from tests.distributed import spawn
from tests.jobs_scripts import JOBS, load_script

pytestmark = [pytest.mark.dist, pytest.mark.slow]
CFG = dataclasses.replace(GPT_SIZES["tiny"], n_layer=4, n_head=4, d_model=32, vocab_size=64, seq_len=16)
STEPS, ROWS, LR = 3, 8, 1e-2
OPT = {"lr": LR, "weight_decay": 0.1, "eps": 1e-5}  # eps: see test_pipeline's note on AdamW's eps


def batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG.vocab_size, (ROWS, CFG.seq_len + 1), generator=g) for _ in range(STEPS)]


def train_split(rank: int, world: int, layout: tuple, out: str) -> None:
    native = load_script("torch_native")
    run = native.build(CFG, native.Layout(*layout), micro_batches=2, device=torch.device("cpu"),
                       dtype=torch.float32, seed=0, **OPT)
    dp, dp_rank = layout[2], run.mesh["dp"].get_local_rank()
    losses = []
    for tokens in batches():
        part = tokens.chunk(dp)[dp_rank]
        loss = run.step(part[:, :-1], part[:, 1:])
        if loss is not None:  # the last stage's: the mean over this data-parallel rank's rows
            loss = loss.clone()
            dist.all_reduce(loss, group=run.mesh["dp"].get_group())
            losses.append(loss.item() / dp)
    spawn.save_result(out, rank, {"losses": losses, "state": native.full_state(run)})


@pytest.mark.parametrize("layout", [(2, 2, 2), (2, 1, 2)], ids=["pipelined", "one-stage"])
def test_tensor_pipeline_data_parallel_baseline_trains_as_one_process(layout: tuple, tmp_path: Path) -> None:
    """(2, 1, 2): one stage runs without the pipeline schedule (accumulated micro-batches, one
    gradient reduction), and must train the same."""
    world = layout[0] * layout[1] * layout[2]
    spawn.run(train_split, world, layout, str(tmp_path), timeout_s=120)
    native = load_script("torch_native")
    ref = native.gpt_reference(CFG, 0)
    opt = torch.optim.AdamW(ref.parameters(), foreach=True, **OPT)
    want = []
    for tokens in batches():
        loss = ref(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    results = spawn.results(str(tmp_path), world)
    last_stage = [r for r in results if r["losses"]]
    assert len(last_stage) == layout[0] * layout[2]  # the last stage's ranks: tensor x data
    for r in last_stage:
        assert r["losses"] == pytest.approx(want, rel=1e-5)
    expected = ref.state_dict()
    seen = set()
    for r in results:
        for name, got in r["state"].items():
            seen.add(name)
            torch.testing.assert_close(got, expected[name].float(), atol=1e-5, rtol=1e-4, msg=name)
    assert seen == set(expected)  # the stages hold every weight between them


@pytest.mark.parametrize("impl", ["torch_native", "hybrid"])
def test_bench_layouts_measures_each_stack_at_a_pipelined_layout(impl: str, tmp_path: Path) -> None:
    """Two processes, pipeline 2: a result row with the layout and a finite loss."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(JOBS.parent)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(JOBS / "bench_layouts.py"), "--measure", "--impl", impl, "--layout", "1,2,1",
           "--steps", "2", "--warmup", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(rows) == 1, proc.stderr[-3000:]
    row = rows[0]
    assert (row["impl"], row["tp"], row["pp"], row["dp"], row["world"]) == (impl, 1, 2, 1, 2)
    assert row["tok_s_gpu"] > 0 and 0 < row["loss"] < 10, row
