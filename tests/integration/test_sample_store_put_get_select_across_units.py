"""Sample store on Ray: values spread over storage units come back by key in the asked order, tags select keys
without touching data, and deleted keys are gone from both the units and the metadata."""

import pytest
import torch

from mrl.data.sample_store import SampleStore

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def store(ray_cluster):
    s = SampleStore.create(num_units=3)
    yield s
    s.shutdown()


def test_put_get_select_delete(store, ray_cluster):
    items = {f"traj-{i}": {"ids": torch.arange(i + 1), "score": float(i % 2)} for i in range(12)}
    tags = {k: {"step": 1, "status": "ready" if v["score"] else "pending"} for k, v in items.items()}
    store.put(items, tags)
    sizes = ray_cluster.get([u.size.remote() for u in store.units])
    assert sum(sizes) == 12 and max(sizes) < 12  # spread over the units
    keys = ["traj-7", "traj-0", "traj-11"]
    for key, value in zip(keys, store.get(keys)):
        assert torch.equal(value["ids"], items[key]["ids"]) and value["score"] == items[key]["score"]
    ready = store.select(step=1, status="ready")
    assert ready == [f"traj-{i}" for i in range(1, 12, 2)]
    store.tag(ready[:2], status="consumed")
    assert store.select(status="consumed") == ready[:2]
    assert store.tags(["traj-1"]) == [{"step": 1, "status": "consumed"}]
    assert store.delete(ready) == len(ready)
    assert store.select(status="ready") == [] and sum(ray_cluster.get([u.size.remote() for u in store.units])) == 6
    with pytest.raises(Exception, match="no values"):
        store.get(["traj-1"])
