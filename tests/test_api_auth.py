"""The admin API asks who you are: a real control plane with a joined agent, asked by ``ctl`` and by
requests shaped like a browser's.

A read-only token reads and cannot drain; an admin token drains; a web page's cross-origin
``text/plain`` POST, a foreign ``Host`` (DNS rebinding) and a write without a JSON content type are
refused, and after each refusal the node is still not draining. Without any token the API answers
this machine only, and says so when it starts.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fleet_procs import Agent, ControlProcess, free_port, poll
from tests.test_catalog import CatalogQuery

READ = "r" * 8 + "-read-token-0001"
ADMIN = "a" * 8 + "-admin-token-001"
#: A catalog that places nothing, so a drain moves nothing and is never refused for a model's sake.
CATALOG = """
state_dir = "{state}"
reconcile_interval = 0.3
[listen]
agents = "127.0.0.1:{agents}"
api = "{api}"
router = ""
{api_table}
[[models]]
name = "m"
replicas = 0
[models.profile]
engine = "sim"
model = "m"
"""


def _config(tmp: Path, api: str = "127.0.0.1:0", tokens: bool = True) -> str:
    table = f'[api]\nread_tokens = ["{READ}"]\nadmin_tokens = ["{ADMIN}"]\n' if tokens else ""
    return CATALOG.format(state=tmp / "state", agents=free_port(), api=api, api_table=table)


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[ControlProcess]:
    control = ControlProcess(tmp_path / "cp", _config(tmp_path))
    control.start()
    try:
        yield control
    finally:
        control.terminate()


@pytest.fixture
def node(cp: ControlProcess, tmp_path: Path) -> Iterator[str]:
    agent = Agent(
        tmp_path / "agents",
        "gpu01",
        f"http://127.0.0.1:{cp.agent_port}",
        "h100x8.toml",
        "ib-a:mlx5_0:1",
        "127.0.0.1",
        extra=("--engine-ports", "23000-23099", "--mgmt-interface", "lo"),
    )
    agent.start()
    try:
        poll("gpu01 to be ready", lambda: _node(cp, "gpu01", ADMIN).get("state") == "ready", timeout=60)
        yield "gpu01"
    finally:
        if agent.proc is not None:
            agent.proc.terminate()
            agent.proc.wait(10)


def _get(cp: ControlProcess, path: str, token: str = "", **headers: str) -> httpx.Response:
    if token:
        headers["authorization"] = f"Bearer {token}"
    return httpx.get(f"http://127.0.0.1:{cp.api_port}{path}", headers=headers, timeout=15)


def _node(cp: ControlProcess, node_id: str, token: str) -> dict[str, Any]:
    resp = _get(cp, "/api/nodes", token)
    assert resp.status_code == 200, resp.text
    return next((n for n in resp.json() if n["node_id"] == node_id), {})


def _ctl(cp: ControlProcess, *args: str, token: str = "", token_file: Path | None = None) -> Any:
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "LLMGW_API_TOKEN"}
    if token:
        env["LLMGW_API_TOKEN"] = token
    extra = ("--token-file", str(token_file)) if token_file else ()
    return subprocess.run(
        [*cp.ctl_argv(), *extra, *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_a_read_only_token_reads_and_cannot_drain_an_admin_token_drains(
    cp: ControlProcess, node: str
) -> None:
    nobody = _ctl(cp, "nodes")
    assert nobody.returncode == 1 and "HTTP 401" in nobody.stderr and "LLMGW_API_TOKEN" in nobody.stderr
    wrong = _ctl(cp, "nodes", token="x" * 20)
    assert wrong.returncode == 1 and "unknown admin API token" in wrong.stderr
    reader = _ctl(cp, "nodes", token=READ)
    assert reader.returncode == 0 and node in reader.stdout, reader.stderr
    refused = _ctl(cp, "drain", node, token=READ)
    assert refused.returncode == 1 and "HTTP 403" in refused.stderr and "admin token" in refused.stderr
    assert _node(cp, node, READ)["draining"] is False
    drained = _ctl(cp, "drain", node, token=ADMIN)
    assert drained.returncode == 0, drained.stderr
    assert _node(cp, node, READ)["draining"] is True
    # The token can come from a file too; the read token still cannot undo the drain.
    token_file = cp.workdir / "admin.token"
    token_file.write_text(ADMIN + "\n")
    token_file.chmod(0o600)
    assert _ctl(cp, "uncordon", node, token=READ).returncode == 1
    assert _node(cp, node, READ)["draining"] is True
    undone = _ctl(cp, "uncordon", node, token_file=token_file)
    assert undone.returncode == 0, undone.stderr
    assert _node(cp, node, READ)["draining"] is False


def test_browser_shaped_requests_are_refused_whatever_the_token(cp: ControlProcess, node: str) -> None:
    url = f"http://127.0.0.1:{cp.api_port}/api/drain/{node}"
    admin = {"authorization": f"Bearer {ADMIN}"}
    # A web page's form or fetch: a text/plain POST needs no CORS preflight. The browser adds
    # Origin; even with the admin token (a page cannot have it, but the check does not rely on that).
    for headers in (
        {"origin": "http://evil.example", "content-type": "text/plain"},
        {"origin": "http://evil.example", "content-type": "application/json", **admin},
        {"sec-fetch-site": "cross-site", "content-type": "application/json", **admin},
    ):
        resp = httpx.post(url, content=b"{}", headers=headers, timeout=15)
        assert resp.status_code == 403 and "cross-site" in resp.json()["error"], resp.text
    # DNS rebinding: the page's own name, now resolving to 127.0.0.1, is the Host.
    for host in (f"evil.example:{cp.api_port}", "evil.example", f"localhost:{cp.api_port + 1}"):
        resp = httpx.post(url, json={}, headers={"host": host, **admin}, timeout=15)
        assert resp.status_code == 403 and "is not this admin API's address" in resp.json()["error"], (
            resp.text
        )
        assert _get(cp, "/api/nodes", READ, host=host).status_code == 403
    # A write that is not JSON, even with the admin token and an own Host.
    resp = httpx.post(url, content=b"{}", headers={"content-type": "text/plain", **admin}, timeout=15)
    assert resp.status_code == 415 and "application/json" in resp.json()["error"]
    assert _node(cp, node, READ)["draining"] is False
    # Own names pass: localhost and 127.0.0.1 with the port.
    for host in (f"localhost:{cp.api_port}", f"127.0.0.1:{cp.api_port}"):
        assert _get(cp, "/api/nodes", READ, host=host).status_code == 200


def test_the_join_token_is_for_admin_tokens_only(cp: ControlProcess) -> None:
    assert _get(cp, "/api/token", READ).status_code == 403
    assert _get(cp, "/api/token", ADMIN).status_code != 403


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route's source
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_without_tokens_the_api_answers_this_machine_only_and_warns(tmp_path: Path) -> None:
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no address but loopback to reach the API from")
    control = ControlProcess(tmp_path / "cp", _config(tmp_path, api="0.0.0.0:0", tokens=False))
    control.start()
    try:
        log = control.log.read_text()
        assert "admin API: no tokens in [api]" in log and "although it listens on 0.0.0.0" in log, log
        assert _get(control, "/api/nodes").status_code == 200
        far = httpx.get(f"http://{address}:{control.api_port}/api/nodes", timeout=15)
        assert far.status_code == 403 and "no tokens are configured" in far.json()["error"]
        far_drain = httpx.post(f"http://{address}:{control.api_port}/api/drain/gpu01", json={}, timeout=15)
        assert far_drain.status_code == 403
        near = _ctl(control, "cordon", "gpu09")
        assert near.returncode == 1 and "HTTP 404" in near.stderr  # reached the route: no node gpu09
    finally:
        control.terminate()


def test_mutual_tls_on_the_admin_listener(tmp_path: Path) -> None:
    """``[api.tls]`` with ``client_ca`` and ``require_client_cert``: ctl with a certificate from that
    CA (and a token) is answered; without a certificate, or with one from another CA, the
    handshake fails and nothing is answered."""
    import trustme

    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.cert_chain_pems[0].write_to_path(tmp_path / "api.pem")
    server.private_key_pem.write_to_path(tmp_path / "api.key")
    for name, issuer in (("operator", ca), ("rogue", other)):
        cert = issuer.issue_cert(f"{name}.operators.llmgw")
        cert.cert_chain_pems[0].write_to_path(tmp_path / f"{name}.pem")
        cert.private_key_pem.write_to_path(tmp_path / f"{name}.key")
    tls = (
        f'[api.tls]\ncert = "{tmp_path / "api.pem"}"\nkey = "{tmp_path / "api.key"}"\n'
        f'client_ca = "{tmp_path / "ca.pem"}"\nrequire_client_cert = true\n'
    )
    text = _config(tmp_path).replace("\n[[models]]", f"\n{tls}[[models]]", 1)
    control = ControlProcess(tmp_path / "cp", text)
    control.start()
    try:
        api = ("--api", f"https://127.0.0.1:{control.api_port}", "--cacert", str(tmp_path / "ca.pem"))

        def ctl(*args: str) -> Any:
            import subprocess

            env = {**os.environ, "LLMGW_API_TOKEN": READ}
            argv = [sys.executable, "-m", "control", "ctl", *api, *args, "nodes", "--json"]
            return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)

        answered = ctl("--cert", str(tmp_path / "operator.pem"), "--key", str(tmp_path / "operator.key"))
        assert answered.returncode == 0 and answered.stdout.strip() == "[]", answered.stderr
        for args in ((), ("--cert", str(tmp_path / "rogue.pem"), "--key", str(tmp_path / "rogue.key"))):
            refused = ctl(*args)
            assert refused.returncode == 1 and "cannot reach the control plane" in refused.stderr, refused
        plain = _ctl(control, "nodes", token=READ)  # http:// to an https listener
        assert plain.returncode == 1, plain
    finally:
        control.terminate()


def test_which_host_headers_are_the_apis_own() -> None:
    """The Host rule on its own: the listen address, localhost and 127.0.0.1 with the bound port;
    any IP literal when listening on every address; names from ``[api] hosts``; nothing else."""
    from control.api import ApiGuard
    from control.config import AdminApi

    def own(listen: str, port: int, hosts: tuple[str, ...] = (), tls: bool = False) -> Any:
        guard = ApiGuard.from_config(AdminApi(hosts=hosts), listen, port, tls=tls)
        return guard.own_host

    loopback = own("127.0.0.1", 7080)
    for host in ("127.0.0.1:7080", "localhost:7080", "LOCALHOST:7080", "[::1]:7080", "localhost.:7080"):
        assert loopback(host), host
    for host in ("127.0.0.1:7081", "127.0.0.1", "evil.example:7080", "10.0.0.5:7080", "", "127.0.0.1:70x"):
        assert not loopback(host), host
    everywhere = own("0.0.0.0", 7080, hosts=("cp.example.internal",))
    for host in ("10.0.0.5:7080", "[fd00::2]:7080", "cp.example.internal:7080", "CP.example.internal.:7080"):
        assert everywhere(host), host
    for host in ("evil.example:7080", "cp.example.internal:80", "10.0.0.5.nip.io:7080"):
        assert not everywhere(host), host
    # A Host without a port means the scheme's default port.
    assert own("10.0.0.5", 80)("10.0.0.5") and own("10.0.0.5", 443, tls=True)("10.0.0.5")
    assert not own("10.0.0.5", 443)("10.0.0.5")


# -- the route table, over a hand-built query: every route checks its own role --------------------


class _FleetlessQuery(CatalogQuery):
    """Every ``ControlQuery`` method over a real ``Catalog`` (one model, ``m``), a real join book and
    no node: a request that passes the guard reaches its route's handler, which answers from here
    (``no node 'x1'; nodes: none`` for a node's routes, the model's documents for ``m``)."""

    def __init__(self, state: Path) -> None:
        from control.catalog import Catalog
        from control.config import ModelConfig, ProfileConfig
        from control.joins import JoinBook

        super().__init__(Catalog())
        self.catalog.apply_file(
            [ModelConfig(name="m", replicas=0, profile=ProfileConfig(engine="sim", model="m"))]
        )
        self.book = JoinBook.load(state)

    async def request_logs(self, node_id: str, shard_id: str, lines: int, **_: Any) -> Any:
        raise LookupError(f"{node_id} is not connected")

    def _no_node(self, node_id: str) -> KeyError:
        from control.notfound import unknown_node

        return KeyError(unknown_node(node_id, ()))

    async def cordon(self, node_id: str) -> Any:
        raise self._no_node(node_id)

    async def uncordon(self, node_id: str) -> Any:
        raise self._no_node(node_id)

    async def drain(self, node_id: str, *, force: bool = False) -> list[str]:
        raise self._no_node(node_id)

    def joins(self) -> Any:
        return self.book


@pytest.fixture
def app(tmp_path: Path) -> Any:
    """The admin API over ``_FleetlessQuery``, with the read and the admin token configured."""
    from control.api import ApiGuard, make_app

    guard = ApiGuard(
        read_tokens=(READ.encode(),),
        admin_tokens=(ADMIN.encode(),),
        hosts=frozenset({"127.0.0.1"}),
        port=7080,
    )
    return make_app(_FleetlessQuery(tmp_path), guard)  # type: ignore[arg-type]


def _route_path(path: str) -> str:
    """A route's path with a value in each parameter: the model ``m``, any other name ``x1``."""
    return path.replace("{model}", "m").replace("{node}", "x1").replace("{shard}", "x1")


