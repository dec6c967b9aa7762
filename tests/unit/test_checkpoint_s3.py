"""Checkpoints on an S3-protocol server on loopback (moto_server, started here)."""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install 'hybrid_ray[test]')")

from hybrid_ray.cli import main as cli  # noqa: E402
from hybrid_ray.engine.checkpoint import offline as checkpoint_offline  # noqa: E402
from tests.unit.test_checkpoint import CFG, assert_equal_state, make, train  # noqa: E402

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    """host:port of a moto S3 server, stopped after the module's tests."""
    port = free_port()
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "moto.server"]
    server = subprocess.Popen(cmd + ["-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, f"moto_server exited: {server.stderr.read().decode()[-2000:]}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "moto_server did not start listening"
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture
def bucket(endpoint: str, monkeypatch) -> str:
    """s3:// URI prefix of a fresh bucket, credentials in the environment."""
    import pyarrow.fs as pafs
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    name = f"ckpt-{time.monotonic_ns()}"
    pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1",
                     allow_bucket_creation=True).create_dir(name)
    return name


def uri(bucket: str, endpoint: str, path: str) -> str:
    return f"s3://{bucket}/{path}?endpoint_override={endpoint}&scheme=http&region=us-east-1"


@pytest.mark.slow
def test_save_load_retention_and_tools_on_s3(bucket: str, endpoint: str, tmp_path: Path, capsys) -> None:
    import pyarrow.fs as pafs
    engine = make(cfg={**CFG, "checkpoint": {"keep_last": 1}})
    train(engine, range(1))
    root = uri(bucket, endpoint, "run/ckpts")
    assert engine.save_checkpoint(root) == f"{bucket}/run/ckpts/global_step1"
    train(engine, range(1, 2))
    engine.save_checkpoint(root, async_save=True)  # S3 cannot move directories: copy, manifest last
    assert engine.wait_checkpoint() == f"{bucket}/run/ckpts/global_step2"
    fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1")
    names = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(f"{bucket}/run/ckpts")))
    assert names == ["global_step2", "latest"]  # staging copied away, step 1 retired (keep_last 1)
    loaded = make(seed=1)
    path, _ = loaded.load_checkpoint(root)
    assert path == f"{bucket}/run/ckpts/global_step2" and loaded.global_steps == 2
    assert_equal_state(engine, loaded)
    assert cli(["checkpoint", "inspect", root]) == 0
    assert "global_step2  [latest]: ok" in capsys.readouterr().out
    _, exported = checkpoint_offline.export(root, str(tmp_path / "model.pt"))
    assert all(exported[k].equal(v) for k, v in engine.module.state_dict().items())
