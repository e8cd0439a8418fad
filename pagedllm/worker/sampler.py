"""The sampler: one token per request from the logits of its last scheduled position.

Order (as vLLM v1):
  0. structured output: the grammar's token bitmask (apply_grammar_bitmask, called by the runner
     on the constrained rows only);
  1. logprobs from the *raw* logits (log_softmax before any processing), if any row asks;
  2. logit_bias, min_tokens masking of stop ids, penalties (repetition, presence, frequency);
  3. greedy rows: argmax of the processed logits;
     random rows: / temperature, min_p, top_k, top_p, softmax, exponential race.

Everything is vectorised over the batch and the vocabulary; Python loops run over
requests only, to build metadata and to draw seeded noise from per-request generators.

Seeded requests: the caller makes ONE generator per request, once
(``torch.Generator(device).manual_seed(seed)``), keeps it for the life of the request
and passes the same object every step (on the logits' device). Each sample of a random row
advances it by ``vocab_size`` uniform draws (greedy rows never touch it), and every step of
the sampler is row-local, so a seeded request gets the same token sequence whatever other
requests share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from pagedllm.sampling_params import SamplingParams


def greedy_argmax(logits: torch.Tensor, ops=None) -> torch.Tensor:
    """logits [B, V] -> [B] int64, torch.argmax(dim=-1)'s answer (first index of the largest, a
    NaN the largest). ops: the C++ extension (csrc/argmax.cpp) for CPU logits, or None: torch's
    CPU argmax takes ~1 element a cycle, 5 ms a 128-row step over SmolLM2's 49,152 logits."""
    if (
        ops is not None
        and logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.dim() == 2
        and logits.shape[1] > 0
        and logits.stride(1) == 1
    ):
        return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32, 0 = greedy row
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor  # [B] float32, 1 = off
    top_k: torch.Tensor  # [B] int64, vocab_size = off
    min_p: torch.Tensor  # [B] float32, 0 = off
    no_top_p: bool
    no_top_k: bool
    no_min_p: bool
    repetition_penalties: torch.Tensor  # [B] float32, 1 = off
    presence_penalties: torch.Tensor  # [B] float32, 0 = off
    frequency_penalties: torch.Tensor  # [B] float32, 0 = off
    no_penalties: bool
    # Padded with vocab_size (a dummy column dropped after counting); None when no_penalties.
    prompt_token_ids: Optional[torch.Tensor]  # [B, max_prompt_len] int64
    output_token_ids: Optional[torch.Tensor]  # [B, max_output_len] int64
    # Sparse (row, token, value) triples; None when no row has them.
    logit_bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # [N] int64, [N] int64, [N] f32
    min_tokens_mask: Optional[tuple[torch.Tensor, torch.Tensor]]  # [M] int64 rows, [M] int64 ids
    max_top_k: Optional[int] = None  # largest top_k that is on (None when no_top_k)
    random_rows: Optional[torch.Tensor] = None  # [R] int64 rows that sample; None when all do
    random_row_list: list[int] = field(default_factory=list)  # the same, for the generator loop
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # batch row -> generator
    max_num_logprobs: Optional[int] = None  # k of the widest logprobs request; None: no row asks

    @property
    def no_logit_bias(self) -> bool:
        return self.logit_bias is None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[Optional[torch.Generator]],
        stop_ids_for_min_tokens: Sequence[set[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> "SamplingMetadata":
        """Metadata for a batch, row i = request i.

        ``generators[i]``: the request's own persistent generator (see module docstring) or None.
        ``stop_ids_for_min_tokens[i]``: the ids that would end request i (its stop ids, plus
        EOS unless ignore_eos); they are masked while ``len(output_token_ids[i]) < min_tokens``.
        Token ids >= vocab_size in logit_bias / stop ids are ignored here: validating them is
        the input processor's job, and one bad request must not fail the whole batch.
        """
        B, V = len(params), vocab_size
        assert len(prompt_token_ids) == len(output_token_ids) == len(generators) == len(stop_ids_for_min_tokens) == B
        greedy = [p.greedy for p in params]
        # Sampling-only knobs are neutralised on greedy rows so that the flags only
        # count rows where they matter.
        temps = [0.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        top_p = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy)]
        top_k = [V if g or p.top_k == -1 else min(p.top_k, V) for p, g in zip(params, greedy)]
        min_p = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]
        rep = [float(p.repetition_penalty) for p in params]
        pres = [float(p.presence_penalty) for p in params]
        freq = [float(p.frequency_penalty) for p in params]
        no_penalties = all(r == 1.0 and a == 0.0 and b == 0.0 for r, a, b in zip(rep, pres, freq))
        random_list = [i for i, g in enumerate(greedy) if not g]
        on_k = [k for k in top_k if k < V]
        return cls(
            temperature=_f32(temps, device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_p=_f32(top_p, device),
            top_k=_i64(top_k, device),
            min_p=_f32(min_p, device),
            no_top_p=all(x >= 1.0 for x in top_p),
            no_top_k=not on_k,
            max_top_k=max(on_k, default=None),
            random_rows=None if len(random_list) in (0, B) else _i64(random_list, device),
            random_row_list=random_list,
            no_min_p=all(x <= 0.0 for x in min_p),
            repetition_penalties=_f32(rep, device),
            presence_penalties=_f32(pres, device),
            frequency_penalties=_f32(freq, device),
            no_penalties=no_penalties,
            prompt_token_ids=None if no_penalties else _pad(prompt_token_ids, V, device),
            output_token_ids=None if no_penalties else _pad(output_token_ids, V, device),
            logit_bias=_logit_bias(params, V, device),
            min_tokens_mask=_min_tokens_mask(params, output_token_ids, stop_ids_for_min_tokens, V, device),
            generators={i: g for i, g in enumerate(generators) if g is not None and not greedy[i]},
            max_num_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=None),
        )


