"""Where a setting points: a local path or a URI that pyarrow.fs opens (s3://, gs://, file://)."""
from __future__ import annotations

import os


def is_uri(path: str) -> bool:
    """`s3://bucket/run` and `file:///tmp/x` are URIs; `runs/x` and `/data/x` are local paths."""
    return "://" in str(path)


def absolute(path: str) -> str:
    """A local path made absolute (another process, another node, may have another working
    directory); a URI as given."""
    return path if is_uri(path) else os.path.abspath(path)
