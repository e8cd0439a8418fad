"""RejectionSampler: verifies draft tokens against the target's logits so that the tokens it emits
follow the target's own distribution exactly (speculative sampling, Leviathan et al. / Chen et
al.; vLLM v1's rejection_sampler).

For a request with k drafts the target scored k + 1 positions: position j's logits give the
distribution p_j of the token after drafts 0..j-1. Draft j (drawn from q_j) is accepted with
probability min(1, p_j(x) / q_j(x)); at the first rejection the token is drawn from
norm(max(0, p_j - q_j)) instead, and when every draft is accepted a bonus token is drawn from
p_k. Taking q_k = 0 makes the bonus the same rule. Greedy requests: p is the argmax, so a
draft is accepted when it equals the target's argmax, and the target's argmax follows.
The n-gram proposer has no distribution: q is one-hot at its token (as vLLM).

p is the target's *processed* distribution (logit bias, min_tokens, penalties, temperature,
min_p, top-k, top-p: the sampler's own functions), computed per position with the drafts
before it counted as output. Seeded requests draw from their own generator, k uniforms then V
for the last token, so a seeded request's tokens do not depend on its batch.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from pagedllm.worker.sampler import SamplingMetadata, apply_logits_processors, random_probs


class RejectionSampler:
    def __call__(
        self,
        logits: torch.Tensor,
        draft_token_ids: Sequence[Sequence[int]],
        md: Optional[SamplingMetadata],
        generators: Sequence[Optional[torch.Generator]],
        draft_probs: Optional[torch.Tensor] = None,
    ) -> list[list[int]]:
        """logits [N, V]: request b's k_b + 1 positions, requests in order (N = sum(k_b + 1));
        draft_token_ids[b]: its k_b drafts (0 allowed: a plain sample); md: metadata of the N
        rows (None: every row plain greedy); generators[b]: request b's or None;
        draft_probs [B, K, V] (K = max k_b): the proposer's q, None for one-hot (n-gram).
        -> per request the accepted drafts followed by one sampled token."""
        B = len(draft_token_ids)
        ks = np.array([len(d) for d in draft_token_ids], dtype=np.int64)  # [B]
        K = int(ks.max()) if B else 0
        device = logits.device
        starts = np.concatenate([[0], np.cumsum(ks + 1)[:-1]])  # [B]
        # Row of logits for (request, position), positions past k_b clamped (never used).
        idx = torch.from_numpy(starts[:, None] + np.minimum(np.arange(K + 1)[None, :], ks[:, None])).to(
            device
        )  # [B, K+1]
        drafts_np = np.zeros((B, K), dtype=np.int64)
        for b, d in enumerate(draft_token_ids):
            drafts_np[b, : len(d)] = d
        drafts = torch.from_numpy(drafts_np).to(device)  # [B, K]
        valid = torch.from_numpy(np.arange(K)[None, :] < ks[:, None]).to(device)  # [B, K]
        logits = logits.float()
        if md is not None:
            logits = apply_logits_processors(logits, md)
        target_argmax = logits.argmax(dim=-1)[idx]  # [B, K+1]
        accepted = valid & (drafts == target_argmax[:, :K])  # greedy rule
        token = None
        random_req = None
        if md is not None and not md.all_greedy:
            random_req = md.temperature[torch.from_numpy(starts).to(device)] > 0  # [B] bool
            probs = torch.zeros_like(logits)  # [N, V]
            rows = md.random_rows if md.random_rows is not None else slice(None)
            probs[rows] = random_probs(logits, md)
            P = probs[idx]  # [B, K+1, V]
            p_draft = P[:, :K].gather(2, drafts[..., None])[..., 0]  # [B, K]
            q_draft = (
                torch.ones_like(p_draft) if draft_probs is None else draft_probs.gather(2, drafts[..., None])[..., 0]
            )  # [B, K]
            u_accept, u_token = self._uniforms(B, K, P.shape[-1], ks, generators, random_req, device)
            accepted_random = valid & (u_accept * q_draft < p_draft)  # u < p / q
            accepted = torch.where(random_req[:, None], accepted_random, accepted)
            n_acc = accepted.long().cumprod(dim=1).sum(dim=1)  # [B]
            ar = torch.arange(B, device=device)
            p_last = P[ar, n_acc]  # [B, V]
            residual = self.residual(p_last, n_acc, drafts, ks, draft_probs)
            # Exponential race over the unnormalised residual: argmax(r_i / E_i) picks i ~ r_i / sum r.
            sampled = residual.div_(u_token.log_().neg_()).argmax(dim=-1)  # [B]
            token = torch.where(random_req, sampled, target_argmax[ar, n_acc])
        else:
            n_acc = accepted.long().cumprod(dim=1).sum(dim=1)
            token = target_argmax[torch.arange(B, device=device), n_acc]
        n_acc_l, token_l, drafts_l = n_acc.tolist(), token.tolist(), drafts_np.tolist()
        return [drafts_l[b][: n_acc_l[b]] + [token_l[b]] for b in range(B)]

    @staticmethod
    def residual(
        p_last: torch.Tensor,
        n_acc: torch.Tensor,
        drafts: torch.Tensor,
        ks: np.ndarray,
        draft_probs: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """max(0, p - q) at each request's first rejected position (q = 0 at the bonus
        position) -> [B, V], unnormalised; p where it is all zero (p == q)."""
        B, K = drafts.shape
        ar = torch.arange(B, device=p_last.device)
        if draft_probs is None:  # one-hot q: p without the rejected draft token
            residual = p_last.clone()
            has_q = n_acc < torch.from_numpy(ks).to(p_last.device)
            if K:
                rejected_tok = drafts.gather(1, n_acc.clamp(max=K - 1)[:, None])[:, 0]
                residual[ar[has_q], rejected_tok[has_q]] = 0.0
        else:
            q_last = torch.nn.functional.pad(draft_probs, (0, 0, 0, 1))[ar, n_acc]  # [B, V], 0 at k_b
            residual = (p_last - q_last).clamp_(min=0.0)
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        return torch.where(empty, p_last, residual)

    @staticmethod
    def _uniforms(B: int, K: int, V: int, ks: np.ndarray, generators, random_req: torch.Tensor, device):
        """U[0, 1) for the acceptance tests [B, K] and the last token's race [B, V]; a seeded
        request draws its k_b, then V, from its own generator."""
        u_accept = torch.rand(B, K, device=device)
        u_token = torch.rand(B, V, device=device)
        for b in torch.nonzero(random_req).flatten().tolist():
            gen = generators[b]
            if gen is not None:
                k = int(ks[b])
                if k:
                    u_accept[b, :k].uniform_(generator=gen)
                u_token[b].uniform_(generator=gen)
        # U = 0 would make E = inf: that token would be dropped (a 2**-24 event, as the sampler).
        return u_accept, u_token
