"""The suites of jobs/benchmark.py: which implementations each runs, and its baseline."""
from __future__ import annotations

from typing import Dict, List

SUITES: Dict[str, List[dict]] = {
    "gpu1": [dict(impl="torch"), dict(impl="hybrid", stage=1), dict(impl="hybrid", stage=2),
             dict(impl="hybrid", stage=0), dict(impl="deepspeed", stage=2)],
    "gpu2": [dict(impl="ddp"), dict(impl="hybrid", stage=1), dict(impl="hybrid", stage=2),
             dict(impl="deepspeed", stage=2)],
    "cpu": [dict(impl="ddp"), dict(impl="hybrid", stage=1), dict(impl="hybrid", stage=2),
            dict(impl="hybrid", stage=0),
            # the parameter all-gather overlapped with the next forward, over 1M-element buckets
            dict(impl="hybrid", stage=1, overlap_gather=True, bucket=1e6),
            dict(impl="hybrid", stage=2, overlap_gather=True, bucket=1e6)],
    # ZeRO-3: against plain torch / DDP and FSDP2 (fully_shard per block, reshard after forward).
    "zero3-gpu1": [dict(impl="torch"), dict(impl="hybrid", stage=3), dict(impl="fsdp2"),
                   dict(impl="deepspeed", stage=3)],
    "zero3-gpu2": [dict(impl="ddp"), dict(impl="hybrid", stage=3), dict(impl="fsdp2"),
                   dict(impl="deepspeed", stage=3)],
    "zero3-gpu2-1.3b": [dict(impl="fsdp2", model="1.3b"), dict(impl="hybrid", stage=3, model="1.3b"),
                        dict(impl="hybrid", stage=3, model="1.3b", norm_activations="half")],
    # The pipeline path at one stage (PipelineModule + train_batch) costs nothing over the engine.
    "pipe-gpu1": [dict(impl="torch"), dict(impl="hybrid", stage=1), dict(impl="hybrid-pipe", stage=1),
                  dict(impl="hybrid", stage=2), dict(impl="hybrid-pipe", stage=2)],
    # Buddy replicas (fault_tolerance): step time with the shard copied to host memory every
    # step / every 4 / 16 steps (mode copy), or each step's gradient replayed (mode replay),
    # against none. At one GPU there is no buddy to send to:
    # this times the device-to-host copy; on the CPU suite two ranks also exchange their copies.
    "replicas-gpu1": [dict(impl="hybrid", stage=2), dict(impl="hybrid", stage=2, replicas=1),
                      dict(impl="hybrid", stage=2, replicas=4), dict(impl="hybrid", stage=2, replicas=16)],
    # Replay at one GPU: a buddy in the same process (jobs/replay_loop.py) steps a host copy,
    # or (replay_on device) a copy on the GPU with the owner's fused kernel on a side stream.
    "replay-gpu1": [dict(impl="hybrid", stage=2), dict(impl="hybrid", stage=2, replicas=1),
                    dict(impl="hybrid", stage=2, replicas=1, replay=True),
                    dict(impl="hybrid", stage=2, replicas=1, replay=True, replay_on="device")],
    "replicas-cpu": [dict(impl="hybrid", stage=2), dict(impl="hybrid", stage=2, replicas=1),
                     dict(impl="hybrid", stage=2, replicas=4), dict(impl="hybrid", stage=2, replicas=1, replay=True)],
    # Blocks compiled (torch.compile per block, inductor): the engine against compiled torch.
    "compile-gpu1": [dict(impl="torch"), dict(impl="torch", compile=True),
                     dict(impl="hybrid", stage=0, compile=True), dict(impl="hybrid", stage=1, compile=True),
                     dict(impl="hybrid", stage=2, compile=True), dict(impl="hybrid", stage=2)],
    "compile-gpu1-1.3b": [dict(impl="torch", model="1.3b"), dict(impl="torch", compile=True, model="1.3b"),
                          dict(impl="hybrid", stage=3, compile=True, model="1.3b"),
                          dict(impl="hybrid", stage=2, compile=True, model="1.3b")],
    # ... and with the final norm, head and loss compiled too (one fused cross-entropy), at 1.3B.
    "compile-head-gpu1-1.3b": [dict(impl="torch", compile=True, model="1.3b"),
                               dict(impl="torch", compile=True, compile_head=True, model="1.3b"),
                               dict(impl="hybrid", stage=3, compile=True, compile_head=True, model="1.3b")],
    # Optimizer offload (1 GPU): the model still fits without offload, so plain torch is the ceiling.
    "offload1": [dict(impl="torch", model="1.3b"), dict(impl="hybrid", stage=2, offload=True, model="1.3b"),
                 dict(impl="hybrid", stage=2, offload=True, delayed=True, model="1.3b"),
                 dict(impl="deepspeed", stage=2, offload=True, model="1.3b")],
    # Partial offload (offload_optimizer.ratio): half of the optimizer state on the host, or what
    # does not fit in half the free device memory ("auto"), against DeepSpeed's whole offload.
    "offload-ratio-gpu1": [dict(impl="deepspeed", stage=2, offload=True, model="1.3b"),
                           dict(impl="hybrid", stage=2, offload=True, offload_ratio="auto", model="1.3b"),
                           dict(impl="hybrid", stage=2, offload=True, model="1.3b"),
                           dict(impl="hybrid", stage=2, offload=True, offload_ratio=0.5, model="1.3b")],
    # The same at the sizes where offload is needed (2.7B: micro-batch 4), and the largest model
    # each trains on one GPU and its host (DeepSpeed was killed for host memory at 6.7B).
    "offload-ratio-gpu1-2.7b": [dict(impl="deepspeed", stage=2, offload=True, model="2.7b"),
                                dict(impl="hybrid", stage=2, offload=True, offload_ratio="auto", model="2.7b")],
    "offload-largest-gpu1": [dict(impl="hybrid", stage=2, offload=True, offload_ratio="auto", model="8.3b"),
                             dict(impl="hybrid", stage=2, offload=True, offload_ratio="auto", model="6.7b")],
    # The largest model each offload trains on one GPU and its host (DeepSpeed was killed for
    # host memory at 6.7B): DeepSpeed between 2.7B and 6.7B, ours past 8.3B. A run the kernel
    # kills for memory leaves no row.
    "offload-largest-ds-gpu1": [dict(impl="deepspeed", stage=2, offload=True, model="3.8b"),
                                dict(impl="deepspeed", stage=2, offload=True, model="5b"),
                                dict(impl="hybrid", stage=2, offload=True, offload_ratio="auto", model="10b")],
    # Past 10B on one H200 and its host: blocks recomputed in backward leave the GPU's memory to
    # the optimizer state (a fixed ratio: "auto" keeps half the free memory for activations),
    # and DeepSpeed between 5B (trained) and 6.7B (killed) pinned at 5.8B.
    "offload-largest-h200": [dict(impl="hybrid", stage=2, offload=True, offload_ratio=0.55, act_ckpt=True,
                                  model="11.5b"),
                             dict(impl="deepspeed", stage=2, offload=True, model="5.8b")],
    # The CPU step bucket by bucket during backward (offload_optimizer.overlap_step, clipped by the
    # previous step's norm), whole and partial offload, against the step after backward.
    "offload-overlap-gpu1": [dict(impl="deepspeed", stage=2, offload=True, model="1.3b"),
                             dict(impl="hybrid", stage=2, offload=True, overlap_step=True, model="1.3b"),
                             dict(impl="hybrid", stage=2, offload=True, offload_ratio=0.5, overlap_step=True,
                                  model="1.3b"),
                             dict(impl="hybrid", stage=2, offload=True, model="1.3b"),
                             dict(impl="hybrid", stage=2, offload=True, offload_ratio=0.5, model="1.3b")],
    # The two-GPU offload target: 1.3B, ZeRO-2 + offload, against DeepSpeed's own.
    "offload2": [dict(impl="deepspeed", stage=2, offload=True, model="1.3b"),
                 dict(impl="hybrid", stage=2, offload=True, model="1.3b"),
                 dict(impl="hybrid", stage=2, offload=True, delayed=True, model="1.3b")],
}
# The ratio column is against this implementation (default: plain torch or DDP, else the first).
BASELINE = {"zero3-gpu2-1.3b": "fsdp2", "offload2": "deepspeed", "offload-ratio-gpu1": "deepspeed",
            "offload-overlap-gpu1": "deepspeed",
            "offload-ratio-gpu1-2.7b": "deepspeed"}
# ... and among several rows of that implementation, the one with these settings.
BASELINE_SETTINGS = {"compile-gpu1": {"compile": True}, "compile-gpu1-1.3b": {"compile": True},
                     "compile-head-gpu1-1.3b": {"compile": True}}
