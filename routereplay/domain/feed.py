"""The ready feed's domain types: an announced record, a read request and its answer.

The route cache's feed (``route_cache.feed``) produces them, the wire converts them
(``routereplay.rpc.wire``), and a trainer's ``routereplay.rpc.ready.ReadyConsumer`` consumes
them; none of them needs protobuf or gRPC.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReadyEntry:
    """One committed record, as the feed announces it.

    Attributes:
        entry_id: the stream entry id (``"<ms>-<seq>"``); what ``ack_ready`` takes.
        sample_id, group_id: the record's ids (group_id empty when it has none).
        num_tokens: the record's token count when it was written.
        policy_versions: the policy version of each turn, in order.
    """

    entry_id: str
    sample_id: str
    group_id: str
    num_tokens: int
    policy_versions: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReadyRead:
    """One ``read_ready`` request: what ``consumer`` of ``consumer_group`` asks the feed for
    (see the ReadReady call in the proto, and ``ReadyFeed.read`` in the route cache, for the
    three stages a read goes through)."""

    consumer_group: str
    consumer: str
    max_entries: int = 256
    block_ms: int = 0
    pending_cursor: str = ""
    claim_idle_ms: int = 0
    claim_cursor: str = ""
    start_from_latest: bool = False


@dataclass(frozen=True)
class ReadyPage:
    """One ``read_ready`` answer.

    Attributes:
        entries: in stream order.
        pending_cursor: send it back with the next read; empty once this consumer's pending
            entries have all come back.
        claim_cursor: send it back with the next read that claims.
        trimmed: pending entries met whose stream entries were trimmed before anyone
            acknowledged them (acknowledged by the server; their samples cannot be named).
    """

    entries: list[ReadyEntry]
    pending_cursor: str = ""
    claim_cursor: str = ""
    trimmed: int = 0
