"""Prompt expansion: a rendered prompt plus its images and videos -> `ProcessedInput`.

Each `<|image_pad|>` in the prompt becomes `t * h * w / merge²` image pad tokens. Each `<|video_pad|>`
becomes, for a video processor with timestamps (Qwen3-VL's), per temporal patch group,
`<{seconds:.1f} seconds><|vision_start|>` + pad tokens + `<|vision_end|>`, the chat template's
`<|vision_start|>` and `<|vision_end|>` around the whole video dropped — the text transformers'
`Qwen3VLProcessor` produces (4.57, whose text the published models were trained on, and 5.25; the 5.x
releases between kept the outer pair); for one without (Qwen2-VL's, which Qwen2.5-VL's processor uses),
`t * h * w / merge²` video pad tokens, as `Qwen2_5_VLProcessor` writes them. The expanded text is tokenized
as a whole (as there), and each item's pad runs are recorded as its `spans`.

Every item carries its content hash (`mm_cache.hashing.media_hash`). A processed-input cache keyed by
it lets a repeated image or video (same bytes, same settings) skip decoding, resizing and normalising;
concurrent first requests for one (on the HTTP server's preprocessing threads) process it once.

A media item that cannot be used is a `MediaError` whose `param` names where the item is in the request
(`messages[0].content[1]` for a chat message's part, or the `MediaInput`'s own `param`).

A media item may carry a client's `uuid` (vLLM's multimodal UUIDs): the processor remembers which
content hash that uuid named, so a later item with the uuid and no source is the cached item itself,
without its bytes (see `MultimodalProcessor`).

A pixel-free processor (`pixels=False`, a PD decode server's, which never runs the vision tower) reads
only each item's header: image size and EXIF orientation, video frame count, rate and size. Its ids,
grids, spans, timestamps and hashes are the full processor's; its pixels are `meta` tensors.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vlm_serve.mm_cache.cache import MultimodalCache
from vlm_serve.mm_cache.hashing import media_hash
from vlm_serve.multimodal.image_processor import ImageProcessor
from vlm_serve.multimodal.items import MediaTimings, MultimodalItem, ProcessedInput
from vlm_serve.multimodal.media import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageSource,
    MediaAccess,
    MediaError,
    VideoSource,
    decode_image,
    load_image,
    media_part,
    open_image,
    probe_image,
    read_media,
)
from vlm_serve.multimodal.video import VideoProcessor
from vlm_serve.tokenizer import Tokenizer

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
_PLACEHOLDER = re.compile(f"{re.escape(IMAGE_PAD)}|{re.escape(VIDEO_PAD)}")
_IMAGE_OPTIONS = ("min_pixels", "max_pixels")
_VIDEO_OPTIONS = ("min_pixels", "max_pixels", "fps", "max_frames")
MAX_MEDIA_UUIDS = 1 << 16  # uuids remembered (the least recently used are forgotten first)
PartParam = Callable[[int, int], str | None]  # (message i, its part j) -> the part's place in the request


@dataclass
class MediaInput:
    """One image or video of a request with its own preprocessing overrides (keys of `_*_OPTIONS`) and
    the client's `uuid` for it, if any; `source` None refers to media sent before with that uuid.
    `param` is where the item is in the request (`image_data[1]`): a `MediaError` about it names it."""

    source: Any
    options: dict[str, Any] = field(default_factory=dict)
    uuid: str | None = None
    param: str | None = None


def chat_part_param(message: int, part: int) -> str:
    """Where a chat request's content part is, as an error's `param` names it (as OpenAI does)."""
    return f"messages[{message}].content[{part}]"


class MultimodalProcessor:
    """Builds model inputs from prompts and media, equal to the output of the checkpoint's processor in
    transformers (`Qwen3VLProcessor`, `Qwen2_5_VLProcessor`).

    `cache_mb` is the processed-input cache's budget (0 disables it). `pixels` False makes pixel-free
    items (see the module's doc); the cache, the processor's own, then holds only those.

    Media uuids: an item with a `uuid` and a source is processed as any other, and the uuid then names
    its content hash, under its modality and its preprocessing settings (pixel limits, fps, frame
    limits: those in effect for it). An item with a uuid and no source is the processed-input cache's
    item under the content hash its uuid names with the same modality and settings: no fetching,
    decoding or preprocessing, and the same hash, so the same embeddings and prefix cache entries. A
    uuid sent with other settings than before names nothing yet (the bytes are not kept to process
    them again): that, a uuid never sent, or one whose item left the cache (or a cache of 0 MB) is a
    `MediaError` asking for the media again. A uuid sent again with a source names the new content.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        image_processor: ImageProcessor,
        video_processor: VideoProcessor,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        access: MediaAccess = MediaAccess(),
        cache_mb: int = 0,
        pixels: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.video_processor = video_processor
        self.max_image_pixels = max_image_pixels
        self.access = access
        self.pixels = pixels
        self.cache: MultimodalCache[MultimodalItem] = MultimodalCache(cache_mb << 20)
        self.uuids = _UuidIndex(MAX_MEDIA_UUIDS)
        self.image_token_id = _required_token_id(tokenizer, IMAGE_PAD)
        self.video_token_id = _required_token_id(tokenizer, VIDEO_PAD)

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | os.PathLike,
        tokenizer: Tokenizer,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        access: MediaAccess = MediaAccess(),
        cache_mb: int = 0,
        pixels: bool = True,
    ) -> MultimodalProcessor:
        """Processors configured by the checkpoint's `preprocessor_config.json` / `video_preprocessor_config.json`."""
        return cls(
            tokenizer,
            ImageProcessor.from_pretrained(model_dir),
            VideoProcessor.from_pretrained(model_dir, max_frame_pixels=max_image_pixels),
            max_image_pixels=max_image_pixels,
            access=access,
            cache_mb=cache_mb,
            pixels=pixels,
        )

    # -- public entry points -------------------------------------------------------------------------

    def process(
        self,
        prompt: str,
        images: Sequence[ImageSource | MediaInput] = (),
        videos: Sequence[VideoSource | MediaInput] = (),
        *,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        video_min_pixels: int | None = None,
        video_max_pixels: int | None = None,
        fps: float | None = None,
        max_frames: int | None = None,
    ) -> ProcessedInput:
        """Expand and tokenize a rendered `prompt` holding one `<|image_pad|>` / `<|video_pad|>` per item.

        `min_pixels` / `max_pixels` override the image pixel limits, `video_min_pixels` /
        `video_max_pixels` (whole clip) `fps` and `max_frames` the video settings, for every item
        without its own value (a `MediaInput`'s options win).
        """
        image_defaults = _given(min_pixels=min_pixels, max_pixels=max_pixels)
        video_defaults = _given(
            min_pixels=video_min_pixels, max_pixels=video_max_pixels, fps=fps, max_frames=max_frames
        )
        return self._process(
            prompt,
            [_with_defaults(item, image_defaults, _IMAGE_OPTIONS, "image") for item in images],
            [_with_defaults(item, video_defaults, _VIDEO_OPTIONS, "video") for item in videos],
        )

    def process_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        part_param: PartParam = chat_part_param,
        **overrides: Any,
    ) -> ProcessedInput:
        """Render OpenAI-style `messages` with the chat template and process their media.

        Content parts: `{"type": "text", "text": ...}`, `{"type": "image", "image": src}`,
        `{"type": "image_url", "image_url": {"url": src}}` (or a plain string), and the same for
        `video` / `video_url`; `src` is a path, `data:` URL, bytes or (images) a PIL image. A media
        part may carry its own `min_pixels`, `max_pixels` (and for videos `fps`, `max_frames`), and a
        `uuid`: with it, the source may be left out (None or an empty url) to use media sent before.
        `chat_template_kwargs` are more variables for the chat template; `overrides` are `process`'s
        keyword arguments (a part's own options win over them). `part_param(i, j)` names the place of
        message i's part j in the request, for the `param` of a `MediaError` about its media.
        """
        media: dict[str, list[MediaInput]] = {"image": [], "video": []}
        for i, message in enumerate(messages):
            content = message.get("content")
            if isinstance(content, str) or content is None:
                continue
            for j, part in enumerate(content):
                modality = _part_modality(part)
                if modality is None:
                    continue
                param = part_param(i, j)
                with media_part(param):
                    source = _part_source(part, modality)
                options = _part_options(part, _IMAGE_OPTIONS if modality == "image" else _VIDEO_OPTIONS)
                media[modality].append(MediaInput(source, options, _part_uuid(part), param))
        prompt = self.tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(chat_template_kwargs or {}),
        )
        return self.process(prompt, media["image"], media["video"], **overrides)

    # -- internals -----------------------------------------------------------------------------------

    def _process(self, prompt: str, images: list[MediaInput], videos: list[MediaInput]) -> ProcessedInput:
        for token, items, kind in ((IMAGE_PAD, images, "image"), (VIDEO_PAD, videos, "video")):
            if prompt.count(token) != len(items):
                raise ValueError(
                    f"the prompt has {prompt.count(token)} {token} placeholder(s) but {len(items)} {kind}(s) were given"
                )
        image_items = [self._named(self._image_item, item) for item in images]
        video_items = [self._named(self._video_item, item) for item in videos]
        text = self._expand(prompt, image_items, video_items)
        input_ids = self.tokenizer.encode(text)
        self._set_spans(input_ids, self.image_token_id, image_items, self.image_processor.config.merge_size)
        self._set_spans(input_ids, self.video_token_id, video_items, self.video_processor.config.merge_size)
        mm_items = sorted(image_items + video_items, key=lambda item: item.spans[0][0])
        return ProcessedInput(input_ids=input_ids, mm_items=mm_items)

    @staticmethod
    def _named(make: Callable[[MediaInput], MultimodalItem], item: MediaInput) -> MultimodalItem:
        """`make(item)`; a `MediaError` it raises names the item's place in the request."""
        with media_part(item.param):
            return make(item)

    def _image_item(self, item: MediaInput) -> MultimodalItem:
        settings = self.image_processor.config.with_overrides(**item.options)
        if item.source is None:
            return self._by_uuid(item.uuid, "image", settings)
        timings = MediaTimings()
        start = time.perf_counter()
        if isinstance(item.source, Image.Image):
            data = load_image(item.source, self.max_image_pixels)  # upright, as it will be preprocessed
            timings.decode = time.perf_counter() - start
        else:
            data = read_media(item.source, "image", self.access)
            if isinstance(data, Path):
                data = data.read_bytes()  # read once: hashed, then decoded from memory
            timings.fetch = time.perf_counter() - start

        def preprocess() -> MultimodalItem:
            start = probed = time.perf_counter()
            if isinstance(data, Image.Image):
                image = data
            else:
                header = open_image(data, self.max_image_pixels)
                probed = time.perf_counter()
                image = decode_image(header)
            decoded = time.perf_counter()
            processed = self.image_processor.preprocess(image, **item.options)
            timings.probe = probed - start
            timings.decode += decoded - probed
            timings.preprocess = time.perf_counter() - decoded
            return processed

        def describe() -> MultimodalItem:
            start = time.perf_counter()
            width, height = data.size if isinstance(data, Image.Image) else probe_image(data, self.max_image_pixels)
            timings.probe = time.perf_counter() - start
            return self.image_processor.describe(width, height, **item.options)

        return self._remember(
            item.uuid, settings, self._cached(data, "image", settings, timings, preprocess if self.pixels else describe)
        )

    def _video_item(self, item: MediaInput) -> MultimodalItem:
        settings = self.video_processor.config.with_overrides(**item.options)
        if item.source is None:
            return self._by_uuid(item.uuid, "video", settings)
        if not isinstance(item.source, (str, bytes, bytearray, memoryview, os.PathLike)):
            raise MediaError(f"unsupported video source of type {type(item.source).__name__}")
        timings = MediaTimings()
        start = time.perf_counter()
        data = read_media(item.source, "video", self.access)  # a local video is streamed, not read whole
        timings.fetch = time.perf_counter() - start

        def preprocess() -> MultimodalItem:
            processed = self.video_processor.preprocess(data, **item.options, pixels=self.pixels)
            timings.probe, timings.decode = processed.timings.probe, processed.timings.decode
            timings.preprocess = processed.timings.preprocess
            return processed

        return self._remember(item.uuid, settings, self._cached(data, "video", settings, timings, preprocess))

    def _remember(self, uuid: str | None, settings: Any, item: MultimodalItem) -> MultimodalItem:
        """`item`, whose `uuid` (if any) now names its content hash under its modality and `settings`."""
        if uuid is not None:
            self.uuids.put((item.modality, uuid, repr(settings)), item.hash)
        return item

    def _by_uuid(self, uuid: str | None, modality: str, settings: Any) -> MultimodalItem:
        """A fresh item (no spans, its own timings) of the cached media `uuid` names, or a `MediaError`."""
        if uuid is None:
            raise MediaError(f"{modality} content part has neither a source nor a uuid")
        content_hash = self.uuids.get((modality, uuid, repr(settings)))
        cached = self.cache.get(content_hash) if content_hash is not None else None
        if cached is None:
            why = "" if self.cache.budget_bytes else " (this server keeps no processed media: its cache is 0 MB)"
            raise MediaError(
                f"unknown {modality} uuid {uuid!r}: this server holds no {modality} sent with that uuid and these "
                f"preprocessing options{why}, or no longer holds it; send the {modality} again (its url, "
                f"with the uuid)"
            )
        return replace(cached, spans=[], timings=MediaTimings(processor_cache_hit=True))

    def _cached(
        self, data: Any, modality: str, settings: Any, timings: MediaTimings, preprocess: Callable[[], MultimodalItem]
    ) -> MultimodalItem:
        """A fresh item (no spans yet, its own `timings`) for the media `data`, preprocessed only when
        the processed-input cache does not hold its content hash, and by one thread when several ask
        for it at once (the others wait for its result)."""
        start = time.perf_counter()
        key = media_hash(data, modality, settings)
        timings.hash = time.perf_counter() - start
        item, computed = self.cache.get_or_compute(key, lambda: replace(preprocess(), hash=key), _cached_bytes)
        timings.processor_cache_hit = not computed
        return replace(item, spans=[], timings=timings)

    def _expand(self, prompt: str, images: list[MultimodalItem], videos: list[MultimodalItem]) -> str:
        """`prompt` with every placeholder replaced by its item's full token text, in order."""
        image_merge = self.image_processor.config.merge_size
        video_merge = self.video_processor.config.merge_size
        replacements = {
            IMAGE_PAD: iter(IMAGE_PAD * item.num_tokens(image_merge) for item in images),
            VIDEO_PAD: iter(self._video_text(item, video_merge) for item in videos),
        }
        if self.video_processor.timestamps:
            # each group of a video's frames comes in a <|vision_start|> ... <|vision_end|> of its own, so the chat
            # template's pair around the whole video goes, as transformers' Qwen3VLProcessor (4.57, 5.25) drops it
            prompt = prompt.replace(VISION_START + VIDEO_PAD + VISION_END, VIDEO_PAD)
        return _PLACEHOLDER.sub(lambda match: next(replacements[match.group()]), prompt)

    def _video_text(self, item: MultimodalItem, merge_size: int) -> str:
        if not self.video_processor.timestamps:
            return VIDEO_PAD * item.num_tokens(merge_size)
        _, height, width = item.grid_thw
        pads = VIDEO_PAD * (height * width // merge_size**2)
        return "".join(f"<{seconds:.1f} seconds>{VISION_START}{pads}{VISION_END}" for seconds in item.timestamps)

    def _set_spans(self, input_ids: list[int], token_id: int, items: list[MultimodalItem], merge_size: int) -> None:
        """Give each item, in order, its runs of `token_id` (a video's: one per temporal group where the
        prompt sets its groups apart)."""
        positions = np.flatnonzero(np.asarray(input_ids) == token_id)
        if len(positions) != sum(item.num_tokens(merge_size) for item in items):
            raise ValueError(f"the tokenized prompt does not hold the expected number of tokens with id {token_id}")
        cursor = 0
        for item in items:
            groups = item.grid_thw[0] if item.modality == "video" and self.video_processor.timestamps else 1
            run = item.num_tokens(merge_size) // groups
            item.spans = []
            for _ in range(groups):
                start, last = int(positions[cursor]), int(positions[cursor + run - 1])
                if last - start != run - 1:
                    raise ValueError(f"the {item.modality} placeholder tokens were split by tokenization")
                item.spans.append((start, last + 1))
                cursor += run


class _UuidIndex:
    """Thread-safe LRU map from (modality, uuid, settings) to a content hash, of at most `capacity`
    entries; a key put again names its new hash."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[tuple[str, str, str], int] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._hashes)

    def put(self, key: tuple[str, str, str], content_hash: int) -> None:
        with self._lock:
            self._hashes[key] = content_hash
            self._hashes.move_to_end(key)
            while len(self._hashes) > self.capacity:
                self._hashes.popitem(last=False)

    def get(self, key: tuple[str, str, str]) -> int | None:
        with self._lock:
            content_hash = self._hashes.get(key)
            if content_hash is not None:
                self._hashes.move_to_end(key)
            return content_hash


def _cached_bytes(item: MultimodalItem) -> int:
    """The memory a processed item holds: its pixels, or a pixel-free item's grid and timestamps."""
    if item.pixels.is_meta:
        return 256 + 32 * len(item.timestamps or ())
    return item.pixels.nbytes


def _required_token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"the tokenizer has no {token} token; it is not a Qwen VL tokenizer")
    return token_id


