"""`hybrid-ray launch`: DeepSpeed's `deepspeed` launcher on one machine.

    hybrid-ray launch --num_gpus 2 train.py --deepspeed_config ds.json   # as `deepspeed --num_gpus 2 ...`

Starts N processes of the script through torchrun's elastic agent (so a dead rank ends the
others and the exit code says so) with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
set, and, as DeepSpeed's launcher does, `--local_rank=<i>` passed to each process right after the
script (`--no_local_rank` leaves it out). The rendezvous stays on 127.0.0.1 unless `--master_addr`
says otherwise. Several machines (`--hostfile`, `--num_nodes` > 1) are refused: run torchrun on
each node, or `hybrid-ray train` on Ray.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List

from hybrid_ray.config import NotSupportedError

ENTRY = "hybrid_ray.compat.launch_entry"


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="run a DeepSpeed script on N local processes, as the deepspeed launcher does",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num_gpus", "--num_accelerators", "--num_procs", dest="num_procs", type=int, default=None,
                   help="processes to start (default: the visible GPUs, or 1 without any)")
    p.add_argument("--num_nodes", type=int, default=1, help="only 1 is supported")
    p.add_argument("--hostfile", default=None, help="refused: one machine only")
    p.add_argument("--master_addr", default="127.0.0.1")
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--no_local_rank", action="store_true",
                   help="do not pass --local_rank to the script (it reads LOCAL_RANK)")
    p.add_argument("--module", action="store_true", help="the target is a module, run as python -m")
    p.add_argument("script", help="the training script (or module, with --module)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.set_defaults(func=launch)


def _num_procs(requested: int | None) -> int:
    if requested is not None:
        if requested < 1:
            raise NotSupportedError(f"launch --num_gpus: must be >= 1, got {requested}")
        return requested
    import torch

    return max(1, torch.cuda.device_count())


def torchrun_argv(args: argparse.Namespace) -> List[str]:
    """The torchrun command line `launch` runs."""
    if args.hostfile is not None or args.num_nodes != 1:
        raise NotSupportedError("launch: one machine only (--hostfile / --num_nodes > 1 are not supported); "
                                "run torchrun on each node, or `hybrid-ray train` on a Ray cluster")
    entry = [ENTRY] + (["--module"] if args.module else []) + (["--no_local_rank"] if args.no_local_rank else [])
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
            f"--nproc_per_node={_num_procs(args.num_procs)}", f"--master_addr={args.master_addr}",
            f"--master_port={args.master_port}", f"--local-addr={args.master_addr}",
            "-m", *entry, args.script, *args.script_args]


def launch(args: argparse.Namespace) -> int:
    try:
        argv = torchrun_argv(args)
    except NotSupportedError as e:
        print(f"hybrid-ray: {e}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.execv(sys.executable, argv)  # torchrun takes over: signals and the exit code are its own
    return 0  # not reached
