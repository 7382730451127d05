"""The log identity a checkpoint records, compared with the log read now (no broker)."""

from __future__ import annotations

import dataclasses

import pytest
from deferline.topics import LogIdentity, TopicIdentity, compare_identity

DEFER = TopicIdentity("p.defer", "0193e0a4-0000-7000-8000-00000000000d", 4)
RESUME = TopicIdentity("p.resume", "0193e0a4-0000-7000-8000-00000000000e", 4)
LOG = LogIdentity(cluster_id="c1", topics=(DEFER, RESUME), prefix="p.", group="p.triggerer")


def _with_topic(identity: LogIdentity, **changes: object) -> LogIdentity:
    first = dataclasses.replace(identity.topics[0], **changes)  # type: ignore[arg-type]
    return dataclasses.replace(identity, topics=(first, *identity.topics[1:]))


def test_the_same_log_matches() -> None:
    same = LogIdentity.from_json(LOG.to_json())
    assert same == LOG
    assert compare_identity(LOG, same) is None


def test_a_changed_cluster_is_named_with_both_ids() -> None:
    mismatch = compare_identity(LOG, dataclasses.replace(LOG, cluster_id="c0"))
    assert mismatch is not None
    assert (mismatch.what, mismatch.expected, mismatch.found) == ("cluster id", "c1", "c0")
    assert str(mismatch) == "cluster id: expected c1, found c0"


def test_a_changed_topic_id_is_named_with_the_topic() -> None:
    found = _with_topic(LOG, topic_id="0193e0a4-0000-7000-8000-0000000000ff")
    mismatch = compare_identity(LOG, found)
    assert mismatch is not None
    assert mismatch.what == "topic id of p.defer"
    assert mismatch.expected == DEFER.topic_id
    assert mismatch.found == "0193e0a4-0000-7000-8000-0000000000ff"


def test_a_changed_partition_count_is_named() -> None:
    mismatch = compare_identity(LOG, _with_topic(LOG, partitions=8))
    assert mismatch is not None
    assert (mismatch.what, mismatch.expected, mismatch.found) == (
        "partition count of p.defer",
        "4",
        "8",
    )


def test_a_changed_prefix_is_named() -> None:
    mismatch = compare_identity(LOG, dataclasses.replace(LOG, prefix="q."))
    assert mismatch is not None
    assert (mismatch.what, mismatch.expected, mismatch.found) == ("topic prefix", "p.", "q.")


def test_a_changed_group_is_named() -> None:
    mismatch = compare_identity(LOG, dataclasses.replace(LOG, group="other"))
    assert mismatch is not None
    assert mismatch.what == "group"


def test_other_topics_do_not_match() -> None:
    mismatch = compare_identity(LOG, dataclasses.replace(LOG, topics=(DEFER,)))
    assert mismatch is not None
    assert (mismatch.what, mismatch.found) == ("topics", "p.defer")


@pytest.mark.parametrize(("expected_id", "found_id"), [(None, "x"), ("x", None)])
def test_a_topic_id_only_one_side_has_does_not_match(
    expected_id: str | None, found_id: str | None
) -> None:
    mismatch = compare_identity(
        _with_topic(LOG, topic_id=expected_id), _with_topic(LOG, topic_id=found_id)
    )
    assert mismatch is not None
    assert mismatch.what == "topic id of p.defer"


def test_without_topic_ids_the_rest_is_still_compared() -> None:
    bare = _with_topic(LOG, topic_id=None)
    assert compare_identity(bare, bare) is None
    assert compare_identity(bare, dataclasses.replace(bare, cluster_id="c0")) is not None


def test_a_checkpoint_that_records_no_identity_does_not_match() -> None:
    mismatch = compare_identity(LOG, None)
    assert mismatch is not None
    assert mismatch.found == "none recorded"
    assert "cluster c1" in mismatch.expected
