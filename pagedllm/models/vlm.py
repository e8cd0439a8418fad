"""What the vision-language models share: a text model (`language_model`) that embeds, runs
and computes logits, a vision part beside it, and checkpoint tensors routed to one or the other."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from pagedllm.models.layers.weight_utils import default_weight_loader


class VisionLanguageModel(nn.Module):
    language_model: nn.Module

    def text_weight_name(self, name: str) -> Optional[str]:
        """A checkpoint tensor's name -> its name in the text model; None: a vision weight."""
        raise NotImplementedError

    def vision_weight_name(self, name: str) -> str:
        """A vision checkpoint tensor's name -> its parameter's name."""
        return name.removeprefix("model.")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed(input_ids)

    def forward(self, input_ids, positions, hidden_in=None):
        return self.language_model(input_ids, positions, hidden_in)

    def compute_logits(self, hidden: torch.Tensor):
        return self.language_model.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        text, loaded = [], set()
        for name, tensor in weights:
            text_name = self.text_weight_name(name)
            if text_name is not None:
                text.append((text_name, tensor))
                continue
            name = self.vision_weight_name(name)
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected weight {name!r}")
            default_weight_loader(param, tensor)
            loaded.add(name)
        return loaded | {f"language_model.{n}" for n in self.language_model.load_weights(text)}
