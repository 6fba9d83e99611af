"""Models as objects: the catalog's rules (pure), and ``ctl apply``, ``scale`` and ``delete`` against
a real control plane, agent and sim engines, the router answering through the ``openai`` client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from control.catalog import Action, Catalog, CatalogConflict, Source
from control.config import ConfigError, ModelConfig, ProfileConfig, parse_models
from control.state import parse_state, state_doc
from tests.fleet_procs import ControlProcess, one_node, poll
from tests.support import asgi_call

FIXTURE_STATE = Path(__file__).parent / "fixtures" / "state" / "control-state-2026-12-03.json"


def model(name: str, replicas: int = 1, engine_model: str = "m") -> ModelConfig:
    return ModelConfig(name, ProfileConfig(engine="sim", model=engine_model), replicas=replicas)


def actions(changes: list[Any]) -> dict[str, Action]:
    return {c.name: c.action for c in changes}


# -- the catalog, pure ------------------------------------------------------------------------------


def test_a_model_new_in_the_file_is_created() -> None:
    cat = Catalog()
    changes = cat.apply_file([model("a"), model("b", 2)])
    assert actions(changes) == {"a": Action.CREATED, "b": Action.CREATED}
    assert [str(c) for c in changes] == ["model/a created", "model/b created"]
    assert [m.name for m in cat.models()] == ["a", "b"]
    entry = cat.entry("b")
    assert entry is not None and entry.source is Source.FILE and entry.file_definition == model("b", 2)
    assert cat.generation("a") == 1 and cat.generation("missing") == 0


def test_an_unchanged_file_keeps_what_ctl_made_of_a_model() -> None:
    """A restart (the same file applied again) never reverts a ctl scale or a ctl apply."""
    cat = Catalog()
    cat.apply_file([model("a")])
    assert cat.scale("a", 3).action is Action.SCALED
    assert cat.apply([model("b", 1, "other")])[0].action is Action.CREATED
    revision = cat.revision
    changes = cat.apply_file([model("a")])
    assert actions(changes) == {"a": Action.UNCHANGED}
    a = cat.get("a")
    assert a is not None and a.replicas == 3 and cat.generation("a") == 2
    assert cat.get("b") is not None  # a model only applied stays
    assert cat.revision == revision  # nothing changed: nothing to place or save


def test_a_changed_file_definition_wins_over_ctl() -> None:
    cat = Catalog()
    cat.apply_file([model("a")])
    cat.scale("a", 3)
    changes = cat.apply_file([model("a", 1, "m2")])
    assert actions(changes) == {"a": Action.CONFIGURED}
    assert str(changes[0]) == "model/a configured"
    entry = cat.entry("a")
    assert entry is not None
    assert entry.config == model("a", 1, "m2") and entry.source is Source.FILE and entry.generation == 3


def test_a_model_that_left_the_file_is_deleted_and_one_only_applied_stays() -> None:
    cat = Catalog()
    cat.apply_file([model("a"), model("b")])
    cat.apply([model("c")])
    cat.apply([model("b", 4)])  # b came from the file; ctl changed it since
    changes = cat.apply_file([])
    assert actions(changes) == {"a": Action.DELETING, "b": Action.DELETING}
    assert {m.name: m.replicas for m in cat.models()} == {"a": 0, "b": 0, "c": 1}
    assert [m.name for m in cat.served()] == ["c"]
    assert cat.finish_deletes({"a"}) and cat.names() == ["a", "c"]
    assert [str(c) for c in cat.finish_deletes(())] == ["model/a deleted"] and cat.names() == ["c"]


def test_the_file_naming_an_applied_model_takes_it_over() -> None:
    cat = Catalog()
    cat.apply([model("a", 2)])
    # The same definition: nothing runs differently, but the file now owns it.
    assert actions(cat.apply_file([model("a", 2)])) == {"a": Action.UNCHANGED}
    entry = cat.entry("a")
    assert entry is not None and entry.file_definition == model("a", 2) and entry.generation == 1
    # A different one: the file wins.
    cat2 = Catalog()
    cat2.apply([model("a", 2)])
    assert actions(cat2.apply_file([model("a", 1)])) == {"a": Action.CONFIGURED}
    got = cat2.get("a")
    assert got is not None and got.replicas == 1


def test_apply_scale_delete_say_what_changed_and_refuse_conflicts() -> None:
    cat = Catalog()
    cat.apply_file([model("infile")])
    assert actions(cat.apply([model("a")])) == {"a": Action.CREATED}
    assert actions(cat.apply([model("a")])) == {"a": Action.UNCHANGED}
    assert actions(cat.apply([model("a", 2)])) == {"a": Action.CONFIGURED}
    assert cat.generation("a") == 2
    assert cat.scale("a", 2).action is Action.UNCHANGED
    assert cat.scale("a", 0).action is Action.SCALED and cat.generation("a") == 3
    with pytest.raises(KeyError, match="no model 'zz' in the catalog; models: a, infile"):
        cat.scale("zz", 1)
    with pytest.raises(ValueError, match="0 or more"):
        cat.scale("a", -1)
    with pytest.raises(CatalogConflict, match=r"llmgw\.toml"):
        cat.delete("infile")
    assert cat.delete("a").action is Action.DELETING
    assert cat.delete("a").action is Action.UNCHANGED
    with pytest.raises(CatalogConflict, match="being deleted"):
        cat.scale("a", 1)
    revision = cat.revision
    with pytest.raises(CatalogConflict, match="being deleted"):
        cat.apply([model("b"), model("a")])
    assert cat.revision == revision and "b" not in cat  # all or nothing
    with pytest.raises(ValueError, match="defined twice"):
        cat.apply([model("b"), model("b")])


def test_the_catalog_is_kept_in_the_state_file_and_an_old_file_still_loads() -> None:
    cat = Catalog()
    cat.apply_file([model("f", 2)])
    cat.scale("f", 5)
    cat.apply([model("api", 1, "x")])
    cat.apply([model("gone")])
    cat.delete("gone")
    doc = json.loads(json.dumps(state_doc({}, [], [], cat.entries())))
    saved = parse_state(json.dumps(doc))
    assert saved.catalog == tuple(cat.entries())
    restored = Catalog(saved.catalog)
    assert restored.models() == cat.models() and restored.entry("f") == cat.entry("f")
    # The fixture predates the catalog: it loads, with no catalog (the file's models then apply).
    old = parse_state(FIXTURE_STATE.read_text(), FIXTURE_STATE)
    assert old.catalog is None and old.placements
    # A damaged entry names the file and the field.
    doc["catalog"][0]["definition"]["replicas"] = "two"
    with pytest.raises(ValueError, match=r"control-state.json: catalog\[0\].definition: replicas"):
        parse_state(json.dumps(doc))


def test_parse_models_names_key_and_line_and_refuses_server_settings() -> None:
    text = '[[models]]\nname = "chat"\n[models.gpus]\ncount = "four"\n[models.profile]\nengine = "sim"\nmodel = "m"\n'
    with pytest.raises(ConfigError) as bad:
        parse_models(text, "model.toml")
    assert str(bad.value) == "models[0].gpus.count: expected an integer, got 'four' (model.toml line 4)"
    with pytest.raises(ConfigError, match=r"state_dir: a server setting.*llmgw.toml.*\(model.toml line 1\)"):
        parse_models(
            'state_dir = "/tmp"\n[[models]]\nname="a"\nprofile={engine="sim",model="m"}\n', "model.toml"
        )
    with pytest.raises(ConfigError, match="no \\[\\[models\\]\\] table"):
        parse_models("", "model.toml")
    two = parse_models(
        '[[models]]\nname="a"\nprofile={engine="sim",model="m"}\n[[models]]\nname="b"\nreplicas=2\n'
        'profile={engine="sim",model="m"}\n'
    )
    assert [(m.name, m.replicas) for m in two] == [("a", 1), ("b", 2)]


# -- end to end: a real control plane, agent and sim engines ----------------------------------------


def model_toml(name: str, replicas: int = 1, load: str = "0.2", extra: str = "") -> str:
    return (
        f'[[models]]\nname = "{name}"\nreplicas = {replicas}\n{extra}[models.profile]\nengine = "sim"\n'
        f'model = "m"\nenv = {{ LLMGW_SIM_LOAD_SECONDS = "{load}", LLMGW_SIM_TTFT_MS = "1" }}\n'
    )


def get_models(cp: ControlProcess) -> dict[str, dict[str, Any]]:
    out = cp.ctl("get", "models", "-o", "json")
    assert out.returncode == 0, out.stderr
    return {m["model"]: m for m in json.loads(out.stdout)}


def ready_count(cp: ControlProcess, name: str, n: int) -> dict[str, Any] | None:
    m = get_models(cp).get(name)
    return m if m and m["replicas_ready"] == n and m["replicas_placed"] == n else None


def chat(cp: ControlProcess, name: str) -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cp.router_port}/v1", api_key="none")
    reply = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    return reply.choices[0].message.content or ""


def test_apply_scale_and_delete_a_model_through_ctl(tmp_path: Path) -> None:
    """A model only ``ctl apply`` knows is placed, becomes ready and answers through the router;
    ``scale`` 1 -> 2 -> 0; ``delete`` stops its engines and the router answers 404 for it; a bad
    file is exit 1 with the key and its line, and changes nothing."""
    tag = f"k{os.getpid()}"
    base, new = f"base-{tag}", f"applied-{tag}"
    with one_node(tmp_path, model_toml(base), "24800-24849") as (cp, agent):
        poll(f"{base} ready", lambda: ready_count(cp, base, 1))
        path = tmp_path / "model.toml"
        path.write_text(model_toml(new) + model_toml(f"{new}-b", replicas=0))
        out = cp.ctl("apply", "-f", str(path))
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == [f"model/{new} created", f"model/{new}-b created"]
        poll(f"{new} ready", lambda: ready_count(cp, new, 1))
        assert chat(cp, new).strip()
        piped = [*cp.ctl_argv(), "apply", "-f", "-"]
        same = subprocess.run(piped, input=path.read_text(), capture_output=True, text=True, timeout=60)
        assert same.returncode == 0 and same.stdout.splitlines() == [
            f"model/{new} unchanged",
            f"model/{new}-b unchanged",
        ], same.stderr

        wide = cp.ctl("get", "models", "-o", "wide")
        assert wide.returncode == 0 and "GENERATION" in wide.stdout and "SOURCE" in wide.stdout
        row = next(line for line in wide.stdout.splitlines() if line.startswith(new + " "))
        assert " api " in f" {row} " and " 1 " in row

        # A bad file: exit 1, the server's message names the key and its line; nothing changes.
        bad = tmp_path / "bad.toml"
        bad.write_text(model_toml(new, extra="[models.gpus]\ncount = -1\n"))
        out = cp.ctl("apply", "-f", str(bad))
        assert out.returncode == 1, out
        assert "models[0].gpus.count must be >= 0, got -1" in out.stderr
        assert f"({bad} line 5)" in out.stderr, out.stderr
        assert get_models(cp)[new]["generation"] == 1

        out = cp.ctl("scale", new, "2")
        assert out.returncode == 0 and out.stdout.strip() == f"model/{new} scaled", out
        poll(f"{new} at 2 ready", lambda: ready_count(cp, new, 2))
        assert get_models(cp)[new]["generation"] == 2
        described = cp.ctl("describe", "model", new)
        assert "Generation:    2 (source api)" in described.stdout, described
        assert f"model/{new} scaled by ctl scale to 2 (generation 2)" in described.stdout
        assert f"model/{new} created by ctl apply (generation 1)" in described.stdout
        out = cp.ctl("scale", new, "0")
        assert out.returncode == 0, out.stderr
        poll(f"{new} at 0", lambda: ready_count(cp, new, 0))
        poll(
            f"{new}'s engines stopped",
            lambda: (
                not any(
                    s["node_id"] for r in cp.api("/api/replicas") if r["model"] == new for s in r["shards"]
                )
            ),
        )
        out = cp.ctl("scale", new, "1")
        assert out.returncode == 0, out.stderr
        poll(f"{new} back at 1", lambda: ready_count(cp, new, 1))

        unknown = cp.ctl("scale", f"nope-{tag}", "1")
        assert unknown.returncode == 1 and "HTTP 404" in unknown.stderr and base in unknown.stderr
        in_file = cp.ctl("delete", base)
        assert in_file.returncode == 1 and "HTTP 409" in in_file.stderr and "SIGHUP" in in_file.stderr

        out = cp.ctl("delete", new, "--wait", "--timeout", "60")
        assert out.returncode == 0, out
        lines = out.stdout.splitlines()
        assert lines[0] == f"model/{new} deleting" and lines[-1] == f"model/{new} deleted", lines
        assert new not in get_models(cp) and base in get_models(cp)
        assert not any(r["model"] == new for r in cp.api("/api/replicas"))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{cp.router_port}/v1", api_key="none")
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=new, messages=[{"role": "user", "content": "hi"}])
        assert chat(cp, base).strip()
        gone = cp.ctl("delete", new)
        assert gone.returncode == 1 and "HTTP 404" in gone.stderr
        del agent


def test_the_catalog_survives_a_kill9_restart_and_no_engine_restarts(tmp_path: Path) -> None:
    """An applied model and a ``ctl scale`` of a file model are in the state file: after a kill -9
    and a start with the same llmgw.toml both are still there, and every engine is the one that
    ran before (adopted, not started again)."""
    tag = f"r{os.getpid()}"
    base, new = f"base-{tag}", f"applied-{tag}"
    with one_node(tmp_path, model_toml(base), "24850-24899") as (cp, agent):
        path = tmp_path / "model.toml"
        path.write_text(model_toml(new))
        assert cp.ctl("apply", "-f", str(path)).returncode == 0
        assert cp.ctl("scale", base, "2").returncode == 0
        poll(f"{base} at 2 ready", lambda: ready_count(cp, base, 2))
        poll(f"{new} ready", lambda: ready_count(cp, new, 1))
        engines = agent.marked_engines()
        assert len(engines) == 3, engines
        cp.kill9()
        cp.start()
        models = get_models(cp)
        assert models[new]["source"] == "api" and models[new]["generation"] == 1
        assert models[base]["replicas_wanted"] == 2 and models[base]["generation"] == 2
        poll(f"{base} at 2 ready again", lambda: ready_count(cp, base, 2))
        poll(f"{new} ready again", lambda: ready_count(cp, new, 1))
        assert chat(cp, new).strip()
        assert agent.marked_engines() == engines


def test_sighup_applies_the_file_and_a_broken_file_changes_nothing(tmp_path: Path) -> None:
    """SIGHUP: a file model whose table changed takes the file's definition, a model that left the
    file is deleted, a model only applied stays, another changed setting is named as needing a
    restart; then a file that does not parse is one error naming key and line, and everything runs
    on as it was."""
    tag = f"h{os.getpid()}"
    kept, dropped, applied = f"kept-{tag}", f"dropped-{tag}", f"applied-{tag}"
    with one_node(tmp_path, model_toml(kept) + model_toml(dropped), "24900-24949") as (cp, _agent):
        path = tmp_path / "model.toml"
        path.write_text(model_toml(applied))
        assert cp.ctl("apply", "-f", str(path)).returncode == 0
        for name in (kept, dropped, applied):
            poll(f"{name} ready", lambda name=name: ready_count(cp, name, 1))
        assert cp.proc is not None
        original = cp.config.read_text()
        changed = original.replace("reconcile_interval = 0.3", "reconcile_interval = 0.4")
        changed = changed.replace(model_toml(kept), model_toml(kept, replicas=2))
        changed = changed.replace(model_toml(dropped), "")
        assert changed.count("[[models]]") == 1
        cp.config.write_text(changed)
        os.kill(cp.proc.pid, signal.SIGHUP)
        poll(f"{kept} at 2 ready", lambda: ready_count(cp, kept, 2))
        poll(f"{dropped} gone", lambda: dropped not in get_models(cp))
        models = get_models(cp)
        assert models[kept]["source"] == "file" and models[kept]["generation"] == 2
        assert ready_count(cp, applied, 1)
        log = cp.log.read_text()
        assert f"model/{kept} configured (file)" in log
        assert f"model/{dropped} deleting (file)" in log
        assert "reconcile_interval changed; that takes effect at the next start" in log

        broken = changed.replace(f'name = "{kept}"\nreplicas = 2', f'name = "{kept}"\nreplicas = "three"')
        assert broken != changed
        cp.config.write_text(broken)
        line = broken.splitlines().index('replicas = "three"') + 1
        os.kill(cp.proc.pid, signal.SIGHUP)
        poll(
            "the SIGHUP error",
            lambda: (
                f"models[0].replicas: expected an integer, got 'three' ({cp.config} line {line})"
                in cp.log.read_text()
            ),
        )
        assert "nothing was changed" in cp.log.read_text()
        assert cp.proc.poll() is None
        assert get_models(cp)[kept]["replicas_wanted"] == 2 and get_models(cp)[kept]["generation"] == 2
        assert chat(cp, kept).strip() and chat(cp, applied).strip()


def test_delete_drains_a_model_a_streaming_request_finishes_and_new_ones_get_404(tmp_path: Path) -> None:
    """``ctl delete`` under a streaming request: the router answers new requests for the model 404
    at once, the stream under way gets every token (its engine is drained, not stopped under it),
    and the model is gone once its engine has stopped."""
    tag = f"d{os.getpid()}"
    name = f"slow-{tag}"
    slow = model_toml(name).replace(
        'LLMGW_SIM_TTFT_MS = "1"', 'LLMGW_SIM_TTFT_MS = "1", LLMGW_SIM_ITL_MS = "100"'
    )
    # No [[models]] in llmgw.toml at all: the control plane runs, and its models come from apply.
    # The agent's stop grace bounds the engine's own drain window (vLLM --shutdown-timeout, 2 s
    # below it): 12 s leaves the 4 s stream room to finish.
    with one_node(tmp_path, "", "24950-24999", agent_extra=("--stop-grace", "12")) as (cp, agent):
        apply = subprocess.run(
            [*cp.ctl_argv(), "apply", "-f", "-"], input=slow, capture_output=True, text=True, timeout=60
        )
        assert apply.returncode == 0 and apply.stdout == f"model/{name} created\n", apply
        poll(f"{name} ready", lambda: ready_count(cp, name, 1))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{cp.router_port}/v1", api_key="none")
        stream = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hello"}], max_tokens=40, stream=True
        )
        chunks = iter(stream)
        first = next(chunks)  # the stream is under way before the delete
        result: dict[str, Any] = {}

        def finish() -> None:
            try:
                rest = list(chunks)
                result["finish"] = [c.choices[0].finish_reason for c in rest if c.choices][-1]
                result["chunks"] = 1 + len(rest)
            except Exception as exc:  # reported by the assertion below, with what was received
                result["error"] = exc

        reader = threading.Thread(target=finish)
        reader.start()
        deleting = subprocess.Popen(
            [*cp.ctl_argv(), "delete", name, "--wait", "--timeout", "60"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        poll(f"{name} out of the routes", lambda: _not_found(client, name))
        out, err = deleting.communicate(timeout=90)
        reader.join(60)
        assert deleting.returncode == 0, (out, err)
        assert out.splitlines()[-1] == f"model/{name} deleted"
        assert "error" not in result and result["finish"] == "length", (first, result)
        assert name not in get_models(cp) and not agent.marked_engines()
        assert f"drain {name}-r0-s0" in cp.log.read_text()


def test_delete_answers_after_the_model_left_the_routes(tmp_path: Path) -> None:
    """``DELETE /api/models/MODEL`` (what ``ctl delete`` sends) answers only once the model has left
    the router's table: a request sent the instant the answer arrives, on a connection already open
    to the router, gets 404 model_not_found (before the fix it was served: the table changed at the
    next reconcile pass, some 50 ms or more after the answer)."""
    name = f"gone-{os.getpid()}"
    with one_node(tmp_path, "", "24900-24949") as (cp, _):
        apply = subprocess.run(
            [*cp.ctl_argv(), "apply", "-f", "-"],
            input=model_toml(name),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert apply.returncode == 0, apply
        poll(f"{name} ready", lambda: ready_count(cp, name, 1))
        body = {"model": name, "prompt": "hi", "max_tokens": 1}
        with (
            httpx.Client(base_url=f"http://127.0.0.1:{cp.router_port}", timeout=30) as router,
            httpx.Client(base_url=f"http://127.0.0.1:{cp.api_port}", timeout=30) as api,
        ):
            assert router.post("/v1/completions", json=body).status_code == 200  # served, connection open
            deleted = api.delete(f"/api/models/{name}", headers={"content-type": "application/json"})
            after = router.post("/v1/completions", json=body)
        assert deleted.status_code == 200 and deleted.json()["line"] == f"model/{name} deleting", deleted.text
        assert after.status_code == 404 and after.json()["error"]["code"] == "model_not_found", after.text


def _not_found(client: openai.OpenAI, name: str) -> bool:
    try:
        client.completions.create(model=name, prompt="hi", max_tokens=1)
    except openai.NotFoundError:
        return True
    return False


# -- the admin API's model routes, over a hand-built ControlQuery ---------------------------------


class CatalogQuery:
    """The part of ``ControlQuery`` the model routes use, over a real ``Catalog``."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def view(self) -> Any:
        from control.placement import Plan
        from control.query import ControlView

        models = {m.name: m for m in self.catalog.models()}
        entries = {e.name: e for e in self.catalog.entries()}
        return ControlView(
            now=0.0, nodes={}, placements=(), plan=Plan((), ()), models=models, catalog=entries
        )

    async def apply_models(self, models: list[ModelConfig]) -> list[Any]:
        return self.catalog.apply(models)

    async def scale_model(self, name: str, replicas: int) -> Any:
        return self.catalog.scale(name, replicas)

    async def delete_model(self, name: str) -> Any:
        return self.catalog.delete(name)


