"""`hybrid-ray launch`: the torchrun command it builds, what each process runs, and what it
refuses. (A real 2-process launch runs DeepSpeed's test_model.py in test_deepspeed_scripts.)"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_ray import cli, launch_cli
from hybrid_ray.compat import launch_entry

REPO = Path(__file__).resolve().parents[2]


def _args(*argv: str):
    parser = cli._parser()
    return parser.parse_args(["launch", *argv])


def test_builds_torchrun_on_loopback_with_the_entry_first() -> None:
    argv = launch_cli.torchrun_argv(_args("--num_gpus", "3", "--master_port", "1234", "train.py",
                                          "--deepspeed_config", "ds.json", "--zero", "2"))
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    assert "--nproc_per_node=3" in argv and "--master_port=1234" in argv
    assert "--master_addr=127.0.0.1" in argv and "--local-addr=127.0.0.1" in argv
    tail = argv[argv.index("-m", 3):]
    assert tail == ["-m", launch_cli.ENTRY, "train.py", "--deepspeed_config", "ds.json", "--zero", "2"]


def test_entry_passes_local_rank_right_after_the_script(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launch_entry._argv(["train.py", "--x", "1"]) == (False, "train.py", ["train.py", "--local_rank=1", "--x", "1"])
    assert launch_entry._argv(["--module", "--no_local_rank", "pkg.train", "--x"]) == \
        (True, "pkg.train", ["pkg.train", "--x"])


@pytest.mark.parametrize("argv", [["--num_nodes", "2", "t.py"], ["--hostfile", "hosts", "t.py"],
                                  ["--num_gpus", "0", "t.py"]])
def test_refuses_in_one_line(argv) -> None:
    proc = subprocess.run([sys.executable, "-m", "hybrid_ray.cli", "launch", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("hybrid-ray: launch")
