"""The triggerer process: a consumer-group member that runs triggers and emits their events."""

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
    "BootstrapError",
    "TopicDeletedError",
    "Triggerer",
    "TriggererError",
    "TriggererOptions",
    "default_member",
    "default_state_dir",
    "triggerer_command",
]
