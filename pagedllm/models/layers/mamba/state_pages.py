"""A recurrent layer's state spread over several blocks of a hybrid's KV cache, for a state
larger than one attention page (a released Qwen3.5's delta-rule state is 16 x 128 x 128
values a layer; its attention page at block_size 16 holds 2 x 8192).

A block's page in the layer's tensor slot is one row of each of the slot's tensors (K, V). The
layer's state tensors, flattened and laid one after another, fill the pages of the request's
blocks in order: block 0's K row, its V row, block 1's K row, ... A tensor may straddle rows,
so it is a list of pieces. A step gathers each request's pieces into [R, *shape] tensors and
scatters them back: the copies a decode step makes anyway (the one-token recurrence runs on
every request's state at once); a prefill chunk pays one more gather and scatter of its state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Piece:
    block: int  # which of the request's blocks in the group (0-based)
    row: int  # which tensor of the slot (its row of that block)
    col: int  # first element in that row
    start: int  # first element of the flattened state tensor
    length: int


def state_pieces(row_elems: Sequence[int], shapes: Sequence[tuple[int, ...]]) -> list[list[Piece]]:
    """The pieces of each state tensor, laid over pages of rows of row_elems elements."""
    out, page, used = [], 0, 0  # page: (block, row) pairs in order, `used` elements into it
    for shape in shapes:
        pieces, start, n = [], 0, math.prod(shape)
        while start < n:
            block, row = divmod(page, len(row_elems))
            take = min(n - start, row_elems[row] - used)
            pieces.append(Piece(block, row, used, start, take))
            start, used = start + take, used + take
            if used == row_elems[row]:
                page, used = page + 1, 0
        out.append(pieces)
    return out


def blocks_needed(row_elems: Sequence[int], shapes: Sequence[tuple[int, ...]]) -> int:
    """Blocks whose pages (rows of row_elems elements each) hold the state tensors laid end to end."""
    return -(sum(math.prod(s) for s in shapes) // -sum(row_elems))


class StatePages:
    """One layer's state tensors over the pages of n blocks; `blocks` arguments are [R, n] block
    ids (each request's blocks in the layer's group, in order)."""

    def __init__(self, rows: Sequence[torch.Tensor], shapes: Sequence[tuple[int, ...]]) -> None:
        """rows: the slot's tensors as [num_blocks, row_elems] views (row b: block b's page)."""
        self.rows, self.shapes = list(rows), [tuple(s) for s in shapes]
        self.pieces = state_pieces([r.shape[1] for r in self.rows], self.shapes)
        self.num_blocks = 1 + max(p.block for ps in self.pieces for p in ps)
        self.dtype = self.rows[0].dtype

    def _slice(self, p: Piece, blocks: torch.Tensor) -> tuple:
        return blocks[:, p.block], slice(p.col, p.col + p.length)

    def gather(self, i: int, blocks: torch.Tensor) -> torch.Tensor:
        """State tensor i of each request -> [R, *shape] (a copy)."""
        parts = [self.rows[p.row][self._slice(p, blocks)] for p in self.pieces[i]]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return flat.view(blocks.shape[0], *self.shapes[i])

    def scatter(self, i: int, blocks: torch.Tensor, value: torch.Tensor) -> None:
        """Write value [R, *shape] back as state tensor i of each request."""
        flat = value.reshape(blocks.shape[0], -1).to(self.dtype)
        for p in self.pieces[i]:
            self.rows[p.row][self._slice(p, blocks)] = flat[:, p.start : p.start + p.length]

    def zero(self, blocks: torch.Tensor) -> None:
        """Every state tensor of these requests set to zero (a state that starts here)."""
        for pieces in self.pieces:
            for p in pieces:
                self.rows[p.row][self._slice(p, blocks)] = 0
