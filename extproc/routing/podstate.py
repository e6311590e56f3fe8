"""What each pod says about its load, gathered once per node and shared by every worker.

- ``parse_metrics`` (pure): a pod's Prometheus ``/metrics`` text, read through its engine's profile
  (``extproc.routing.engines``) -> ``PodState`` (queue, KV cache, prefix cache, LoRA adapters),
  with the model ids its ``/v1/models`` lists; None when the text has none of the profile's load
  metrics (an engine started without its metrics flag, or another engine than configured): such a
  pod is unknown, never idle, and ``llmgw_pool_pods_known`` leaves it out.
- ``PodStates`` (pure): the latest state of each pod as one worker sees it. A state older than
  ``stale_after_s`` is unknown, never "idle": a pod that stopped answering must not win picks.
  Its optional ``on_update`` hears every change (the pool gauges autoscalers read are fed there).
- ``pool_loads`` (pure): a pool's queue, running requests and KV-cache use over its known pods.
- ``gather_forever`` (the shell): the extproc workers of a node share one snapshot file. The
  worker holding an exclusive ``flock`` on ``<file>.lock`` is the node's scraper: once per
  interval it asks every pod for ``/metrics`` and ``/v1/models`` and replaces the file atomically;
  every worker loads the file when it changed. The kernel drops the lock of a process that dies,
  so another worker takes over at its next try, within one interval. Rounds are spaced by the
  ``round_started`` time in the file, so a takeover does not scrape early either (unless the old
  scraper died between asking the pods and writing the file).

Cost: one scrape of each pod per interval per node, whatever the number of workers.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import math
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from extproc.routing.engines import VLLM, EngineProfile

log = logging.getLogger("llmgw.podstate")

_SNAPSHOT_VERSION = 1


@dataclass(frozen=True, slots=True)
class PodState:
    """One scrape of one pod."""

    endpoint: str  # "host:port"
    scraped_at: float  # time.time() when the pod answered /metrics
    waiting: float  # queued requests (vllm:num_requests_waiting, llamacpp:requests_deferred, ...)
    running: float  # requests generating (vllm:num_requests_running, llamacpp:requests_processing, ...)
    kv_usage: float  # 0..1 (vllm:kv_cache_usage_perc, mean over engines); NaN: the engine does not say
    prefix_queries: float  # counter, in tokens
    prefix_hits: float  # counter, in tokens
    running_adapters: frozenset[str]
    waiting_adapters: frozenset[str]
    max_lora: int  # 0 when the pod reports no LoRA info
    models: frozenset[str]  # ids from /v1/models (base and adapters); empty when unknown


# -- parsing (pure) --------------------------------------------------------------------------


def parse_metrics(endpoint: str, text: str, scraped_at: float, models: frozenset[str] = frozenset(),
                  profile: EngineProfile = VLLM) -> PodState | None:
    """A pod's state from its Prometheus text, read with its engine's names. Gauges and counters
    are summed over label sets (a pod with several engines), KV usage is their mean. A line the
    parser refuses counts as absent; so does a metric the pod does not export (0), but a text
    with neither the profile's waiting nor its running metric is no state at all (None)."""
    values: dict[str, list[float]] = {}
    lora_at, lora_labels = -math.inf, {}
    for name, labels, value in _samples(text, profile.wanted):
        if name != profile.lora_info:
            values.setdefault(name, []).append(value)
        elif value > lora_at:  # vLLM sets the value to the update's time: a stale series stays behind
            lora_at, lora_labels = value, labels
    waiting, running = _first(values, profile.waiting), _first(values, profile.running)
    if not waiting and not running:
        return None
    hits = float(sum(_first(values, profile.prefix_hits)))
    queries = float(sum(_first(values, profile.prefix_queries)))
    return PodState(
        endpoint=endpoint,
        scraped_at=scraped_at,
        waiting=float(sum(waiting)),
        running=float(sum(running)),
        kv_usage=_kv_usage(values, profile),
        prefix_queries=queries + hits if profile.queries_exclude_hits else queries,
        prefix_hits=hits,
        running_adapters=_names(lora_labels.get("running_lora_adapters", "")),
        waiting_adapters=_names(lora_labels.get("waiting_lora_adapters", "")),
        max_lora=_int(lora_labels.get("max_lora", "0")),
        models=models,
    )


