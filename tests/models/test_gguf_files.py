"""GGUF files served as they are, for every registered architecture (models/gguf/): config and
tokenizer from the metadata against transformers' own GGUF reader (the independent reference,
run once per file); files written by the make-gguf writer (its tensor names are the gguf
package's table, not the loader's) load and agree greedily with transformers on the same file's
dequantised weights; the 5-bit blocks repack exactly against the gguf package's dequantisation;
a file the engine cannot serve is refused before any weight is read."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

from pagedllm.benchmarks.llama_cpp_tools import missing_tools, tool_path
from pagedllm.models.gguf.writer import write_gguf
from pagedllm.models.layers.quantization.gguf import gguf_model_dir

TEXTS = [
    "Hello world, <|im_start|>user\nhi<|im_end|>",
    "  two  spaces\tand\ttabs\n\n",
    "naïve café 日本語 🙂 1234567",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>",
    "<bos>x</s><eos>",
    "def f(x):\n    return x**2  # comment",
    "The capital of France is",
]
CONFIG_FIELDS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "vocab_size",
    "sliding_window",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "rope_parameters",
    "layer_types",
    "query_pre_attn_scalar",
    "hidden_activation",
)
GREEDY_TOKENS = 16


@pytest.fixture(autouse=True)
def _int16_activations(monkeypatch):
    """The greedy bounds here are against transformers' float model: the GGUF kernels run with
    int16 activations (PAGEDLLM_GGUF_ACTIVATIONS), which keep the float model's tokens; the int8
    default's quality is proved by perplexity against llama.cpp (tests/benchmarks/
    test_llama_cpp_perplexity.py) and its own agreement bound (tests/models/test_quantization.py)."""
    monkeypatch.setenv("PAGEDLLM_GGUF_ACTIVATIONS", "int16")


def _real_file(which):
    from pagedllm.models.download import find_gemma3_gguf, find_gguf

    return find_gguf() if which == "smollm2-q4_1" else find_gemma3_gguf(progress=False)


def _greedy_agreement(ours, ref) -> float:
    """Share of the reference's tokens before each prompt's first divergence."""
    same = sum(next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r)) for o, r in zip(ours, ref))
    return same / sum(len(r) for r in ref)


def _hf_greedy(model, prompts, n):
    """Argmax of transformers' forward n times per prompt, over its own KV cache (generate()
    would suppress EOS, which the engine's ignore_eos leaves in)."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            out, ids = model(torch.tensor([p]), use_cache=True, logits_to_keep=1), []
            while True:
                ids.append(int(out.logits[0, -1].argmax()))
                if len(ids) == n:
                    break
                out = model(torch.tensor([ids[-1:]]), cache=out.cache, use_cache=True)
            outs.append(ids)
    return outs


def _divergence_gaps(model, prompts, ours, ref) -> list[float]:
    """At each prompt's first divergence: the reference's logit of its own token minus that of
    ours (small where the choice was a near tie that rounding may flip)."""
    gaps = []
    with torch.no_grad():
        for p, o, r in zip(prompts, ours, ref):
            d = next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None)
            if d is not None:
                logits = model(torch.tensor([p + r[:d]])).logits[0, -1]
                gaps.append(float(logits[r[d]] - logits[o[d]]))
    return gaps


def _engine_greedy(model, prompts, n, **kw):
    from pagedllm import LLM, SamplingParams

    llm = LLM(str(model), enable_prefix_caching=False, kv_cache_memory=2**27, max_num_seqs=8, **kw)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.model
@pytest.mark.parametrize("which", ["smollm2-q4_1", "gemma3-q4_k_m"])
def test_config_and_tokenizer_match_transformers_reader(which, tmp_path):
    from transformers import AutoConfig

    path = _real_file(which)
    model_dir = gguf_model_dir(path, tmp_path)
    _check_config(AutoConfig.from_pretrained(model_dir), AutoConfig.from_pretrained(path.parent, gguf_file=path.name))
    _check_tokenizer(model_dir, path)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text"])
