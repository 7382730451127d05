"""Built-in triggers. Each validates its kwargs and never blocks the event loop.

Their classpaths are ``deferline.engine.triggers.<Name>``, inside the default allowed prefix.
"""

from ._file import FileTrigger
from ._http import HttpTrigger
from ._kafka import KafkaMessageTrigger
from ._kafka_watch import KafkaWatchTrigger
from ._temporal import DateTimeTrigger, TimeDeltaTrigger

__all__ = [
    "DateTimeTrigger",
    "FileTrigger",
    "HttpTrigger",
    "KafkaMessageTrigger",
    "KafkaWatchTrigger",
    "TimeDeltaTrigger",
]
