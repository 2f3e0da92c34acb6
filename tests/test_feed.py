"""The Feed protocol and its builder: what every placement gives the trainer."""

import numpy as np
import pytest
import torch

from flashdraft.data.collate import Batch
from flashdraft.feed import ListFeed, Micro, StepInput


def _item(step: int) -> StepInput:
    ids = torch.full((1, 4), step)
    batch = Batch(input_ids=ids, loss_mask=torch.ones_like(ids, dtype=torch.uint8), attention_mask=torch.ones_like(ids),
                  lengths=torch.tensor([4]))
    micro = Micro(batch, np.array([step]), device_batch=batch, device_ids=torch.tensor([step]),
                  features=torch.zeros(1, 4, 8))
    return StepInput([micro], slot=[object()], sampler_state={"step": step})


def test_a_list_feed_yields_its_steps_in_order_and_reports_them_once_closed():
    items = [_item(k) for k in range(3)]
    with ListFeed(items) as feed:
        seen = []
        for item in feed:
            seen.append(item.sampler_state["step"])
            assert set(feed.window_metrics()) >= {"pipe/bound"}
            feed.done(item)
    assert seen == [0, 1, 2] and feed.cache_stats() is None
    assert feed.report is not None and [s.name for s in feed.report.stages] == ["data", "drafter"]


def test_a_list_feed_paces_on_done_like_a_placement():
    """Each step's slot comes back with done(): a consumer that keeps every item without
    returning it would hold the pool, exactly as with the pooled buffers of a real placement."""
    items = [_item(k) for k in range(2)]
    feed = ListFeed(items)
    first = next(feed)
    feed.done(first)
    assert next(feed) is items[1]
    with pytest.raises(StopIteration):
        next(feed)
    feed.close()
    feed.close()  # idempotent
