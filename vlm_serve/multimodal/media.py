"""Loading images and videos from what a request carries: bytes, local paths, `data:` URLs, PIL images.

Every problem with the media itself (empty or undecodable data, a missing file, an unsupported URL,
a picture over the pixel limit, ...) is raised as `MediaError`, a 400 (`BadRequest`, a `ValueError`)
whose message names the problem and whose `param` names the part of the request that holds the media
(`media_part` sets it); decoder exceptions never escape.

A picture's pixel count is read from its header and checked against the caller's limit (by default
Pillow's own threshold) before any pixel is decoded. Images are opened without Pillow's check of the
size their header states (`Image.MAX_IMAGE_PIXELS`), which would refuse first in its own words and at
its own limit; its checks of what decoding finds beyond the header (an ICO's embedded image, a TIFF's
tiles) stay, at no less than the caller's limit.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from PIL import Image, ImageOps, UnidentifiedImageError

from vlm_serve.config import DEFAULT_MAX_IMAGE_PIXELS
from vlm_serve.errors import MediaError

MAX_IMAGE_PIXELS_FLAG = "--max-image-pixels"
_EXIF_ORIENTATION = 0x0112
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)  # turned or mirrored about a diagonal: width and height swap
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_EXIF_CHUNKS = (b"IHDR", b"eXIf", b"tEXt", b"zTXt", b"iTXt")  # the header, and where Pillow finds EXIF
_PNG_IMAGE_DATA = (b"IDAT", b"fdAT")
_DATA_URL_MEDIA_TYPES = {"image": ("image/",), "video": ("video/",)}
_GENERIC_MEDIA_TYPE = "application/octet-stream"
_URL_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
DEFAULT_MAX_FETCH_BYTES = 64 << 20
# Pillow's own check fires (at twice a limit no lower than the caller's) only for what its header does not state
_LARGER_THAN_STATED = "image holds more pixels than its header states: refused as a decompression bomb"
FRAME_LIST_MEDIA_TYPE = "video/jpeg"  # vLLM's video as still frames: data:video/jpeg;base64,<frame>,<frame>,...

ImageSource = str | os.PathLike | bytes | bytearray | memoryview | Image.Image
VideoSource = str | os.PathLike | bytes | bytearray | memoryview


@contextmanager
def media_part(param: str | None) -> Iterator[None]:
    """A `MediaError` raised inside names `param` (where the media is in the request, e.g.
    `messages[0].content[1]`), unless it names a part already. A new error is raised: the one caught
    may be shared by requests waiting for the same media (`MultimodalCache.get_or_compute`)."""
    try:
        yield
    except MediaError as exc:
        if param is None or exc.param is not None:
            raise
        raise MediaError(exc.message, param=param) from exc


class FrameList(tuple):
    """A video sent as its frames, each an encoded still image (bytes), in order: what
    `data:video/jpeg;base64,<frame>,<frame>,...` (vLLM's format) holds. `vision.video` reads it as a
    clip at `FRAME_LIST_FPS` frames per second."""


@dataclass(frozen=True)
class MediaAccess:
    """Where a request's media may come from, and how large it may be.

    `local_dirs` None allows any local path (the in-process engine); a tuple allows paths inside those
    folders only (empty: none). `domains` are the hosts http(s) URLs may name (empty: no fetching; see
    `vision.fetch`). `max_bytes` bounds every source: data URLs, files and downloads.
    """

    local_dirs: tuple[str, ...] | None = None
    domains: tuple[str, ...] = ()
    max_bytes: int | None = None
    fetch_timeout: float = 10.0


def read_media(
    source: str | os.PathLike | bytes | bytearray | memoryview, kind: str, access: MediaAccess = MediaAccess()
) -> bytes | Path | FrameList:
    """Resolve `source` to raw bytes (bytes, `data:` URL, allowed http(s) URL) or an existing local file
    (path, `file://` URL), within `access`. `kind` ("image" or "video") is used in messages and to check
    a data URL's media type. A video data URL of type `video/jpeg` is a list of frames: a `FrameList`
    (passed through as it is when given)."""
    if isinstance(source, FrameList):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        if not data:
            raise MediaError(f"{kind} data is empty")
        _check_bytes(len(data), kind, access)
        return data
    if isinstance(source, os.PathLike):
        return _local_file(Path(source), kind, access)
    if not isinstance(source, str):
        raise MediaError(f"unsupported {kind} source of type {type(source).__name__}")
    if source.startswith("data:"):
        return _decode_data_url(source, kind, access)
    if source.startswith("file://"):
        return _local_file(Path(source[len("file://") :]), kind, access)
    if source.startswith(("http://", "https://")):
        from vlm_serve.multimodal.fetch import fetch_url  # noqa: PLC0415 - only servers fetch

        max_bytes = access.max_bytes if access.max_bytes is not None else DEFAULT_MAX_FETCH_BYTES
        return fetch_url(source, kind, access.domains, max_bytes, access.fetch_timeout)
    if not source:
        raise MediaError(f"{kind} source is an empty string")
    if _URL_SCHEME.match(source):
        raise MediaError(
            f"unsupported {kind} URL scheme {source.split(':', 1)[0]!r}: use data:, http(s): or a file path"
        )
    return _local_file(Path(source), kind, access)


def _check_bytes(size: int, kind: str, access: MediaAccess) -> None:
    if access.max_bytes is not None and size > access.max_bytes:
        raise MediaError(f"{kind} is too large: {size} bytes exceeds the limit of {access.max_bytes} bytes")


def _decode_data_url(url: str, kind: str, access: MediaAccess) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError(f"malformed data URL for {kind}: no ',' separates the header from the data")
    params = header[len("data:") :].split(";")
    media_type = params[0].strip().lower()
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise MediaError(f"unsupported data URL for {kind}: only base64-encoded data URLs are supported")
    if media_type and media_type != _GENERIC_MEDIA_TYPE and not media_type.startswith(_DATA_URL_MEDIA_TYPES[kind]):
        raise MediaError(f"unsupported data URL for {kind}: media type {media_type!r} is not {kind}/*")
    _check_bytes(len(payload) * 3 // 4 - 2, kind, access)  # before decoding it
    if kind == "video" and media_type == FRAME_LIST_MEDIA_TYPE:
        return _decode_frame_list(payload)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(f"invalid base64 data in {kind} data URL: {exc}") from exc
    if not data:
        raise MediaError(f"{kind} data URL holds no data")
    return data


def _decode_frame_list(payload: str) -> FrameList:
    """The frames of a `video/jpeg` data URL's payload: base64 images separated by commas."""
    pieces = payload.split(",")
    frames = []
    for index, piece in enumerate(pieces):
        try:
            frame = base64.b64decode(piece.strip(), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MediaError(f"invalid base64 data in {frame_name(index, len(pieces))}: {exc}") from exc
        if not frame:
            raise MediaError(f"{frame_name(index, len(pieces))} is empty")
        frames.append(frame)
    return FrameList(frames)


def frame_name(index: int, count: int) -> str:
    """How a message names one frame of a `FrameList`."""
    return f"video frame {index} (counting from 0, of {count})"


def _local_file(path: Path, kind: str, access: MediaAccess) -> Path:
    if access.local_dirs is not None:
        if not access.local_dirs:
            raise MediaError(
                f"local {kind} files are not allowed (the server allows them under --allowed-local-media-path); "
                f"send a data: URL instead"
            )
        resolved = path.resolve()
        if not any(resolved.is_relative_to(Path(d).resolve()) for d in access.local_dirs):
            raise MediaError(f"{kind} path {str(path)!r} is outside the allowed local directories")
    if not path.exists():
        raise MediaError(f"{kind} file {str(path)!r} does not exist")
    if not path.is_file():
        raise MediaError(f"{kind} path {str(path)!r} is not a regular file")
    if path.stat().st_size == 0:
        raise MediaError(f"{kind} file {str(path)!r} is empty")
    _check_bytes(path.stat().st_size, kind, access)
    return path


def load_image(
    source: ImageSource,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    access: MediaAccess = MediaAccess(),
) -> Image.Image:
    """Decode `source` into a PIL image with its EXIF orientation applied (the mode is left as stored).

    The pixel count is checked against `max_pixels` from the header, before any pixel is decoded.
    """
    if isinstance(source, Image.Image):
        check_image_size(source.width, source.height, max_pixels)
        return apply_exif_orientation(source)
    return decode_image(open_image(read_media(source, "image", access), max_pixels))


def open_image(data: bytes | Path, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """The image in `data`, opened lazily: its header is read and its pixel count checked against
    `max_pixels`; no pixel is decoded."""
    if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < max_pixels:
        Image.MAX_IMAGE_PIXELS = max_pixels  # Pillow's checks while decoding: never below this limit
    try:
        image = _open_unchecked(io.BytesIO(data if isinstance(data, bytes) else data.read_bytes()))
    except Image.DecompressionBombError as exc:  # an ICO's embedded picture, read as it opens
        raise MediaError(_LARGER_THAN_STATED) from exc
    except UnidentifiedImageError as exc:
        raise MediaError("cannot decode image: the data is not in a recognized image format") from exc
    except Exception as exc:  # noqa: BLE001 - any decoder failure is a property of the data
        raise MediaError(f"cannot decode image: {exc}") from exc
    try:
        check_image_size(image.width, image.height, max_pixels)
    except MediaError:
        image.close()
        raise
    return image


def _open_unchecked(stream: IO[bytes]) -> Image.Image:
    """The image in `stream` opened as `Image.open` opens it (its header read, no pixel decoded), by the
    first format plugin that accepts its first bytes and can read its header, but without Pillow's check
    of the pixel count the header states: the callers check it against their own limit."""
    prefix = stream.read(16)
    for register in (Image.preinit, Image.init):  # the common formats first, as `Image.open` tries them
        register()
        for name in list(Image.ID):
            factory, accept = Image.OPEN[name]
            verdict = accept(prefix) if accept is not None else True
            if not verdict or isinstance(verdict, (str, bytes)):  # (a string: why the plugin declines it)
                continue
            stream.seek(0)
            try:
                return factory(stream, "")
            except (SyntaxError, IndexError, TypeError, struct.error):  # not this format after all
                continue
    raise UnidentifiedImageError("cannot identify image file")


def decode_image(image: Image.Image) -> Image.Image:
    """An image from `open_image` with its pixels decoded and its EXIF orientation applied."""
    try:
        image.load()
    except Image.DecompressionBombError as exc:
        image.close()
        raise MediaError(_LARGER_THAN_STATED) from exc
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt data
        image.close()
        raise MediaError(f"cannot decode image: {exc}") from exc
    return apply_exif_orientation(image)


def probe_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> tuple[int, int]:
    """(width, height) of the image `load_image` makes of `data`, EXIF orientation applied, read from
    its header and metadata: no pixel is decoded."""
    with open_image(data, max_pixels) as image:
        width, height = image.size
        orientation = _orientation_after_decoding(image, data)
    return (height, width) if orientation in _TRANSPOSING_ORIENTATIONS else (width, height)


def _orientation_after_decoding(image: Image.Image, data: bytes) -> object:
    """The EXIF orientation `apply_exif_orientation` finds once the image (opened from `data`) is decoded."""
    if image.format == "TIFF":
        return 1  # Pillow turns a TIFF upright as it decodes it, and states the upright size at open
    if image.format == "PNG":
        return _orientation(lambda: _png_exif(data, getattr(image, "is_animated", False)))
    return _orientation(image.getexif)


def _png_exif(data: bytes, animated: bool) -> Image.Exif:
    """The EXIF Pillow finds in a PNG once its pixels are decoded, found without decoding them.

    Metadata may follow the image data, and Pillow reads what follows only while decoding
    (`PngImageFile.getexif` decodes to get there). So the chunks that can hold EXIF (eXIf, and text:
    "Raw profile type exif", XMP) are copied in their order into a PNG without image data, whose
    chunks Pillow reads when it opens it; the copy ends where decoding stops reading: at IEND, or at
    an animation's second frame.
    """
    chunks = []
    position, after_image_data = len(_PNG_SIGNATURE), False
    while position + 8 <= len(data):
        length, kind = struct.unpack_from(">I4s", data, position)
        body = data[position + 8 : position + 8 + length]
        position += 12 + length
        if kind == b"IEND" or (kind == b"fcTL" and animated and after_image_data) or len(body) < length:
            break
        if kind in _PNG_EXIF_CHUNKS:
            chunks.append(_png_chunk(kind, body))  # a fresh CRC: decoding does not check those after the data
        after_image_data = after_image_data or kind in _PNG_IMAGE_DATA
    metadata = _open_unchecked(io.BytesIO(_PNG_SIGNATURE + b"".join(chunks) + _png_chunk(b"IEND", b"")))
    return Image.Image.getexif(metadata)  # not PngImageFile's, which would look for pixels to decode


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def check_image_size(width: int, height: int, max_pixels: int | None = None) -> None:
    """Raise `MediaError` for an empty image or one with more than `max_pixels` pixels."""
    if width <= 0 or height <= 0:
        raise MediaError(f"image is empty ({width}x{height} pixels)")
    check_pixel_count("image is", width, height, max_pixels)


def check_pixel_count(what: str, width: int, height: int, max_pixels: int | None) -> None:
    """Raise `MediaError` when a picture (`what` names it: "image is", "each video frame is") has more
    than `max_pixels` pixels, saying its size, the limit and the flag that sets it."""
    if max_pixels is not None and width * height > max_pixels:
        raise MediaError(
            f"{what} {width} x {height} = {width * height} pixels, more than the limit of {max_pixels} "
            f"({MAX_IMAGE_PIXELS_FLAG})"
        )


def apply_exif_orientation(image: Image.Image) -> Image.Image:
    """`image` turned upright according to its EXIF orientation tag (the same object when upright)."""
    if _orientation(image.getexif) not in (2, 3, 4, 5, 6, 7, 8):
        return image
    try:
        return ImageOps.exif_transpose(image)
    except Exception as exc:  # noqa: BLE001
        raise MediaError(f"cannot apply the image's EXIF orientation: {exc}") from exc


def _orientation(read_exif: Callable[[], Image.Exif]) -> object:
    """The EXIF orientation tag (1 when there is none: a broken EXIF block means "no orientation")."""
    try:
        return read_exif().get(_EXIF_ORIENTATION, 1)
    except Exception:  # noqa: BLE001
        return 1


def has_transparency(image: Image.Image) -> bool:
    """Whether `image` has an alpha band or a transparency key (the test transformers uses)."""
    return "A" in image.getbands() or image.info.get("transparency") is not None


def to_rgb(image: Image.Image) -> Image.Image:
    """An RGB version of `image`, converted exactly as transformers' image processors do.

    Images with transparency (an alpha band or a transparency key) are composited onto white; every
    other mode goes through Pillow's `convert("RGB")`.
    """
    try:
        if has_transparency(image):
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        return image if image.mode == "RGB" else image.convert("RGB")
    except (ValueError, OSError) as exc:
        raise MediaError(f"cannot convert image of mode {image.mode!r} to RGB: {exc}") from exc
