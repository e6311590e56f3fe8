"""The compose lane's tests carry the ``compose`` mark (``pytest -m compose`` runs them alone)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "/compose/" in str(item.fspath):
            item.add_marker(pytest.mark.compose)
