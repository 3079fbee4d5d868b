"""What the parts ask the engine: distinct text prompts, and a 1024 x 1024 picture as a user uploads it."""

from __future__ import annotations

import io


def text_prompts(engine, count: int, first: int = 0, length: int = 32) -> list:
    """`count` distinct text prompts of about `length` tokens (no prefix shared past the template), the
    `first`th on."""
    words = "red green blue circle square star moves left right top bottom small large".split()
    conversations = [
        [{"role": "user", "content": f"{i}: " + " ".join(words[(i * 7 + j) % len(words)] for j in range(length))}]
        for i in range(first, first + count)
    ]
    return [engine.processor.process_messages(c, add_generation_prompt=True) for c in conversations]


def jpeg_upload(seed: int, side: int = 1024) -> bytes:
    """A `side` x `side` picture as a user sends it: a JPEG file's bytes."""
    from vlm_serve.testing.media import make_image

    buffer = io.BytesIO()
    make_image(side, side, seed=seed).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def picture_prompt(engine, upload: bytes):
    """`upload` asked about: decoded, preprocessed and tokenized as the server does."""
    content = [{"type": "image", "image": upload}, {"type": "text", "text": "Describe it."}]
    return engine.processor.process_messages([{"role": "user", "content": content}], add_generation_prompt=True)
