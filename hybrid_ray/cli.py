"""`hybrid-ray`: check configs and start the local training job from the shell.

    hybrid-ray config check PATH         # "ok: ..." or the one-line config error (exit 2)
    hybrid-ray train CONFIG [--nproc N]  # the LM job under torchrun on this machine
    hybrid-ray train CONFIG --workers N | --min-workers A --max-workers B [--address ADDR]
                                         # the LM job on Ray, elastic, with a live progress bar
    hybrid-ray checkpoint inspect PATH   # step, world size, stage, files, checksums
    hybrid-ray checkpoint export PATH OUT [--dtype fp32|bf16]   # model state_dict, offline
    hybrid-ray mlflow sync RUN_DIR       # send the MLflow records a run left in RUN_DIR/mlflow

`config check` takes a plain engine config (DeepSpeed-style JSON) or a job file with an
"engine" section (jobs/configs/*.json); it builds nothing, so it runs in a second.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from hybrid_ray import checkpoint_cli, mlflow_cli
from hybrid_ray.config import Config, ConfigError, load_config
from hybrid_ray.config.api import read_json

EXIT_CONFIG = 2  # argparse's code for bad usage; a bad config is the same kind of mistake


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybrid-ray", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{config,train,checkpoint,mlflow}")
    config = sub.add_parser("config", help="work with config files")
    config_sub = config.add_subparsers(dest="action", required=True, metavar="{check}")
    check = config_sub.add_parser("check", help="validate an engine config or a job file")
    check.add_argument("path", help="JSON file: engine config, or job file with an 'engine' section")
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
    return p


def describe(cfg: Config) -> str:
    """The resolved settings people check first: precision and ZeRO stage."""
    zero = cfg.zero_optimization.stage
    return (f"precision {cfg.base_dtype}, ZeRO stage {zero}, optimizer {cfg.optimizer.type}, "
            f"scheduler {cfg.scheduler.type if cfg.scheduler else 'none'}")


def _config_check(args: argparse.Namespace) -> int:
    from hybrid_ray.lm.job import is_job_file, load_job

    try:
        raw = read_json(Path(args.path))
        if is_job_file(raw):
            job = load_job(args.path)
            m = job.model
            print(f"ok: job file; {describe(job.engine)}; model {m.n_layer} layers x "
                  f"d_model {m.d_model}, context {m.seq_len}; {job.train.steps} steps")
        else:
            # The path, not raw: a JSON string at the top would be taken for a path.
            print(f"ok: {describe(load_config(args.path))}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


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
