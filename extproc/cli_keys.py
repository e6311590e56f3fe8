"""``llmgw keys add|revoke|list``: the key table in Redis (``extproc.keys``) from the command line.

Argument handling and printing only: the table itself, its digests and its rules live in
``extproc.keys``. A key given on the command line or read from stdin is hashed at once; only a
key this command generates is printed, once.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis import exceptions as redis_errors

from extproc.keys import KeyConflict, RedisKeyTable, check_tenant_name, digest_of, new_api_key, parse_digest_hex

REDIS_URL_ENV = "LLMGW_REDIS_URL"
T = TypeVar("T")


def add_keys_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Declare ``llmgw keys add|revoke|list`` on the ``llmgw`` parser's subcommands."""
    keys = subparsers.add_parser("keys", help="API keys kept in Redis (stored as SHA-256 digests only)")
    actions = keys.add_subparsers(dest="keys_command", required=True)
    redis_help = f"the Redis holding the key table (default ${REDIS_URL_ENV})"

    add = actions.add_parser("add", help="grant a key to a tenant; without --key, make one and print it once")
    add.add_argument("--tenant", required=True)
    add.add_argument("--key", default=None, help="the key to grant ('-': read it from stdin); default: a new one")
    add.add_argument("--redis-url", default=None, help=redis_help)
    add.set_defaults(handler=cmd_keys_add)

    revoke = actions.add_parser("revoke", help="withdraw a key; every gateway refuses it within seconds")
    which = revoke.add_mutually_exclusive_group(required=True)
    which.add_argument("--key", default=None, help="the key itself ('-': read it from stdin)")
    which.add_argument("--sha256", default=None, help="the key's SHA-256 digest (64 hex digits)")
    revoke.add_argument("--redis-url", default=None, help=redis_help)
    revoke.set_defaults(handler=cmd_keys_revoke)

    listing = actions.add_parser("list", help="key digests (first 12 hex digits) and their tenants")
    listing.add_argument("--redis-url", default=None, help=redis_help)
    listing.set_defaults(handler=cmd_keys_list)


def _fail(message: str, code: int = 1) -> int:
    print(f"llmgw keys: {message}", file=sys.stderr)
    return code


def _redis_url(args: argparse.Namespace) -> str | None:
    return args.redis_url or os.environ.get(REDIS_URL_ENV) or None


def _key_argument(value: str) -> str:
    # '-' keeps the key out of the shell history and the process list.
    return sys.stdin.readline().strip() if value == "-" else value


async def _on_table(url: str, action: Callable[[RedisKeyTable], Awaitable[T]]) -> T:
    table = RedisKeyTable.from_url(url, timeout_s=5.0)
    try:
        return await action(table)
    finally:
        await table.aclose()


def _run(args: argparse.Namespace, action: Callable[[RedisKeyTable], Awaitable[T]]) -> tuple[T | None, int | None]:
    """Run ``action`` on the table at the command's Redis; (result, None) or (None, exit code)."""
    url = _redis_url(args)
    if url is None:
        return None, _fail(f"no Redis: pass --redis-url or set {REDIS_URL_ENV}", 2)
    try:
        return asyncio.run(_on_table(url, action)), None
    except (redis_errors.RedisError, OSError) as error:
        return None, _fail(f"Redis unreachable or refused the command ({type(error).__name__}: {error})")


def cmd_keys_add(args: argparse.Namespace) -> int:
    """``llmgw keys add``: grant a key to a tenant; a generated key is printed here, once, and nowhere else."""
    generated = args.key is None
    key = new_api_key() if generated else _key_argument(args.key)
    try:
        digest = digest_of(key)
        check_tenant_name(args.tenant)
    except ValueError as error:
        return _fail(str(error), 2)
    try:
        added, code = _run(args, lambda table: table.add(digest, args.tenant))
    except KeyConflict as error:
        return _fail(str(error))
    if code is not None:
        return code
    if generated:
        print(f"# API key for tenant {args.tenant} (shown once; only its SHA-256 is stored): {key}")
    state = "added" if added else "already granted"
    print(f"{state}: {digest.hex()[:12]} -> {args.tenant}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    """``llmgw keys revoke``: withdraw a key given in clear or by its digest."""
    try:
        digest = digest_of(_key_argument(args.key)) if args.key is not None else parse_digest_hex(args.sha256)
    except ValueError as error:
        return _fail(str(error), 2)
    removed, code = _run(args, lambda table: table.revoke(digest))
    if code is not None:
        return code
    if not removed:
        return _fail(f"no key {digest.hex()[:12]} in the table")
    print(f"revoked: {digest.hex()[:12]}")
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    """``llmgw keys list``: the digests (first 12 hex digits) and tenants; keys are never stored."""
    keys, code = _run(args, lambda table: table.list())
    if code is not None or keys is None:
        return code or 1
    for digest_hex, tenant in sorted(keys.items(), key=lambda item: (item[1], item[0])):
        print(f"{digest_hex[:12]}  {tenant}")
    print(f"{len(keys)} keys")
    return 0