def parse_models(body: bytes) -> frozenset[str] | None:
    """The model ids of an OpenAI ``GET /v1/models`` answer; None when it is not one."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        return None
    return frozenset(card["id"] for card in data if isinstance(card, dict) and isinstance(card.get("id"), str))


def _kv_usage(values: Mapping[str, list[float]], profile: EngineProfile) -> float:
    """KV-cache use, 0..1: the profile's ratio gauge (mean over engines), or used / total; NaN when
    the engine reports neither."""
    ratio = _first(values, profile.kv_usage)
    if ratio:
        return min(max(sum(ratio) / len(ratio), 0.0), 1.0)
    used = sum(values.get(profile.kv_used or "", ()))
    total = sum(values.get(profile.kv_total or "", ()))
    return min(max(used / total, 0.0), 1.0) if total > 0 else math.nan


def _samples(text: str, wanted: frozenset[str]) -> Iterator[tuple[str, dict[str, str], float]]:
    """Samples of the wanted metrics only: each line is parsed alone, so a bad line costs itself."""
    for line in text.splitlines():
        head = line.partition("{")[0].split(maxsplit=1)
        if not head or head[0] not in wanted:
            continue
        try:
            families = list(text_string_to_metric_families(line + "\n"))
        except ValueError:
            continue
        for family in families:
            for sample in family.samples:
                if sample.name == head[0] and math.isfinite(sample.value):
                    yield sample.name, sample.labels, sample.value


def _first(values: Mapping[str, list[float]], names: tuple[str, ...]) -> list[float]:
    # A pod exporting both a name and its deprecated alias must not count twice.
    return next((values[name] for name in names if name in values), [])


def _names(joined: str) -> frozenset[str]:
    return frozenset(name for name in joined.split(",") if name)


def _int(text: str) -> int:
    try:
        return max(int(text), 0)
    except ValueError:
        return 0


# -- what a worker knows (pure) ---------------------------------------------------------------


class PodStates:
    """What every worker reads: the latest snapshot, with a staleness bound."""

    def __init__(self, stale_after_s: float, clock: Callable[[], float] = time.time,
                 on_update: Callable[[Mapping[str, PodState]], None] | None = None) -> None:
        if stale_after_s <= 0:
            raise ValueError("stale_after_s must be > 0")
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._states: dict[str, PodState] = {}
        # Called after each ``update`` with the fresh states (a scrape landed, or a snapshot loaded).
        self._on_update = on_update

    def get(self, endpoint: str) -> PodState | None:
        """The pod's latest state; None when never seen or older than ``stale_after_s``."""
        state = self._states.get(endpoint)
        if state is None or self._clock() - state.scraped_at > self.stale_after_s:
            return None
        return state

    def update(self, states: Iterable[PodState]) -> None:
        """Keep the newer of the known and the given state of each pod; forget stale ones."""
        now = self._clock()
        merged = {ep: s for ep, s in self._states.items() if now - s.scraped_at <= self.stale_after_s}
        for state in states:
            known = merged.get(state.endpoint)
            if now - state.scraped_at <= self.stale_after_s and (
                    known is None or state.scraped_at >= known.scraped_at):
                merged[state.endpoint] = state
        self._states = merged  # one assignment: a reader sees the old map or the new one
        if self._on_update is not None:
            self._on_update(MappingProxyType(merged))

    def snapshot(self) -> dict[str, PodState]:
        """The fresh states, by endpoint."""
        now = self._clock()
        return {ep: s for ep, s in self._states.items() if now - s.scraped_at <= self.stale_after_s}


@dataclass(frozen=True, slots=True)
class PoolLoad:
    """A pool's load as last scraped, over the pods whose state is fresh (the unknown are left out:
    unknown is not idle). With no pod known, the load itself is unknown (NaN)."""

    pods: int  # the pool's endpoints
    pods_known: int  # of them, with fresh state
    waiting: float  # sum of the pods' waiting requests: the pool's queue depth
    running: float  # sum of their running requests
    kv_usage_mean: float  # mean KV-cache use, 0..1, of the pods that report it (an autoscaler's average)


def pool_loads(states: Mapping[str, PodState], pools: Mapping[str, Iterable[str]]) -> dict[str, PoolLoad]:
    """Each pool's load from the fresh states by endpoint (``PodStates.snapshot()``) and its endpoints."""
    loads: dict[str, PoolLoad] = {}
    for pool, endpoints in pools.items():
        members = tuple(dict.fromkeys(endpoints))  # a pod listed twice counts once
        known = [states[ep] for ep in members if ep in states]
        if not known:
            loads[pool] = PoolLoad(len(members), 0, math.nan, math.nan, math.nan)
            continue
        kv = [s.kv_usage for s in known if not math.isnan(s.kv_usage)]
        loads[pool] = PoolLoad(len(members), len(known), sum(s.waiting for s in known),
                               sum(s.running for s in known), sum(kv) / len(kv) if kv else math.nan)
    return loads


