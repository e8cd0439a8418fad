"""Chat messages with image parts (offline LLM.chat): each part becomes the model's image
placeholder in the message's text, its image one of the prompt's images, in order."""
from __future__ import annotations

# part type -> the key that holds its PIL image (vLLM's offline "image_pil", and plain "image")
IMAGE_PARTS = {"image_pil": "image_pil", "image": "image"}


def has_image_parts(conversation) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") in IMAGE_PARTS for p in m["content"])
               for m in conversation)


def split_image_parts(conversation: list, image_token: str) -> tuple[list, list]:
    """-> (the messages with string contents, the images in order); ValueError naming a part
    that is neither text nor an image."""
    messages, images = [], []
    for i, m in enumerate(conversation):
        content = m.get("content")
        if not isinstance(content, list):
            messages.append(m)
            continue
        text = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text.append(part.get("text", ""))
            elif kind in IMAGE_PARTS:
                images.append(part.get(IMAGE_PARTS[kind]))
                text.append(image_token)
            else:
                raise ValueError(f"messages[{i}].content[{j}]: type {kind!r} is not supported; "
                                 f"allowed: text, {', '.join(IMAGE_PARTS)}")
        messages.append({**m, "content": "".join(text)})
    return messages, images
