"""A vocabulary that TP does not divide: Megatron's padded size (make_vocab_size_divisible_by × TP), the embedding
and output layer padded with zero rows on import and cut back on export to the HF tensor bit for bit; start-up
refuses such a vocabulary only where a TP rank would hold nothing but padding."""

from __future__ import annotations

import pytest
import torch

from bridges.mapping import ModelShape, Shard, Tied, Vocab, VocabParallel, padded_vocab_size
from mrl.config.model_shape import layout_shape_problems


def test_padded_size_is_megatrons():
    assert padded_vocab_size(1001, 2) == 1002
    assert padded_vocab_size(1000, 2) == 1000
    assert padded_vocab_size(1001, 2, 128) == 1024
    assert padded_vocab_size(151936, 8) == 151936 and padded_vocab_size(151936, 8, 128) == 152576
    assert padded_vocab_size(129280, 3) == 129282


@pytest.mark.parametrize("mapping", [Vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                                     Tied("output_layer.weight", "model.embed_tokens.weight")])
@pytest.mark.parametrize(("vocab", "tp", "divisor"), [(1001, 2, 1), (1001, 4, 1), (1000, 4, 1), (7, 4, 1),
                                                     (1001, 2, 128), (1000, 4, 64)])
def test_import_pads_with_zeros_and_export_cuts_to_the_hf_tensor(mapping, vocab, tp, divisor):
    hf = torch.randn(vocab, 8)
    padded = padded_vocab_size(vocab, tp, divisor)
    shape = ModelShape(2, 2, 4, vocab=vocab, padded_vocab=padded)
    shards = [mapping.load([hf], Shard(r, tp), shape) for r in range(tp)]
    assert all(s.shape == (padded // tp, 8) for s in shards)
    full = mapping.merge(shards, shape)
    assert torch.equal(full[:vocab], hf) and not full[vocab:].any()
    assert torch.equal(VocabParallel.to_hf(mapping, full, shape)[0], hf)


@pytest.mark.parametrize(("vocab", "tp", "divisor", "refused"),
                         [(1001, 2, 1, False), (501, 2, 1, False), (151665, 8, 1, False), (9, 4, 1, True),
                          (1, 2, 1, True), (10, 4, 1, False), (1001, 2, 128, False), (151665, 8, 128, False),
                          (1001, 4, 512, True), (1000, 2, 1024, True)])
def test_start_up_refuses_only_a_rank_of_padding(vocab, tp, divisor, refused):
    hf = {"num_attention_heads": 8, "num_key_value_heads": 8, "num_hidden_layers": 2, "vocab_size": vocab}
    problems = dict(layout_shape_problems(hf, tp, 1, None, 1, vocab_divisor=divisor))
    assert ("tensor_model_parallel_size" in problems) == refused, problems
    if refused:
        assert f"vocabulary ({vocab} tokens)" in problems["tensor_model_parallel_size"]
