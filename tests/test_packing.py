"""Packing rows: segments never mix, loss terms land on completion predictions only."""

from __future__ import annotations

import numpy as np

from tunix_mcjax.train import packing


def _seq(prompt, completion, adv=1.0):
    return packing.Sequence(np.array(prompt, np.int32), np.array(completion, np.int32), adv,
                            np.full(len(completion), -0.5, np.float32))


def test_pack_places_targets_and_masks():
    seqs = [_seq([1, 5, 6], [7, 8], adv=2.0), _seq([1, 9], [3], adv=-1.0)]
    rows = packing.pack(seqs, row_len=8, pad_id=0)
    assert rows.num_rows == 1
    np.testing.assert_array_equal(rows.tokens[0], [1, 5, 6, 7, 8, 1, 9, 3])
    np.testing.assert_array_equal(rows.positions[0], [0, 1, 2, 3, 4, 0, 1, 2])
    np.testing.assert_array_equal(rows.segment_ids[0], [1, 1, 1, 1, 1, 2, 2, 2])
    # Position t predicts token t+1 of its own segment; only completion tokens count.
    np.testing.assert_array_equal(rows.loss_mask[0], [0, 0, 1, 1, 0, 0, 1, 0])
    np.testing.assert_array_equal(rows.targets[0, [2, 3, 6]], [7, 8, 3])
    np.testing.assert_array_equal(rows.advantages[0, [2, 3, 6]], [2.0, 2.0, -1.0])
    np.testing.assert_allclose(rows.seq_weight[0, [2, 3, 6]], [0.5, 0.5, 1.0])


def test_first_fit_decreasing_fills_rows():
    bins = packing.first_fit_decreasing([5, 3, 4, 2, 1], row_len=6)
    # Longest first: 5 | 4 | 3, then 2 joins the 4 and 1 joins the 5.
    assert sorted(sorted(b) for b in bins) == [[0, 4], [1], [2, 3]]


def test_rows_per_device_and_padding():
    assert packing.rows_per_device([5, 2], local_devices=2) == 4  # ceil(5/2)=3 -> pow2
    assert packing.rows_per_device([8, 2], local_devices=2) == 4
    assert packing.rows_per_device([0, 0], local_devices=2) == 1
    rows = packing.pack([_seq([1, 2], [3])], row_len=4, pad_id=0)
    padded = packing.pad_rows(rows, 4, pad_id=0)
    assert padded.num_rows == 4
    assert padded.segment_ids[1:].sum() == 0 and padded.loss_mask[1:].sum() == 0


def test_attention_mask_separates_segments():
    import jax.numpy as jnp

    from tunix_mcjax.train.trainer import packed_attention_mask

    mask = np.asarray(packed_attention_mask(jnp.array([[1, 1, 2, 2, 0]])))[0]
    assert mask[1, 0] and not mask[0, 1]  # causal
    assert not mask[2, 1] and mask[3, 2]  # no attention across segments
    assert not mask[4].any()  # padding attends nowhere
