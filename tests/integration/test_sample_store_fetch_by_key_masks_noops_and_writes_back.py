"""The sample path's worker side on a real store: a light batch (keys + scalar columns) fetches exactly the asked
fields of its rows by key, in the batch's order; a no-op row owns a copy of its source's tokens under its own key
(copied inside the store) and reads them with an all-zero response mask; every row's outputs go back under its own
key; bypass mode reads the rollout's log-probs as old ones; and the store counts what it holds (values and tags),
so a test can prove a step left nothing behind."""

import pytest
import torch

from mrl.data.jagged import JaggedTensor
from mrl.data.replay_buffer import pad_with_noops
from mrl.data.sample_store import SampleStore
from mrl.data.samples import fetch, light_batch, payload, put_noop_payloads, write_back
from mrl.workers.training_worker import StoreClient

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def store(ray_cluster):
    s = SampleStore.create(num_units=2)
    s.wait_ready()
    yield s
    s.shutdown()


def test_fetch_by_key_masks_noops_writes_back_and_empties(store):
    records = [{"key": f"k{i}", "uid": "u", "score": float(i), "prompt_len": 2, "response_len": i + 1}
               for i in range(3)]
    store.put({r["key"]: payload([7, 8], list(range(1, r["response_len"] + 1)), [1] * r["response_len"],
                                 [-0.5] * r["response_len"]) for r in records})
    assert store.size() == {"values": 3, "tags": 3}
    padded = pad_with_noops(records, 4)
    put_noop_payloads(store, padded)
    assert store.size() == {"values": 4, "tags": 4}
    batch = light_batch(padded)[[3, 2, 0, 1]]  # the no-op (a copy of k0) first
    assert list(batch["key"]) == ["k0/noop-0", "k2", "k0", "k1"]
    assert batch["is_noop"].tolist() == [True, False, False, False]

    fetched = fetch(store, batch, ["input_ids", "response_mask"])
    assert "rollout_log_probs" not in fetched  # only the fields asked for travel
    assert fetched.as_list("input_ids")[1].tolist() == [7, 8, 1, 2, 3]
    assert fetched.as_list("response_mask")[0].tolist() == [0.0, 0.0, 0.0]  # the no-op trains nothing ...
    assert fetched.as_list("response_mask")[2].tolist() == [0.0, 0.0, 1.0]  # ... its source still does

    ids = fetched.jagged_field("input_ids")  # an output per token: the row's position in the batch
    out = JaggedTensor(torch.repeat_interleave(torch.arange(len(batch), dtype=torch.float32), ids.lengths()),
                       ids.offsets)
    write_back(store, batch, {"old_log_probs": out})
    old = [v["old_log_probs"].tolist() for v in store.get(["k0", "k1", "k2", "k0/noop-0"], ["old_log_probs"])]
    assert old == [[2.0] * 3, [3.0] * 4, [1.0] * 5, [0.0] * 3]  # each row's under its own key

    client = StoreClient()
    client.set_store(store)
    client.old_log_prob_field = "rollout_log_probs"  # bypass: π_old is the rollout's
    bypass = client.fetch(batch, ["old_log_probs"])
    assert bypass.as_list("old_log_probs")[1].tolist() == [0.0, 0.0, -0.5, -0.5, -0.5]

    with pytest.raises(Exception, match="fields \\['values'\\] missing"):
        store.get(["k0"], ["values"])
    assert store.delete(sorted(set(batch["key"]))) == 4
    assert store.size() == {"values": 0, "tags": 0}
