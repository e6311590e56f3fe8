"""``MemoryStore``: the embedded quota store, for one process or for all worker processes of a node.

State lives in SQLite: in this process's memory (``path=None``), or in a file that every extproc
worker of the node opens (``path=run_dir/quota.sqlite``, best on tmpfs). Each call is one
``BEGIN IMMEDIATE`` transaction, which SQLite serialises across processes with file locks, so the
node's workers share one exact limit. A worker that dies mid-transaction is rolled back and its
lock freed by the OS; its leases expire by their TTL like Redis's. The arithmetic is
``extproc.quota.limits``, the same the Redis script mirrors.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from extproc.quota.limits import (
    SPAN,
    Admission,
    Lease,
    Quota,
    ScopeState,
    Verdict,
    bucket_of,
    day_of,
    decide,
    month_of,
    scopes_of,
    settle_bucket,
)
from extproc.quota.store import StoreUnavailable

_REQUESTS, _TOKENS, _LEASES, _DAY_TOKENS = 0, 1, 2, 3  # the kinds of row _STATE returns
_SWEEP_MS = 60_000  # how often one worker deletes every tenant's stale rows

_WINDOW_ADD = ("INSERT INTO win VALUES (?,?,?,?,?)"
               " ON CONFLICT (tenant, scope, kind, bucket) DO UPDATE SET n = n + excluded.n")
_DAY_ADD = "INSERT INTO day VALUES (?,?,?,?) ON CONFLICT (tenant, scope, day) DO UPDATE SET n = n + excluded.n"
_SPEND_ADD = ("INSERT INTO spend VALUES (?,?,?,?,?)"
              " ON CONFLICT (tenant, scope, period, idx) DO UPDATE SET n = n + excluded.n")
# One scope's live state in one statement: its window buckets, its live leases and today's tokens.
_STATE = ("SELECT kind, bucket, n FROM win WHERE tenant=? AND scope=? AND bucket>=?"
          f" UNION ALL SELECT {_LEASES}, 0, count(*) FROM lease WHERE tenant=? AND scope=? AND expires>?"
          f" UNION ALL SELECT {_DAY_TOKENS}, 0, n FROM day WHERE tenant=? AND scope=? AND day=?")
_DAY, _MONTH = 0, 1  # spend.period: idx is a UTC day number, or a UTC month (year * 12 + month - 1)
_SCHEMA_VERSION = 2  # a file of another version is rebuilt (quota state is a minute's worth)
_TABLES = ("win", "lease", "day", "charge", "spend")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS win (tenant TEXT, scope TEXT, kind INTEGER, bucket INTEGER, n INTEGER,
    PRIMARY KEY (tenant, scope, kind, bucket)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS lease (tenant TEXT, scope TEXT, lease_id TEXT, expires INTEGER,
    PRIMARY KEY (tenant, scope, lease_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS day (tenant TEXT, scope TEXT, day INTEGER, n INTEGER,
    PRIMARY KEY (tenant, scope, day)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS charge (tenant TEXT, lease_id TEXT, tokens INTEGER, expires INTEGER, cost INTEGER,
    PRIMARY KEY (tenant, lease_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS spend (tenant TEXT, scope TEXT, period INTEGER, idx INTEGER, n INTEGER,
    PRIMARY KEY (tenant, scope, period, idx)) WITHOUT ROWID;
"""


def _scope_key(scope: str, qos: str) -> str:
    return "t" if scope == "tenant" else f"q:{qos}"


