"""The Unicode ranges of Chinese, Japanese and Korean script, defined once for every text feature.

These scripts put no spaces between words, so the lexical features treat their characters one
by one (the hashing embedder of ``extproc.routing.embedders``, the tokens and guard of
``extproc.cache.semantic``), and the routing rules' ``language`` feature names the script
(``extproc.routing.features``). Each range is a fragment of a regex character class, as in
``re.compile(f"[{HAN}]")``.
"""

from __future__ import annotations

import re

KANA = "\u3040-\u30ff"  # Hiragana and Katakana
HAN_EXT_A = "\u3400-\u4dbf"  # CJK Unified Ideographs Extension A (rarer Chinese characters)
HAN = "\u4e00-\u9fff"  # CJK Unified Ideographs
HANGUL = "\uac00-\ud7af"  # Hangul Syllables
CJK = KANA + HAN_EXT_A + HAN + HANGUL  # all four
CJK_CHAR = re.compile(f"[{CJK}]")  # one character of any of them