def test_every_route_checks_its_role_and_reaches_its_handler(app: Any) -> None:
    """Iterates ``control.api.ROUTES``, so a route added later is covered: without a token 401 (a
    public route 200); with the read token a read route is answered and an admin route is 403;
    with the admin token every route is answered by its handler (never the router's 404/405)."""
    from control.api import ADMIN as ADMIN_ROLE
    from control.api import READ as READ_ROLE
    from control.api import ROUTES
    from tests.support import asgi_call

    def ask(method: str, path: str, token: str) -> tuple[int, bytes]:
        headers = [(b"content-type", b"application/json")]
        if token:
            headers.append((b"authorization", f"Bearer {token}".encode()))
        body = b'{"replicas": 0}' if method in ("PUT", "POST") else b""
        status, _, data = asgi_call(app, method, path, body, headers=headers)
        return status, data

    assert {r.role for r in ROUTES} == {None, READ_ROLE, ADMIN_ROLE}
    assert len({(r.method, r.path) for r in ROUTES}) == len(ROUTES), "a route is in the table twice"
    for route in ROUTES:
        path = _route_path(route.path)
        where = f"{route.method} {route.path}"
        anonymous, _ = ask(route.method, path, "")
        assert anonymous == (200 if route.role is None else 401), where
        for token, may in ((READ, route.role != ADMIN_ROLE), (ADMIN, True)):
            status, data = ask(route.method, path, token)
            if may:
                # The handler's own answer: 200, or its 400/404/409/503 naming the object.
                assert status not in (401, 403, 405) and b"no route" not in data, (where, status, data)
            else:
                assert status == 403 and b"needs an admin token" in data, (where, status, data)
    assert ask("GET", "/api/why/m", READ)[0] == 200 and ask("GET", "/api/nodes/x1", READ) == (
        404,
        b'{\n  "error": "no node \'x1\'; nodes: none"\n}\n',
    )


