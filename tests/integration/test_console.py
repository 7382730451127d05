"""`deferline console` in a real headless browser, against a real broker and real processes.

Screenshots of every page checked are kept (``screenshots/`` under the test's tmp directory,
or ``$DEFERLINE_SCREENSHOTS``).
"""

from __future__ import annotations

import datetime as dt
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from deferline.client import Client
from deferline.runners.console import Console, ConsoleOptions
from deferline.runners.scheduler import Scheduler
from deferline.runners.worker import Worker
from deferline.topics import Settings, ensure_acls, ensure_topics, topic_specs

from tests._until import until
from tests.conftest import SecuredKafka
from tests.integration import _e2e_ops
from tests.integration._browser import Browser, screenshot_dir
from tests.integration._taskflow import TaskFlow
from tests.integration._triggerer_help import TriggererProcess
from tests.integration.test_replay_system import EXAMPLES, allowed, submit, triggerer

FAST = ConsoleOptions(
    port=0,
    tick_s=0.5,
    groups_every_s=1.0,
    stuck_every_s=1.0,
    stuck_older_than=dt.timedelta(seconds=1),
)


@asynccontextmanager
async def page(settings: Settings, tmp_path: Path, view: str = "") -> AsyncIterator[Browser]:
    """A console for ``settings`` and a browser showing it."""
    async with Console(settings, FAST) as console, Browser(tmp_path / "chromium") as browser:
        await browser.goto(f"http://127.0.0.1:{console.port}/#/{view}")
        yield browser


async def status_says(browser: Browser, state: str) -> str:
    """Wait until the page's status banner is in ``state``; return its text."""

    async def shown() -> str:
        found = await browser.evaluate("document.getElementById('status').dataset.state")
        return await browser.text("#status") if found == state else ""

    text: str = await until(shown, within=60, interval=0.2, what=f"status {state}")
    return text


async def count(browser: Browser, state: str) -> int:
    text = await browser.text(f'[data-count="{state}"]')
    return int(text.replace(",", "")) if text else 0


@pytest.mark.integration
@pytest.mark.timeout(300)  # its waits are bounded one by one: a stuck one names itself
async def test_counts_move_and_a_refused_deferral_is_explained(settings: Settings, tmp_path: Path):
    shots = screenshot_dir(tmp_path)
    runs = allowed(settings)  # the worker may run the test operators and defer their triggers
    # ... but this triggerer may not import the test module's trigger: its deferral is refused.
    strict = runs.model_copy(update={"allowed_trigger_prefixes": ["deferline.engine.triggers"]})
    async with (
        TaskFlow(runs) as flow,
        Scheduler(runs, orphan_check_interval=0.5, commit_interval=0.2) as scheduler,
        Worker(runs, slots=4, poll_interval=0.02, graceful_timeout=5.0),
        triggerer(strict, "console-trig"),
        Client(runs) as client,
        page(runs, tmp_path) as browser,
    ):
        await scheduler.wait_active()
        await status_says(browser, "live")
        assert await count(browser, "success") == 0

        quick = [
            await submit(client, f"quick{i}", f"{EXAMPLES}.WaitOperator", seconds=0.2)
            for i in range(6)
        ]
        for task in quick:
            await flow.wait_state(task, "success")

        async def all_succeeded() -> bool:
            return await count(browser, "success") == len(quick)

        await until(all_succeeded, within=20, interval=0.05, what="6 successes on the page")
        waits = await submit(client, "waits", f"{EXAMPLES}.WaitOperator", seconds=600)
        await flow.wait_state(waits, "deferred")

        async def one_waiting() -> bool:
            return await browser.text("#deferrals-waiting") == "1"

        await until(one_waiting, within=20, interval=0.05, what="1 deferral waiting on the page")
        await browser.screenshot(shots / "console-loop.png")

        refused = await submit(client, "refused", f"{_e2e_ops.MODULE}.ExplodeOperator")
        await flow.wait_state(refused, "failed")
        await browser.goto(browser_url(await browser.evaluate("location.origin"), "stuck"))

        async def listed() -> bool:
            rows = await browser.texts("tr.stuck-row")
            return any(refused.ti_key in r and "classpath_not_allowed" in r for r in rows) and any(
                waits.ti_key in r and "running" in r for r in rows
            )

        await until(listed, within=30, interval=0.3, what="both deferrals listed")
        await browser.screenshot(shots / "console-stuck.png")

        await browser.evaluate(
            "[...document.querySelectorAll('a.task-link')]"
            f".find(a => a.innerText === {refused.ti_key!r}).click()"
        )

        async def verdict() -> str:
            return await browser.text("#task-verdict")

        said = await until(verdict, within=30, interval=0.2, what="the task's verdict")
        assert said.startswith("classpath_not_allowed")
        assert "not under an allowed prefix" in said
        assert await browser.evaluate("document.querySelectorAll('#task-page svg circle').length")
        assert not await browser.evaluate("!!document.getElementById('redrive')")  # read-only
        await browser.screenshot(shots / "console-task.png")

        await browser.goto(browser_url(await browser.evaluate("location.origin"), "dead"))
        letters = await until(
            lambda: browser.texts("tr.dead-row"), within=20, interval=0.05, what="dead letters"
        )
        assert "TriggerNotAllowed" in letters[0]
        assert refused.ti_key in letters[0]
        await browser.screenshot(shots / "console-dead.png")


