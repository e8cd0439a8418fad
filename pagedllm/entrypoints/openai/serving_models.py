"""OpenAIServingModels (vLLM's name): the names the server answers to, the base model's and
each LoRA adapter's (--lora-modules name=path, and POST /v1/load_lora_adapter when runtime
updating is allowed). A request's `model` picks the base model or an adapter; an unknown name
is a 404, a bad adapter directory a 400 naming what is wrong (the server goes on serving)."""

from __future__ import annotations

from typing import Optional, Sequence

from pydantic import StrictStr

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel
from pagedllm.entrypoints.openai.serving_engine import OpenAIError
from pagedllm.lora.request import LoRARequest


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: StrictStr
    lora_path: StrictStr


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: StrictStr
    lora_int_id: Optional[int] = None


def parse_lora_modules(values: Optional[Sequence[str]]) -> list[tuple[str, str]]:
    """--lora-modules name=path ... -> [(name, path)]; ValueError naming a malformed one."""
    out = []
    for v in values or ():
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {v!r}")
        out.append((name, path))
    return out


class OpenAIServingModels:
    def __init__(
        self,
        engine,
        base_model_names: Sequence[str],
        lora_modules: Sequence[tuple[str, str]] = (),
        allow_runtime_lora_updating: bool = False,
    ) -> None:
        self.engine = engine
        self.base_model_names = list(base_model_names)
        self.allow_runtime_lora_updating = allow_runtime_lora_updating
        self.lora_requests: dict[str, LoRARequest] = {}
        self._next_id = 1  # every load gets a new id: a reloaded name never reuses cached blocks
        for name, path in lora_modules:
            self.add_lora(name, path)

    # ------------------------------------------------------------ lookup
    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.base_model_names and model not in self.lora_requests:
            raise OpenAIError(
                f"The model `{model}` does not exist.",
                status=404,
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )

    def lora_request(self, model: Optional[str]) -> Optional[LoRARequest]:
        return self.lora_requests.get(model) if model is not None else None

    def model_cards(self, created: int, max_model_len: int) -> list[dict]:
        """OpenAI's Model objects with vLLM's extras: an adapter's `parent` is the base model."""
        root = self.engine.config.model_config.model
        cards = [
            {
                "id": n,
                "object": "model",
                "created": created,
                "owned_by": "pagedllm",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
            }
            for n in self.base_model_names
        ]
        cards += [
            {
                "id": n,
                "object": "model",
                "created": created,
                "owned_by": "pagedllm",
                "root": r.lora_path,
                "parent": self.base_model_names[0],
                "max_model_len": max_model_len,
            }
            for n, r in self.lora_requests.items()
        ]
        return cards

    # ------------------------------------------------------------ adapters
    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Check the adapter directory against the model (ValueError naming what is wrong) and
        serve it under `name`."""
        from pagedllm.lora.peft_helper import PEFTHelper

        config = self.engine.config
        if config.lora_config is None:
            raise ValueError("LoRA adapters need a server started with --enable-lora")
        if name in self.lora_requests or name in self.base_model_names:
            raise ValueError(f"the model name {name!r} is already served")
        PEFTHelper.from_local_dir(path, config.model_config.hf_config, config.lora_config.max_lora_rank)
        lora = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        self.lora_requests[name] = lora
        return lora

    def load_lora_adapter(self, req: LoadLoRAAdapterRequest) -> str:
        self._check_updating()
        try:
            self.add_lora(req.lora_name, req.lora_path)
        except ValueError as e:
            raise OpenAIError(str(e), status=400, param="lora_path", code="invalid_lora_adapter") from None
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    def unload_lora_adapter(self, req: UnloadLoRAAdapterRequest) -> str:
        self._check_updating()
        if req.lora_name not in self.lora_requests:
            raise OpenAIError(
                f"The lora adapter '{req.lora_name}' cannot be found.",
                status=404,
                param="lora_name",
                code="lora_not_found",
            )
        del self.lora_requests[req.lora_name]  # requests in flight keep theirs to the end
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."

    def _check_updating(self) -> None:
        if not self.allow_runtime_lora_updating:
            raise OpenAIError(
                "loading and unloading LoRA adapters at run time is off: start the server "
                "with --allow-runtime-lora-updating (or PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1)",
                status=404,
                code="not_found",
            )
