"""The member core's figures and their metrics: what a member counts of its membership, and
the series a role shows of them under its prefix."""

from __future__ import annotations

import pytest
from deferline.runners.member import MemberCollector, MemberFigures, MemberMetricNames
from prometheus_client import CollectorRegistry, generate_latest


def names(role: str, owned: str) -> MemberMetricNames:
    return MemberMetricNames(
        rebalances=f"deferline_{role}_rebalances",
        takeovers=f"deferline_{role}_takeovers",
        partitions_fenced=f"deferline_{role}_partitions_fenced",
        transactions=f"deferline_{role}_transactions",
        transactions_fenced=f"deferline_{role}_transactions_fenced",
        owned=f"deferline_{role}_{owned}",
        owned_help="Partitions this member owns.",
    )


SCHEDULER = names("scheduler", "partitions_owned")


def registry_of(collector: MemberCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def kinds(registry: CollectorRegistry) -> dict[str, str]:
    """Each family's name and type, as a scrape shows them."""
    return {metric.name: metric.type for metric in registry.collect()}


def test_figures_count_what_the_member_did() -> None:
    held = [0, 1, 2]
    figures = MemberFigures(owned=lambda: len(held))
    figures.assigned()
    figures.took_over(2, 0.25)
    figures.took_over(1, 0.5)
    figures.fenced(3)
    figures.round_committed()
    figures.round_fenced()
    assert (figures.rebalances, figures.takeovers, figures.takeover_seconds) == (1, 3, 0.5), (
        "takeovers add up; the seconds are the last takeover's"
    )
    assert (figures.partitions_fenced, figures.rounds, figures.fenced_rounds) == (3, 1, 1)
    assert figures.owned == 3
    held.pop()
    assert figures.owned == 2, "read from the role at each look, not copied"


def test_a_new_member_has_counted_nothing() -> None:
    figures = MemberFigures()
    assert (figures.rebalances, figures.takeovers, figures.partitions_fenced) == (0, 0, 0)
    assert (figures.rounds, figures.fenced_rounds, figures.owned) == (0, 0, 0)
    assert figures.takeover_seconds is None


def test_one_member_shows_its_figures_unlabelled_under_the_prefix() -> None:
    held = [0, 1]
    figures = MemberFigures(owned=lambda: len(held))
    collector = MemberCollector(SCHEDULER)
    collector.add(figures)
    registry = registry_of(collector)
    assert kinds(registry) == {
        "deferline_scheduler_rebalances": "counter",
        "deferline_scheduler_takeovers": "counter",
        "deferline_scheduler_partitions_fenced": "counter",
        "deferline_scheduler_partitions_owned": "gauge",
        "deferline_scheduler_transactions": "counter",
        "deferline_scheduler_transactions_fenced": "counter",
    }
    figures.assigned()  # a rebalance gave it two partitions,
    figures.took_over(2, 0.1)  # which it took over,
    figures.round_committed()  # wrote for in a round,
    figures.round_fenced()  # and lost when the group fenced the next one
    figures.fenced(2)
    held.clear()
    text = generate_latest(registry).decode()
    for line in (
        "deferline_scheduler_rebalances_total 1.0",
        "deferline_scheduler_takeovers_total 2.0",
        "deferline_scheduler_partitions_fenced_total 2.0",
        "deferline_scheduler_partitions_owned 0.0",
        "deferline_scheduler_transactions_total 1.0",
        "deferline_scheduler_transactions_fenced_total 1.0",
    ):
        assert line in text, line


def test_several_members_are_labelled_and_their_transactions_summed() -> None:
    """A triggerer has a member per queue: its partition figures per queue, its
    transactions one series for the process (as it always showed them)."""
    default, gpu = MemberFigures(owned=lambda: 3), MemberFigures(owned=lambda: 1)
    collector = MemberCollector(names("triggerer", "assigned_partitions"), label="queue")
    collector.add(default, "default")
    collector.add(gpu, "gpu")
    default.assigned()
    gpu.assigned()
    gpu.assigned()
    gpu.fenced(1)
    for figures in (default, gpu, gpu):
        figures.round_committed()
    text = generate_latest(registry_of(collector)).decode()
    for line in (
        'deferline_triggerer_rebalances_total{queue="default"} 1.0',
        'deferline_triggerer_rebalances_total{queue="gpu"} 2.0',
        'deferline_triggerer_partitions_fenced_total{queue="default"} 0.0',
        'deferline_triggerer_partitions_fenced_total{queue="gpu"} 1.0',
        'deferline_triggerer_assigned_partitions{queue="default"} 3.0',
        'deferline_triggerer_assigned_partitions{queue="gpu"} 1.0',
        "deferline_triggerer_transactions_total 3.0",
        "deferline_triggerer_transactions_fenced_total 0.0",
    ):
        assert line in text, line


def test_the_families_are_known_by_name_before_any_member_is_added() -> None:
    """A scrape asking for some series by name (``?name[]=``) finds them, once a member is."""
    collector = MemberCollector(SCHEDULER)
    registry = registry_of(collector)
    collector.add(MemberFigures(owned=lambda: 4))
    names = ["deferline_scheduler_partitions_owned", "deferline_scheduler_rebalances_total"]
    text = generate_latest(registry.restricted_registry(names)).decode()
    assert "deferline_scheduler_partitions_owned 4.0" in text
    assert "deferline_scheduler_rebalances_total 0.0" in text
    assert "deferline_scheduler_transactions_total" not in text


def test_without_a_label_a_role_has_one_member() -> None:
    collector = MemberCollector(SCHEDULER)
    collector.add(MemberFigures())
    collector.add(MemberFigures())  # the same member's, in place of the first
    with pytest.raises(ValueError, match="told apart by a label"):
        collector.add(MemberFigures(), "another")
