"""InputBatch: the persistent per-row state of the requests in the batch, and prepare_inputs.

Rows are preallocated CPU tensors (token-id table, block table) that live across steps:
a request gets a row when it enters the batch and keeps it; rows are condensed so that the
live ones are always [0, num_reqs). prepare_inputs turns one step's scheduled token counts
into the model's inputs with vectorised index arithmetic, no Python loop over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the runner keeps of a request between steps (also while it is out of the batch)."""

    req_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: Optional[torch.Generator]
    lora_request: Optional[Any] = None  # pagedllm.lora.LoRARequest, or None: the base model
    # Several KV cache groups: the block tables of groups 1.. (block_ids is group 0's).
    extra_block_ids: list[list[int]] = field(default_factory=list)
    mm_inputs: tuple = ()  # multimodal.inputs.ImageInput of each image of the prompt
    # M-RoPE (Qwen2-VL) with images: (the prompt's positions [3, prompt] int64, rope delta); None: plain.
    mrope: Optional[tuple] = None


@dataclass
class ModelInputs:
    """One step's inputs, named as in the worked example of the seed (003)."""

    req_ids: list[str]
    num_scheduled_tokens: np.ndarray  # [num_reqs]
    request_indices: np.ndarray  # [num_tokens] row of each token
    positions: torch.Tensor  # [num_tokens] int64
    token_indices: np.ndarray  # [num_tokens] into the flattened token-id table
    input_ids: torch.Tensor  # [num_tokens] int64
    block_table_indices: np.ndarray  # [num_tokens] into the flattened block table
    block_numbers: np.ndarray  # [num_tokens] physical block of each token
    block_offsets: np.ndarray  # [num_tokens]
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    num_computed_tokens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32 (a view)
    max_query_len: int
    max_seq_len: int
    sample_rows: np.ndarray  # rows whose last scheduled token is their last token
    logits_indices: torch.Tensor  # [len(sample_rows)] token index of each sampled row
    # Several KV cache groups: groups 1..'s block tables [num_reqs, max_blocks] and slot mappings [num_tokens].
    group_block_tables: list[torch.Tensor] = field(default_factory=list)
    group_slot_mappings: list[torch.Tensor] = field(default_factory=list)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, num_kv_cache_groups: int = 1) -> None:
        self.num_kv_cache_groups = num_kv_cache_groups
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_num_blocks_per_req = -(max_model_len // -block_size)
        # (max_num_reqs, max_model_len) int32: every known token of every row.
        self.token_ids_cpu = torch.zeros((max_num_reqs, max_model_len), dtype=torch.int32)
        self.token_ids_np = self.token_ids_cpu.numpy()
        # (max_num_reqs, max_num_blocks_per_req) int32; block 0 = the null block.
        self.block_table = torch.zeros((max_num_reqs, self.max_num_blocks_per_req), dtype=torch.int32)
        self.block_table_np = self.block_table.numpy()
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        # Groups 1..'s block tables (core/kv_cache_utils.py), the same shape; none with one group.
        self.group_block_tables = [torch.zeros_like(self.block_table) for _ in range(num_kv_cache_groups - 1)]
        self.group_block_tables_np = [t.numpy() for t in self.group_block_tables]
        self.group_num_blocks = [np.zeros(max_num_reqs, dtype=np.int32) for _ in range(num_kv_cache_groups - 1)]
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        self.req_ids: list[Optional[str]] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.states: list[Optional[CachedRequestState]] = [None] * max_num_reqs
        self.num_reqs = 0

    # ------------------------------------------------------------ rows
    def add_request(self, state: CachedRequestState) -> int:
        row = self.num_reqs  # rows are kept dense, so the first free row is num_reqs
        if row >= self.max_num_reqs:
            raise RuntimeError("input batch is full")
        n = len(state.token_ids)
        self.token_ids_np[row, :n] = state.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = state.num_prompt_tokens
        self.num_computed_tokens_cpu[row] = state.num_computed_tokens
        self.num_blocks_per_row[row] = 0
        self.append_block_ids(row, state.block_ids)
        for counts in self.group_num_blocks:
            counts[row] = 0
        self.append_extra_block_ids(row, state.extra_block_ids)
        self.req_ids[row] = state.req_id
        self.req_id_to_index[state.req_id] = row
        self.states[row] = state
        self.num_reqs += 1
        return row

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks_per_row[row]
        self.block_table_np[row, start : start + len(block_ids)] = block_ids
        self.num_blocks_per_row[row] = start + len(block_ids)

    def append_extra_block_ids(self, row: int, extra_block_ids) -> None:
        """Groups 1..'s new block ids of the row (several KV cache groups)."""
        for table, counts, ids in zip(self.group_block_tables_np, self.group_num_blocks, extra_block_ids):
            start = counts[row]
            table[row, start : start + len(ids)] = ids
            counts[row] = start + len(ids)

    def remove_requests(self, req_ids) -> None:
        """Remove rows, then condense: the last live rows move into the holes."""
        holes = sorted(self.req_id_to_index.pop(r) for r in req_ids if r in self.req_id_to_index)
        for row in holes:
            self.req_ids[row] = None
            self.states[row] = None
        # Fill holes from the end, lowest hole first.
        last = self.num_reqs - 1
        for row in holes:
            while last > row and self.req_ids[last] is None:
                last -= 1
            if last <= row:
                break
            self._move(last, row)
            last -= 1
        self.num_reqs -= len(holes)

    def _move(self, src: int, dst: int) -> None:
        n = self.num_tokens[src]
        self.token_ids_np[dst, :n] = self.token_ids_np[src, :n]
        nb = self.num_blocks_per_row[src]
        self.block_table_np[dst, :nb] = self.block_table_np[src, :nb]
        for table, counts in zip(self.group_block_tables_np, self.group_num_blocks):
            table[dst, : counts[src]] = table[src, : counts[src]]
            counts[dst] = counts[src]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu, self.num_blocks_per_row):
            arr[dst] = arr[src]
        self.req_ids[dst], self.req_ids[src] = self.req_ids[src], None
        self.states[dst], self.states[src] = self.states[src], None
        self.req_id_to_index[self.req_ids[dst]] = dst

    def append_token(self, row: int, token_id: int) -> None:
        n = self.num_tokens[row]
        self.token_ids_np[row, n] = token_id
        self.num_tokens[row] = n + 1
        self.states[row].token_ids.append(token_id)

    # ------------------------------------------------------------ inputs
    def prepare_inputs(self, num_scheduled: dict[str, int]) -> ModelInputs:
        num_reqs = self.num_reqs
        req_ids = self.req_ids[:num_reqs]
        counts = np.array([num_scheduled[r] for r in req_ids], dtype=np.int64)  # [num_reqs]
        total = int(counts.sum())
        cu = np.cumsum(counts)  # [num_reqs]
        request_indices = np.repeat(np.arange(num_reqs), counts)  # [total]
        # Offset of each token inside its request's scheduled chunk: 0, 1, 2, 0, 1, ...
        arange = np.arange(total) - np.repeat(cu - counts, counts)
        computed = self.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        positions = computed[request_indices] + arange
        token_indices = request_indices * self.max_model_len + positions
        input_ids = self.token_ids_np.reshape(-1)[token_indices]
        block_table_indices = request_indices * self.max_num_blocks_per_req + positions // self.block_size
        block_numbers = self.block_table_np.reshape(-1)[block_table_indices].astype(np.int64)
        block_offsets = positions % self.block_size
        slot_mapping = block_numbers * self.block_size + block_offsets
        group_slot_mappings = [  # the same positions through each other group's table
            torch.from_numpy(t.reshape(-1)[block_table_indices].astype(np.int64) * self.block_size + block_offsets)
            for t in self.group_block_tables_np
        ]
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        query_start_loc[1:] = cu
        seq_lens = computed + counts
        # A row samples when this step reaches its last known token (not mid-prefill).
        sample_rows = np.nonzero(seq_lens >= self.num_tokens[:num_reqs])[0]
        return ModelInputs(
            req_ids=list(req_ids),
            num_scheduled_tokens=counts,
            request_indices=request_indices,
            positions=torch.from_numpy(positions),
            token_indices=token_indices,
            input_ids=torch.from_numpy(input_ids.astype(np.int64)),
            block_table_indices=block_table_indices,
            block_numbers=block_numbers,
            block_offsets=block_offsets,
            slot_mapping=torch.from_numpy(slot_mapping),
            query_start_loc=torch.from_numpy(query_start_loc),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            num_computed_tokens=torch.from_numpy(computed.astype(np.int32)),
            block_table=self.block_table[:num_reqs],
            max_query_len=int(counts.max()) if num_reqs else 0,
            max_seq_len=int(seq_lens.max()) if num_reqs else 0,
            sample_rows=sample_rows,
            logits_indices=torch.from_numpy(cu[sample_rows] - 1),
            group_block_tables=[t[:num_reqs] for t in self.group_block_tables],
            group_slot_mappings=group_slot_mappings,
        )
