"""The whole suite: runs record in an MLflow store of the session's own, never in the checkout.

A job run without a tracking URI records in sqlite:///mlflow.db of its working directory (the
default users get); the tests that check that default set their own working directory.
"""
from __future__ import annotations

import os
import tempfile


def pytest_configure(config) -> None:
    if "MLFLOW_TRACKING_URI" not in os.environ:
        store = tempfile.mkdtemp(prefix="hybrid_ray-tests-mlflow-")
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{store}/mlflow.db"
