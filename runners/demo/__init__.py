"""The end-to-end demo: every process on the embedded broker, with a live view."""

from ._demo import (
    DemoOptions,
    DemoSummary,
    demo_command,
    run_demo,
)

__all__ = [
    "DemoOptions",
    "DemoSummary",
    "demo_command",
    "run_demo",
]