def _f32(xs: list[float], device) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32, device=device)


def _i64(xs: list[int], device) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64, device=device)


def _logit_bias(params: Sequence[SamplingParams], V: int, device):
    """Every row's logit_bias as sparse (rows [N], token ids [N], values [N]); None if no row has one."""
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        for t, v in (p.logit_bias or {}).items():
            if 0 <= t < V:
                rows.append(i)
                ids.append(t)
                values.append(v)
    return (_i64(rows, device), _i64(ids, device), _f32(values, device)) if rows else None


def _min_tokens_mask(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    stop_ids: Sequence[set[int]],
    V: int,
    device,
):
    """(rows [M], token ids [M]) of the stop ids masked in rows still short of min_tokens; None if none."""
    rows, ids = [], []
    for i, (p, out, stops) in enumerate(zip(params, output_token_ids, stop_ids)):
        if len(out) < p.min_tokens:
            for t in stops:
                if 0 <= t < V:
                    rows.append(i)
                    ids.append(t)
    return (_i64(rows, device), _i64(ids, device)) if rows else None


def _pad(rows: Sequence[Sequence[int]], pad: int, device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=torch.int64, device=device).view(
        len(rows), width
    )  # [B, width]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprob_token_ids: Optional[torch.Tensor]  # [B, k+1] int64: sampled token first, then the top-k
    logprobs: Optional[torch.Tensor]  # [B, k+1] float32
    sampled_token_ranks: Optional[torch.Tensor]  # [B] int64, 1 = most likely under the raw logits


class Sampler:
    """Stateless: all per-request state lives in SamplingMetadata (and the callers' generators).
    argmax_ops: the C++ extension the greedy argmax of CPU logits runs on (built at load time), or
    None (torch's argmax)."""

    def __init__(self, argmax_ops=None) -> None:
        self.argmax_ops = argmax_ops

    def __call__(self, logits: torch.Tensor, md: Optional[SamplingMetadata]) -> SamplerOutput:
        """md None: every row is plain greedy (SamplingParams.plain_greedy), so the tokens are
        the logits' argmax and no metadata is built (a batch-1 step saves ~0.3 ms)."""
        if md is None:
            return SamplerOutput(greedy_argmax(logits, self.argmax_ops), None, None, None)
        logits = logits.float()  # [B, V]; no copy when already float32
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]

        logits = apply_logits_processors(logits, md)
        if md.all_greedy:
            sampled = greedy_argmax(logits, self.argmax_ops)
        elif md.all_random:
            sampled = _sample_random(logits, md)
        else:
            # Only the random rows pay for filtering and noise.
            sampled = greedy_argmax(logits, self.argmax_ops)
            sampled[md.random_rows] = _sample_random(logits, md)

        if raw_logprobs is None:
            return SamplerOutput(sampled, None, None, None)
        ids, lps, ranks = gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled, ids, lps, ranks)


