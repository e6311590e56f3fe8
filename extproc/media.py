"""Media headers: an image's size and an audio clip's duration, read from their first bytes.

Pure, and no Pillow or audio library: a ``ByteSource`` gives random access to a payload, and over
base64 text (``Base64Bytes``, a ``data:`` URL's payload or ``input_audio.data``) it decodes only
the few 4-character groups a header needs, so sizing a megabyte image costs microseconds.
Images: PNG, GIF, WebP (VP8, VP8L, VP8X) and JPEG. Audio: WAV from its header, else (mp3, or a
WAV without a readable header) estimated from the payload's size. ``extproc.tokens`` turns sizes
and durations into tokens.
"""

from __future__ import annotations

import binascii
import struct
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import unquote_to_bytes

# mp3 has no duration in a fixed header; assume a constant 128 kbit/s (the common default).
MP3_BITS_PER_SECOND = 128_000
# A WAV whose header cannot be read: 16 kHz, 16-bit mono PCM (speech-model input) = 32000 B/s.
WAV_FALLBACK_BYTES_PER_SECOND = 32_000


# ---------------------------------------------------------------------------------------------
# Payloads


class ByteSource(Protocol):
    """Random access to a payload's bytes (``size`` bytes long) without materialising it."""

    @property
    def size(self) -> int:
        """Length of the payload in bytes."""
        ...

    def read(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``offset`` (fewer at the end)."""
        ...


@dataclass(frozen=True, slots=True)
class RawBytes:
    """A ``ByteSource`` over bytes in memory."""

    data: bytes

    @property
    def size(self) -> int:
        """Length of ``data``."""
        return len(self.data)

    def read(self, offset: int, length: int) -> bytes:
        """A slice of ``data``."""
        return self.data[offset:offset + length]


class Base64Bytes:
    """A ``ByteSource`` over base64 text that decodes only the 4-character groups it is asked
    for (RFC 4648 section 4: every 4 characters encode 3 bytes), so reading a header of a
    megabyte image costs microseconds."""

    __slots__ = ("_text", "size")

    def __init__(self, text: str) -> None:
        if " " in text or "\n" in text or "\r" in text or "\t" in text:
            text = "".join(text.split())  # MIME-style line breaks would shift the offsets
        self._text = text
        self.size = len(text.rstrip("=")) * 3 // 4  # 6 bits per character, padding or not

    def read(self, offset: int, length: int) -> bytes:
        """Decode the groups covering ``[offset, offset + length)``; b'' if not base64."""
        first = offset // 3
        last = -(-(offset + length) // 3)
        groups = self._text[first * 4:last * 4]
        try:
            chunk = binascii.a2b_base64(groups + "=" * (-len(groups) % 4))
        except binascii.Error:
            return b""
        start = offset - first * 3
        return chunk[start:start + length]


def data_url_bytes(url: str) -> ByteSource | None:
    """The payload of a ``data:`` URL (RFC 2397): base64 or percent-encoded; None if malformed."""
    header, comma, payload = url.partition(",")
    if not comma:
        return None
    if header.endswith(";base64"):
        return Base64Bytes(payload)
    return RawBytes(unquote_to_bytes(payload))



# ---------------------------------------------------------------------------------------------
# Images


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers carry the size: C0-CF except DHT (C4), JPG (C8) and DAC (CC).
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_JPEG_STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01}
_MAX_SEGMENTS = 256


def image_size(source: ByteSource) -> tuple[int, int] | None:
    """``(width, height)`` from a PNG, GIF, WebP or JPEG header; None if unrecognised."""
    head = source.read(0, 32)
    size: tuple[int, int] | None
    if head.startswith(_PNG_SIGNATURE) and head[12:16] == b"IHDR" and len(head) >= 24:
        size = struct.unpack(">II", head[16:24])  # PNG spec 11.2.2: IHDR width, height
    elif head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 10:
        size = struct.unpack("<HH", head[6:10])  # GIF89a 18: logical screen width, height
    elif head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        size = _webp_size(head)
    elif head[:2] == b"\xff\xd8":
        size = _jpeg_size(source)
    else:
        return None
    if size is None or size[0] <= 0 or size[1] <= 0:
        return None
    return size[0], size[1]


def _webp_size(head: bytes) -> tuple[int, int] | None:
    """WebP container (RFC 9649): the first chunk is VP8, VP8L or VP8X."""
    if len(head) < 30:
        return None
    chunk = head[12:16]
    if chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
        # RFC 6386 9.1: after the 3-byte frame tag and start code, 14-bit width and height.
        width, height = struct.unpack("<HH", head[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and head[20] == 0x2F:
        # RFC 9649 3.2: 14 bits width - 1, 14 bits height - 1 after the 0x2f signature.
        bits = int.from_bytes(head[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        # RFC 9649 2.7: 4 bytes of flags, then 24-bit canvas width - 1 and height - 1.
        return int.from_bytes(head[24:27], "little") + 1, int.from_bytes(head[27:30], "little") + 1
    return None


def _jpeg_size(source: ByteSource) -> tuple[int, int] | None:
    """Walk JPEG segments (ITU T.81 B.1) to the first start-of-frame; read height, width."""
    pos = 2
    for _ in range(_MAX_SEGMENTS):
        segment = source.read(pos, 9)
        if len(segment) < 4 or segment[0] != 0xFF:
            return None
        marker = segment[1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker in _JPEG_STANDALONE:
            pos += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image / start of scan before any frame header
            return None
        if marker in _JPEG_SOF:
            if len(segment) < 9:
                return None
            height, width = struct.unpack(">HH", segment[5:9])
            return width, height
        pos += 2 + int.from_bytes(segment[2:4], "big")
    return None



# ---------------------------------------------------------------------------------------------
# Audio


def audio_duration(source: ByteSource, audio_format: str) -> float:
    """Seconds of audio: from the WAV header, else estimated from the size (WAV at 32000 B/s,
    mp3 at 128 kbit/s)."""
    if audio_format == "wav":
        seconds = wav_duration(source)
        if seconds is not None:
            return seconds
        return source.size / WAV_FALLBACK_BYTES_PER_SECOND
    return source.size * 8 / MP3_BITS_PER_SECOND


def wav_duration(source: ByteSource) -> float | None:
    """Duration of a RIFF/WAVE file: ``data`` chunk bytes / the ``fmt `` chunk's byte rate.
    A data size of 0 or 0xFFFFFFFF (streamed WAV) or past the end means "to the end"."""
    head = source.read(0, 12)
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    pos, byte_rate = 12, 0
    for _ in range(_MAX_SEGMENTS):
        chunk = source.read(pos, 8)
        if len(chunk) < 8:
            return None
        size = int.from_bytes(chunk[4:8], "little")
        if chunk[:4] == b"fmt ":
            fmt = source.read(pos + 8, 12)
            if len(fmt) < 12:
                return None
            byte_rate = int.from_bytes(fmt[8:12], "little")  # fmt: format, channels, rate, byte rate
        elif chunk[:4] == b"data":
            if byte_rate <= 0:
                return None
            available = max(0, source.size - pos - 8)
            if size == 0 or size == 0xFFFFFFFF or size > available:
                size = available
            return size / byte_rate
        pos += 8 + size + (size & 1)  # RIFF chunks are padded to an even length
    return None
