"""LoRA through the server with the official openai client: adapters given at start
(--lora-modules) and loaded / unloaded at run time (switched on by
$PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1; off, those routes are 404s), the request's `model` picking the adapter
(greedy equal to PEFT's merged model), /v1/models with `parent`, 404 for an unknown adapter,
400 for a bad adapter directory while the server goes on serving, and lora_requests_info."""

import httpx
import openai
import pytest
from greedy_utils import hf_greedy
from server_utils import RemoteServer

PROMPT, MAX_TOKENS = [5, 17, 40, 9, 200, 33, 71], 8


@pytest.fixture(scope="module")
def server(tiny_dir, tiny_adapters):
    a1, a2 = tiny_adapters[:2]
    srv = RemoteServer(
        [
            "--model",
            tiny_dir,
            "--max-model-len",
            "128",
            "--enable-lora",
            "--max-loras",
            "2",
            "--lora-modules",
            f"{a1.lora_name}={a1.lora_path}",
            f"{a2.lora_name}={a2.lora_path}",
        ],
        env={"PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )  # as --allow-runtime-lora-updating
    yield srv
    srv.close()


def _greedy(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    return out.choices[0].text.split()  # the tiny tokenizer's words: "w<id>"


def test_adapters_served_loaded_and_unloaded(server, client, tiny_dir, tiny_adapters, tiny_references, tmp_path):
    a1, a2, a3 = tiny_adapters[:3]
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {tiny_dir, a1.lora_name, a2.lora_name}
    assert models[a1.lora_name].parent == tiny_dir and models[tiny_dir].parent is None

    def want(lora):
        ids = hf_greedy(tiny_references[lora.lora_int_id if lora else 0], [PROMPT], MAX_TOKENS)[0][0]
        return [f"w{i}" for i in ids]

    assert _greedy(client, a1.lora_name) == want(a1)
    assert _greedy(client, tiny_dir) == want(None) != want(a1)

    # At run time: a3 in, a2 out.
    r = client.post(
        "/load_lora_adapter", cast_to=httpx.Response, body={"lora_name": a3.lora_name, "lora_path": a3.lora_path}
    )
    assert r.status_code == 200
    assert _greedy(client, a3.lora_name) == want(a3)
    client.post("/unload_lora_adapter", cast_to=httpx.Response, body={"lora_name": a2.lora_name})
    with pytest.raises(openai.NotFoundError, match=a2.lora_name):
        _greedy(client, a2.lora_name)
    with pytest.raises(openai.NotFoundError):
        client.post("/unload_lora_adapter", cast_to=httpx.Response, body={"lora_name": "nope"})
    assert a3.lora_name in {m.id for m in client.models.list().data}

    # A bad directory: 400 naming what is wrong; the server goes on serving.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "use_dora": true}')
    (bad / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(openai.BadRequestError, match="DoRA"):
        client.post("/load_lora_adapter", cast_to=httpx.Response, body={"lora_name": "bad", "lora_path": str(bad)})
    with pytest.raises(openai.BadRequestError, match="not a directory"):
        client.post(
            "/load_lora_adapter", cast_to=httpx.Response, body={"lora_name": "bad", "lora_path": str(tmp_path / "none")}
        )
    assert _greedy(client, a1.lora_name) == want(a1)

    info = [k for k in server.metrics() if k.startswith("pagedllm:lora_requests_info{")]
    assert info and all('max_lora="2"' in k for k in info), info


def test_runtime_updating_off_is_404(tiny_shared_server, tiny_adapters):
    """Without the switch (flag or variable) the run-time routes are 404s, saying how to turn it on."""
    a3 = tiny_adapters[2]
    client = tiny_shared_server.client()
    for path, body in (
        ("/load_lora_adapter", {"lora_name": a3.lora_name, "lora_path": a3.lora_path}),
        ("/unload_lora_adapter", {"lora_name": a3.lora_name}),
    ):
        with pytest.raises(openai.NotFoundError, match="PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1"):
            client.post(path, cast_to=httpx.Response, body=body)
