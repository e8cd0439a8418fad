"""--generation-config (vLLM's): the sampling defaults of a model's generation_config.json, on a
copy of `random:tiny` whose file sets them. top_k 1 makes the default sampling an argmax, and the
repetition penalty visibly changes the tiny model's greedy output (it repeats tokens), so "the
defaults applied" is checked against an explicit greedy request with that penalty, and "not
applied" against plain greedy."""

import json
import os

import pytest

from model_dirs import with_generation_config
from pagedllm import LLM, SamplingParams
from pagedllm.engine.generation_defaults import load_sampling_defaults

DEFAULTS = {"temperature": 0.7, "top_k": 1, "repetition_penalty": 1.5, "do_sample": True}
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7]}, {"prompt_token_ids": [9, 10, 11]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return with_generation_config("random:tiny", str(tmp_path_factory.mktemp("gen") / "tiny"), DEFAULTS)


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_the_file_is_read_as_vllm_reads_it(model_dir, tmp_path):
    want = {"temperature": 0.7, "top_k": 1, "repetition_penalty": 1.5}  # do_sample is not a default
    assert load_sampling_defaults("auto", model_dir) == want
    assert load_sampling_defaults("vllm", model_dir) == {}
    assert load_sampling_defaults(model_dir, str(tmp_path)) == want  # a folder: its file
    assert load_sampling_defaults("auto", str(tmp_path)) == {}  # no file: no defaults
    with pytest.raises(ValueError, match="generation_config: .*generation_config.json does not exist"):
        load_sampling_defaults(str(tmp_path), model_dir)
    with open(os.path.join(tmp_path, "generation_config.json"), "w") as f:
        json.dump({"top_p": 1.5}, f)
    with pytest.raises(ValueError, match="generation_config: .*top_p"):
        load_sampling_defaults(str(tmp_path), model_dir)


def test_generate_without_params_takes_the_defaults_and_vllm_ignores_them(model_dir):
    llm = LLM(model_dir)
    assert llm.get_default_sampling_params().repetition_penalty == 1.5
    defaulted = tokens(llm.generate(PROMPTS, use_tqdm=False))
    penalised = tokens(
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=16), use_tqdm=False)
    )
    greedy = tokens(llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False))
    assert defaulted == penalised
    assert penalised != greedy  # the penalty shows
    plain = LLM(model_dir, generation_config="vllm")
    assert plain.get_default_sampling_params().repetition_penalty == 1.0
    assert plain.get_default_sampling_params().top_k == -1


def test_a_bad_folder_is_refused_at_start_up(tmp_path):
    with pytest.raises(ValueError, match="generation_config: .* does not exist"):
        LLM("random:tiny", generation_config=str(tmp_path))
