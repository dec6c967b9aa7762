"""`hybrid-ray`: check configs and start the local training job from the shell.

    hybrid-ray config check PATH [--world-size N]   # "ok: ..." or the one-line error (exit 2)
    hybrid-ray train CONFIG [--nproc N]  # the LM job under torchrun on this machine
    hybrid-ray train CONFIG --workers N | --min-workers A --max-workers B [--address ADDR]
                                         # the LM job on Ray, elastic, with a live progress bar
    hybrid-ray checkpoint inspect PATH   # step, world size, stage, files, checksums
    hybrid-ray checkpoint export PATH OUT [--dtype fp32|bf16]   # model state_dict, offline
    hybrid-ray mlflow sync RUN_DIR       # send the MLflow records a run left in RUN_DIR/mlflow
    hybrid-ray launch --num_gpus N script.py ARGS   # DeepSpeed scripts, as `deepspeed --num_gpus N`

`config check` takes a plain engine config (DeepSpeed-style JSON) or a job file with an
"engine" section (jobs/configs/*.json); it builds nothing, so it runs in a second. It refuses
what `initialize` refuses for the config alone, with the same message; the batch split for one
world size is known only with `--world-size N`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from hybrid_ray import checkpoint_cli, launch_cli, mlflow_cli
from hybrid_ray.compat.version import __version__
from hybrid_ray.config import Config, ConfigError, load_config
from hybrid_ray.config.api import read_json

EXIT_CONFIG = 2  # argparse's code for bad usage; a bad config is the same kind of mistake


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybrid-ray", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"hybrid-ray {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{config,train,checkpoint,mlflow,launch}")
    config = sub.add_parser("config", help="work with config files")
    config_sub = config.add_subparsers(dest="action", required=True, metavar="{check}")
    check = config_sub.add_parser("check", help="validate an engine config or a job file")
    check.add_argument("path", help="JSON file: engine config, or job file with an 'engine' section")
    check.add_argument("--world-size", type=int, metavar="N",
                       help="also split the batch for N data-parallel ranks, as initialize does "
                            "(without it, only batch sizes no world size can run are refused)")
    check.set_defaults(func=_config_check)
    train = sub.add_parser("train", help="train the GPT LM job: torchrun here, or elastic on Ray (--workers/--min-workers)")
    train.add_argument("config", help="job file, e.g. jobs/configs/small_cpu.json")
    from hybrid_ray.lm.launch import add_job_options, add_nproc, add_ray  # deferred: keeps `config check` light

    add_nproc(train)
    add_job_options(train)
    add_ray(train)
    train.set_defaults(func=_train)
    checkpoint_cli.add_commands(sub)
    mlflow_cli.add_commands(sub)
    launch_cli.add_commands(sub)
    return p


def describe(cfg: Config) -> str:
    """The resolved settings people check first: precision and ZeRO stage."""
    zero = cfg.zero_optimization.stage
    return (f"precision {cfg.base_dtype}, ZeRO stage {zero}, optimizer {cfg.optimizer.type}, "
            f"scheduler {cfg.scheduler.type if cfg.scheduler else 'none'}")


def _config_check(args: argparse.Namespace) -> int:
    from hybrid_ray.lm.job import for_world, is_job_file, load_job

    try:
        raw = read_json(Path(args.path))
        if is_job_file(raw):
            job = load_job(args.path)
            if args.world_size is not None:
                job = for_world(job, _world_size(args.world_size))
            m = job.model
            print(f"ok: job file; {describe(job.engine)}; model {m.n_layer} layers x "
                  f"d_model {m.d_model}, context {m.seq_len}; {job.train.steps} steps"
                  f"{_batch_words(job.engine, args.world_size)}")
        else:
            cfg = load_config(args.path)  # not raw: a JSON string at the top is no path
            print(f"ok: {describe(cfg)}{_batch_words(cfg, args.world_size)}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


def _world_size(n: int) -> int:
    if n < 1:
        raise ConfigError(f"--world-size: out of range; got {n}; allowed: >= 1", "--world-size")
    return n


def _batch_words(cfg: Config, world_size: Optional[int]) -> str:
    """'; world size 2: batch 32 = 8 x 2 accumulation steps x 2 ranks' (raises ConfigError as
    the engine would at that world size); '' without a world size."""
    if world_size is None:
        return ""
    dp = cfg.data_parallel_size(_world_size(world_size))
    b = cfg.resolve_batch(dp)
    ranks = "ranks" if dp == world_size else (
        f"data-parallel ranks (tensor {cfg.tensor_model_parallel_size} x pipeline "
        f"{cfg.pipeline_model_parallel_size} ranks per replica)")
    return (f"; world size {world_size}: batch {b.train_batch_size} = micro-batch "
            f"{b.micro_batch_size} x {b.gradient_accumulation_steps} accumulation steps x "
            f"{dp} {ranks}")


def _train(args: argparse.Namespace) -> int:
    from hybrid_ray.lm.launch import ray_sizes, run, run_on_ray

    sizes = ray_sizes(args)
    if sizes is not None:
        return run_on_ray(args, *sizes)
    return run(args.config, args.nproc, args.resume, args.overrides, args.steps, args.storage,
               args.restart)


def main(argv: Optional[List[str]] = None) -> int:
    """Console-script entry; returns the exit code (0 ok, 1 training failed, 2 bad input)."""
    args = _parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
