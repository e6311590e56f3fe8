"""``GET /v1/models`` and ``/v1/models/{name}``: every name a client may use. Pure."""

from __future__ import annotations

import orjson

from extproc.config import GatewayConfig, Model


def model_card(name: str, model: Model) -> dict[str, object]:
    """One model (or alias) as OpenAI lists it, with vLLM's ``root`` and ``max_model_len``."""
    card: dict[str, object] = {"id": name, "object": "model", "created": 0, "owned_by": model.owned_by}
    if name != model.name:
        card["root"] = model.name  # an alias: vLLM's field for the model it serves
    if model.max_model_len:
        card["max_model_len"] = model.max_model_len
    return card


def models_list(config: GatewayConfig) -> bytes:
    """The list body: canonical names first, then aliases (built once per config snapshot)."""
    cards = [model_card(m.name, m) for m in config.models]
    cards += [model_card(alias, m) for m in config.models for alias in m.aliases]
    return orjson.dumps({"object": "list", "data": cards})
