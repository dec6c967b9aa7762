"""What each process of `hybrid-ray launch` runs: the user's script (or module) as `__main__`,
with `--local_rank=<LOCAL_RANK>` right after it as DeepSpeed's launcher passes it, since
DeepSpeed scripts read their rank from that argument (and its default, often 0, would be wrong on
every other rank)."""
from __future__ import annotations

import os
import runpy
import sys
from typing import List


def _argv(args: List[str]) -> tuple:
    module = no_local_rank = False
    while args[0] in ("--module", "--no_local_rank"):  # the launcher's own flags come first
        flag = args.pop(0)
        module |= flag == "--module"
        no_local_rank |= flag == "--no_local_rank"
    target, rest = args[0], args[1:]
    local = [] if no_local_rank else [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}"]
    return module, target, [target, *local, *rest]


def main() -> None:
    module, target, sys.argv = _argv(list(sys.argv[1:]))
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python script.py` does
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
