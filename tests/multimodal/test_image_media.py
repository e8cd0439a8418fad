"""image_url loading (multimodal/media.py) and --limit-mm-per-prompt (multimodal/limits.py), without
a model: what loads gives PIL's own decoding of the bytes, and every refusal is a ParamError naming
the part."""

import base64
import http.server
import io
import os
import threading
import time

import numpy as np
import pytest
from PIL import Image

from pagedllm.multimodal.limits import check_allowed_local_media_path, check_item_count, parse_limit_mm_per_prompt
from pagedllm.multimodal.media import load_image_url
from pagedllm.sampling_params import ParamError

WHERE = "messages[0].content[1].image_url.url"


def _png(size=(6, 4), mode="RGB") -> bytes:
    img = Image.fromarray(np.arange(size[0] * size[1] * 3, dtype=np.uint8).reshape(size[1], size[0], 3)).convert(mode)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _refused(url, words, allowed=""):
    with pytest.raises(ParamError) as e:
        load_image_url(url, WHERE, allowed)
    assert e.value.param == WHERE and str(e.value).startswith(WHERE) and words in str(e.value), str(e.value)


def test_data_url_decodes_as_pil_does():
    data = _png(mode="L")  # a grey image comes back as RGB
    img = load_image_url("data:image/png;base64," + base64.b64encode(data).decode(), WHERE)
    assert img.mode == "RGB" and img.size == (6, 4)
    assert img.tobytes() == Image.open(io.BytesIO(data)).convert("RGB").tobytes()


def test_bad_urls_are_refused(tmp_path):
    _refused("", "non-empty URL")
    _refused(None, "non-empty URL")
    _refused("gopher://x/a.png", "not supported")
    _refused("data:image/png;base64", "needs a ','")
    _refused("data:image/png,rawbytes", "data:image/<type>;base64")
    _refused("data:image/png;base64,***", "does not decode")
    _refused("data:image/png;base64," + base64.b64encode(b"GIF89a but not").decode(), "not an image")


def test_file_urls_only_under_the_allowed_folder(tmp_path):
    inside, outside = tmp_path / "media", tmp_path / "other"
    inside.mkdir()
    outside.mkdir()
    (inside / "a.png").write_bytes(_png())
    (outside / "b.png").write_bytes(_png())
    os.symlink(outside / "b.png", inside / "link.png")  # a link out of the folder is outside
    assert load_image_url(f"file://{inside}/a.png", WHERE, str(inside)).size == (6, 4)
    _refused(f"file://{inside}/a.png", "--allowed-local-media-path DIR")  # no folder allowed
    _refused(f"file://{outside}/b.png", "outside --allowed-local-media-path", str(inside))
    _refused(f"file://{inside}/../other/b.png", "outside --allowed-local-media-path", str(inside))
    _refused(f"file://{inside}/link.png", "outside --allowed-local-media-path", str(inside))
    _refused(f"file://{inside}/none.png", "cannot read", str(inside))
    _refused(f"file://otherhost{inside}/a.png", "local path", str(inside))


def test_size_and_pixel_limits(tmp_path, monkeypatch):
    data = _png()
    monkeypatch.setenv("PAGEDLLM_MAX_IMAGE_BYTES", str(len(data) - 1))
    (tmp_path / "a.png").write_bytes(data)
    _refused(f"file://{tmp_path}/a.png", "PAGEDLLM_MAX_IMAGE_BYTES", str(tmp_path))
    _refused("data:image/png;base64," + base64.b64encode(data + b"padding!").decode(), "PAGEDLLM_MAX_IMAGE_BYTES")
    monkeypatch.delenv("PAGEDLLM_MAX_IMAGE_BYTES")
    big = io.BytesIO()
    Image.new("1", (9000, 8000)).save(big, format="PNG")  # a few KB, 72 M pixels decoded
    _refused("data:image/png;base64," + base64.b64encode(big.getvalue()).decode(), "9000x8000 pixels")


@pytest.fixture
def loopback():
    """127.0.0.1: /ok.png an image, /big.png more bytes than the limit set below, /slow.png
    answers after 3 s."""
    body = _png()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/slow.png":
                time.sleep(3)
            if self.path not in ("/ok.png", "/slow.png", "/big.png"):
                self.send_error(404)
                return
            data = body * (50 if self.path == "/big.png" else 1)
            try:
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout, size limit)
                pass

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_http_fetch_is_bounded(loopback, monkeypatch):
    assert load_image_url(f"{loopback}/ok.png", WHERE).tobytes() == Image.open(io.BytesIO(_png())).tobytes()
    _refused(f"{loopback}/gone.png", "HTTP 404")
    monkeypatch.setenv("PAGEDLLM_MAX_IMAGE_BYTES", str(10 * len(_png())))
    _refused(f"{loopback}/big.png", "PAGEDLLM_MAX_IMAGE_BYTES")
    monkeypatch.setenv("PAGEDLLM_IMAGE_FETCH_TIMEOUT", "0.5")
    _refused(f"{loopback}/slow.png", "timed out")
    _refused("http://127.0.0.1:1/a.png", "fetching the image failed")  # nothing listens


def test_limit_mm_per_prompt():
    assert parse_limit_mm_per_prompt('{"image": 2}') == {"image": 2}
    assert parse_limit_mm_per_prompt(None) == {}
    for bad, words in (
        ('{"video": 1}', "unknown modality 'video'"),
        ('{"image": -1}', "integer >= 0"),
        ('{"image": true}', "integer >= 0"),
        ("[1]", "JSON object"),
        ("{image: 2}", "not valid JSON"),
    ):
        with pytest.raises(ValueError, match=words):
            parse_limit_mm_per_prompt(bad)
    check_item_count({"image": 2}, "image", 2, "messages")
    check_item_count({}, "image", 999, "messages")  # vLLM's default
    with pytest.raises(ParamError, match=r"at most 2 image\(s\)") as e:
        check_item_count({"image": 2}, "image", 3, "messages")
    assert e.value.param == "messages"
    with pytest.raises(ParamError, match=r"at most 0 image\(s\)"):
        check_item_count({"image": 0}, "image", 1, "multi_modal_data")


def test_allowed_local_media_path(tmp_path):
    assert check_allowed_local_media_path("") == "" and check_allowed_local_media_path(None) == ""
    assert check_allowed_local_media_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="allowed_local_media_path must be an existing directory"):
        check_allowed_local_media_path(str(tmp_path / "nope"))
