"""A role's membership figures as Prometheus metrics, under the role's own names.

Both roles count the same things of their membership (:class:`~._figures.MemberFigures`);
this one collector turns them into metrics at scrape time, so a triggerer's and a
scheduler's series mean the same. The names are each role's (:class:`MemberMetricNames`),
spelled out in full where the role is: they came before this core, dashboards and alert
rules use them, and a name searched for is found.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ._figures import MemberFigures

__all__ = ["MemberCollector", "MemberMetricNames"]

_REBALANCES = "Group assignments received (one per rebalance)."
_TAKEOVERS = "Partitions taken over (acquired, and written for since)."
_FENCED = (
    "Partitions dropped because the group refused a round holding their writes (the member "
    "was paused or cut off past its session; Apache Kafka)."
)
_TRANSACTIONS = (
    "Transactions committed: one per round of a member's producer, holding every owned "
    "partition's batches handed over since the round before (Apache Kafka)."
)
_FENCED_ROUNDS = "Rounds the group refused, or the broker aborted after their transaction timeout."


@dataclass(frozen=True, slots=True)
class MemberMetricNames:
    """What a role calls the metric of each membership figure (a counter's without its
    ``_total``)."""

    rebalances: str
    takeovers: str
    partitions_fenced: str
    transactions: str
    transactions_fenced: str
    owned: str
    owned_help: str
    """The owned-partitions gauge's help: each role counts its own (see
    :class:`~._figures.MemberFigures`)."""


class MemberCollector(Collector):
    """The membership figures of a role's members, read at each scrape.

    Per member (labelled ``label`` where a role has several: a triggerer has one per queue):
    rebalances, takeovers and fenced partitions (counters) and the owned partitions (a
    gauge). For the process, every member's summed: transactions and fenced transactions (a
    triggerer has always shown one series of transactions for all its queues).

    Args:
        names: the role's names of these metrics.
        label: the label telling the role's members apart; None: the role has one member.
    """

    def __init__(self, names: MemberMetricNames, *, label: str | None = None) -> None:
        self._names = names
        self._label = label
        self._members: dict[str, MemberFigures] = {}

    def add(self, figures: MemberFigures, member: str = "") -> None:
        """Read ``figures`` at each scrape as those of the member labelled ``member`` (in
        place of any added under that label before)."""
        if self._label is None and any(other != member for other in self._members):
            raise ValueError("a role's members are told apart by a label: none was given")
        self._members[member] = figures

    def collect(self) -> Iterator[Metric]:
        return self._families(list(self._members.items()))

    def describe(self) -> Iterator[Metric]:
        """The families without samples: the registry knows their names before any member
        is added (a scrape asking for some series by name finds these too)."""
        return self._families([])

    def _families(self, members: list[tuple[str, MemberFigures]]) -> Iterator[Metric]:
        names = self._names
        labels = [] if self._label is None else [self._label]
        per_member: tuple[tuple[str, str, Callable[[MemberFigures], int]], ...] = (
            (names.rebalances, _REBALANCES, lambda figures: figures.rebalances),
            (names.takeovers, _TAKEOVERS, lambda figures: figures.takeovers),
            (names.partitions_fenced, _FENCED, lambda figures: figures.partitions_fenced),
        )
        for name, documentation, figure in per_member:
            counter = CounterMetricFamily(name, documentation, labels=labels)
            for member, figures in members:
                counter.add_metric([member] if labels else [], figure(figures))
            yield counter
        owned = GaugeMetricFamily(names.owned, names.owned_help, labels=labels)
        for member, figures in members:
            owned.add_metric([member] if labels else [], figures.owned)
        yield owned
        summed: tuple[tuple[str, str, Callable[[MemberFigures], int]], ...] = (
            (names.transactions, _TRANSACTIONS, lambda figures: figures.rounds),
            (names.transactions_fenced, _FENCED_ROUNDS, lambda figures: figures.fenced_rounds),
        )
        for name, documentation, figure in summed:
            total = CounterMetricFamily(name, documentation, labels=[])
            if members:
                total.add_metric([], sum(figure(figures) for _, figures in members))
            yield total
