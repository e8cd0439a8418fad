"""A recurrent state spread over several blocks' pages (models/layers/mamba/state_pages.py):
the pieces laid out as written by hand, and gather / scatter / zero checked against a page
layout built element by element in plain Python."""

import pytest
import torch

from pagedllm.models.layers.mamba.state_pages import Piece, StatePages, blocks_needed, state_pieces


def test_pieces_fill_k_then_v_rows_block_after_block():
    """Rows of 6 (K) and 4 (V) elements; a conv state (2, 3) and an SSM state (3, 4): 6 + 12 = 18
    elements over pages of 10 -> 2 blocks. The conv state fills block 0's K row; the SSM state
    takes block 0's V row (4), block 1's K row (6) and 2 of its V row."""
    rows, shapes = [6, 4], [(2, 3), (3, 4)]
    assert blocks_needed(rows, shapes) == 2
    assert state_pieces(rows, shapes) == [
        [Piece(0, 0, 0, 0, 6)],
        [Piece(0, 1, 0, 0, 4), Piece(1, 0, 0, 4, 6), Piece(1, 1, 0, 10, 2)],
    ]
    # A tensor that starts mid-row: 4 elements, then 9 over rows of 5 (both K and V).
    assert state_pieces([5, 5], [(4,), (9,)]) == [
        [Piece(0, 0, 0, 0, 4)],
        [Piece(0, 0, 4, 0, 1), Piece(0, 1, 0, 1, 5), Piece(1, 0, 0, 6, 3)],
    ]
    assert blocks_needed([5, 5], [(4,), (9,)]) == 2 and blocks_needed([5, 5], [(10,)]) == 1


def _reference_layout(pages, blocks, shapes, row_elems):
    """Each request's state tensors read element by element from its blocks' pages, laid end
    to end over (block, row) in order."""
    out = []
    for r in range(blocks.shape[0]):
        stream = [
            pages[j][int(blocks[r, k]), c].item()
            for k in range(blocks.shape[1])
            for j in range(len(row_elems))
            for c in range(row_elems[j])
        ]
        tensors, at = [], 0
        for shape in shapes:
            n = torch.Size(shape).numel()
            tensors.append(torch.tensor(stream[at : at + n]).view(shape))
            at += n
        out.append(tensors)
    return out


@pytest.mark.parametrize(
    "shapes, blocks",
    [
        ([(2, 3), (3, 4)], [[5, 2], [1, 6]]),  # the second tensor over 3 rows of 2 blocks, none whole
        ([(2, 3), (4, 5)], [[5, 2, 4], [1, 6, 3]]),  # the second fills block 1 whole: moved as one page
        ([(5,), (5,)], [[5], [1]]),
    ],
)  # the second straddling K and V of one block
def test_gather_scatter_and_zero_against_the_layout(shapes, blocks):
    row_elems, num_blocks = [6, 4], 7
    k, v = torch.arange(num_blocks * 6.0).view(num_blocks, 6), 100 + torch.arange(num_blocks * 4.0).view(num_blocks, 4)
    pages = StatePages([k, v], shapes)
    blocks = torch.tensor(blocks)  # two requests' blocks, in no order
    assert pages.num_blocks == blocks.shape[1]
    ref = _reference_layout([k, v], blocks, shapes, row_elems)
    for i in range(2):
        got = pages.gather(i, blocks)
        assert got.shape == (2, *shapes[i])
        assert torch.equal(got, torch.stack([ref[r][i] for r in range(2)]))
    # Scatter new values for request 1 only, then read the pages back by hand.
    new = [-torch.arange(float(torch.Size(s).numel())).view(1, *s) - 10 * (i + 1) for i, s in enumerate(shapes)]
    for i in range(2):
        pages.scatter(i, blocks[1:], new[i])
    back = _reference_layout([k, v], blocks, shapes, row_elems)
    assert torch.equal(back[1][0], new[0][0]) and torch.equal(back[1][1], new[1][0])
    assert all(torch.equal(a, b) for a, b in zip(back[0], ref[0]))  # request 0 untouched
    pages.zero(blocks[:1])
    assert all(t.eq(0).all() for t in _reference_layout([k, v], blocks[:1], shapes, row_elems)[0])
    # The tail of the last block's page past the state is no piece of it: left as it was.
    used = sum(torch.Size(s).numel() for s in shapes) - 10 * (blocks.shape[1] - 1)
    last = int(blocks[0, -1])
    tail = torch.cat([k[last], v[last]])[used:]
    assert torch.equal(tail, torch.cat([torch.arange(6.0) + 6 * last, 100 + torch.arange(4.0) + 4 * last])[used:])
