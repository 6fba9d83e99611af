"""The fleet page at ``/``: over HTTP (who sees what, the headers, escaping) and in a real headless
Chromium from the Debian packages, driven by selenium with the system chromedriver (nothing is
downloaded at run time): the page follows a real fleet without a reload, asks for a token when the
API has tokens, and shows what nodes send as text, never as markup.

A missing browser fails these tests (it does not skip them), naming the command that installs it;
``.ci/run`` installs it in CI. ``LLMGW_FLEET_PAGE_SCREENSHOT=docs/fleet-page.png`` makes the demo
layout test save its screenshot there (the README's picture); otherwise it goes to a temporary
directory.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from control.page import CSP, MAX_ROWS, fleet_html, page_html
from tests.fleet_procs import Agent, ControlProcess, free_port, poll

TAG = f"p{os.getpid()}"
READ = "read-token-for-the-page-test-0123456789"
ADMIN = "admin-token-for-the-page-test-0123456789"
HOSTILE = """<script>window.__xss=1</script><img src=x onerror="window.__xss=2">"""
APT = "apt-get install -y chromium chromium-driver"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


# -- the page as a function of the API's documents ------------------------------------------------


def test_node_supplied_strings_are_text_not_markup() -> None:
    nodes = [
        {
            "node_id": "gpu01",
            "state": "ready",
            "reason": HOSTILE,
            "since_s": 3.0,
            "gpus": 8,
            "gpus_free": 6,
            "gpu_model": HOSTILE,
            "fabrics": [HOSTILE],
            "heartbeat_age_s": 0.2,
            "mgmt_addr": "10.0.0.1",
            "engines": [{"engine": "vllm", "version": "", "error": HOSTILE}],
        }
    ]
    models = [
        {
            "model": "chat",
            "engine": "vllm",
            "replicas_wanted": 2,
            "replicas_ready": 1,
            "replicas_placed": 1,
            "unplaced": [HOSTILE],
        }
    ]
    shard = {
        "shard_id": "chat-r0-s0",
        "state": "failed",
        "node_id": "gpu01",
        "node_state": "ready",
        "pid": 4242,
        "gpus": [0, 1],
        "port": 21000,
        "failures": 2,
        "retry_in_s": 1.5,
        "error": HOSTILE,
        "output_tail": ["loading", HOSTILE],
    }
    out = fleet_html(nodes, models, [{"model": "chat", "shards": [shard]}])
    assert "<script" not in out and "<img" not in out and 'onerror="' not in out
    assert out.count("&lt;script&gt;window.__xss=1&lt;/script&gt;") == 7
    assert "4242" in out and "1/2" in out and "2/8" in out
    page = page_html(out, tokens=False).decode()
    # Exactly one script: the page's own, allowed by its hash in the CSP; no inline handler.
    assert page.count("<script>") == 1 and "'unsafe-inline'" not in CSP


def test_a_big_fleet_shows_its_problems_first_and_a_bounded_page() -> None:
    def node(i: int, state: str) -> dict[str, Any]:
        return {"node_id": f"gpu{i:04d}", "state": state, "gpus": 8, "gpus_free": 8}

    nodes = [node(i, "ready") for i in range(1000)] + [node(1000, "unreachable")]
    shards = [{"shard_id": f"s{i}", "state": "ready", "node_id": "gpu0001"} for i in range(999)]
    shards.append({"shard_id": "s-bad", "state": "failed", "node_id": "gpu0001", "output_tail": ["boom"]})
    out = fleet_html(nodes, [], [{"model": "chat", "shards": shards}])
    assert out.count("<tr><td>gpu") == MAX_ROWS and "gpu1000" in out
    assert f"and {1001 - MAX_ROWS} more nodes" in out and f"and {1000 - MAX_ROWS} more shards" in out
    assert "s-bad" in out and "boom" in out
    # The summary still counts the whole fleet.
    assert "1001 node(s): 1000 ready, 1 unreachable" in out and "GPUs in use 0/8008" in out


# -- over HTTP ----------------------------------------------------------------------------------------


def _model(name: str, gpus: int, env: str, replicas: int = 1, engine: str = "vllm") -> str:
    profile = (
        f'engine = "vllm"\nmodel = "meta-llama/Llama-3.1-8B-Instruct"\nserved_model_name = "{name}"\n'
        f'tensor_parallel_size = {max(gpus, 1)}\ndtype = "bfloat16"\n'
        if engine == "vllm"
        else 'engine = "sim"\nmodel = "m"\n'
    )
    return (
        f'[[models]]\nname = "{name}"\nreplicas = {replicas}\n[models.gpus]\ncount = {gpus}\n'
        f"[models.profile]\n{profile}env = {{ {env} }}\n"
    )


def _config(tmp: Path, ports: str, models: str, api_table: str = "", router: str = "") -> str:
    return (
        f'state_dir = "{tmp / "cp" / "state"}"\nreconcile_interval = 0.3\nbackoff_initial = 0.5\n'
        f'[listen]\nagents = "127.0.0.1:{free_port()}"\napi = "127.0.0.1:0"\nrouter = "{router}"\n'
        f'[engines]\nports = "{ports}"\n'
        "[liveness]\nunreachable_after = 1.5\nlost_after = 60\nstartup_grace = 8.0\n"
        f"{api_table}{models}"
    )


TOKENS = f'[api]\nread_tokens = ["{READ}"]\nadmin_tokens = ["{ADMIN}"]\n'


def test_with_tokens_the_page_is_a_shell_until_a_token_is_given(tmp_path: Path) -> None:
    model = f"chat-{TAG}"
    cp = ControlProcess(
        tmp_path / "cp", _config(tmp_path, "25800-25899", _model(model, 0, "", 0, "sim"), TOKENS)
    )
    try:
        cp.start()
        base = f"http://127.0.0.1:{cp.api_port}"
        bare = httpx.get(f"{base}/", timeout=15)
        assert bare.status_code == 200 and bare.headers["content-type"] == "text/html; charset=utf-8"
        assert bare.headers["content-security-policy"] == CSP
        assert bare.headers["x-frame-options"] == "DENY" and bare.headers["cache-control"] == "no-store"
        # The shell: the token form and the script, no fleet data.
        assert 'id="login"' in bare.text and model not in bare.text
        assert httpx.get(f"{base}/fleet", timeout=15).status_code == 401
        reader = {"authorization": f"Bearer {READ}"}
        assert model in httpx.get(f"{base}/", headers=reader, timeout=15).text
        fragment = httpx.get(f"{base}/fleet", headers=reader, timeout=15)
        assert fragment.status_code == 200 and model in fragment.text
        # The page's own fetches (same-origin, no Origin) pass; a page elsewhere does not.
        same = httpx.get(f"{base}/fleet", headers={**reader, "sec-fetch-site": "same-origin"}, timeout=15)
        assert same.status_code == 200
        for foreign in ({"origin": "http://evil.example"}, {"sec-fetch-site": "cross-site"}):
            assert httpx.get(f"{base}/fleet", headers={**reader, **foreign}, timeout=15).status_code == 403
            assert httpx.get(f"{base}/", headers=foreign, timeout=15).status_code == 403
        # A write to / is still a write: the admin role, then no such route.
        assert httpx.post(f"{base}/", headers=reader, json={}, timeout=15).status_code == 403
    finally:
        cp.terminate()


# -- in a real browser ----------------------------------------------------------------------------


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless Chromium from the Debian packages; fails, naming the apt command, when absent."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: the fleet page test needs a real browser; run `{APT}`")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        pytest.fail(f"selenium is missing ({exc}): pip install -e '.[test]'")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    # The system driver, by path: selenium's manager never looks for (or downloads) another.
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _rows(driver: Any, table: str) -> list[str]:
    """The text of each row of ``table``, read in one script: the page swaps its tables every 2 s,
    so elements found in one call may be gone by the next."""
    rows = driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0])).map(r => r.innerText)",
        f"#{table} tbody tr",
    )
    return [" ".join(str(r).split()) for r in rows]


def _row(driver: Any, table: str, first: str) -> str | None:
    """The text of ``table``'s row whose first cell is ``first``."""
    return next((r for r in _rows(driver, table) if r.split(" ", 1)[0] == first), None)


