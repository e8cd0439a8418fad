"""Greedy equality with transformers (docs/design.md, correctness rules): the reference's
tokens and top-2 logit gaps, and the comparison that allows only numerical ties."""

import torch

TIE_EPS = 1e-4


def hf_greedy(model, prompts, max_new_tokens: int, **generate_kw) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy generate per prompt -> (output token ids, top-2 logit gap per step)."""
    refs = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                output_logits=True,
                return_dict_in_generate=True,
                **generate_kw,
            )
            gaps = []
            for step_logits in out.logits:
                top2 = step_logits[0].float().topk(2).values
                gaps.append(float(top2[0] - top2[1]))
            refs.append((out.sequences[0, len(p) :].tolist(), gaps))
    return refs


def hf_greedy_batched(
    model, prompts, max_new_tokens: int, pad_token_id: int = 0
) -> list[tuple[list[int], list[float]]]:
    """hf_greedy's result from one left-padded generate over all prompts (64 steps of a batch
    instead of 64 steps per prompt): each row is cut after its first EOS, as generate alone
    would stop there. Padding changes the reference's logits only by float rounding, which the
    tie rule already allows for."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=pad_token_id,
        )
        top2 = torch.stack(out.logits, 1).float().topk(2, dim=-1).values  # [B, steps, 2]
    refs = []
    for i in range(len(prompts)):
        toks = out.sequences[i, width:].tolist()
        n = next((j + 1 for j, t in enumerate(toks) if t in eos), len(toks))
        refs.append((toks[:n], (top2[i, :n, 0] - top2[i, :n, 1]).tolist()))
    return refs


def assert_greedy_equal(outputs, reference, label: str, max_ties: int = 2) -> None:
    """Our RequestOutputs equal the reference token for token; where they first differ the
    reference's top-2 logits must be within TIE_EPS (a tie; that sequence's comparison ends)."""
    ties = 0
    for i, (out, (ref, gaps)) in enumerate(zip(outputs, reference)):
        ours = out.outputs[0].token_ids
        for j, (a, b) in enumerate(zip(ours, ref)):
            if a != b:
                assert gaps[j] < TIE_EPS, (
                    f"[{label}] prompt {i} (len {len(out.prompt_token_ids)}): token {j} is {a}, "
                    f"transformers gives {b} (top-2 gap {gaps[j]:.3g} is no tie)"
                )
                ties += 1
                break
        else:
            assert len(ours) == len(ref), f"[{label}] prompt {i}: {len(ours)} tokens vs {len(ref)}"
    print(f"[{label}] {len(outputs)} prompts equal to transformers; numerical ties met: {ties}")
    assert ties <= max_ties, f"[{label}] too many ties ({ties}) to be chance"