def test_written_files_config_matches_the_source_model(model_type, tmp_path):
    """The config read back from a written file is the one it was written from (transformers'
    reader is no reference here: it drops Qwen3's head_dim, Qwen3-MoE's expert size, Gemma 3's
    attention scale and reads Mixtral as Llama); its tokenizer is transformers' reading."""
    from transformers import AutoConfig

    source = _tiny_hf(model_type)
    path = write_gguf(source, tmp_path / "m.gguf", "Q8_0")
    model_dir = gguf_model_dir(path, tmp_path)
    ours = AutoConfig.from_pretrained(model_dir)
    # Mistral is written as "llama" (as llama.cpp does) and served by the same model class.
    assert ours.model_type == {"mistral": "llama"}.get(model_type, model_type)
    _check_config(ours, source.config, skip=("model_type", "bos_token_id", "eos_token_id", "pad_token_id"))
    _check_tokenizer(model_dir, path)


def _check_config(ours, ref, skip=()):
    fields = CONFIG_FIELDS + (
        "num_local_experts",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
    )
    for field in fields:
        if field not in skip:
            a, b = getattr(ours, field, None), getattr(ref, field, None)
            assert a == (pytest.approx(b, rel=1e-7) if isinstance(b, float) else b), field  # GGUF floats: float32
    head_dim = lambda c: getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads  # noqa: E731
    assert head_dim(ours) == head_dim(ref)


def _check_tokenizer(model_dir, path):
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(model_dir)
    ref = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        assert ours(text).input_ids == ref(text).input_ids, text
    assert (ours.bos_token, ours.eos_token, ours.chat_template) == (ref.bos_token, ref.eos_token, ref.chat_template)


# What each architecture's tiny model sets beyond TINY (llama.cpp's assumptions included: Qwen3-MoE
# renormalises its top-k, Gemma 3 has a global layer every 6th and scales attention by head_dim).
TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=2048,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
    tie_word_embeddings=True,
)
TINY_ARCH = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": dict(tie_word_embeddings=False, sliding_window=None),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
    "gemma3_text": dict(num_hidden_layers=6, sliding_window=4, query_pre_attn_scalar=64),
}


def _tiny_hf(model_type, seed=0):
    """A tiny transformers model of the architecture, weights wide enough (std 0.1) that the
    greedy choice is rarely a near tie."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {**TINY, **TINY_ARCH[model_type]}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw)).eval()
    if model_type == "qwen2":  # q/k/v biases are zeros at init: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    return model


def _check_written_file(path, ref, what):
    """The engine serving the file's blocks (activations rounded to integers in its kernels)
    against the reference model: most greedy tokens agree, and where a prompt diverges the
    reference itself all but tied (a wrong tensor name, permutation or block decoding moves
    logits by about their spread, ~1 here)."""
    prompts = [[5 + i, (17 * i) % 500 + 3, 100 + i, 250, 7 * i + 1] for i in range(8)]
    ref_out = _hf_greedy(ref, prompts, GREEDY_TOKENS)
    assert len({t for r in ref_out for t in r}) > 4, "a degenerate reference (one repeated token) proves nothing"
    ours = _engine_greedy(path, prompts, GREEDY_TOKENS)
    agree, gaps = _greedy_agreement(ours, ref_out), _divergence_gaps(ref, prompts, ours, ref_out)
    print(f"{what}: {agree:.1%} agree; gaps at the divergences {gaps}")
    assert agree >= 0.75 and all(g < 0.05 for g in gaps)


@pytest.mark.parametrize(
    "model_type,qtype", [("qwen2", "Q8_0"), ("mistral", "Q4_0"), ("mistral", "Q5_0"), ("qwen2", "Q4_1")]
)
def test_written_file_agrees_with_transformers(model_type, qtype, tmp_path, monkeypatch):
    """The writer's file as transformers reads it (gguf_file=: its own dequantisation and Q/K
    un-permutation) against the engine serving it."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PAGEDLLM_HOME", str(tmp_path / "home"))
    path = write_gguf(_tiny_hf(model_type), tmp_path / f"{model_type}.gguf", qtype)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    _check_written_file(path, ref, f"{model_type} {qtype}")


