"""A consumer whose delivered entry vanished (a failover of the stream's master lost it) must
train the sample's next announcement, not acknowledge it as a stale repeat.

Found by the fault run's WAIT-only fault (``benchmarks/faults/bench_faults.py``, issue 29): consumer
c0 read an announcement from the stream's master while its replica was cut off; the master
died and the promoted replica never had the entry. c0's ``settle`` then found nothing pending
(taken), and ``ReadyConsumer`` remembered the sample as settled; the retried final append
announced it again, c0 acknowledged that entry at once as a stale repeat, and the route cache
gave c0 the sample's settle claim. The other consumer, which held the same new entry, was then
told it was taken: nobody trained the sample (the checker: ``never_trained: 1``).
"""

from __future__ import annotations

from routereplay.domain.feed import ReadyEntry, ReadyPage
from routereplay.rpc.ready import ReadyConsumer


class VanishingFeed:
    """A feed whose first delivered entry vanishes before it is acknowledged (XACK finds
    nothing: 0), then announces the sample again."""

    def __init__(self):
        self.pages = [
            [ReadyEntry("1-0", "s", "", 8)],
            [ReadyEntry("2-0", "s", "", 8)],  # the retried final append's announcement
        ]
        self.acks: list[list[str]] = []

    def read_ready(self, consumer_group, consumer, **kwargs) -> ReadyPage:
        entries = self.pages.pop(0) if self.pages else []
        return ReadyPage(entries, "", "", 0)

    def ack_ready(self, consumer_group, entry_ids, consumer="", sample_ids=()) -> int:
        self.acks.append(list(entry_ids))
        return 0 if "1-0" in entry_ids else len(entry_ids)


def test_a_sample_whose_entry_vanished_is_trained_from_its_next_announcement():
    feed = VanishingFeed()
    consumer = ReadyConsumer(feed, "g", "c0", group_size=1)
    (first,) = consumer.next_groups(1, timeout_s=1)
    assert consumer.settle([first]) == []  # taken: the entry is gone
    (again,) = consumer.next_groups(1, timeout_s=1)  # the repeat is handed out to train
    assert again.entry_ids == ["2-0"]
    assert consumer.settle([again]) == [again]
    assert feed.acks == [["1-0"], ["2-0"]]  # never acknowledged as a stale repeat
