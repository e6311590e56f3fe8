"""What every extproc worker the launcher starts (``llmgw up``, ``llmgw serve``) finds in its
environment before it imports numpy."""

from __future__ import annotations

import pytest

from extproc.launcher import worker_blas_env


def test_workers_get_one_blas_thread_unless_the_environment_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    assert worker_blas_env() == {"OPENBLAS_NUM_THREADS": "1"}
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")
    assert worker_blas_env() == {}  # the operator's own setting is inherited as it is
