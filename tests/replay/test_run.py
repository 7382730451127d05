"""Running one trigger locally from its DeferRequest."""

from __future__ import annotations

import datetime as dt

from deferline.replay import run_trigger
from deferline.schemas import DeferRequest, KwargsCipher, seal

from ._history import TIMER, task_key

ALLOWED = ["deferline.engine.triggers"]


def request(moment: dt.datetime, **fields) -> DeferRequest:
    task = task_key()
    return DeferRequest(
        trigger_id="trig-1", task=task, classpath=TIMER, kwargs={"moment": moment}, **fields
    )


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


async def test_a_due_timer_fires():
    lines: list[str] = []
    result = await run_trigger(
        request(now() - dt.timedelta(seconds=5)),
        cipher=None,
        allowed_prefixes=ALLOWED,
        seconds=10,
        echo=lines.append,
    )
    assert result.ended == "event"
    assert [o.status for o in result.outcomes] == ["fired"]
    assert result.exit_code == 0
    assert any(line.startswith("event    fired") for line in lines)
    assert any(line.startswith("timer    due at") for line in lines)


async def test_no_event_within_the_time_given():
    result = await run_trigger(
        request(now() + dt.timedelta(hours=1)),
        cipher=None,
        allowed_prefixes=ALLOWED,
        seconds=0.2,
        echo=lambda _: None,
    )
    assert result.ended == "timeout"
    assert result.exit_code == 3


async def test_the_recorded_timeout_applies_only_when_asked():
    req = request(now() + dt.timedelta(hours=1), timeout_at=now() - dt.timedelta(seconds=1))
    ignored = await run_trigger(
        req, cipher=None, allowed_prefixes=ALLOWED, seconds=0.2, echo=lambda _: None
    )
    assert ignored.ended == "timeout"
    kept = await run_trigger(
        req,
        cipher=None,
        allowed_prefixes=ALLOWED,
        seconds=10,
        keep_timeout=True,
        echo=lambda _: None,
    )
    assert [o.status for o in kept.outcomes] == ["timed_out"]
    assert kept.exit_code == 1


async def test_a_classpath_outside_the_allowed_prefixes_is_not_built():
    lines: list[str] = []
    result = await run_trigger(
        request(now()).model_copy(update={"classpath": "os.system"}),
        cipher=None,
        allowed_prefixes=ALLOWED,
        seconds=1,
        echo=lines.append,
    )
    assert result.ended == "load_error"
    assert result.exit_code == 2
    assert "TriggerNotAllowed" in lines[0]


async def test_sealed_kwargs_need_the_key():
    cipher = KwargsCipher([KwargsCipher.generate_key()])
    sealed = seal(request(now() - dt.timedelta(seconds=1)), cipher)
    without = await run_trigger(
        sealed, cipher=None, allowed_prefixes=ALLOWED, seconds=1, echo=lambda _: None
    )
    assert without.ended == "load_error"
    assert "DecryptionError" in (without.error or "")
    opened = await run_trigger(
        sealed, cipher=cipher, allowed_prefixes=ALLOWED, seconds=10, echo=lambda _: None
    )
    assert opened.exit_code == 0