_BIT = torch.arange(32, dtype=torch.int32)  # bit j of a bitmask word allows token 32 * word + j


def apply_grammar_bitmask(
    logits: torch.Tensor, bitmask, bitmask_req_ids: Sequence[str], row_req_ids: Sequence[str]
) -> None:
    """Structured output: -inf, in place, on the tokens each constrained row's grammar forbids,
    before any other processing (so greedy, temperature, top-k / top-p and logprobs all see the
    mask). ``logits``: [B, V], row i = request row_req_ids[i]; ``bitmask``: numpy int32
    [R, ceil(V' / 32)], row j = request bitmask_req_ids[j] (V' >= V: the grammar engine's width
    may be padded). Rows without a grammar are not touched."""
    where = {rid: i for i, rid in enumerate(row_req_ids)}
    pairs = [(where[rid], j) for j, rid in enumerate(bitmask_req_ids) if rid in where]
    if not pairs:
        return
    V = logits.shape[1]
    rows = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
    words = torch.from_numpy(bitmask)[[p[1] for p in pairs]]  # [R, W] int32
    allowed = ((words[:, :, None] >> _BIT) & 1).view(len(pairs), -1)[:, :V].bool()  # [R, V]
    if allowed.shape[1] < V:  # logits wider than the grammar's vocabulary: padding ids stay forbidden
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]), value=False)
    rows, allowed = rows.to(logits.device), allowed.to(logits.device, non_blocking=True)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """logit_bias, min_tokens masking and penalties; returns a new tensor when any applies
    (the caller's logits are never written)."""
    if md.logit_bias is None and md.min_tokens_mask is None and md.no_penalties:
        return logits
    logits = logits.clone()
    if md.logit_bias is not None:
        rows, ids, vals = md.logit_bias
        logits.index_put_((rows, ids), vals, accumulate=True)
    if md.min_tokens_mask is not None:
        logits.index_put_(md.min_tokens_mask, torch.tensor(float("-inf"), device=logits.device))
    if not md.no_penalties:
        logits = apply_penalties(
            logits,
            md.prompt_token_ids,
            md.output_token_ids,
            md.repetition_penalties,
            md.presence_penalties,
            md.frequency_penalties,
        )
    return logits