# -- the node's snapshot file -----------------------------------------------------------------


def default_state_path(endpoints: Iterable[str]) -> Path:
    """The snapshot file of this user's workers watching these pods: the workers of a node that
    are given the same endpoints share it without configuration."""
    digest = hashlib.sha256("\n".join(sorted(set(endpoints))).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"llmgw-pods-{os.getuid()}-{digest}.json"


@dataclass(frozen=True, slots=True)
class _Snapshot:
    round_started: float  # time.time() when the scraper began the round that wrote it
    pods: tuple[PodState, ...]


def _encode(snapshot: _Snapshot) -> bytes:
    return orjson.dumps({"version": _SNAPSHOT_VERSION, "round_started": snapshot.round_started,
                         "pods": snapshot.pods}, default=_sorted_set)


def _sorted_set(value: object) -> list[str]:
    if isinstance(value, frozenset):
        return sorted(value)
    raise TypeError(f"not JSON: {type(value).__name__}")


def _decode(body: bytes) -> _Snapshot:
    """Raises ValueError, KeyError or TypeError on anything that is not a snapshot of ours."""
    document = orjson.loads(body)
    if document["version"] != _SNAPSHOT_VERSION:
        raise ValueError(f"snapshot version {document['version']!r}")
    pods = tuple(PodState(
        endpoint=str(p["endpoint"]), scraped_at=float(p["scraped_at"]), waiting=float(p["waiting"]),
        running=float(p["running"]), kv_usage=math.nan if p["kv_usage"] is None else float(p["kv_usage"]),
        prefix_queries=float(p["prefix_queries"]), prefix_hits=float(p["prefix_hits"]),
        running_adapters=frozenset(map(str, p["running_adapters"])),
        waiting_adapters=frozenset(map(str, p["waiting_adapters"])),
        max_lora=int(p["max_lora"]), models=frozenset(map(str, p["models"])),
    ) for p in document["pods"])
    return _Snapshot(float(document["round_started"]), pods)


class _NodeFile:
    """The snapshot file and its lock, as one worker holds them (sync: each call is a syscall or
    two on a file of a few KiB, cheaper than handing it to a thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")
        self.leader = False
        self._loaded: tuple[int, int, int] | None = None
        self._lock_fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        if os.fstat(self._lock_fd).st_uid != os.getuid():
            os.close(self._lock_fd)
            raise PermissionError(f"{self.lock_path} belongs to another user: pod state is not shared through it")

    def close(self) -> None:
        """Release the lock (another worker becomes the scraper)."""
        os.close(self._lock_fd)

    def try_lead(self) -> bool:
        """Take the node's scraper lock if it is free; once held, it is held until ``close``."""
        if not self.leader:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            self.leader = True
            log.info("this worker (pid %d) now scrapes the node's pods into %s", os.getpid(), self.path)
        return True

    def load_if_changed(self) -> _Snapshot | None:
        """The file's snapshot when it changed since the last load or write, else None."""
        try:
            seen = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return None
        if _identity(seen) == self._loaded:
            return None
        if not stat.S_ISREG(seen.st_mode) or seen.st_uid != os.getuid():
            log.warning("%s is not a file of this user: ignored", self.path)
            self._loaded = _identity(seen)
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as file:
                self._loaded = _identity(os.fstat(file.fileno()))
                body = file.read()
        except OSError as err:
            log.warning("cannot read the pod snapshot %s: %s", self.path, err)
            return None
        try:
            return _decode(body)
        except (ValueError, KeyError, TypeError) as err:
            log.warning("the pod snapshot %s is malformed (%s): ignored", self.path, err)
            return None

    def write(self, snapshot: _Snapshot) -> None:
        """Replace the file atomically (a reader sees the old snapshot or the new one)."""
        fd, temp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(_encode(snapshot))
                written = os.fstat(file.fileno())
            os.replace(temp, self.path)
        except OSError:
            os.unlink(temp)
            raise
        self._loaded = _identity(written)  # no need to read back what this worker wrote


def _identity(seen: os.stat_result) -> tuple[int, int, int]:
    # Each write is a new inode: with mtime and size, a changed file differs even on coarse clocks.
    return seen.st_ino, seen.st_mtime_ns, seen.st_size


# -- scraping (the shell) ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _ScrapeFailed:
    """A request to a pod that did not answer 2xx in time, and how."""

    reason: str

    def __str__(self) -> str:
        return self.reason


async def _fetch(session: aiohttp.ClientSession, url: str) -> bytes | _ScrapeFailed:
    try:
        async with session.get(url) as response:
            if not 200 <= response.status < 300:
                return _ScrapeFailed(f"HTTP {response.status}")
            return await response.read()
    except TimeoutError:  # aiohttp's timeouts are TimeoutErrors
        return _ScrapeFailed("timed out")
    except (aiohttp.ClientError, OSError) as err:
        return _ScrapeFailed(str(err) or type(err).__name__)


MODELS_EVERY = 10  # rounds between two reads of a pod's /v1/models (its adapters change rarely)


class _Scraper:
    """One round: every pod's /metrics (and every ``MODELS_EVERY`` rounds, or while unknown, its
    /v1/models), concurrently; logs a pod's failures once."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        self._failing: set[str] = set()
        self._rounds = 0

    async def round(self, targets: Mapping[str, EngineProfile], known: Mapping[str, PodState]
                    ) -> dict[str, PodState]:
        """The new state of each pod (by endpoint, read with its engine's profile); a pod that
        failed keeps its known state, which ages."""
        self._rounds += 1
        endpoints = tuple(targets)
        fresh = await asyncio.gather(*(self._scrape(ep, targets[ep], known.get(ep)) for ep in endpoints))
        pods: dict[str, PodState] = {}
        for endpoint, state in zip(endpoints, fresh, strict=True):
            if state is None:
                state = known.get(endpoint)
            if state is not None:
                pods[endpoint] = state
        return pods

    async def _scrape(self, endpoint: str, profile: EngineProfile, known: PodState | None) -> PodState | None:
        metrics_url = f"http://{endpoint}/metrics"
        if known is None or not known.models or self._rounds % MODELS_EVERY == 1:
            metrics, models = await asyncio.gather(_fetch(self._session, metrics_url),
                                                   _fetch(self._session, f"http://{endpoint}{profile.models_path}"))
        else:
            metrics, models = await _fetch(self._session, metrics_url), _ScrapeFailed("not asked")
        scraped_at = time.time()
        if isinstance(metrics, _ScrapeFailed):
            self._failed(endpoint, f"/metrics failed ({metrics})")
            return None
        ids = None if isinstance(models, _ScrapeFailed) else parse_models(models)
        if ids is None:  # the load is still worth having; a model list rarely changes
            ids = known.models if known is not None else frozenset()
        state = parse_metrics(endpoint, metrics.decode("utf-8", "replace"), scraped_at, ids, profile)
        if state is None:
            flag = f" (is it started with {profile.metrics_flag}?)" if profile.metrics_flag else ""
            self._failed(endpoint, f"/metrics has none of {profile.name}'s load metrics "
                               f"({', '.join(profile.waiting + profile.running)}){flag}")
            return None
        if endpoint in self._failing:
            self._failing.discard(endpoint)
            log.info("pod %s: /metrics answers again", endpoint)
        return state

    def _failed(self, endpoint: str, why: str) -> None:
        if endpoint not in self._failing:
            self._failing.add(endpoint)
            log.warning("pod %s: %s; it is unknown (never idle) until it answers", endpoint, why)


async def gather_forever(targets: Callable[[], Mapping[str, EngineProfile]], path: Path, interval_s: float,
                         states: PodStates, timeout_s: float | None = None) -> None:
    """Keep ``states`` filled from the node's snapshot at ``path``, scraping the pods of
    ``targets()`` (each read with its engine's profile) whenever this worker holds the node's lock
    (see the module doc). Workers that share ``path`` must watch the same pods
    (``default_state_path`` makes sure of it)."""
    if interval_s <= 0:
        raise ValueError("interval_s must be > 0")
    timeout = aiohttp.ClientTimeout(total=min(interval_s, 1.0) if timeout_s is None else timeout_s)
    node = _NodeFile(path)
    known: dict[str, PodState] = {}
    round_started = 0.0
    try:
        # Keep-alive: each pod is asked twice per interval; a dead socket fails one round only.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            scraper = _Scraper(session)
            while True:
                loaded = node.load_if_changed()
                if loaded is not None:
                    known = {pod.endpoint: pod for pod in loaded.pods}
                    round_started = loaded.round_started
                    states.update(loaded.pods)
                wait = interval_s
                if node.try_lead():
                    # min(): a wall clock stepped back must not hold the next round off for long.
                    wait = min(round_started + interval_s - time.time(), interval_s)
                    if wait <= 0:
                        round_started = time.time()
                        known = await scraper.round(targets(), known)
                        try:
                            node.write(_Snapshot(round_started, tuple(known.values())))
                        except OSError as err:
                            log.warning("cannot write the pod snapshot %s: %s", node.path, err)
                        states.update(known.values())
                        wait = round_started + interval_s - time.time()
                await asyncio.sleep(max(wait, 0.0))
    finally:
        node.close()