def browser_url(origin: str, view: str) -> str:
    return f"{origin}/#/{view}"


@pytest.mark.integration
@pytest.mark.kafka_only
async def test_a_killed_triggerers_partitions_move_in_the_groups_view(
    settings: Settings, tmp_path: Path
):
    shots = screenshot_dir(tmp_path)
    timing = ("--session-timeout-ms", "6000", "--heartbeat-interval-ms", "500")
    async with TaskFlow(settings):
        first = TriggererProcess(settings, "trig-a", tmp_path, *timing)
        second = TriggererProcess(settings, "trig-b", tmp_path, *timing)
        try:
            async with page(settings, tmp_path, "groups") as browser:

                async def partitions_of(member: str) -> list[str]:
                    text = await browser.text(f'tr.member[data-member="{member}"] .partitions')
                    return [p for p in text.split() if ".defer[" in p]

                async def both_own() -> bool:
                    a, b = await partitions_of("trig-a"), await partitions_of("trig-b")
                    return len(a) + len(b) == settings.partitions and bool(a) and bool(b)

                await until(both_own, within=60, interval=0.3, what="both own partitions")
                moved = await partitions_of("trig-a")
                await browser.screenshot(shots / "console-groups-before.png")

                first.close()  # SIGKILL: no leave, the coordinator notices at session timeout

                async def b_owns_all() -> bool:
                    return len(await partitions_of("trig-b")) == settings.partitions

                await until(b_owns_all, within=60, interval=0.3, what="b owns all")
                moves = await until(
                    lambda: browser.texts(".group tr.move"),
                    within=10,
                    interval=0.05,
                    what="moves listed",
                )
                for partition in moved:
                    assert any(partition in m and "trig-a" in m and "trig-b" in m for m in moves)
                left = await browser.texts(".group tr.left")
                assert any("trig-a" in row for row in left), left
                await browser.screenshot(shots / "console-groups-after.png")
        finally:
            first.close()
            second.close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_a_broker_that_does_not_answer_is_said(tmp_path: Path):
    settings = Settings(bootstrap_servers=f"127.0.0.1:{closed_port()}", topic_prefix="x.")
    async with page(settings, tmp_path) as browser:
        text = await status_says(browser, "unreachable")
    assert "No broker answered at 127.0.0.1:" in text


@pytest.mark.tansu_first
@pytest.mark.integration
async def test_an_empty_cluster_is_said(settings: Settings, tmp_path: Path):
    async with page(settings, tmp_path) as browser:
        text = await status_says(browser, "empty")
        await browser.screenshot(screenshot_dir(tmp_path) / "console-empty.png")
    assert f"no deferline topics under the prefix {settings.topic_prefix!r}" in text


@pytest.mark.integration
async def test_the_replay_principal_reads_and_one_without_acls_is_refused(
    secured_kafka: SecuredKafka, tmp_path: Path
):
    prefix = f"c{uuid.uuid4().hex[:8]}."
    admin = secured_kafka.settings("admin", prefix=prefix)
    await ensure_topics(admin, topic_specs(admin))
    await ensure_acls(admin, {"replay": "User:replay"})
    async with page(secured_kafka.settings("replay", prefix=prefix), tmp_path) as browser:
        await status_says(browser, "live")
    async with page(secured_kafka.settings("noacl", prefix=prefix), tmp_path) as browser:
        text = await status_says(browser, "refused")
    assert "AuthorizationError" in text
    assert "User:noacl" in text


@pytest.mark.integration
async def test_a_redrive_needs_the_flag_and_the_token(settings: Settings, tmp_path: Path):
    runs = allowed(settings)
    async with (
        TaskFlow(runs) as flow,
        Scheduler(runs, orphan_check_interval=0.5, commit_interval=0.2) as scheduler,
        Worker(runs, slots=2, poll_interval=0.02, graceful_timeout=5.0),
        Client(runs) as client,
        Console(runs, FAST) as read_only,
        Console(runs, replace(FAST, redrive_token="s3cret")) as console,
        aiohttp.ClientSession() as http,
    ):
        await scheduler.wait_active()
        task = await submit(client, "orphan", f"{EXAMPLES}.WaitOperator", seconds=600)
        # No triggerer runs it: it waits for ever.
        body = {"trigger_id": (await flow.wait_state(task, "deferred")).trigger_id}

        async def post(port: int | None, token: str | None) -> tuple[int, dict[str, Any]]:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            url = f"http://127.0.0.1:{port}/api/redrive"
            async with http.post(url, json=body, headers=headers) as response:
                return response.status, await response.json()

        assert (await post(read_only.port, "s3cret"))[0] == 403
        assert (await post(console.port, None))[0] == 401
        assert (await post(console.port, "wrong"))[0] == 401
        status, plan = await post(console.port, "s3cret")
        assert status == 200, plan
        assert (plan["action"], plan["published"], plan["verdict"]) == (
            "publish",
            1,
            "no_live_triggerer",
        )
        async with Browser(tmp_path / "chromium") as browser:
            url = f"http://127.0.0.1:{console.port}/#/task/{task.ti_key}"
            await browser.goto(url)
            await until(
                lambda: browser.text("#redrive"), within=30, interval=0.05, what="the button"
            )