def test_unknown_paths_methods_and_query_parameters_are_named(app: Any) -> None:
    """404 for a path no route has and 405 with ``Allow`` for a method its path lacks (after the
    read role is checked for a read, the admin role for a write), and every query parameter
    checked: its range and the value given in the error."""
    import json

    from tests.support import asgi_call

    auth = [(b"authorization", f"Bearer {READ}".encode())]
    admin = [(b"authorization", f"Bearer {ADMIN}".encode()), (b"content-type", b"application/json")]

    def ask(method: str, path: str, query: bytes = b"", headers: Any = auth) -> tuple[int, Any, Any]:
        status, head, data = asgi_call(app, method, path, headers=headers, query=query)
        return status, head, json.loads(data) if data else None

    assert ask("GET", "/api/nosuch", headers=[])[0] == 401  # nothing said about paths to a stranger
    status, _, doc = ask("GET", "/api/nosuch")
    assert (status, doc["error"]) == (404, "no route GET /api/nosuch")
    assert ask("PATCH", "/api/models/m")[0] == 403  # a write: the admin role before anything is said
    assert ask("POST", "/api/nosuch")[0] == 403
    assert ask("POST", "/api/nosuch", headers=admin)[0] == 404
    status, head, doc = ask("PATCH", "/api/models/m", headers=admin)
    assert status == 405 and head[b"allow"] == b"GET, HEAD, DELETE", head
    assert doc["error"] == "PATCH /api/models/m: this path takes GET, HEAD, DELETE"
    status, head, doc = ask("HEAD", "/healthz", headers=[])
    assert status == 200 and doc is None and int(head[b"content-length"]) > 0
    bad = {
        b"lines=abc": "lines must be a whole number from 1 to 10000, got 'abc'",
        b"lines=0": "lines must be a whole number from 1 to 10000, got '0'",
        b"lines=10001": "lines must be a whole number from 1 to 10000, got '10001'",
        b"lines=-5": "lines must be a whole number from 1 to 10000, got '-5'",
        b"lines=1_0": "lines must be a whole number from 1 to 10000, got '1_0'",
        b"after=x": f"after must be a whole number from 0 to {2**63 - 1}, got 'x'",
        b"previous=maybe": "previous must be 1 or 0 (true or false), got 'maybe'",
        b"lines=5&lines=6": "query parameter lines is given 2 times; give it once",
        b"line=5": "GET /api/logs/{shard} takes no query parameter 'line' (it takes: lines, previous, after)",
        b"lines=" + b"9" * 100: f"lines must be a whole number from 1 to 10000, got {'9' * 40!r}...",
    }
    for query, error in bad.items():
        status, _, doc = ask("GET", "/api/logs/s1", query)
        assert (status, doc["error"]) == (400, error), query
    # In range, the request reaches the handler: no such shard.
    status, _, doc = ask("GET", "/api/logs/s1", b"lines=10000&previous=1&after=0")
    assert (status, doc["error"]) == (404, "no shard 's1' is placed or reported on any node")
    status, _, doc = ask("GET", "/api/nodes", b"watch=1")
    assert (status, doc["error"]) == (400, "GET /api/nodes takes no query parameter 'watch' (it takes: none)")


def test_the_module_docstring_lists_every_route_of_the_table() -> None:
    """``control.api``'s docstring is where a reader finds the routes: it names each route of
    ``ROUTES`` once (NODE, MODEL and SHARD for the path's parameters), and no route the table lacks."""
    import re

    import control.api
    from control.api import ROUTES

    listed = re.findall(r"^    (GET|POST|PUT|DELETE) +(/[^\s?\[]*)", control.api.__doc__ or "", re.MULTILINE)
    documented = sorted(
        (method, re.sub(r"[A-Z]+", lambda m: "{" + m[0].lower() + "}", path)) for method, path in listed
    )
    assert documented == sorted((r.method, r.path) for r in ROUTES)