def _use_wal(db: sqlite3.Connection, timeout_s: float) -> None:
    """Switch the file to WAL mode. The switch needs the file to itself, and SQLite answers "database
    is locked" at once instead of waiting (its busy timeout does not cover it): several workers
    starting together retry until the one switching is done."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


class MemoryStore:
    """The quota store without Redis: exact across this node's worker processes when given a path."""

    name = "memory"

    def __init__(self, path: str | Path | None = None, *, lease_ttl_s: float = 60.0,
                 clock: Callable[[], float] = time.time, busy_timeout_s: float = 5.0) -> None:
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self._clock = clock
        # isolation_level=None: transactions are begun explicitly (BEGIN IMMEDIATE takes the write
        # lock up front, so two workers never both read the old counts).
        self._db = sqlite3.connect(":memory:" if path is None else str(path),
                                   timeout=busy_timeout_s, isolation_level=None)
        if path is not None:
            _use_wal(self._db, busy_timeout_s)
        # Quota state is rebuilt within a minute after a crash: durability is not worth an fsync.
        self._db.execute("PRAGMA synchronous=OFF")
        with self._transaction():
            (version,), = self._db.execute("PRAGMA user_version")
            if version != _SCHEMA_VERSION:
                for table in _TABLES:
                    self._db.execute(f"DROP TABLE IF EXISTS {table}")
                self._db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
            for statement in _SCHEMA.split(";")[:-1]:  # not executescript: it would COMMIT first
                self._db.execute(statement)
        self._last_sweep = 0
        self._purged: dict[tuple[str, str], int] = {}  # (tenant, scope) -> the window start it was purged at

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)

    async def admit(self, admission: Admission, quota: Quota) -> Verdict:
        """See ``QuotaStore.admit``."""
        db, tenant = self._db, admission.tenant
        with self._transaction():
            now = self._now_ms()
            self._sweep(now)
            oldest, today, (month, _) = bucket_of(now) - SPAN + 1, day_of(now), month_of(now)
            scopes = []
            for scope, limits in scopes_of(quota, admission.qos):
                key = _scope_key(scope, admission.qos)
                # Reads skip rows past their time; a scope's are deleted at most once a second.
                if self._purged.get((tenant, key)) != oldest:
                    self._purged[(tenant, key)] = oldest
                    db.execute("DELETE FROM charge WHERE tenant=? AND expires<=?", (tenant, now))
                    db.execute("DELETE FROM win WHERE tenant=? AND scope=? AND bucket<?", (tenant, key, oldest))
                    db.execute("DELETE FROM lease WHERE tenant=? AND scope=? AND expires<=?", (tenant, key, now))
                    db.execute("DELETE FROM day WHERE tenant=? AND scope=? AND day<?", (tenant, key, today - 1))
                windows: dict[int, dict[int, int]] = {_REQUESTS: {}, _TOKENS: {}}
                leases = day_tokens = 0
                for kind, bucket, n in db.execute(_STATE, (tenant, key, oldest, tenant, key, now,
                                                          tenant, key, today)):
                    if kind == _LEASES:
                        leases = n
                    elif kind == _DAY_TOKENS:
                        day_tokens = n
                    else:
                        windows[kind][bucket] = n
                spent = {_DAY: 0, _MONTH: 0}
                if limits.daily_cost is not None or limits.monthly_cost is not None:
                    for period, n in db.execute(
                            "SELECT period, n FROM spend WHERE tenant=? AND scope=? AND ((period=? AND idx=?) OR "
                            "(period=? AND idx=?))", (tenant, key, _DAY, today, _MONTH, month)):
                        spent[period] = n
                state = ScopeState(windows[_REQUESTS], windows[_TOKENS], leases, day_tokens,
                                   spent[_DAY], spent[_MONTH])
                scopes.append((scope, limits, state))
            cost = admission.reserve_cost
            verdict = decide(scopes, admission.reserve_tokens, now, cost)
            if not verdict.admitted:
                return Verdict(False, verdict.figures, verdict.refused_by, verdict.refused_scope,
                                verdict.retry_after_ms)
            expires = now + self.lease_ttl_ms
            bucket = bucket_of(now)
            for scope, _ in scopes_of(quota, admission.qos):
                key = _scope_key(scope, admission.qos)
                db.execute(_WINDOW_ADD, (tenant, key, _REQUESTS, bucket, 1))
                if admission.reserve_tokens:
                    db.execute(_WINDOW_ADD, (tenant, key, _TOKENS, bucket, admission.reserve_tokens))
                db.execute(_DAY_ADD, (tenant, key, today, admission.reserve_tokens))
                if cost:
                    db.execute(_SPEND_ADD, (tenant, key, _DAY, today, cost))
                    db.execute(_SPEND_ADD, (tenant, key, _MONTH, month, cost))
                db.execute("INSERT OR REPLACE INTO lease VALUES (?,?,?,?)", (tenant, key, admission.lease_id, expires))
            db.execute("INSERT OR REPLACE INTO charge VALUES (?,?,?,?,?)",
                       (tenant, admission.lease_id, admission.reserve_tokens, expires, cost))
        lease = Lease(tenant, admission.qos, admission.lease_id, admission.reserve_tokens, now, expires, self.name,
                      reserved_cost=cost)
        return Verdict(True, verdict.figures, lease=lease)

    def _sweep(self, now: int) -> None:
        # Per-tenant purges run on admissions; this catches tenants that went quiet.
        if now - self._last_sweep < _SWEEP_MS:
            return
        self._last_sweep = now
        self._purged.clear()
        self._db.execute("DELETE FROM win WHERE bucket<?", (bucket_of(now) - SPAN + 1,))
        self._db.execute("DELETE FROM lease WHERE expires<=?", (now,))
        self._db.execute("DELETE FROM charge WHERE expires<=?", (now,))
        self._db.execute("DELETE FROM day WHERE day<?", (day_of(now) - 1,))
        self._db.execute("DELETE FROM spend WHERE (period=? AND idx<?) OR (period=? AND idx<?)",
                         (_DAY, day_of(now) - 1, _MONTH, month_of(now)[0] - 1))

    def _settle(self, lease: Lease, actual_tokens: int | None, actual_cost: int | None, free: bool) -> None:
        db, tenant = self._db, lease.tenant
        keys = [_scope_key(scope, lease.qos) for scope in (("tenant", "qos") if lease.qos else ("tenant",))]
        with self._transaction():
            now = self._now_ms()
            if free:  # the charge row goes with the lease
                rows = db.execute("DELETE FROM charge WHERE tenant=? AND lease_id=? RETURNING tokens, cost",
                                  (tenant, lease.lease_id)).fetchall()
                for key in keys:
                    db.execute("DELETE FROM lease WHERE tenant=? AND scope=? AND lease_id=?",
                               (tenant, key, lease.lease_id))
            else:
                rows = db.execute("SELECT tokens, cost FROM charge WHERE tenant=? AND lease_id=?",
                                  (tenant, lease.lease_id)).fetchall()
            if rows and actual_cost is not None and actual_cost != rows[0][1]:
                delta = actual_cost - rows[0][1]
                periods = ((_DAY, day_of(lease.admitted_ms)), (_MONTH, month_of(lease.admitted_ms)[0]))
                for key in keys:
                    for period, index in periods:
                        if delta > 0:
                            db.execute(_SPEND_ADD, (tenant, key, period, index, delta))
                        else:  # a refund to a period already purged has nothing to return to
                            db.execute("UPDATE spend SET n=n+? WHERE tenant=? AND scope=? AND period=? AND idx=?",
                                       (delta, tenant, key, period, index))
                if not free:
                    db.execute("UPDATE charge SET cost=? WHERE tenant=? AND lease_id=?",
                               (actual_cost, tenant, lease.lease_id))
            if rows and actual_tokens is not None and actual_tokens != rows[0][0]:
                delta = actual_tokens - rows[0][0]
                bucket = settle_bucket(lease.admitted_ms, now, delta)
                day = day_of(lease.admitted_ms)
                for key in keys:
                    if bucket is not None:
                        db.execute(_WINDOW_ADD, (tenant, key, _TOKENS, bucket, delta))
                    if delta > 0:
                        db.execute(_DAY_ADD, (tenant, key, day, delta))
                    else:  # a refund to a day already purged has nothing to return to
                        db.execute("UPDATE day SET n=n+? WHERE tenant=? AND scope=? AND day=?",
                                   (delta, tenant, key, day))
                if not free:
                    db.execute("UPDATE charge SET tokens=? WHERE tenant=? AND lease_id=?",
                               (actual_tokens, tenant, lease.lease_id))

    async def reconcile(self, lease: Lease, actual_tokens: int, actual_cost: int | None = None) -> None:
        """See ``QuotaStore.reconcile``."""
        self._settle(lease, actual_tokens, actual_cost, free=False)

    async def release(self, lease: Lease, actual_tokens: int | None = None, actual_cost: int | None = None) -> None:
        """See ``QuotaStore.release``."""
        self._settle(lease, actual_tokens, actual_cost, free=True)

    async def renew(self, lease: Lease) -> Lease | None:
        """See ``QuotaStore.renew``."""
        db = self._db
        with self._transaction():
            now = self._now_ms()
            expires = now + self.lease_ttl_ms
            alive = db.execute("UPDATE lease SET expires=? WHERE tenant=? AND lease_id=? AND expires>?",
                               (expires, lease.tenant, lease.lease_id, now)).rowcount
            db.execute("UPDATE charge SET expires=? WHERE tenant=? AND lease_id=? AND expires>?",
                       (expires, lease.tenant, lease.lease_id, now))
        return replace(lease, expires_ms=expires) if alive else None

    async def close(self) -> None:
        """See ``QuotaStore.close``."""
        self._db.close()


class _Transaction:
    """``BEGIN IMMEDIATE`` .. ``COMMIT`` (``ROLLBACK`` on error); a locked file is an outage."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as error:  # "database is locked" past busy_timeout
            raise StoreUnavailable(f"local quota store: {error}") from error

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self._db.execute("ROLLBACK" if kind else "COMMIT")
