"""The triggerer process: a consumer-group member that runs triggers and emits their events."""

from ..member import LONG_POLL_MS, SHORT_WAIT_MS, answers_fetches_early, choose_fetch_wait
from ._triggerer import (
    DEFAULT_CAPACITY,
    BootstrapError,
    TopicDeletedError,
    Triggerer,
    TriggererError,
    TriggererOptions,
    default_member,
    default_state_dir,
    triggerer_command,
)

__all__ = [
    "DEFAULT_CAPACITY",
    "LONG_POLL_MS",
    "SHORT_WAIT_MS",
    "BootstrapError",
    "TopicDeletedError",
    "Triggerer",
    "TriggererError",
    "TriggererOptions",
    "answers_fetches_early",
    "choose_fetch_wait",
    "default_member",
    "default_state_dir",
    "triggerer_command",
]
