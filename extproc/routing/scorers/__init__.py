"""The endpoint picker's scorers, one module each, found here by name: a module that registers a
function with ``extproc.routing.plugins.scorer`` is all a new scorer needs, with its weight in the
config (``picker.weights``)."""

from __future__ import annotations

import importlib
import pkgutil

from extproc.routing.plugins import SCORERS

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["SCORERS"]
