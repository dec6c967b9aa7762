"""DeepSpeed's command-line arguments: `add_config_arguments(parser)` adds them, and
`config_from_args` reads them in `initialize(args=...)` as DeepSpeed does when no config is given.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

from ..config import ConfigError, load_config


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add --deepspeed and --deepspeed_config (and the hidden, older --deepscale spellings)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def _args_config(args: Any) -> Any:
    """args.deepspeed_config, or the older args.deepscale_config; None when neither is set."""
    new = getattr(args, "deepspeed_config", None)
    old = getattr(args, "deepscale_config", None)
    if new is not None and old is not None and new != old:
        raise ConfigError(f"args.deepspeed_config, args.deepscale_config: contradiction; got "
                          f"{new!r} and {old!r}; pass one (deepscale_config is the older name)")
    return new if new is not None else old


def _check_local_rank(args: Any) -> None:
    """DeepSpeed's check: a --local_rank the launcher passed must match LOCAL_RANK."""
    local_rank = getattr(args, "local_rank", None)
    env = os.environ.get("LOCAL_RANK")
    if local_rank is None or env is None or isinstance(local_rank, bool) or \
            not isinstance(local_rank, int) or local_rank < 0:
        return
    if int(env) != local_rank:
        raise ConfigError(f"args.local_rank: contradiction; got {local_rank} but LOCAL_RANK is "
                          f"{env}; pass the launcher's --local_rank unchanged, or none")


def config_from_args(args: Any, config: Any) -> Any:
    """The config initialize uses: `config` (config or config_params), else args.deepspeed_config.

    Both given is accepted only when they load to the same config; neither is a ConfigError.
    """
    if args is not None:
        _check_local_rank(args)
    from_args = _args_config(args) if args is not None else None
    if config is None and from_args is None:
        raise ConfigError("config: missing; got None; pass a JSON path, a dict or a Config to "
                          "initialize, or --deepspeed_config FILE in args")
    if from_args is None:
        return config
    if config is None:
        return from_args
    if load_config(config) != load_config(from_args):
        raise ConfigError(f"config, args.deepspeed_config: contradiction; got a config and "
                          f"{from_args!r}, which differ; pass one")
    return config
