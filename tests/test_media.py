"""Media headers: image sizes (PNG, GIF, WebP, JPEG) and audio durations (WAV, mp3), read from
bytes in memory and through lazy base64, and ``data:`` URLs."""

from __future__ import annotations

import base64
import io
import struct
import wave

import pytest

from extproc.media import Base64Bytes, RawBytes, audio_duration, data_url_bytes, image_size, wav_duration


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---------------------------------------------------------------------------------------------
# Hand-built media headers (just the bytes each parser reads)


def png(width: int, height: int) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I4sII", 13, b"IHDR", width, height) + b"\x08\x02\x00\x00\x00"


def gif(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", width, height) + b"\x00" * 8


def webp_vp8(width: int, height: int) -> bytes:
    frame = b"\x00\x00\x00" + b"\x9d\x01\x2a" + struct.pack("<HH", width, height)
    return b"RIFF" + struct.pack("<I", 30) + b"WEBP" + b"VP8 " + struct.pack("<I", 10) + frame + b"\x00" * 4


def webp_vp8l(width: int, height: int) -> bytes:
    bits = (width - 1) | (height - 1) << 14
    lossless = b"\x2f" + struct.pack("<I", bits)
    return b"RIFF" + struct.pack("<I", 30) + b"WEBPVP8L" + struct.pack("<I", 5) + lossless + b"\x00" * 6


def webp_vp8x(width: int, height: int) -> bytes:
    canvas = (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    flags = b"\x00" * 4
    return b"RIFF" + struct.pack("<I", 30) + b"WEBPVP8X" + struct.pack("<I", 10) + flags + canvas + b"\x00" * 4


def jpeg(width: int, height: int, *, exif_bytes: int = 0, fill: bool = False) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00" + b"\x00" * 9
    app1 = b"\xff\xe1" + struct.pack(">H", exif_bytes + 2) + b"\x00" * exif_bytes if exif_bytes else b""
    sof = (b"\xff" if fill else b"") + b"\xff\xc2" + struct.pack(">HBHH", 17, 8, height, width) + b"\x00" * 12
    return b"\xff\xd8" + app0 + app1 + sof + b"\xff\xda"


@pytest.mark.parametrize(
    ("data", "size"),
    [
        pytest.param(png(1920, 1080), (1920, 1080), id="png"),
        pytest.param(gif(320, 200), (320, 200), id="gif"),
        pytest.param(webp_vp8(1000, 750), (1000, 750), id="webp lossy"),
        pytest.param(webp_vp8l(16383, 1), (16383, 1), id="webp lossless, 14-bit extremes"),
        pytest.param(webp_vp8x(5000, 3000), (5000, 3000), id="webp extended (24-bit canvas)"),
        pytest.param(jpeg(640, 480), (640, 480), id="jpeg progressive SOF2"),
        pytest.param(jpeg(4032, 3024, exif_bytes=60000), (4032, 3024), id="jpeg behind a 60 KB EXIF"),
        pytest.param(jpeg(10, 20, fill=True), (10, 20), id="jpeg with a fill byte"),
        pytest.param(png(0, 10), None, id="zero width is no size"),
        pytest.param(png(100, 100)[:20], None, id="truncated png"),
        pytest.param(b"\xff\xd8\xff\xda", None, id="jpeg scan before any frame"),
        pytest.param(b"\xff\xd8\x00\x00", None, id="jpeg garbage after SOI"),
        pytest.param(b"BM" + b"\x00" * 40, None, id="bmp is not recognised"),
        pytest.param(b"", None, id="empty"),
    ],
)
def test_image_size_from_headers(data: bytes, size: tuple[int, int] | None) -> None:
    assert image_size(RawBytes(data)) == size
    assert image_size(Base64Bytes(b64(data))) == size  # same through lazy base64


@pytest.mark.parametrize("fmt", ["PNG", "GIF", "JPEG", "WEBP"])
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_image_size_of_real_files(fmt: str, mode: str) -> None:
    from PIL import Image  # a dev dependency (via matplotlib): missing, this fails; the parsers use none

    buffer = io.BytesIO()
    Image.new(mode, (123, 45)).save(buffer, format=fmt)
    assert image_size(Base64Bytes(b64(buffer.getvalue()))) == (123, 45)


@pytest.mark.parametrize(
    ("text", "start", "length"),
    [
        pytest.param("aGVsbG8gd29ybGQ=", 0, 5, id="aligned"),
        pytest.param("aGVsbG8gd29ybGQ=", 4, 4, id="mid-group start"),
        pytest.param("aGVsbG8gd29ybGQ=", 9, 10, id="past the end: short read"),
        pytest.param("aGVs\nbG8g\nd29y\nbGQ=", 2, 6, id="MIME line breaks"),
        pytest.param("aGVsbG8gd29ybGQ", 6, 5, id="missing padding"),
    ],
)
def test_base64_reads_any_window(text: str, start: int, length: int) -> None:
    source = Base64Bytes(text)
    assert source.read(start, length) == b"hello world"[start:start + length]
    assert source.size == 11


def test_data_urls() -> None:
    assert data_url_bytes("data:,A%20b").read(0, 3) == b"A b"  # RFC 2397 percent-encoding
    assert data_url_bytes("data:image/png;base64,aGk=").read(0, 2) == b"hi"  # type: ignore[union-attr]
    assert data_url_bytes("data:image/png;base64") is None  # no comma: malformed


# ---------------------------------------------------------------------------------------------
# Audio (hand-built WAV files)


def wav_bytes(seconds: float, rate: int = 16000, channels: int = 1, width: int = 2) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(width)
        out.setframerate(rate)
        out.writeframes(b"\x00" * int(seconds * rate) * channels * width)
    return buffer.getvalue()


def with_list_chunk(data: bytes) -> bytes:
    """Insert a LIST chunk of odd length (so followed by a pad byte) between ``fmt `` and ``data``."""
    info = b"INFOISFT" + struct.pack("<I", 3) + b"ab\x00"
    chunk = b"LIST" + struct.pack("<I", len(info)) + info + b"\x00"
    return data[:36] + chunk + data[36:]


def streamed(data: bytes) -> bytes:
    """Mark the data size unknown (0xFFFFFFFF), as streaming encoders do."""
    return data[:40] + b"\xff\xff\xff\xff" + data[44:]


@pytest.mark.parametrize(
    ("data", "seconds"),
    [
        pytest.param(wav_bytes(1.0), 1.0, id="16 kHz mono 16-bit"),
        pytest.param(wav_bytes(2.5, rate=44100, channels=2), 2.5, id="44.1 kHz stereo"),
        pytest.param(with_list_chunk(wav_bytes(0.5)), 0.5, id="LIST chunk before data"),
        pytest.param(streamed(wav_bytes(3.0, rate=8000)), 3.0, id="streamed: size to the end"),
        pytest.param(b"RIFF\x00\x00\x00\x00WAVEdata\x04\x00\x00\x00", None, id="data before fmt"),
        pytest.param(b"ID3\x03" + b"\x00" * 20, None, id="not a wav"),
    ],
)
def test_wav_duration(data: bytes, seconds: float | None) -> None:
    assert wav_duration(Base64Bytes(b64(data))) == (None if seconds is None else pytest.approx(seconds))


@pytest.mark.parametrize(
    ("data", "fmt", "seconds"),
    [
        pytest.param(wav_bytes(2.0), "wav", 2.0, id="wav from its header"),
        pytest.param(b"\x00" * 64000, "wav", 2.0, id="headerless wav: 32000 B/s"),
        pytest.param(b"\x00" * 32000, "mp3", 2.0, id="mp3: 128 kbit/s = 16000 B/s"),
    ],
)
def test_audio_duration(data: bytes, fmt: str, seconds: float) -> None:
    assert audio_duration(Base64Bytes(b64(data)), fmt) == pytest.approx(seconds, rel=1e-3)