def _quantize_like_the_file(model, file_type):
    """The model's weights as the writer's file holds them: each matrix in the type the file
    gives it (its llama.cpp name from the gguf package's table), dequantised by the gguf package."""
    from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map
    from gguf.quants import dequantize
    from pagedllm.models.gguf.file_types import tensor_type
    from pagedllm.models.gguf.writer import GGUF_ARCH, quantize_rows

    cfg = model.config
    arch = next(a for a in MODEL_ARCH if MODEL_ARCH_NAMES[a] == GGUF_ARCH[cfg.model_type])
    names = get_tensor_name_map(arch, cfg.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights once
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias")) or "experts"
            t = tensor_type(file_type, gguf_name, tuple(p.shape), cfg.num_hidden_layers, not cfg.tie_word_embeddings)
            if t != "F32":
                w = dequantize(quantize_rows(p.float().numpy(), t), GGMLQuantizationType[t])
                p.copy_(torch.from_numpy(w.reshape(p.shape)))
    return model


@pytest.mark.parametrize(
    "model_type,qtype",
    [
        ("llama", "Q4_0"),
        ("llama", "Q4_K_M"),
        ("qwen3", "Q8_0"),
        ("qwen3", "Q5_K"),
        ("qwen3_moe", "Q4_1"),
        ("mixtral", "Q5_0"),
        ("gemma3_text", "Q4_K_M"),
    ],
)
def test_every_architecture_agrees_with_its_dequantised_hf_model(model_type, qtype, tmp_path, monkeypatch):
    """Each registered architecture's file (llama.cpp's names, Q/K order, Gemma's norm + 1,
    stacked experts) against transformers' own class holding the same dequantised weights."""
    monkeypatch.setenv("PAGEDLLM_HOME", str(tmp_path / "home"))
    model = _tiny_hf(model_type)
    path = write_gguf(model, tmp_path / f"{model_type}.gguf", qtype)
    ref = _quantize_like_the_file(model, qtype)
    _check_written_file(path, ref, f"{model_type} {qtype}")


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quantizers_decode_with_the_gguf_package(type_name):
    """The writer's K-type bytes, decoded by the gguf package, are each value to within half a
    step of its sub-block (the step a 6-bit scale can hold: up to one scale unit coarser)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from pagedllm.models.gguf.kquants import K_QUANTIZERS

    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 512)).astype(np.float32) * rng.uniform(0.01, 3, (6, 1)).astype(np.float32)
    x[0, :40], x[1] = 0, np.abs(x[1])  # an all-zero sub-block; a row without negatives
    err = np.abs(dequantize(K_QUANTIZERS[type_name](x), GGMLQuantizationType[type_name]) - x)
    sub, levels = (16, 63) if type_name == "Q6_K" else (32, 15 if type_name == "Q4_K" else 31)
    g = x.reshape(6, -1, sub)
    span = np.maximum(g.max(-1), 0) - np.minimum(g.min(-1), 0) if type_name != "Q6_K" else 2 * np.abs(g).max(-1)
    step = span / levels  # [6, groups]
    unit = step.reshape(6, -1, 256 // sub).max(-1, keepdims=True) / 60  # one 6-bit scale unit
    bound = 0.5 * (step.reshape(6, -1, 256 // sub) + 2 * unit) + 1e-6
    assert (err.reshape(6, -1, 256 // sub, sub) <= bound[..., None]).all()


def test_llama3_rope_scaling_recovered_from_rope_freqs():
    """Llama-3.2-1B's scaling -> rope_freqs.weight (convert_hf_to_gguf's arithmetic) -> the
    config's llama3 scaling -> the engine's inverse frequencies, equal to the original's."""
    from pagedllm.models.gguf.hf_config import llama3_scaling_from_factors
    from pagedllm.models.gguf.writer import llama3_rope_factors
    from pagedllm.models.layers.rotary_embedding import rope_inv_freq
    from pagedllm.models.random_model import SHAPES

    spec = SHAPES["llama-3.2-1b"]
    scaling = llama3_scaling_from_factors(
        llama3_rope_factors(spec["rope_scaling"], spec["rope_theta"], 64).astype(np.float64),
        spec["rope_theta"],
        64,
        "test",
    )
    assert scaling == {**spec["rope_scaling"], "low_freq_factor": 1.0}
    ours, _ = rope_inv_freq({"rope_theta": spec["rope_theta"], "rope_scaling": scaling}, 64)
    ref, _ = rope_inv_freq({"rope_theta": spec["rope_theta"], "rope_scaling": spec["rope_scaling"]}, 64)
    assert torch.equal(ours, ref)


