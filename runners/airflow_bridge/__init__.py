"""``deferline airflow bridge``: an Airflow deployment's deferred tasks run on deferline."""

from ._bridge import AirflowBridge, BridgeOptions
from ._cli import airflow_command
from ._rows import bridge_trigger_id, parse_trigger_id
from ._state import BridgeLifecycle, BridgeState, IllegalTransition

__all__ = [
    "AirflowBridge",
    "BridgeLifecycle",
    "BridgeOptions",
    "BridgeState",
    "IllegalTransition",
    "airflow_command",
    "bridge_trigger_id",
    "parse_trigger_id",
]
