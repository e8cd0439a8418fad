"""Steps replayed from captured CUDA graphs: decode steps, and (cudagraph_mode FULL) mixed
prefill + decode steps at padded token counts.

A step launches ~10 kernels a layer; at small batch the GPU finishes each one sooner than
Python launches the next, so the step is bound by launches. A CUDA graph records every launch
of one forward, once per size of a ladder, and replays them with one call. A graph reads fixed
addresses, so its inputs live in static buffers: a step copies its inputs in (through
page-locked host buffers, worker/pinned_staging.py) and pads up to the next captured size.

Two kinds of graph (`StepGraphs`):
- decode: a size is a batch of one-token requests (config.cuda_graph_ladder). A padding row
  is a one-token request of length 1 whose K/V are not written (slot -1) and whose output is
  dropped; it reads one slot of a block it does not own, harmlessly.
- mixed: a size is a number of tokens T, split in any way among up to R = min(T, max_num_seqs)
  requests (config.mixed_graph_ladder). The attention kernel's grid depends only on T and R
  (attention/backends/triton_attn/), and it finds each program's request from query_start_loc on the device,
  so one graph serves every split: padding requests own no tokens (their query_start_loc
  entries all equal the real token count) and padding tokens, past the last request's, are
  attended by no program and written nowhere (slot -1). The tile shapes are the prefill ones,
  as an eager mixed step takes them.

The attention metadata of a captured size is fixed at capture, over the static buffers: the
backend builds it (`AttentionBackend.build_graph_metadata`) so that one graph serves every
context length. The forward context is set around the capture (the layers read the metadata
then); a replay needs none.

capture=False runs the same padded static-buffer path eagerly: the CPU tests use it under
Triton's interpreter to check the padding; only a GPU checks the capture itself.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from pagedllm.forward_context import set_forward_context
from pagedllm.worker.pinned_staging import PinnedStaging

logger = logging.getLogger(__name__)


class StepGraphs:
    def __init__(
        self,
        runner,
        sizes: list[int],
        capture: bool = True,
        mixed: bool = False,
        max_reqs: int | None = None,
        pool=None,
    ) -> None:
        """sizes: batch sizes (decode) or token counts (mixed); max_reqs: a mixed step's most
        requests (max_num_seqs); pool: a graph memory pool to share (with the other kind)."""
        self.runner = runner
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        self.capture = capture
        self.mixed = mixed
        self.pool = pool
        dev, T = runner.device, self.max_size
        R = min(T, max_reqs) if mixed else T
        self.max_reqs = R
        max_blocks = runner.input_batch.max_num_blocks_per_req
        # Static inputs of the largest size; a smaller graph reads their first rows.
        self.input_ids = torch.zeros(T, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(T, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((T,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(R, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(R + 1, dtype=torch.int32, device=dev)  # decode: 1 token each
        self.block_table = torch.zeros((R, max_blocks), dtype=torch.int32, device=dev)
        # Their host side, page-locked: a step's copies into them then never wait for the GPU.
        specs = {
            "input_ids": ((T,), torch.int64),
            "positions": ((T,), torch.int64),
            "slot_mapping": ((T,), torch.int64),
            "seq_lens": ((R,), torch.int32),
            "block_table": ((R, max_blocks), torch.int32),
        }
        if mixed:
            specs["query_start_loc"] = ((R + 1,), torch.int32)
        self.staging = PinnedStaging(specs, torch.device(dev))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> static hidden [size, hidden]
        if capture:
            self._capture_all()

    def _reqs(self, size: int) -> int:
        """Requests a graph of this size is recorded with."""
        return min(size, self.max_reqs)

    def _meta(self, size: int):
        r, n = self.runner, self._reqs(size)
        return r.attn_backend.build_graph_metadata(
            self.slot_mapping[:size],
            self.query_start_loc[: n + 1],
            self.seq_lens[:n],
            self.block_table[:n],
            r.num_kv_heads,
            r.block_size,
            r.max_model_len,
            max_query_len=size if self.mixed else 1,
        )

    def _forward(self, size: int, meta) -> torch.Tensor:
        with set_forward_context(meta):
            return self.runner.model(self.input_ids[:size], self.positions[:size])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        before = torch.cuda.mem_get_info()[0]
        if self.mixed:  # a valid layout to warm up on: every request one token, the rest padding
            n = self.max_reqs
            self.query_start_loc.copy_(torch.arange(n + 1, dtype=torch.int32))
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its pool
            meta = self._meta(size)
            self._forward(size, meta)  # warm-up: Triton compiles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self._forward(size, meta)
            self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d %s CUDA graphs (%s %d..%d) in %.1f s, %.2f GiB",
            len(self.sizes),
            "mixed-step" if self.mixed else "decode",
            "tokens" if self.mixed else "batch sizes",
            self.sizes[0],
            self.max_size,
            time.perf_counter() - t0,
            (before - torch.cuda.mem_get_info()[0]) / 2**30,
        )

    def padded_size(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def can_run(self, inputs) -> bool:
        """decode: an all-decode step (one token per request) of at most the largest size;
        mixed: any step of at most the largest token count."""
        if self.mixed:
            return len(inputs.input_ids) <= self.max_size
        return inputs.max_query_len == 1 and len(inputs.req_ids) <= self.max_size

    def run(self, inputs) -> torch.Tensor:
        """This step's hidden states [num_tokens, hidden] (a view of the graph's output)."""
        n, r = len(inputs.input_ids), len(inputs.req_ids)
        size = self.padded_size(n)
        nb = -(inputs.max_seq_len // -self.runner.block_size)
        st = self.staging
        st.begin()
        st.copy_to("input_ids", inputs.input_ids, self.input_ids[:n])
        st.copy_to("positions", inputs.positions, self.positions[:n])
        st.copy_to("slot_mapping", inputs.slot_mapping, self.slot_mapping[:n])
        st.copy_to("seq_lens", inputs.seq_lens, self.seq_lens[:r])
        st.copy_to("block_table", inputs.block_table[:, :nb], self.block_table[:r, :nb])
        if self.mixed:
            st.copy_to("query_start_loc", inputs.query_start_loc, self.query_start_loc[: r + 1])
        st.end()
        if self.runner.async_outputs is not None:  # async scheduling: tokens still on the device
            self.runner.async_outputs.fill_placeholders(self.input_ids[:n], inputs)
        if n < size:  # padding tokens: written nowhere
            self.slot_mapping[n:size].fill_(-1)
        R = self._reqs(size)
        if self.mixed:  # padding requests own no tokens
            self.query_start_loc[r + 1 : R + 1].fill_(n)
            self.seq_lens[r:R].fill_(0)
        elif r < R:  # padding rows: one token over one slot
            self.seq_lens[r:R].fill_(1)
        if self.capture:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size, self._meta(size))[:n]


class CudaGraphs:
    """The runner's graphs: decode steps by batch size, then (if captured) mixed steps by token
    count; a step neither takes runs eagerly. Both kinds share one memory pool."""

    def __init__(self, runner, decode_sizes: list[int], mixed_sizes: list[int], capture: bool = True) -> None:
        self.decode = StepGraphs(runner, decode_sizes, capture) if decode_sizes else None
        pool = self.decode.pool if self.decode is not None else None
        self.mixed = (
            StepGraphs(runner, mixed_sizes, capture, mixed=True, max_reqs=runner.input_batch.max_num_reqs, pool=pool)
            if mixed_sizes
            else None
        )
        self.taken = None  # the StepGraphs the last can_run chose

    def can_run(self, inputs) -> bool:
        self.taken = next((g for g in (self.decode, self.mixed) if g is not None and g.can_run(inputs)), None)
        return self.taken is not None

    def run(self, inputs) -> torch.Tensor:
        return self.taken.run(inputs)
