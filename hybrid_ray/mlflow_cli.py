"""`hybrid-ray mlflow sync RUN_DIR`: send what a run left unsent to MLflow.

    hybrid-ray mlflow sync RUN_DIR [--tracking-uri URI] [--timeout S]

A run with a spool (the LM job keeps one in RUN_DIR/mlflow) journals every record there; what
the tracking server had not acknowledged when the run ended (the server was down, the driver was
killed) is sent by this command, in order and once, and the run's MLflow status becomes the one
it ended with (FINISHED, FAILED, KILLED; KILLED when the driver died without closing the run).
The journal names the server, experiment and run. Exit codes: 0 sent or nothing to send, 1 not
sent (server unreachable, the run still being written, no spool); nothing is lost on failure.
"""
from __future__ import annotations

import argparse
import sys


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register `mlflow sync` under the top-level parser (MLflow is imported only when it runs)."""
    group = sub.add_parser("mlflow", help="send a run's spooled MLflow records (mlflow sync RUN_DIR)")
    actions = group.add_subparsers(dest="action", required=True, metavar="{sync}")
    sync = actions.add_parser("sync", help="send what RUN_DIR/mlflow holds unsent and end the run "
                                           "with its recorded status",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sync.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (or its mlflow/ spool)")
    sync.add_argument("--tracking-uri", default=None,
                      help="send to this server instead of the one the journal names")
    sync.add_argument("--timeout", type=float, default=300.0,
                      help="seconds to keep trying once the server answered (default 300)")
    sync.set_defaults(func=sync_command)


def sync_command(args: argparse.Namespace) -> int:
    from hybrid_ray.tracking.sync import sync

    result = sync(args.run_dir, args.tracking_uri, args.timeout)
    print(result.line, file=sys.stdout if result.code == 0 else sys.stderr)
    return result.code
