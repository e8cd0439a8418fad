"""Greedy equality with transformers (docs/design.md, correctness rules): the reference's
tokens and top-2 logit gaps, and the comparison that allows only numerical ties."""
import torch

TIE_EPS = 1e-4


def hf_greedy(model, prompts, max_new_tokens: int, **generate_kw) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy generate per prompt -> (output token ids, top-2 logit gap per step)."""
    refs = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_new_tokens, output_logits=True,
                                 return_dict_in_generate=True, **generate_kw)
            gaps = []
            for step_logits in out.logits:
                top2 = step_logits[0].float().topk(2).values
                gaps.append(float(top2[0] - top2[1]))
            refs.append((out.sequences[0, len(p):].tolist(), gaps))
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
                    f"transformers gives {b} (top-2 gap {gaps[j]:.3g} is no tie)")
                ties += 1
                break
        else:
            assert len(ours) == len(ref), f"[{label}] prompt {i}: {len(ours)} tokens vs {len(ref)}"
    print(f"[{label}] {len(outputs)} prompts equal to transformers; numerical ties met: {ties}")
    assert ties <= max_ties, f"[{label}] too many ties ({ties}) to be chance"
