"""``llmgw route --calibrate``: cross-validation over a config's own examples, and overlap warnings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from extproc.routing.calibrate import calibrate
from extproc.routing.embedders import HashingEmbedder
from extproc.routing.intents import Intent, IntentIndex

COOKING = Intent("cooking", ("cook pasta for dinner", "cook rice for dinner", "cook eggs for dinner",
                             "bake bread for dinner"), "m", "p")
CODE = Intent("code", ("fix my python loop", "fix my python class", "debug my python code", "fix my python error"),
              "m", "p")
PYTHON = Intent("python", ("my python loop error", "fix my python code", "fix python class", "debug my python loop"),
                "m", "p")


def test_held_out_examples_find_their_intents_when_the_intents_are_apart() -> None:
    result = calibrate(IntentIndex([COOKING, CODE], HashingEmbedder(), threshold=0.0, margin=0.0))
    assert result.examples == 8 and result.per_intent == {"cooking": 1.0, "code": 1.0}
    assert result.accuracy == 1.0 and not result.overlaps and not result.warnings


def test_two_intents_saying_the_same_are_named_as_overlapping() -> None:
    result = calibrate(IntentIndex([COOKING, CODE, PYTHON], HashingEmbedder(), threshold=0.0, margin=0.0))
    assert result.per_intent["cooking"] == 1.0 and result.accuracy < 1.0
    (overlap,) = result.overlaps
    assert (overlap.first, overlap.second) == ("code", "python") and overlap.crossed >= 1
    assert any("'code' and 'python' overlap" in line for line in result.warnings)


def test_the_description_is_never_held_out_and_a_high_threshold_sends_examples_to_the_default() -> None:
    described = Intent(COOKING.name, COOKING.examples, "m", "p", description="cooking food at home")
    result = calibrate(IntentIndex([described, CODE], HashingEmbedder(), threshold=0.99))
    assert result.examples == 8 and result.to_default == 8 and result.accuracy == 0.0


def test_a_held_out_example_still_meets_its_intents_description() -> None:
    # Held out of a one-example intent, only the description is left of its prototype.
    lonely = Intent("breakfast", ("boil an egg for breakfast",), "m", "p")
    described = Intent("breakfast", lonely.examples, "m", "p", description="eggs for breakfast")
    bare = calibrate(IntentIndex([lonely, CODE], HashingEmbedder(), threshold=0.0, margin=0.0, scoring="centroid"))
    helped = calibrate(IntentIndex([described, CODE], HashingEmbedder(), threshold=0.0, margin=0.0,
                                   scoring="centroid"))
    assert (bare.per_intent["breakfast"], helped.per_intent["breakfast"]) == (0.0, 1.0)


@pytest.mark.parametrize("scoring", ["centroid", "nearest"])
def test_a_held_out_example_scores_as_a_new_prompt_would(scoring: str) -> None:
    # Held out of a one-example intent, the intent has nothing left: the example goes elsewhere.
    lonely = Intent("lonely", ("boil an egg for breakfast",), "m", "p")
    result = calibrate(IntentIndex([lonely, CODE], HashingEmbedder(), threshold=0.0, margin=0.0,
                                   scoring=scoring))  # type: ignore[arg-type]
    assert result.per_intent["lonely"] == 0.0


def test_the_cli_prints_the_expected_accuracy_as_json(tmp_path: Path) -> None:
    config = tmp_path / "llmgw.yaml"
    config.write_text(yaml.safe_dump({
        "pools": [{"name": "p", "endpoints": ["127.0.0.1:1"]}],
        "models": [{"name": "a", "pool": "p"}, {"name": "d", "pool": "p"}],
        "intents": {"embedder": {"kind": "hashing"}, "default": {"model": "d"},
                    "routes": [{"name": i.name, "model": "a", "examples": list(i.examples)}
                               for i in (COOKING, CODE, PYTHON)]}}))
    out = subprocess.run([sys.executable, "-m", "extproc.cli", "route", "--calibrate", "--config", str(config),
                          "--format", "json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["examples"] == 12 and 0 < result["accuracy"] < 1
    assert any("overlap" in line for line in result["warnings"])
    table = subprocess.run([sys.executable, "-m", "extproc.cli", "route", "--calibrate", "--config", str(config)],
                           capture_output=True, text=True, timeout=120)
    assert table.returncode == 0 and "expected accuracy" in table.stdout
