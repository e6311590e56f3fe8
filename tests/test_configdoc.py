"""The configuration reference is generated from the config models and checked in: it must be current,
cover every model and field, and say what each field means where the source does."""

from __future__ import annotations

from pathlib import Path

from extproc.config import GatewaySpec, PoolSpec
from extproc.configdoc import all_spec_models, comments, main, models_documented, reference

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_the_checked_in_reference_is_current() -> None:
    assert DOC.read_text() == reference(), \
        "docs/configuration.md is stale: run `llmgw config-reference --write docs/configuration.md`"
    assert main(["--check", str(DOC)]) == 0


def test_a_stale_copy_is_caught(tmp_path: Path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(reference().replace("| `ttl_s` |", "| `ttl` |"))
    assert main(["--check", str(stale)]) == 1


def test_every_config_model_and_field_has_its_place() -> None:
    assert all_spec_models() <= models_documented()
    text = reference()
    for name in GatewaySpec.model_fields:
        assert f"| `{name}` |" in text


def test_meanings_come_from_the_comments_beside_each_field() -> None:
    notes = comments(PoolSpec)
    assert "simulate" in notes and "llmgw up" in notes["simulate"]
    text = reference()
    assert "| `workers` | int | `0` | >= 0, <= 256 | 0 = one per core |" in text
    assert "| `pools` | list of [PoolSpec](#poolspec) | **required** |" in text
