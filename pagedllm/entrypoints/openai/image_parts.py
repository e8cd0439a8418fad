"""Images of the APIs built on the chat path (the Responses API's input_image parts, Anthropic's
image blocks) as chat's image_url parts: one loader (multimodal/media.py), one image limit and
one set of 400s for all of them. Those 400s name chat's paths (`messages[i].content[j]`, and
`.image_url.url` for the URL); the paths recorded here turn them into the API's own
(serving_engine.renamed_error)."""

from __future__ import annotations


class ImagePaths(dict):
    """chat's path of an image part, and of its URL -> the API's (renames for renamed_error)."""

    def part(self, url: str, chat_where: str, api_where: str, api_url: str) -> dict:
        """Chat's image_url part for `url`, its paths recorded."""
        self[chat_where] = api_where
        self[f"{chat_where}.image_url.url"] = api_url
        return {"type": "image_url", "image_url": {"url": url}}
