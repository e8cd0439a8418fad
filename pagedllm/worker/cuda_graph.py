"""Decode steps replayed from captured CUDA graphs.

A decode step launches ~10 kernels a layer; at small batch the GPU finishes each one sooner
than Python launches the next, so the step is bound by launches. A CUDA graph records every
launch of one forward, once per batch size of a ladder (config.cuda_graph_ladder), and
replays them with one call. A graph reads fixed addresses, so its inputs live in static
buffers: a step copies its inputs in (through page-locked host buffers, worker/pinned_staging.py)
and pads the batch up to the next captured size. A padding row is a one-token request of
length 1 whose K/V are not written (slot -1) and whose output is dropped; it reads one slot of
a block it does not own, harmlessly.

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


class DecodeGraphs:
    def __init__(self, runner, sizes: list[int], capture: bool = True) -> None:
        self.runner = runner
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        self.capture = capture
        dev, B = runner.device, self.max_size
        max_blocks = runner.input_batch.max_num_blocks_per_req
        # Static inputs of the largest size; a size-b graph reads their first b rows.
        self.input_ids = torch.zeros(B, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(B, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((B,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(B, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(B + 1, dtype=torch.int32, device=dev)  # 1 token each
        self.block_table = torch.zeros((B, max_blocks), dtype=torch.int32, device=dev)
        # Their host side, page-locked: a step's copies into them then never wait for the GPU.
        self.staging = PinnedStaging({"input_ids": ((B,), torch.int64), "positions": ((B,), torch.int64),
                                      "slot_mapping": ((B,), torch.int64), "seq_lens": ((B,), torch.int32),
                                      "block_table": ((B, max_blocks), torch.int32)}, torch.device(dev))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}     # size -> static hidden [size, hidden]
        if capture:
            self._capture_all()

    def _meta(self, size: int):
        r = self.runner
        return r.attn_backend.build_graph_metadata(
            self.slot_mapping[:size], self.query_start_loc[:size + 1], self.seq_lens[:size],
            self.block_table[:size], r.num_kv_heads, r.block_size, r.max_model_len)

    def _forward(self, size: int, meta) -> torch.Tensor:
        with set_forward_context(meta):
            return self.runner.model(self.input_ids[:size], self.positions[:size])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        before = torch.cuda.mem_get_info()[0]
        pool = None
        for size in reversed(self.sizes):   # largest first: the smaller ones reuse its pool
            meta = self._meta(size)
            self._forward(size, meta)       # warm-up: Triton compiles outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size, meta)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %d..%d) in %.1f s, %.2f GiB",
                    len(self.sizes), self.sizes[0], self.max_size, time.perf_counter() - t0,
                    (before - torch.cuda.mem_get_info()[0]) / 2**30)

    def padded_size(self, num_reqs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_reqs)]

    def can_run(self, inputs) -> bool:
        """An all-decode step (one token per request) of at most the largest captured size."""
        return inputs.max_query_len == 1 and len(inputs.req_ids) <= self.max_size

    def run(self, inputs) -> torch.Tensor:
        """This step's hidden states [num_reqs, hidden] (a view of the graph's output)."""
        n = len(inputs.req_ids)
        size = self.padded_size(n)
        nb = -(inputs.max_seq_len // -self.runner.block_size)
        st = self.staging
        st.begin()
        st.copy_to("input_ids", inputs.input_ids, self.input_ids[:n])
        st.copy_to("positions", inputs.positions, self.positions[:n])
        st.copy_to("slot_mapping", inputs.slot_mapping, self.slot_mapping[:n])
        st.copy_to("seq_lens", inputs.seq_lens, self.seq_lens[:n])
        st.copy_to("block_table", inputs.block_table[:, :nb], self.block_table[:n, :nb])
        st.end()
        if self.runner.async_outputs is not None:   # async scheduling: tokens still on the device
            self.runner.async_outputs.fill_placeholders(self.input_ids[:n], inputs)
        if n < size:   # padding rows: one token over one slot, nothing written
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
        if self.capture:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size, self._meta(size))[:n]