def test_unservable_files_refused_before_loading(tmp_path):
    from gguf import GGUFWriter

    f16 = write_gguf(_tiny_hf("qwen2"), tmp_path / "f16.gguf", "F16")
    with pytest.raises(ValueError, match=r"tensor blk\.0\.attn_\w+\.weight has type F16"):
        gguf_model_dir(f16, tmp_path / "home")
    w = GGUFWriter(str(tmp_path / "bloom.gguf"), "bloom")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="architecture 'bloom' is not supported"):
        gguf_model_dir(tmp_path / "bloom.gguf", tmp_path / "home")
    assert not list((tmp_path / "home" / "gguf").glob("*-*")), "a refused file left a model directory"


@pytest.mark.model
def test_gemma3_own_file_served_as_it_is_agrees_with_transformers():
    """`--quantization gguf` for gemma3-270m serves its Q4_K_M file (Q5_0, Q4_K, Q6_K, Q8_0
    linears); transformers runs the float32 directory dequantised from that very file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from pagedllm.models.download import GEMMA3_MODEL, ensure_ready_model, resolve_model

    served = resolve_model(GEMMA3_MODEL, quantization="gguf")
    tok = AutoTokenizer.from_pretrained(served)
    prompts = [
        tok(t).input_ids
        for t in (
            "The capital of France is",
            "def fibonacci(n):",
            "Once upon a time",
            "The three primary colors are",
            "import numpy as np\n",
            "Water boils at",
            "My favourite book is",
            "1, 2, 3, 5, 8,",
        )
    ]
    ref = AutoModelForCausalLM.from_pretrained(
        ensure_ready_model(GEMMA3_MODEL, progress=False), dtype=torch.float32
    ).eval()
    ref_out = _hf_greedy(ref, prompts, GREEDY_TOKENS)
    agree = _greedy_agreement(_engine_greedy(served, prompts, GREEDY_TOKENS, quantization="gguf"), ref_out)
    print(f"gemma3-270m Q4_K_M as it is: {agree:.1%} of transformers' greedy tokens")
    assert agree >= 0.95


def test_make_gguf_cli_writes_the_shape(tmp_path, monkeypatch):
    """`pagedllm make-gguf`: the file's metadata and tensor types, read back with the gguf
    package, are the shape's (random_model.SHAPES) and the type asked for."""
    from gguf import GGUFReader
    from pagedllm.entrypoints.cli import main
    from pagedllm.models.random_model import SHAPES

    out = tmp_path / "tiny.gguf"
    assert main(["make-gguf", "--shape", "tiny", "--type", "Q8_0", "--out", str(out)]) == 0
    reader = GGUFReader(str(out))
    meta = {k: f.contents() for k, f in reader.fields.items()}
    spec = SHAPES["tiny"]
    assert (
        meta["general.architecture"],
        meta["llama.embedding_length"],
        meta["llama.block_count"],
        meta["llama.attention.head_count_kv"],
        len(meta["tokenizer.ggml.tokens"]),
    ) == ("llama", spec["hidden_size"], spec["num_hidden_layers"], spec["num_key_value_heads"], spec["vocab_size"])
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == types["output.weight"] == "Q8_0" and types["output_norm.weight"] == "F32"


