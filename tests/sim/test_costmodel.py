"""The step-time formula and the capacity arithmetic of the GPU cost model."""

from __future__ import annotations

import pytest

from llmgw_sim.costmodel import CostParams

PARAMS = CostParams(decode_base_s=0.010, decode_per_seq_s=0.001, prefill_per_token_s=0.0001,
                    kv_cache_tokens=1000, block_size=16)


@pytest.mark.parametrize(
    ("batch_size", "prefill_tokens", "expected_s"),
    [
        pytest.param(0, 0, 0.0, id="idle step costs nothing"),
        pytest.param(1, 0, 0.011, id="one decode: base + one increment"),
        pytest.param(10, 0, 0.020, id="ten decodes: base + 10 increments"),
        pytest.param(1, 1000, 0.111, id="one admission: 1000 prefill tokens add 100 ms"),
        pytest.param(4, 250, 0.039, id="mixed: 10 + 4 + 25 ms"),
    ],
)
def test_step_time(batch_size: int, prefill_tokens: int, expected_s: float) -> None:
    assert PARAMS.step_time(batch_size, prefill_tokens) == pytest.approx(expected_s)


@pytest.mark.parametrize(
    ("tokens", "blocks"),
    [
        pytest.param(1, 1, id="a partial block still takes a block"),
        pytest.param(16, 1, id="exactly one block"),
        pytest.param(17, 2, id="one token spills into a second block"),
        pytest.param(0, 0, id="nothing needs nothing"),
    ],
)
def test_blocks_for(tokens: int, blocks: int) -> None:
    assert PARAMS.blocks_for(tokens) == blocks


def test_num_blocks_rounds_down() -> None:
    assert PARAMS.num_blocks == 62  # 1000 // 16: a partial block cannot be used


def test_defaults_are_a_7b_on_one_a100() -> None:
    params = CostParams()
    # tens of ms per decode step and several thousand prefill tokens/s (see costmodel.py)
    assert 0.005 <= params.step_time(1, 0) <= 0.05
    assert 2000 <= 1 / params.prefill_per_token_s <= 20000
    assert params.max_num_seqs == 256 and params.block_size == 16


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param({"decode_base_s": -1.0}, id="negative time"),
        pytest.param({"max_num_seqs": 0}, id="no sequences"),
        pytest.param({"kv_cache_tokens": 8}, id="less than one block"),
    ],
)
def test_invalid_params(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CostParams(**bad)  # type: ignore[arg-type]
