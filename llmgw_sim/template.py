"""The simulated model's chat template: messages -> prompt segments (text and media placeholders).

The definition lives in ``extproc.templates``, shared with the gateway's token estimator so that
the gateway and the pod render a prompt identically; this module re-exports the names the
simulator uses. The pod renders with ChatML and counts each image as ``IMAGE_PLACEHOLDER_TOKENS``
and each audio clip as ``AUDIO_PLACEHOLDER_TOKENS`` placeholder tokens.
"""

from __future__ import annotations

from extproc.templates import (
    AUDIO_PLACEHOLDER_TOKENS,
    IM_END,
    IM_START,
    IMAGE_PLACEHOLDER_TOKENS,
    MediaKind,
    Placeholder,
    Segment,
    TemplateError,
    render_chat,
)

__all__ = [
    "AUDIO_PLACEHOLDER_TOKENS",
    "IMAGE_PLACEHOLDER_TOKENS",
    "IM_END",
    "IM_START",
    "MediaKind",
    "Placeholder",
    "Segment",
    "TemplateError",
    "render_chat",
]
