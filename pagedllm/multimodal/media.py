"""An image_url part's image (vLLM's MediaConnector, images only): a `data:` URL (base64), a
`file://` path under --allowed-local-media-path, or an http(s) URL fetched with a time limit
(PAGEDLLM_IMAGE_FETCH_TIMEOUT) and a size limit (PAGEDLLM_MAX_IMAGE_BYTES). Every failure is a
ParamError naming the part (`where`), raised before the image reaches the processor."""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.error
import urllib.parse
import urllib.request

from pagedllm import envs
from pagedllm.sampling_params import ParamError

# Decoded size bound (a small PNG can decode to gigabytes): 8192 x 8192 pixels.
MAX_IMAGE_PIXELS = 1 << 26
URL_SCHEMES = ("data", "file", "http", "https")


def load_image_url(url, where: str, allowed_local_media_path: str = ""):
    """url: the part's image_url.url -> an RGB PIL image."""
    if not isinstance(url, str) or not url:
        raise ParamError(where, f"{where} must be a non-empty URL string, got {url!r:.80}")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url_bytes(url, where)
    elif scheme == "file":
        data = _local_file_bytes(url, where, allowed_local_media_path)
    elif scheme in ("http", "https"):
        data = _fetch(url, where)
    else:
        raise ParamError(
            where, f"{where}: URL scheme {scheme or url[:20]!r} is not supported; allowed: {', '.join(URL_SCHEMES)}"
        )
    return decode_image(data, where)


def _data_url_bytes(url: str, where: str) -> bytes:
    """data:[<media type>][;base64],<data>; only base64 images."""
    head, sep, payload = url.partition(",")
    if not sep:
        raise ParamError(where, f"{where}: a data URL needs a ',' before its data (data:image/png;base64,...)")
    media, _, encoding = head[5:].rpartition(";")
    if encoding != "base64" or not media.startswith("image/"):
        raise ParamError(where, f"{where}: a data URL must be data:image/<type>;base64,<data>, got {head[:60]!r}")
    limit = envs.PAGEDLLM_MAX_IMAGE_BYTES
    if len(payload) * 3 // 4 > limit:
        raise ParamError(where, f"{where}: the image is larger than {limit} bytes (PAGEDLLM_MAX_IMAGE_BYTES)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ParamError(where, f"{where}: the data URL's base64 does not decode: {e}") from None


def _local_file_bytes(url: str, where: str, allowed: str) -> bytes:
    if not allowed:
        raise ParamError(where, f"{where}: file:// URLs need the server started with --allowed-local-media-path DIR")
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ParamError(where, f"{where}: a file:// URL must name a local path, got host {parsed.netloc!r}")
    path = os.path.realpath(urllib.request.url2pathname(parsed.path))
    root = os.path.realpath(allowed)
    if os.path.commonpath([path, root]) != root:
        raise ParamError(where, f"{where}: {parsed.path!r} is outside --allowed-local-media-path")
    try:
        size = os.path.getsize(path)
        if size > envs.PAGEDLLM_MAX_IMAGE_BYTES:
            raise ParamError(
                where,
                f"{where}: the file has {size} bytes, more than PAGEDLLM_MAX_IMAGE_BYTES "
                f"({envs.PAGEDLLM_MAX_IMAGE_BYTES})",
            )
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ParamError(where, f"{where}: cannot read {parsed.path!r}: {e.strerror or e}") from None


def _fetch(url: str, where: str) -> bytes:
    """The body, read up to the size limit, within the time limit (each socket operation)."""
    limit, timeout = envs.PAGEDLLM_MAX_IMAGE_BYTES, envs.PAGEDLLM_IMAGE_FETCH_TIMEOUT
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers={"User-Agent": "pagedllm"}), timeout=timeout
        ) as r:
            data = r.read(limit + 1)
    except urllib.error.HTTPError as e:
        raise ParamError(where, f"{where}: fetching the image failed: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:  # refused, unknown host, timeout
        reason = getattr(e, "reason", None) or e
        raise ParamError(where, f"{where}: fetching the image failed: {reason}") from None
    if len(data) > limit:
        raise ParamError(where, f"{where}: the image is larger than {limit} bytes (PAGEDLLM_MAX_IMAGE_BYTES)")
    return data


def decode_image(data: bytes, where: str):
    """Encoded bytes -> an RGB PIL image; ParamError for what PIL cannot read or what is too big."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        w, h = image.size
        if w * h > MAX_IMAGE_PIXELS:
            raise ParamError(where, f"{where}: the image has {w}x{h} pixels, more than {MAX_IMAGE_PIXELS}")
        image.load()
        return image.convert("RGB")
    except ParamError:
        raise
    except Exception as e:  # PIL raises several kinds (UnidentifiedImageError, OSError, SyntaxError, ...)
        raise ParamError(where, f"{where}: the data is not an image PIL can decode ({type(e).__name__})") from None
