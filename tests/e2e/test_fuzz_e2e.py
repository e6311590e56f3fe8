"""A seeded slice of `python -m bench.fuzz` through the real stack: every answer documented."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

from bench.fuzz import (
    DEFAULT_SEED,
    FAST_POD_ARGS,
    KEY_ENV,
    check_slots,
    dead_children,
    fuzz_config,
    generate_cases,
    run_cases,
    slow_pod,
)
from tests.e2e.conftest import small_stack

CASES = 300


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[Any]]]:
    """The fuzz stack: two instant pods and two extproc workers, plus the real-time pod of the slot check."""
    with slow_pod(tmp_path_factory.mktemp("fuzz-slow-pod")) as (slow, slow_group):
        stack = small_stack(tmp_path_factory, "fuzz", pods=2, extra_config=fuzz_config(slow), workers=2,
                            sim_args=FAST_POD_ARGS, env=KEY_ENV)
        with stack as info:
            yield info.base_url, [stack.group, slow_group]


def test_every_fuzz_case_gets_a_documented_answer(fuzzed: tuple[str, list[Any]]) -> None:
    base_url, groups = fuzzed
    tally = asyncio.run(run_cases(base_url, generate_cases(DEFAULT_SEED, CASES), seed=DEFAULT_SEED, timeout=10))
    report = tally.report()
    violations = report["violations"]
    assert violations == 0, (f"{violations} violations of {tally.cases} cases, by kind:\n"
                             + json.dumps(report["violation_kinds"], indent=1, ensure_ascii=False))
    assert tally.cases == CASES
    assert not dead_children(*groups)


def test_no_quota_slot_leaks_after_fuzzing(fuzzed: tuple[str, list[Any]]) -> None:
    base_url, groups = fuzzed
    result = asyncio.run(check_slots(base_url))
    assert result["ok"], result  # all SLOT_LIMIT streams held at once, and the next one refused
    assert not dead_children(*groups)