def _inventory_file(tmp: Path, node_id: str, text: str) -> Path:
    path = tmp / f"{node_id}-inventory.toml"
    path.write_text(text)
    return path


def test_the_page_follows_the_demo_fleet_without_a_reload(tmp_path: Path, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    import demo.__main__ as demo

    ports = {"gpu01": "25600-25699", "gpu02": "25700-25799"}
    # The demo's catalog and nodes, with short liveness timeouts and ports of this test's own, and
    # a model no node can hold (sixteen GPUs of compute capability 9.0), for the reasons column.
    catalog = demo.CATALOG.format(
        state=tmp_path / "cp" / "state", agents=free_port(), api=0, router=0, model=demo.MODEL
    )
    catalog = catalog.replace("unreachable_after = 6", "unreachable_after = 1.5").replace(
        'ports = "21000-21999"', 'ports = "25600-25799"'
    )
    catalog = catalog.replace("[liveness]", TOKENS + "[liveness]")
    catalog += (
        '\n[[models]]\nname = "llama-3.1-405b-instruct"\nreplicas = 1\nnodes_per_replica = 2\n'
        '[models.gpus]\ncount = 8\nmin_compute_capability = "9.0"\n[models.profile]\nengine = "vllm"\n'
        'model = "meta-llama/Llama-3.1-405B-Instruct"\ntensor_parallel_size = 8\npipeline_parallel_size = 2\n'
        'dtype = "bfloat16"\n'
    )
    catalog = catalog.replace('LLMGW_SIM_LOAD_SECONDS = "3"', 'LLMGW_SIM_LOAD_SECONDS = "0.5"')
    cp = ControlProcess(tmp_path / "cp", catalog)
    agents: dict[str, Agent] = {}
    try:
        cp.start()
        for node_id, addr, inventory, fabric, _ in demo.NODES:
            agent = Agent(
                tmp_path / "agents",
                node_id,
                f"http://127.0.0.1:{cp.agent_port}",
                None,
                fabric,
                addr,
                extra=(
                    "--inventory",
                    str(_inventory_file(tmp_path, node_id, inventory)),
                    "--engine-ports",
                    ports[node_id],
                    "--engines",
                    f"vllm={sys.executable} -m agent.engines.sim",
                ),
            )
            agent.start()
            agents[node_id] = agent

        browser.get(f"http://127.0.0.1:{cp.api_port}/")
        # With tokens the page asks for one, keeps it in this tab and sends it on its fetches.
        poll("the token form", lambda: browser.find_element(By.ID, "login").is_displayed())
        browser.find_element(By.ID, "token").send_keys(READ)
        browser.find_element(By.CSS_SELECTOR, "#login button").click()

        def all_ready() -> bool:
            model = _row(browser, "models", demo.MODEL)
            nodes = [_row(browser, "nodes", n) for n in ("gpu01", "gpu02")]
            return bool(model and "ready 2/2" in model and all(n and " ready" in n for n in nodes))

        poll("both demo replicas ready on the page", all_ready, timeout=90)
        assert browser.execute_script("return sessionStorage.getItem('llmgw-api-token')") == READ
        big = _row(browser, "models", "llama-3.1-405b-instruct") or ""
        assert "0/1" in big and re.search(r"GPU|node", big), big
        shards = [r for r in _rows(browser, "shards") if r.startswith(demo.MODEL)]
        assert len(shards) == 2 and all(" ready " in r for r in shards), shards
        used = [re.search(r"(\d+)/(\d+) NVIDIA", _row(browser, "nodes", n) or "") for n in ("gpu01", "gpu02")]
        assert [m and int(m.group(2)) for m in used] == [8, 4], used
        assert sum(int(m.group(1)) for m in used if m) == 4, used  # two replicas of two GPUs

        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.set_window_size(1280, max(int(height) + 40, 600))
        shot = Path(os.environ.get("LLMGW_FLEET_PAGE_SCREENSHOT", "") or tmp_path / "fleet-page.png")
        assert browser.save_screenshot(str(shot)), shot
        assert shot.stat().st_size > 10_000

        # A mark that only survives if the page is never reloaded.
        browser.execute_script("window.__sameDocument = true")
        assert agents["gpu02"].proc is not None
        os.kill(agents["gpu02"].proc.pid, signal.SIGKILL)
        agents["gpu02"].proc.wait(10)
        poll(
            "gpu02 unreachable on the page", lambda: "unreachable" in (_row(browser, "nodes", "gpu02") or "")
        )
        assert browser.execute_script("return window.__sameDocument") is True
        assert " ready" in (_row(browser, "nodes", "gpu01") or "")
    finally:
        cp.terminate()
        for agent in agents.values():
            agent.stop_all()


def test_an_engine_failure_shows_its_output_as_text(tmp_path: Path, browser: Any) -> None:
    chat, crash = f"chat-{TAG}", f"crash-{TAG}"
    fast = 'LLMGW_SIM_LOAD_SECONDS = "0.3"'
    models = _model(chat, 0, fast, 1, "sim") + _model(
        crash, 0, f"{fast}, LLMGW_SIM_FAIL_LOADING = '{HOSTILE}'", 1, "sim"
    )
    cp = ControlProcess(tmp_path / "cp", _config(tmp_path, "25900-25999", models))
    agent = None
    try:
        cp.start()
        agent = Agent(
            tmp_path / "agents",
            "gpu07",
            f"http://127.0.0.1:{cp.agent_port}",
            None,
            "ib-a:mlx5_0:1",
            "127.0.0.1",
            extra=("--engine-ports", "25900-25999"),
        )
        agent.start()
        # Loopback with no tokens configured: the page is filled in on the server, no token asked.
        first = httpx.get(f"http://127.0.0.1:{cp.api_port}/", timeout=15).text
        assert chat in first and 'id="login" hidden' in first
        browser.get(f"http://127.0.0.1:{cp.api_port}/")

        def failed_tail() -> str | None:
            tails = browser.execute_script(
                "return Array.from(document.querySelectorAll('pre.tail')).map(e => e.textContent)"
            )
            return next((t for t in tails if "window.__xss=1" in t), None)

        tail = poll("the failed engine's output on the page", failed_tail, timeout=60)
        # Shown as the engine wrote it, and nothing of it ran.
        assert HOSTILE in tail
        assert browser.execute_script("return window.__xss === undefined")
        assert poll("chat ready", lambda: "ready 1/1" in (_row(browser, "models", chat) or ""), timeout=60)
        # Its rollout (control.rollout) completes once the replica of its revision is ready.
        poll(
            "chat's rollout complete",
            lambda: " complete " in (_row(browser, "models", chat) or ""),
            timeout=30,
        )
        # The crashing shard is retried with backoff, so its state moves (failed, starting,
        # failed ...); its failure count stays on the row whatever the moment.
        crash_row = next((r for r in _rows(browser, "shards") if r.startswith(crash)), "")
        assert "failure(s)" in crash_row and " ready " not in crash_row.split(" gpu07")[0], crash_row

        # The fragment shows the tail while the shard is failed (between its retries): escaped.
        def escaped_fragment() -> str | None:
            text = httpx.get(f"http://127.0.0.1:{cp.api_port}/fleet", timeout=15).text
            return text if "&lt;script&gt;window.__xss=1" in text else None

        fragment = poll("the failed engine's output in /fleet", escaped_fragment, timeout=60)
        assert "<script>window" not in fragment
    finally:
        cp.terminate()
        if agent is not None:
            agent.stop_all()
