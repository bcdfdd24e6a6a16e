"""A DP chunk pickles to about its own share of the batch, not the whole storage its views point into
(torch pickles a view with its entire storage, so an uncompacted chunk would carry the full batch to every
worker); pickle protocol 5 with out-of-band buffers (what Ray uses) round-trips."""

import pickle

import torch

from mrl.data.batch import Batch


def big_batch(n: int = 256) -> Batch:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(50, 150, (n,), generator=generator).tolist()
    return Batch.from_dict(
        {
            "input_ids": [torch.randint(0, 1000, (length,), generator=generator) for length in lengths],
            "log_probs": [torch.randn(length, generator=generator) for length in lengths],
            "hidden": torch.randn(n, 64, generator=generator),
            "uid": [f"sample-{i}" for i in range(n)],
        },
        meta_info={"global_steps": 5},
    )


def test_each_of_four_chunks_pickles_to_about_a_quarter():
    batch = big_batch()
    whole = len(pickle.dumps(batch))
    for part in batch.chunk(4):
        size = len(pickle.dumps(part))
        assert size < 0.35 * whole, (size, whole)
        assert pickle.loads(pickle.dumps(part)).equal(part)
    # Selections that gather (index lists) are compact already; a slice of one must be compacted again.
    gathered = batch[list(range(0, 256, 2))][:32]
    assert len(pickle.dumps(gathered)) < 0.2 * whole


def test_protocol5_out_of_band_buffers_round_trip():
    batch = big_batch(32)[8:24]
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    again = pickle.loads(payload, buffers=buffers)
    assert again.equal(batch) and again.meta_info == {"global_steps": 5}
