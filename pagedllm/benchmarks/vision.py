"""`pagedllm bench vision`: the cost of an image in a chat on an Idefics3 / SmolVLM model (by
default random weights in SmolVLM-256M's shape, models/random_vlm.py) or a Qwen2-VL / Qwen2.5-VL
checkpoint (--model). Per round, a new image:
the HF processor's time and the encoder's time for it (the model's encode_images, or
encode_image_list for a model whose images have their own grids, called directly); the TTFT of turn 1 (a question about the image: the encoder runs); the TTFT of turn
2 (turn 1, its answer and a follow-up) on the same engine, where the prefix cache covers the
image and the encoder does not run again (counted); and the same turn 2 on an engine with
prefix caching off, which encodes the image again and prefills the whole conversation (what a
server without image-aware caching does every turn). Rounds interleaved (--repeat); medians.
TTFT is the engine's: from the request's arrival (its images processed) to its first token.
With --throughput N: offline throughput with images in the batch instead (vision_throughput.py)."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from pagedllm.benchmarks import vision_throughput
from pagedllm.benchmarks.common import command_line, machine_info, print_table, write_json


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="an Idefics3 / SmolVLM or Qwen2(.5)-VL checkpoint directory (default: random weights of --shape)",
    )
    p.add_argument("--shape", default="smolvlm-256m", help="random shape when no --model (smolvlm-256m, tiny)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--image-size", type=int, default=512, help="side of the square test images (pixels)")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        default=1.0,
        metavar="GiB",
        help="KV cache of each engine (the workloads are small; the engine's default is 4)",
    )
    p.add_argument("--output-json", default=None, metavar="PATH")
    vision_throughput.add_cli_args(p)


def _image(seed: int, side: int):
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 255, (side, side, 3), dtype=np.uint8))


def _encoder_cache(llm):
    return llm.llm_engine.core.model_executor.driver_worker.model_runner.encoder_cache


def _turn(llm, messages, params) -> tuple[float, str, int, int]:
    """(TTFT s, answer, encoder runs, prompt tokens taken from the prefix cache) of one chat turn."""
    cache = _encoder_cache(llm)
    before = cache.images_encoded
    out = llm.chat(messages, params, use_tqdm=False)[0]
    ttft = out.metrics["first_token_time"] - out.metrics["arrival_time"]
    return ttft, out.outputs[0].text, cache.images_encoded - before, out.num_cached_tokens


def _encode_times(llm, img) -> tuple[float, float, int]:
    """(processor s, encoder s, placeholder tokens) for one image, timed directly."""
    import torch

    processor = llm.llm_engine.processor
    mm = processor.load_mm_processor()
    start = time.perf_counter()
    prompt = processor.process_images({"prompt": f"Look {mm.image_token}", "multi_modal_data": {"image": img}})
    processed = time.perf_counter() - start
    image = prompt.mm_inputs[0]
    model = _encoder_cache(llm).model
    pixels = torch.from_numpy(image.pixel_values).to(next(model.parameters()).dtype)  # [tiles, 3, S, S]
    with torch.inference_mode():
        start = time.perf_counter()
        if hasattr(model, "encode_image_list"):  # Qwen2-VL's: patches [t, h, w, C*2*P*P] of one image
            model.encode_image_list([image.pixel_values])
        else:
            model.encode_images(pixels)
        encoded = time.perf_counter() - start
    return processed, encoded, image.length


def _print_header(path: str, dtype: str) -> dict:
    m = machine_info()
    print(f"command: {command_line()}")
    print(f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} with {m['torch_threads']} threads")
    print(f"model: {path} ({dtype})", end="; ")
    return m


def _kv_bytes(ns) -> int:
    if not ns.kv_cache_memory > 0:
        raise ValueError(f"kv_cache_memory must be > 0 GiB, got {ns.kv_cache_memory}")
    return int(ns.kv_cache_memory * 2**30)


def throughput_main(ns, path: str) -> int:
    from pagedllm import LLM

    if ns.repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {ns.repeat}")
    res = vision_throughput.run_throughput(LLM(path, dtype=ns.dtype, kv_cache_memory=_kv_bytes(ns)), ns, _image)
    m = _print_header(path, ns.dtype)
    vision_throughput.print_throughput(res, ns)
    if ns.output_json:
        write_json(ns.output_json, {"command": command_line(), "machine": m, "model": path, **res})
    return 0


def main(ns) -> int:
    from pagedllm import LLM, SamplingParams
    from pagedllm.models.random_vlm import random_vlm_dir

    path = ns.model or str(random_vlm_dir(ns.shape))
    if ns.throughput:
        return throughput_main(ns, path)
    engines = {
        caching: LLM(path, dtype=ns.dtype, enable_prefix_caching=caching, kv_cache_memory=_kv_bytes(ns))
        for caching in (True, False)
    }
    params = SamplingParams(temperature=0, max_tokens=ns.output_len, ignore_eos=True)
    question, follow_up = "What is in this picture?", "And what colours does it have?"
    _turn(engines[True], [{"role": "user", "content": "warm up"}], params)
    _turn(engines[False], [{"role": "user", "content": "warm up"}], params)
    rows: dict[str, list[float]] = {
        k: [] for k in ("processor_s", "encode_s", "turn1_ttft_s", "turn2_hit_ttft_s", "turn2_reencoded_ttft_s")
    }
    turn2_encodes, tokens, cached, same = [], 0, [], True
    for r in range(ns.repeat + 1):  # round 0 warms the image path up
        img = _image(1000 + r, ns.image_size)
        processed, encoded, tokens = _encode_times(engines[True], img)
        turn1 = [
            {"role": "user", "content": [{"type": "text", "text": question}, {"type": "image_pil", "image_pil": img}]}
        ]
        t1, answer, _, _ = _turn(engines[True], turn1, params)
        turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]
        t2, reused, runs, hit = _turn(engines[True], turn2, params)
        t2_cold, reencoded, _, _ = _turn(engines[False], turn2, params)
        same &= reused == reencoded
        if r == 0:
            continue
        for k, v in zip(rows, (processed, encoded, t1, t2, t2_cold)):
            rows[k].append(v)
        turn2_encodes.append(runs)
        cached.append(hit)
    med = {k: statistics.median(v) for k, v in rows.items()}
    m = _print_header(path, ns.dtype)
    print(f"{ns.image_size}x{ns.image_size} images, {tokens} placeholder tokens each; {ns.repeat} rounds, medians\n")
    table = [
        {"what": "HF processor, per image", "s": med["processor_s"]},
        {"what": "encoder, per image", "s": med["encode_s"]},
        {"what": "turn 1 TTFT (image new: encoded)", "s": med["turn1_ttft_s"]},
        {"what": "turn 2 TTFT, prefix cache (image reused)", "s": med["turn2_hit_ttft_s"]},
        {"what": "turn 2 TTFT, no prefix cache (re-encoded)", "s": med["turn2_reencoded_ttft_s"]},
    ]
    print_table(table, [("what", "what", ""), ("s", "seconds", ".4f")])
    print(
        f"\nturn 2: encoder runs {turn2_encodes} (0: the image was not encoded again), prompt tokens from the "
        f"prefix cache {cached}; TTFT ratio re-encoded / reused: "
        f"{med['turn2_reencoded_ttft_s'] / med['turn2_hit_ttft_s']:.2f}x; turn 2's answers identical: {same}"
    )
    if ns.output_json:
        write_json(
            ns.output_json,
            {
                "command": command_line(),
                "machine": m,
                "model": path,
                "medians": med,
                "rounds": rows,
                "turn2_encoder_runs": turn2_encodes,
                "turn2_cached": cached,
                "turn2_answers_identical": same,
                "image_tokens": tokens,
            },
        )
    return 0
