"""The whole suite: every test records in an MLflow store of its own, never in the checkout.

A job run without a tracking URI records in the embedded store beside its run folders (the
default users get); the tests that check that default unset MLFLOW_TRACKING_URI themselves.
One store per test, not per session: a run name is looked up in the store before a run starts
(a name with progress and no checkpoint is refused), so tests that reuse a run name such as
"run" must not see each other's runs. The database is only made when a test records.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_USER_URI = os.environ.get("MLFLOW_TRACKING_URI")


@pytest.fixture(autouse=True)
def _own_mlflow_store(monkeypatch):
    if _USER_URI is not None:  # the person running the suite chose a store: keep it
        yield
        return
    store = tempfile.mkdtemp(prefix="hybrid_ray-tests-mlflow-")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}/mlflow.db")
    yield
    shutil.rmtree(store, ignore_errors=True)