@pytest.mark.skipif(
    bool(missing_tools(["llama-quantize"])),
    reason=f"llama.cpp's llama-quantize is not built on this machine (looked for "
    f"{tool_path('llama-quantize')}); `make llama-cpp` builds it (~15 min on 2 cores), "
    "which CI does not do",
)
@pytest.mark.parametrize("qtype", ["Q4_K_M", "Q4_0", "Q8_0"])
def test_llama_quantize_files_agree_with_transformers(qtype, tmp_path, monkeypatch):
    """The writer's F16 file quantized by llama.cpp's own llama-quantize (its type per tensor:
    Q4_K_M's Q4_K and Q6_K, Q4_0's Q6_K embedding), as transformers reads it, against the engine."""
    from transformers import AutoModelForCausalLM

    quantize = str(tool_path("llama-quantize"))
    monkeypatch.setenv("PAGEDLLM_HOME", str(tmp_path / "home"))
    (tmp_path / "src").mkdir()  # kept apart: transformers reads the one file in tmp_path
    f16 = write_gguf(_tiny_hf("llama"), tmp_path / "src" / "f16.gguf", "F16")
    path = tmp_path / f"llama.{qtype}.gguf"
    subprocess.run([quantize, str(f16), str(path), qtype], check=True, capture_output=True, timeout=300)
    from gguf import GGUFReader

    types = {t.tensor_type.name for t in GGUFReader(str(path)).tensors}
    assert types == {"F32", *{"Q4_K_M": ["Q4_K", "Q6_K"], "Q4_0": ["Q4_0", "Q6_K"], "Q8_0": ["Q8_0"]}[qtype]}, types
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    _check_written_file(path, ref, f"llama-quantize {qtype}")


@pytest.mark.usefixtures("cpu_isa")  # every build of the kernels this CPU runs
@pytest.mark.parametrize("qtype, kv", [("Q4_0", "auto"), ("Q4_K_M", "auto"), ("Q4_0", "bfloat16")])
def test_gguf_decode_step_equals_eager_layers(qtype, kv, tmp_path, monkeypatch):
    """A decode step of 1-16 rows on a GGUF model with int8 activations runs in one parallel
    region (csrc/gguf_decode_step.cpp): each step's hidden states equal the eager layers' (one
    gguf_linear call a linear) on the same inputs bit for bit, Q4_K_M's fused qkv of Q4_K and
    Q6_K rows included; 12 and 16 rows: two tiles a group, the work between linears in claims of
    a tile's rows taken by both threads. A bfloat16 cache: the step rounds K/V as the eager layers' torch
    writer does."""
    from pagedllm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PAGEDLLM_GGUF_ACTIVATIONS", "int8")  # the default, which the step takes
    path = write_gguf(_tiny_hf("llama"), tmp_path / f"llama.{qtype}.gguf", qtype)
    llm = LLM(str(path), enable_prefix_caching=False, kv_cache_memory=2**27, max_num_seqs=16, kv_cache_dtype=kv)
    runner = llm.llm_engine.core.model_executor.driver_worker.model_runner
    assert runner.kv_caches[0][0].dtype == {"auto": torch.float32, "bfloat16": torch.bfloat16}[kv]
    loop = runner.decode_loop
    assert loop is not None, "the engine did not build the C++ decode loop for the GGUF model"
    calls = []

    def checked(input_ids, positions):
        x = loop.embed_tokens(input_ids)
        assert loop.ext.gguf_decode_step_applies(x, loop.weights, len(loop.weights) // len(loop.attns), *loop.dims)
        calls.append(input_ids.shape[0])
        out = loop(input_ids, positions)
        assert torch.equal(out, runner.model(input_ids, positions)), input_ids.shape[0]
        return out

    checked.applies = loop.applies
    runner.decode_loop = checked
    prompts = [[5 + i, (17 * i) % 500 + 3, 100 + i, 250, 7 * i + 1][: 3 + i % 3] for i in range(16)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the claims shared by two threads, whatever the machine's count
    try:
        for n in (1, 3, 12, 16):
            llm.generate(
                [{"prompt_token_ids": p} for p in prompts[:n]],
                SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                use_tqdm=False,
            )
    finally:
        torch.set_num_threads(threads)
    assert set(calls) == {1, 3, 12, 16}, calls
