"""Chat messages with image parts (LLM.chat and the server's /v1/chat/completions): each part
becomes the model's image placeholder in the message's text, where the part stands, and its
image one of the prompt's images, in order. A message's parts are joined with "\n" (as vLLM
joins them for a template that takes string contents, and as the server joins text parts)."""

from __future__ import annotations

from pagedllm.multimodal.media import load_image_url
from pagedllm.sampling_params import ParamError

# part type -> the key that holds its image: a PIL image (offline: vLLM's "image_pil", and plain
# "image"), or {"url": ...} (OpenAI's image_url: data:, file:// or http(s), multimodal/media.py)
IMAGE_PARTS = {"image_pil": "image_pil", "image": "image", "image_url": "image_url"}


def image_part_locations(conversation) -> list[str]:
    """'messages[i].content[j]' of each image part, in order."""
    return [
        f"messages[{i}].content[{j}]"
        for i, m in enumerate(conversation)
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for j, p in enumerate(m["content"])
        if isinstance(p, dict) and p.get("type") in IMAGE_PARTS
    ]


def has_image_parts(conversation) -> bool:
    return bool(image_part_locations(conversation))


def chat_placeholder(mm_processor) -> str:
    """The text an image part becomes in a string content: the processor's `chat_placeholder`
    where the model's template wraps its image token (Qwen2-VL's
    <|vision_start|><|image_pad|><|vision_end|>), else its image token."""
    return getattr(mm_processor, "chat_placeholder", mm_processor.image_token)


_PROBE = "pagedllm-content-probe"


def template_takes_parts(render) -> bool:
    """Whether a chat template iterates over a message's content parts (vLLM's "openai" content
    format: SmolVLM's and most vision templates put the image tag where {"type": "image"} stands)
    rather than printing a string content. render(messages) -> the template's text; a template
    that prints the list (its repr) or fails on it takes strings."""
    try:
        text = render([{"role": "user", "content": [{"type": "text", "text": _PROBE}]}])
    except Exception:
        return False
    return _PROBE in text and "'type'" not in text and '"type"' not in text


def split_image_parts(
    conversation: list, placeholder: str, allowed_local_media_path: str = "", as_parts: bool = False
) -> tuple[list, list]:
    """-> (the messages, the images in order); placeholder: what an image part becomes in a
    string content (chat_placeholder); image_url parts are loaded here (blocking: the
    server calls this in a thread). The messages have string contents, or with as_parts (a
    template that takes parts: template_takes_parts) lists of {"type": "text"} and
    {"type": "image"} parts, every message's. ParamError naming a part that is neither text nor
    an image, or whose image does not load."""
    messages, images = [], []
    for i, m in enumerate(conversation):
        content = m.get("content")
        if not isinstance(content, list):
            messages.append({**m, "content": [{"type": "text", "text": content or ""}]} if as_parts else m)
            continue
        text = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind == "text":
                text.append(part.get("text") or "")
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                images.append(load_image_url(url, where + ".image_url.url", allowed_local_media_path))
                text.append(None)  # the image's place
            elif kind in IMAGE_PARTS:
                images.append(part.get(IMAGE_PARTS[kind]))
                text.append(None)
            else:
                raise ParamError(
                    where, f"{where}: type {kind!r} is not supported; allowed: text, {', '.join(IMAGE_PARTS)}"
                )
        if as_parts:  # the template places the image tags itself
            messages.append(
                {**m, "content": [{"type": "image"} if t is None else {"type": "text", "text": t} for t in text]}
            )
        else:
            messages.append({**m, "content": "\n".join(placeholder if t is None else t for t in text)})
    return messages, images