def apply_penalties(logits, prompt_ids, output_ids, rep, pres, freq) -> torch.Tensor:
    """vLLM / OpenAI penalties. Repetition (prompt + output tokens): divide positive logits,
    multiply negative ones. Presence / frequency (output tokens only):
    ``logit -= frequency * count + presence * (count > 0)``. Ids are padded with V."""
    B, V = logits.shape
    counts = torch.zeros(B, V + 1, dtype=torch.int64, device=logits.device)  # [B, V+1]
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids))
    counts = counts[:, :V]
    seen = torch.zeros(B, V + 1, dtype=torch.bool, device=logits.device)  # [B, V+1]
    seen.scatter_(1, prompt_ids, True)
    seen = seen[:, :V] | (counts > 0)
    # Rows with penalty 1 keep their logits bit for bit (x / 1 and x * 1 are exact).
    p = torch.where(seen, rep[:, None], 1.0)  # [B, V]
    logits = torch.where(logits > 0, logits / p, logits * p)
    logits -= freq[:, None] * counts
    logits -= pres[:, None] * (counts > 0)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p * max probability`` of their row."""
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


# Widths of the candidate sets tried for top-p before sorting the whole vocabulary.
_TOP_P_CANDIDATES = (128, 1024)


def apply_top_k_top_p(
    logits: torch.Tensor, k: Optional[torch.Tensor], p: Optional[torch.Tensor], max_k: Optional[int] = None
) -> torch.Tensor:
    """Keep the k largest logits, then the smallest set of the remaining tokens, most likely
    first, whose renormalised probability reaches p (at least one token). Ties with the last
    kept value are kept too. ``k``: [B] int64, >= V = off; ``p``: [B] float32, 1 = off;
    ``max_k``: the largest k that is on, if the caller knows it (saves a device sync).

    Both filters reduce to a per-row threshold computed from a short sorted prefix, so a
    row's result does not depend on which other rows (or which path) share the batch.
    """
    B, V = logits.shape
    if k is not None:
        off = k >= V
        if max_k is None:
            max_k = int(k.masked_fill(off, 1).max()) if B else 1
        top = logits.topk(min(max_k, V), dim=-1).values  # [B, max_k] descending
        kth = top.gather(1, (k.clamp(max=max_k) - 1)[:, None])  # [B, 1]
        kth = kth.masked_fill(off[:, None], float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p is None:
        return logits
    off = p >= 1.0
    probs = logits.softmax(dim=-1)  # [B, V], renormalised after top-k
    # The top-p set is a prefix of the descending order: look at a few candidates first and
    # widen only when some row's candidates do not reach its p.
    for w in (*(c for c in _TOP_P_CANDIDATES if c < V), V):
        cand = probs.topk(w, dim=-1).values  # [B, w] descending
        cum = cand.cumsum(dim=-1)  # [B, w]
        if w == V or bool(((cum[:, -1] >= p) | off).all()):
            break
    above = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=1)  # mass strictly above each
    n_keep = (above < p[:, None]).sum(dim=-1)  # [B], >= 1 since p > 0
    thresh = cand.gather(1, (n_keep - 1)[:, None]).masked_fill(off[:, None], 0.0)  # [B, 1]
    return logits.masked_fill(probs < thresh, float("-inf"))


def random_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution the random rows (all rows, or md.random_rows) sample from: / temperature,
    min_p, top_k, top_p, softmax -> [R, V] float32 (the rejection sampler's target too)."""
    rows = md.random_rows
    temp, top_k, top_p, min_p = md.temperature, md.top_k, md.top_p, md.min_p
    if rows is not None:
        logits, temp, top_k, top_p, min_p = (t[rows] for t in (logits, temp, top_k, top_p, min_p))
    logits = logits / temp[:, None]
    if not md.no_min_p:
        logits = apply_min_p(logits, min_p)
    logits = apply_top_k_top_p(logits, None if md.no_top_k else top_k, None if md.no_top_p else top_p, md.max_top_k)
    return logits.softmax(dim=-1)  # [R, V]


def _sample_random(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Samples the random rows (all rows, or md.random_rows); returns [R] int64."""
    rows = md.random_rows
    probs = random_probs(logits, md)  # [R, V]
    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i.
    # E = -log(U), U ~ U[0, 1): several times faster than exponential_() on CPU, and never 0
    # (U = 0 gives E = inf, which only drops that token in a 2**-24 event).
    u = torch.empty_like(probs)  # [R, V]
    if len(md.generators) < probs.shape[0]:
        u.uniform_()
    local = range(probs.shape[0]) if rows is None else md.random_row_list
    for j, row in enumerate(local):
        gen = md.generators.get(row)
        if gen is not None:
            u[j].uniform_(generator=gen)
    return probs.div_(u.log_().neg_()).argmax(dim=-1)


def gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, k: int):
    """([B, k+1] ids, [B, k+1] logprobs, [B] ranks): the sampled token first, then the top k."""
    top_lp, top_ids = raw_logprobs.topk(k, dim=-1)  # [B, k], sorted descending
    sampled_lp = raw_logprobs.gather(1, sampled[:, None])  # [B, 1]
    ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1  # [B]
    ids = torch.cat([sampled[:, None], top_ids], dim=1)
    lps = torch.cat([sampled_lp, top_lp], dim=1)
    return ids, lps, ranks
