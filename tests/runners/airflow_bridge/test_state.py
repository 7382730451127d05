"""The bridge's lifecycle table, every transition checked (a hypothesis state machine)."""

from __future__ import annotations

import pytest
from deferline.runners.airflow_bridge import BridgeLifecycle, BridgeState, IllegalTransition
from deferline.runners.airflow_bridge.testing import MOVES
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.lifecycle = BridgeLifecycle()

    @rule(to=st.sampled_from(list(BridgeState)))
    def move(self, to: BridgeState) -> None:
        before = self.lifecycle.state
        if to in MOVES[before]:
            self.lifecycle.move(to)
            assert self.lifecycle.state is to
        else:
            with pytest.raises(IllegalTransition):
                self.lifecycle.move(to)
            assert self.lifecycle.state is before


TestLifecycle = LifecycleMachine.TestCase


def test_a_bridge_runs_then_stops_for_good() -> None:
    lifecycle = BridgeLifecycle()
    for state in (BridgeState.STARTING, BridgeState.RUNNING, BridgeState.STOPPING):
        lifecycle.move(state)
    lifecycle.move(BridgeState.STOPPED)
    assert not any(lifecycle.can_move(s) for s in BridgeState)
