"""Everything a run needs before its first step: threads, data, model, engine, loader, resume.

Split out of loop.py so the loop reads top to bottom; every function here runs on every rank.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

import hybrid_ray
from hybrid_ray.cluster.records import Event, Metrics, Record, Text
from hybrid_ray.config.paths import is_uri
from hybrid_ray.cluster.context import warmed
from hybrid_ray.data import ResumableLoader, TokenDataset, ensure_prepared, load_tokenizer, open_split
from hybrid_ray.data.prepare import read_meta
from hybrid_ray.data.tokenizer import Tokenizer
from hybrid_ray.engine import Engine
from hybrid_ray.engine import Topology
from hybrid_ray.engine.replicas.keeper import NOTHING_HELD
from hybrid_ray.lm.job import DataSection, Job
from hybrid_ray.config import ConfigError
from hybrid_ray.engine.checkpoint.offline import state_dict_keys
from hybrid_ray.lm.pipeline_model import gpt_pipeline, is_pipeline_state
from hybrid_ray.models import GPT, GPTConfig


@dataclass(frozen=True)
class RunContext:
    """What a launcher hands the training function: torchrun's launcher, or a Ray worker.

    topology: the process group this run uses; None joins (or creates) the default group from
      RANK/WORLD_SIZE, as under torchrun. A Ray worker passes the one it already initialised.
    resume: continue from the newest checkpoint in train.out_dir (none there: start afresh).
    report: called on rank 0 with every record (hybrid_ray.cluster.records: Metrics of train and
      val losses, Params, Text, LinkProbe, Interval), e.g. to send them to a driver; all but Text
      also go to train.out_dir/metrics.jsonl.
    threads: torch threads for this process; None splits the cores over LOCAL_WORLD_SIZE ranks.
    on_step: called on every rank after each optimizer step with its number (a Ray worker's
      heartbeat to the driver).
    stop: called on every rank after each checkpoint (a collective: every rank must get the same
      answer); True ends the run there, e.g. for the driver to re-form a larger group.
    directive: called on every rank at each logging step (a collective, like stop): the driver's
      newest directive, e.g. the gradient compression setting chosen for `type: auto`.
    flush: called on every rank before each checkpoint: waits until the driver has every
      record sent so far, so none is lost with a worker after the checkpoint commits.
    driver_prints: a driver prints a line for every step and evaluation record it receives;
      rank 0 then does not print its own (under torchrun it does).
    """

    topology: Optional[Topology] = None
    resume: bool = False
    report: Optional[Callable[[Record], None]] = None
    threads: Optional[int] = None
    on_step: Optional[Callable[[int], None]] = None
    stop: Optional[Callable[[], bool]] = None
    directive: Optional[Callable[[], Optional[dict]]] = None
    flush: Optional[Callable[[], bool]] = None
    driver_prints: bool = False


class RunLog:
    """Rank 0 prints and records; other ranks stay quiet (torchrun would interleave them)."""

    def __init__(self, rank: int, out_dir: Optional[str], report: Optional[Callable[[Record], None]],
                 echo: bool = True):
        self.rank, self.report, self.echo = rank, report, echo
        local = out_dir is not None and not is_uri(out_dir)
        self.metrics_path = os.path.join(out_dir, "metrics.jsonl") if local else None
        if self.metrics_path and rank == 0:
            os.makedirs(out_dir, exist_ok=True)

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)  # torchrun pipes stdout: flush so the log flows

    def progress(self, msg: str) -> None:
        """A step or evaluation line: printed here unless a driver prints its own line for the
        same record (on Ray the two would say it twice)."""
        if self.echo:
            self.say(msg)

    def record(self, **metrics: Any) -> None:
        """Metrics of a step (`step=` among them)."""
        self.send(Metrics(metrics))

    def send(self, rec: Record) -> None:
        """A record to metrics.jsonl (a text artifact only to the driver) and to `report`."""
        if self.rank != 0:
            return
        if self.metrics_path and not isinstance(rec, Text):
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(rec.to_json()) + "\n")
        if self.report is not None:
            self.report(rec)


def set_threads(threads: Optional[int]) -> int:
    """Split the cores between the processes of this machine: oversubscribed ranks crawl."""
    if threads is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(threads)
    return threads


def prepare_data(data: DataSection, topo: Topology, log: RunLog) -> dict:
    """The dataset's meta; rank 0 builds the dataset first when it is missing.

    Rank 0 alone writes (a shared folder or bucket would otherwise get N writers); the others
    wait for its meta, or for its error, so a failure ends every rank with the same message.
    """
    meta, error = None, None
    if topo.rank == 0:
        try:
            meta = ensure_prepared(data.corpus, data.path, data.prepare, log.say)
        except (OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    if topo.world_size > 1:
        box = [(meta, error)]
        dist.broadcast_object_list(box, src=0, group=topo.group)
        meta, error = box[0]
    if error is not None:
        raise RuntimeError(f"data preparation failed on rank 0: {error}")
    return meta


@dataclass
class Run:
    """The built pieces of one run."""

    engine: Engine
    loader: ResumableLoader
    val: TokenDataset
    tokenizer: Tokenizer
    meta: dict
    num_params: int  # the whole model's (counted before tensor parallelism splits it)


def gpt_config(job: Job, vocab_size: int) -> GPTConfig:
    """The job's model; the vocabulary rounded up to `model.vocab_multiple`."""
    m = job.model
    return GPTConfig(n_layer=m.n_layer, n_head=m.n_head, d_model=m.d_model,
                     vocab_size=-(-vocab_size // m.vocab_multiple) * m.vocab_multiple,
                     seq_len=m.seq_len, dropout=m.dropout)


def build_model(job: Job, vocab_size: int, seed: int) -> GPT:
    """The job's GPT, seeded (the same initial weights on every rank)."""
    torch.manual_seed(seed)
    return GPT(gpt_config(job, vocab_size))


def build_stages(job: Job, vocab_size: int, seed: int, resuming: bool = False) -> nn.Module:
    """The job's model for this rank: the GPT, or with pipeline_model_parallel_size > 1 this
    rank's stage of the GPT as a PipelineModule. A stage builds only its own layers, each
    seeded by its index (seed_layers), so its weights do not depend on which stage builds them
    and no rank ever holds the whole model.

    A run keeps its model's form, because the two name their weights differently: resumed
    from a pipelined run's checkpoint, one stage is the PipelineModule whole (so a pipelined
    run resumes at any pipeline size); a plain GPT's checkpoint resumes only unpipelined."""
    stages = job.engine.pipeline_model_parallel_size
    pipelined = _checkpoint_pipelined(job) if resuming else None
    if pipelined is False and stages > 1:
        raise ConfigError(f"engine.pipeline_model_parallel_size: {stages}, but the run's checkpoints "
                          f"in {checkpoint_dir(job)} hold the GPT unpipelined (written at size 1), "
                          "whose weights a pipeline cannot load: resume it at 1, or start a new run "
                          "(another train.out_dir)", "engine.pipeline_model_parallel_size")
    if stages == 1 and not pipelined:
        return build_model(job, vocab_size, seed)
    torch.manual_seed(seed)
    pc = job.engine.pipeline  # the engine's pipeline section cuts the stages (it checks they agree)
    cut = {"stages_per_rank": pc.stages_per_rank if stages > 1 else 1,
           "partition_method": pc.partition_method or "parameters"}
    return gpt_pipeline(gpt_config(job, vocab_size), num_stages=stages, seed_layers=True, base_seed=seed, **cut)


def _checkpoint_pipelined(job: Job) -> Optional[bool]:
    """Whether the newest checkpoint of the run holds the pipelined GPT (None: no checkpoint)."""
    ckpt = checkpoint_dir(job)
    keys = None if ckpt is None else state_dict_keys(ckpt)
    return None if keys is None else is_pipeline_state(dict.fromkeys(keys))


def whole_params(job: Job, vocab_size: int) -> int:
    """The whole GPT's parameter count, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return GPT(gpt_config(job, vocab_size)).num_params()


def warm_model(job: Job) -> None:
    """On a warm spare, while it waits: the job's (unsplit) GPT, built as a run would build it,
    kept in the process (cluster.context.warmed) for `build` to take if it joins. Nothing when
    the dataset is not prepared yet or the model is split into stages (their form depends on
    the run's checkpoint)."""
    meta = read_meta(job.data.path)
    if meta is None or job.engine.pipeline_model_parallel_size > 1:
        return
    vocab = load_tokenizer(job.data.path, meta).vocab_size
    warmed()["lm_model"] = (_model_key(job, vocab), build_model(job, vocab, job.engine.seed or 0))


def _model_key(job: Job, vocab: int) -> tuple:
    return (json.dumps(dataclasses.asdict(job.model), sort_keys=True), vocab, job.engine.seed or 0)


def _take_warm_model(job: Job, vocab: int) -> Optional[nn.Module]:
    key, model = warmed().pop("lm_model", (None, None))
    return model if key == _model_key(job, vocab) and job.engine.pipeline_model_parallel_size == 1 else None


def build(job: Job, topo: Topology, meta: dict, resuming: bool = False) -> Run:
    """Model, engine and this rank's loader; every rank builds the same initial weights
    (`resuming`: the run's checkpoint decides the model's form, build_stages says how)."""
    m, d = job.model, job.data
    tok = load_tokenizer(d.path, meta)
    model = _take_warm_model(job, tok.vocab_size) or build_stages(job, tok.vocab_size, job.engine.seed or 0, resuming)
    num_params = whole_params(job, tok.vocab_size)
    train = open_split(d.path, meta, "train", m.seq_len, d.cache_dir)
    # print_steps off: the job prints its own progress lines (loop.py) and records every
    # steps_per_print step; DeepSpeed's line on top would say the same twice.
    engine, _, loader, _ = hybrid_ray.initialize(model, config=job.engine, training_data=train,
                                                 topology=topo, print_steps=False)
    val = open_split(d.path, meta, "val", m.seq_len, d.cache_dir)
    return Run(engine, loader, val, tok, meta, num_params)


def checkpoint_dir(job: Job) -> Optional[str]:
    out = job.train.out_dir
    return None if out is None else out.rstrip("/") + "/checkpoints"


def resume(run: Run, job: Job, ctx: RunContext, log: RunLog) -> None:
    """Load the newest checkpoint (weights, optimizer, schedule, data position) when asked."""
    if not ctx.resume:
        return
    ckpt = checkpoint_dir(job)
    if ckpt is None:
        raise ValueError("--resume: train.out_dir is null, so there are no checkpoints to resume from")
    path, _ = run.engine.load_checkpoint(ckpt)
    _say_how_it_resumed(run, log)
    if path is None:  # the launcher (torchrun's, or the Ray driver) has said so already
        return
    step, pos = run.engine.global_steps, run.loader.state_dict()
    if step >= job.train.steps:
        log.say(f"resume: {path} at step {step}: the run is already complete (train.steps "
                f"{job.train.steps}); nothing to train, evaluating the final model")
        return
    log.say(f"resume: {path} at step {step}; data epoch {pos['epoch']}, "
            f"sample {pos['position']} of {run.loader.sampler.samples_per_epoch}")


def _say_how_it_resumed(run: Run, log: RunLog) -> None:
    """With replicas in memory, the run's events say whether they carried the group over (and
    in how long), or why the checkpoint was read instead."""
    replicas = run.engine.replicas
    rec = replicas.last_recovery if replicas is not None else None
    if rec is None or (rec["source"] == "disk" and rec["reason"] == NOTHING_HELD):
        return  # a first start: there was nothing to recover
    if rec["source"] == "memory":
        text = f"resumed at step {rec['step']} from the replicas in memory ({rec['seconds']:.2f} s, no disk read)"
    else:
        text = f"replicas in memory not used ({rec['reason']}): resumed from the newest checkpoint"
    log.send(Event(text, run.engine.global_steps))
