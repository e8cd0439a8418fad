"""The scheduler's image arithmetic, by hand: the encoder budget trims a step before an image
that does not fit, and each block keys on the images it covers."""

from pagedllm.core.encoder_cache_manager import block_image_keys, trim_to_encoder_budget
from pagedllm.core.kv_cache_manager import extend_block_hashes
from pagedllm.multimodal.inputs import ImageInput

A, B = ImageInput(4, 16, 111, None), ImageInput(24, 16, 222, None)  # tokens [4, 20) and [24, 40)


def test_budget_stops_before_the_image_that_does_not_fit():
    assert trim_to_encoder_budget([A, B], 0, 48, 32) == (48, 32)  # both fit
    assert trim_to_encoder_budget([A, B], 0, 48, 20) == (24, 16)  # B waits: stop at its offset
    assert trim_to_encoder_budget([A, B], 0, 48, 10) == (4, 0)  # A waits too
    assert trim_to_encoder_budget([A, B], 4, 48, 10) == (20, 16)  # A is first: it runs alone
    assert trim_to_encoder_budget([A, B], 10, 8, 0) == (8, 0)  # A started earlier: no cost


def test_whole_images_are_never_cut():
    """disable_chunked_mm_input (an image's tokens attend to each other): a step ends before an
    image it cannot finish, or schedules nothing when it starts inside or at one."""
    assert trim_to_encoder_budget([A, B], 0, 12, 64, whole=True) == (4, 0)  # stop before A
    assert trim_to_encoder_budget([A, B], 0, 30, 64, whole=True) == (24, 16)  # A whole, stop before B
    assert trim_to_encoder_budget([A, B], 0, 40, 64, whole=True) == (40, 32)  # both end in the window
    assert trim_to_encoder_budget([A, B], 4, 10, 64, whole=True) == (0, 0)  # at A, no room: waits
    assert trim_to_encoder_budget([A, B], 12, 6, 64, whole=True) == (0, 0)  # inside A (a prefix hit)
    assert trim_to_encoder_budget([A, B], 12, 8, 64, whole=True) == (8, 0)  # A's rest fits
    assert trim_to_encoder_budget([A, B], 0, 12, 64) == (12, 16)  # chunked: A is cut


def test_blocks_key_on_the_images_they_cover():
    assert block_image_keys([A, B], 3, 16) == [(111,), (111, 222), (222,)]
    ids = list(range(48))
    same = extend_block_hashes([], ids, 16, (), [A, B])
    other = extend_block_hashes([], ids, 16, (), [A, ImageInput(24, 16, 333, None)])
    assert same[0] == other[0] and same[1] != other[1] and same[2] != other[2]
    assert extend_block_hashes([], ids, 16) != same  # text alone never shares with an image's blocks
