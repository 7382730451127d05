"""Reading the topics back: timelines, stuck-deferral verdicts, re-drive and local runs.

Everything deferline knows is on its topics, so a replay of them explains a stuck deferral:
when it was requested, who owned its partition, whether it fired, failed, timed out or was
never picked up, and whether the scheduler applied or dropped its event.
"""

from ._collect import ReplaySession, StuckReport, StuckScan, WaitingTask, subject_filter
from ._errors import BadSubject, RedriveRefused, ReplayError, TopicsNotFound
from ._explain import explain, explain_task, explain_trigger
from ._fold import (
    OwnerGuess,
    OwnershipLog,
    ReplayIndex,
    TaskHistory,
    TriggerHistory,
    WatchTally,
)
from ._html import REPORT_CSS, ReportItem, render_html, render_item
from ._live import GroupHints, GroupView, LiveView, MemberView, read_live_view
from ._records import REDRIVE_HEADER, Position, RawRecord, ReplayRecord, decode_raw, describe
from ._redrive import RedrivePlan, plan_redrive, publish_redrives
from ._run import LocalRun, run_trigger
from ._source import NullProgress, ProgressSink, ReadBounds, TopicReader
from ._timeline import TimelineEntry, build_timeline
from ._topics import TopicInfo, TopicRole, classify_topic
from ._verdict import Evidence, ReplayContext, Subject, Verdict, VerdictKind, parse_subject
from ._verdict_progress import scheduler_decisions

__all__ = [
    "REDRIVE_HEADER",
    "REPORT_CSS",
    "BadSubject",
    "Evidence",
    "GroupHints",
    "GroupView",
    "LiveView",
    "LocalRun",
    "MemberView",
    "NullProgress",
    "OwnerGuess",
    "OwnershipLog",
    "Position",
    "ProgressSink",
    "RawRecord",
    "ReadBounds",
    "RedrivePlan",
    "RedriveRefused",
    "ReplayContext",
    "ReplayError",
    "ReplayIndex",
    "ReplayRecord",
    "ReplaySession",
    "ReportItem",
    "StuckReport",
    "StuckScan",
    "Subject",
    "TaskHistory",
    "TimelineEntry",
    "TopicInfo",
    "TopicReader",
    "TopicRole",
    "TopicsNotFound",
    "TriggerHistory",
    "Verdict",
    "VerdictKind",
    "WaitingTask",
    "WatchTally",
    "build_timeline",
    "classify_topic",
    "decode_raw",
    "describe",
    "explain",
    "explain_task",
    "explain_trigger",
    "parse_subject",
    "plan_redrive",
    "publish_redrives",
    "read_live_view",
    "render_html",
    "render_item",
    "run_trigger",
    "scheduler_decisions",
    "subject_filter",
]