def call(app: Any, method: str, path: str, body: bytes = b"") -> tuple[int, Any]:
    status, _, data = asgi_call(app, method, path, body)
    return status, json.loads(data)


def test_the_admin_api_model_routes_answer_400_404_409_with_the_reason() -> None:
    from control.api import ApiGuard, make_app

    cat = Catalog()
    cat.apply_file([model("infile")])
    guard = ApiGuard(hosts=frozenset({"127.0.0.1"}), port=7080)
    app = make_app(CatalogQuery(cat), guard)  # type: ignore[arg-type]
    toml = model_toml("chat", replicas=2)
    status, doc = call(app, "POST", "/api/models", json.dumps({"toml": toml, "source": "chat.toml"}).encode())
    assert status == 200 and [c["line"] for c in doc["changes"]] == ["model/chat created"], doc
    status, doc = call(app, "POST", "/api/models", json.dumps({"toml": toml}).encode())
    assert status == 200 and doc["changes"][0]["action"] == "unchanged"
    bad = json.dumps({"toml": toml.replace("replicas = 2", "replicas = -2"), "source": "chat.toml"})
    status, doc = call(app, "POST", "/api/models", bad.encode())
    assert (status, doc["error"]) == (400, "models[0].replicas must be >= 0, got -2 (chat.toml line 3)")
    assert call(app, "POST", "/api/models", b"{not json")[0] == 400
    status, doc = call(app, "POST", "/api/models", b'{"yaml": "x"}')
    assert status == 400 and '{"toml":' in doc["error"]

    status, doc = call(app, "PUT", "/api/models/chat/replicas", b'{"replicas": 3}')
    assert (status, doc["line"], doc["generation"]) == (200, "model/chat scaled", 2)
    assert call(app, "POST", "/api/models/chat/scale", b'{"replicas": 3}')[1]["action"] == "unchanged"
    status, doc = call(app, "PUT", "/api/models/chat/replicas", b'{"replicas": "3"}')
    assert status == 400 and "whole number" in doc["error"]
    status, doc = call(app, "PUT", "/api/models/nope/replicas", b'{"replicas": 1}')
    assert status == 404 and doc["error"] == "no model 'nope' in the catalog; models: chat, infile"

    status, doc = call(app, "DELETE", "/api/models/infile")
    assert status == 409 and "SIGHUP" in doc["error"]
    assert call(app, "DELETE", "/api/models/chat")[1]["line"] == "model/chat deleting"
    status, doc = call(app, "PUT", "/api/models/chat/replicas", b'{"replicas": 1}')
    assert status == 409 and "being deleted" in doc["error"]
    status, doc = call(app, "POST", "/api/models", json.dumps({"toml": toml}).encode())
    assert status == 409 and "being deleted" in doc["error"]
    status, doc = call(app, "GET", "/api/models")
    chat_doc = next(m for m in doc if m["model"] == "chat")
    assert (chat_doc["replicas_wanted"], chat_doc["deleting"], chat_doc["generation"]) == (0, True, 3)
    assert call(app, "DELETE", "/api/models/nope")[0] == 404