def _given(**options: Any) -> dict[str, Any]:
    return {name: value for name, value in options.items() if value is not None}


def _with_defaults(item: Any, defaults: dict[str, Any], allowed: tuple[str, ...], kind: str) -> MediaInput:
    if not isinstance(item, MediaInput):
        return MediaInput(item, dict(defaults))
    unknown = set(item.options) - set(allowed)
    if unknown:
        raise ValueError(f"unknown {kind} option(s): {', '.join(sorted(unknown))}")
    return replace(item, options={**defaults, **item.options})


def _part_modality(part: Any) -> str | None:
    """ "image", "video" or None for a content part, recognised as the chat template does."""
    if not isinstance(part, Mapping):
        raise ValueError(f"message content parts must be objects, got {type(part).__name__}")
    kind = part.get("type")
    if kind in ("image", "image_url") or "image" in part or "image_url" in part:
        return "image"
    if kind in ("video", "video_url") or "video" in part or "video_url" in part:
        return "video"
    return None


def _part_source(part: Mapping[str, Any], kind: str) -> Any:
    """The media of a part: `part[kind]`, or `part[kind + "_url"]` as a string or `{"url": ...}`; None
    (media sent before) for a part with a uuid whose source is missing, None or an empty string."""
    if part.get(kind) is not None:
        return part[kind]
    url = part.get(f"{kind}_url")
    if isinstance(url, Mapping):
        url = url.get("url")
    if _part_uuid(part) is not None and (url is None or url == ""):
        return None
    if url is None:
        raise MediaError(f"{kind} content part has no {kind!r} or {kind + '_url'!r} value")
    return url


def _part_uuid(part: Mapping[str, Any]) -> str | None:
    """A part's `uuid` as a string (vLLM takes any value as its string), or None."""
    uuid = part.get("uuid")
    return None if uuid is None else str(uuid)


def _part_options(part: Mapping[str, Any], allowed: tuple[str, ...]) -> dict[str, Any]:
    return {name: part[name] for name in allowed if part.get(name) is not None}
