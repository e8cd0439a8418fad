"""The runner's encoder cache (vLLM v1's encoder_cache with _execute_encoder and
_gather_encoder_outputs): image features by content hash, computed when a step first schedules
one of the image's placeholder tokens, written over those tokens' embeddings in every step that
prefills some of them (chunked prefill may split an image), and freed once no request still has
placeholder tokens of it to prefill."""

from __future__ import annotations

import numpy as np
import torch


class EncoderCache:
    def __init__(self, model) -> None:
        self.model = model
        self.features: dict[int, torch.Tensor] = {}  # image hash -> [tokens, hidden]
        self.users: dict[int, set[str]] = {}  # image hash -> requests still prefilling it
        self.images_encoded = 0  # encoder runs, one per image
        self.hits = 0  # images a request needed that were already cached
        # vLLM's mm_cache_queries / mm_cache_hits (items): a query when a request starts to need
        # an image's features (_count_queries), a hit when no encoder run was needed for it; since
        # the last take_step_stats().
        self.step_queries = self.step_hits = 0

    def forget(self, req_ids) -> None:
        """Finished or preempted requests no longer hold their images."""
        for h in [h for h, users in self.users.items() if users & set(req_ids)]:
            self._release(h, req_ids)

    def _release(self, h: int, req_ids) -> None:
        self.users.setdefault(h, set()).difference_update(req_ids)
        if not self.users[h]:
            del self.users[h], self.features[h]

    def embed(self, input_ids: torch.Tensor, rows: list[tuple[str, object, int, int, int]]) -> torch.Tensor:
        """input_ids [T] on the device; rows: (req_id, its ImageInputs, tokens computed before
        this step, tokens scheduled, first row in input_ids) of each request with images ->
        the step's input embeddings [T, hidden], image features at the placeholder rows."""
        needed = []  # (req_id, image, overlap lo, hi, first row, computed)
        for req_id, images, computed, n, first in rows:
            for image in images:
                lo, hi = max(image.offset, computed), min(image.end, computed + n)
                if lo < hi:
                    needed.append((req_id, image, lo, hi, first, computed))
        self._count_queries(needed)
        self._encode([image for _, image, *_ in needed])
        x = self.model.embed(input_ids)
        for req_id, image, lo, hi, first, computed in needed:
            pos, rows_of = image.feature_rows(lo, hi)  # a split image's tag tokens keep their embeddings
            x[torch.from_numpy(first + pos - computed).to(x.device)] = self.features[image.hash][
                torch.from_numpy(rows_of).to(x.device)
            ]
            self.users.setdefault(image.hash, set()).add(req_id)
        images_of = {req_id: images for req_id, images, *_ in rows}
        for req_id, image, lo, hi, _, _ in needed:
            # Its last placeholder token is prefilled now (of the last of the request's copies of
            # the image: a prompt may show the same image twice).
            if hi == max(i.end for i in images_of[req_id] if i.hash == image.hash) and image.hash in self.users:
                self._release(image.hash, {req_id})
        return x

    def _count_queries(self, needed) -> None:
        """Before this step's encoder run: an image of a request whose first placeholder token is
        scheduled now (or that the request does not hold yet: resumed, or a prefix hit covering
        its start) is a query; a hit when the features are cached or an earlier image of the step
        has the same content."""
        seen = set(self.features)
        for req_id, image, lo, *_ in needed:
            if lo != image.offset and req_id in self.users.get(image.hash, ()):
                continue  # the next chunk of an image already counted
            self.step_queries += 1
            self.step_hits += image.hash in seen
            seen.add(image.hash)

    def take_step_stats(self) -> tuple[int, int]:
        """(queries, hits) since the last call."""
        out = (self.step_queries, self.step_hits)
        self.step_queries = self.step_hits = 0
        return out

    def _encode(self, images) -> None:
        missing = {}
        for image in images:
            if image.hash in self.features or image.hash in missing:
                self.hits += image.hash in self.features
                continue
            missing[image.hash] = image
        if not missing:
            return
        if hasattr(self.model, "encode_image_list"):  # images of different shapes, each its own grid (Qwen2-VL)
            for h, f in zip(missing, self.model.encode_image_list([m.pixel_values for m in missing.values()])):
                self.features[h] = f  # [length, hidden]
                self.images_encoded += 1
            return
        pixels = torch.from_numpy(np.concatenate([m.pixel_values for m in missing.values()]))  # [tiles, 3, S, S]
        device = next(self.model.parameters()).device
        feats = self.model.encode_images(pixels.to(device))  # [tiles, tokens, hidden]
        at = 0
        for h, image in missing.items():
            tiles = image.pixel_values.shape[0]
            self.features[h] = feats[at : at + tiles].reshape(-1, feats.shape[-1])  # [length, hidden]
            at += tiles
            self.images_encoded += 1
