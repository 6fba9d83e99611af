"""The control plane's config file: each mistake is one line naming the key, the file and the key's own
line, found when the file is read (not as a traceback from inside the running server)."""

from __future__ import annotations

import pytest

from control.config import ConfigError, Listen, line_of, listen_problem, parse

MODEL = '[[models]]\nname = "m"\n[models.profile]\nengine = "sim"\nmodel = "m"\n'


def problem(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse(text, "llmgw.toml")
    return str(info.value)


def test_a_rule_violation_names_the_keys_own_line() -> None:
    # The two cases: a table key reported at its table's header, a top-level key at no line.
    text = "\n".join(
        [
            'state_dir = "/tmp/x"',  # 1
            "",
            "[listen]",  # 3
            'agents = "127.0.0.1:7070"',
            "",
            "",
            "[liveness]",  # 7
            "unreachable_after = 15.0",
            "",
            "# lost after five minutes",
            "lost_after = -8.0",  # 11
            "",
        ]
    )
    assert problem(text) == "liveness.lost_after must be greater than 0, got -8.0 (llmgw.toml line 11)"
    assert problem('state_dir = "/tmp/x"\n\nreconcile_interval = -1\n') == (
        "reconcile_interval must be greater than 0, got -1.0 (llmgw.toml line 3)"
    )
    # A dotted key and an inline table: the line of the key as written.
    assert problem("\nliveness.lost_after = 0\n").endswith("(llmgw.toml line 2)")
    assert problem("\n\nliveness = { unreachable_after = -1 }\n").startswith(
        "liveness.unreachable_after must be greater than 0, got -1"
    )
    assert problem("\n\nliveness = { unreachable_after = -1 }\n").endswith("(llmgw.toml line 3)")


def test_rules_inside_array_tables_name_the_entry_and_its_line() -> None:
    text = MODEL + '[[models]]\nname = "b"\nreplicas = -1\n[models.gpus]\nmin_compute_capability = "8"\n'
    text += '[models.profile]\nengine = "sim"\nmodel = "m"\n'
    # The nested table is structured first; the entry's own rules run once it is whole.
    assert problem(text) == (
        "models[1].gpus.min_compute_capability must look like '8.0', got '8' (llmgw.toml line 10)"
    )
    text = text.replace('"8"', '"8.0"')
    assert problem(text) == "models[1].replicas must be >= 0, got -1 (llmgw.toml line 8)"
    dup = MODEL + MODEL
    assert problem(dup) == (
        "models[1].name: duplicate name 'm' (models[0] has it too); each model needs its own (llmgw.toml line 7)"
    )


@pytest.mark.parametrize(
    ("key", "address", "says"),
    [
        ("router", "8080", "'8080' has no host; write HOST:PORT, e.g. '0.0.0.0:8080'"),
        ("api", ":7080", "':7080' has no host; write HOST:PORT, e.g. '0.0.0.0:7080'"),
        ("api", "localhost", "'localhost' has no port; write HOST:PORT, e.g. 'localhost:7080'"),
        ("api", "::1:7080", "an IPv6 address goes in brackets, as in '[::1]:7080'"),
        ("api", "[::1]", "'[::1]' has no port"),
        ("api", "[10.0.0.1]:7080", "'10.0.0.1' in brackets is not an IPv6 address"),
        ("api", "http://127.0.0.1:7080", "is a URL; write HOST:PORT only, e.g. '127.0.0.1:7080'"),
        ("api", "127.0.0.1:http", "the port 'http' is not a number; use 0-65535"),
        ("router", "0.0.0.0:65536", "port 65536 is out of range; use 0-65535"),
        ("agents", "0.0.0.0:0", "port 0 (any free port) does not suit this listener"),
        ("agents", "gpu host:7070", "'gpu host' is neither an IP address nor a host name"),
        ("agents", "", "is empty; write HOST:PORT, e.g. '0.0.0.0:7070'"),
        ("api", "", "is empty; write HOST:PORT, e.g. '127.0.0.1:7080'"),
    ],
)
def test_listen_addresses_are_checked_when_the_file_is_read(key: str, address: str, says: str) -> None:
    text = f'state_dir = "/tmp/x"\n[listen]\n{key} = "{address}"\n' + MODEL
    message = problem(text)
    assert message.startswith(f"listen.{key}: ") and says in message, message
    assert message.endswith("(llmgw.toml line 3)") and "\n" not in message


@pytest.mark.parametrize(
    "listen",
    [
        {"agents": "[::1]:7070", "api": "[::1]:0", "router": "localhost:8080"},
        {"agents": "gpu07.example.com:7070", "api": "127.0.0.1:0", "router": "127.0.0.1:0"},
        {"agents": "0.0.0.0:7070", "api": "127.0.0.1:7080", "router": ""},
        # The same port on different families' wildcards is two sockets (IPv6-only), not a clash.
        {"agents": "0.0.0.0:7070", "api": "[::]:7070", "router": ""},
    ],
)
def test_good_listen_addresses_parse(listen: dict[str, str]) -> None:
    text = "[listen]\n" + "".join(f'{k} = "{v}"\n' for k, v in listen.items()) + MODEL
    assert parse(text).listen == Listen(**listen)


def test_two_listeners_on_one_port_are_refused() -> None:
    text = '[listen]\nagents = "0.0.0.0:7070"\napi = "127.0.0.1:7070"\n' + MODEL
    assert problem(text) == (
        "listen.api: '127.0.0.1:7070' takes the port of listen.agents ('0.0.0.0:7070'); "
        "each listener needs a port of its own (llmgw.toml line 3)"
    )
    # Port 0 is a free port each, never a clash.
    assert parse('[listen]\nagents = "127.0.0.1:7070"\napi = "127.0.0.1:0"\nrouter = "127.0.0.1:0"\n' + MODEL)


def test_a_router_only_run_needs_a_router_address() -> None:
    text = '[listen]\nrouter = ""\n[[endpoints]]\nmodel = "m"\nurl = "http://10.0.0.5:8000"\n'
    assert problem(text).startswith(
        "listen.router: is empty, but a catalog without [[models]] is a router-only"
    )
    assert parse('[listen]\nrouter = ""\n' + MODEL).listen.router == ""


def test_an_unknown_engine_is_named_with_the_closest_known_one() -> None:
    text = MODEL + '\n[[models]]\nname = "b"\n[models.profile]\nengine = "vlm"\nmodel = "m"\n'
    assert problem(text) == (
        "models[1].profile.engine: unknown engine 'vlm'; did you mean 'vllm'? "
        "known engines: vllm, sglang, llamacpp, trtllm, sim (llmgw.toml line 10)"
    )
    inline = '[[models]]\nname = "a"\nprofile = { engine = "llama.cpp", model = "m" }\n'
    assert "did you mean 'llamacpp'?" in problem(inline) and problem(inline).endswith("line 3)")
    nothing_close = problem(MODEL.replace('"sim"', '"tgi"'))
    assert "unknown engine 'tgi'; known engines: vllm, sglang" in nothing_close


def test_several_problems_are_one_line_each_in_file_order() -> None:
    text = 'bogus = 1\n[liveness]\nlost_after = "x"\n[engines]\nports = "9-1"\n'
    lines = problem(text).splitlines()
    assert lines == [
        "3 problems in the control plane configuration:",
        "  bogus: unknown key (llmgw.toml line 1)",
        "  liveness.lost_after: expected a number, got 'x' (llmgw.toml line 3)",
        "  engines.ports must be FIRST-LAST with 1 <= FIRST <= LAST <= 65535, got '9-1' (llmgw.toml line 5)",
    ]


def test_line_of_follows_tables_arrays_quotes_and_multiline_strings() -> None:
    text = "\n".join(
        [
            'state_dir = "/x"',  # 1
            "# lost_after = 1 in a comment is no key",
            "[tokens]",  # 3
            '"gpu 07" = "a"',  # 4
            "[[models]]",  # 5
            'name = "a"',
            "[models.profile]",  # 7
            'engine = "sim"',  # 8
            'extra_args = ["""',  # 9
            'engine = "not a key"',
            '"""]',
            "[[models]]",  # 12
            'name = "b"',  # 13
            "[ models . profile ]  # spaced",  # 14
            "engine = 'sim'",  # 15
            "[liveness]",  # 16
            "lost_after = 1",  # 17
        ]
    )
    assert line_of(text, "state_dir") == 1
    assert line_of(text, "tokens", "gpu 07") == 4
    assert line_of(text, "models", 0, "profile", "engine") == 8
    assert line_of(text, "models", 1, "name") == 13
    assert line_of(text, "models", 1, "profile", "engine") == 15
    assert line_of(text, "models", 1, "profile", "model") == 14  # not written: its table
    assert line_of(text, "models", 1, "profile", "model", exact=True) is None
    assert line_of(text, "liveness", "lost_after") == 17
    assert line_of(text, "listen", "api") is None


def test_listen_problem_is_pure_and_names_what_to_write() -> None:
    assert listen_problem("0.0.0.0:8080", example="0.0.0.0:8080") == ""
    assert listen_problem("", example="0.0.0.0:8080", may_be_empty=True) == ""
    assert "use 1-65535" in listen_problem("127.0.0.1:0", example="0.0.0.0:7070", fixed_port="agents dial it")


def test_the_served_name_defaults_to_the_catalog_name_and_trtllm_to_its_model() -> None:
    # The name the control plane sends in StartShard and routes under: one name, decided here.
    def served(profile: str) -> str:
        config = parse(f'[[models]]\nname = "chat"\n[models.profile]\n{profile}\n', "llmgw.toml")
        return config.models[0].served_name

    assert served('engine = "vllm"\nmodel = "meta-llama/Llama-3.1-8B"') == "chat"
    assert served('engine = "vllm"\nmodel = "x"\nserved_model_name = "y"') == "y"
    # trtllm-serve cannot rename a model: it serves a hub id as written, a local directory by its name.
    assert served('engine = "trtllm"\nmodel = "nvidia/Llama-3.1-8B"') == "nvidia/Llama-3.1-8B"
    assert served('engine = "trtllm"\nmodel = "/models/llama-8b"') == "llama-8b"
    assert (
        served('engine = "trtllm"\nmodel = "/models/llama-8b"\nserved_model_name = "llama-8b"') == "llama-8b"
    )
    says = problem(
        '[[models]]\nname = "chat"\n[models.profile]\nengine = "trtllm"\nmodel = "/m/x"\nserved_model_name = "chat"\n'
    )
    assert "served_model_name 'chat' cannot be honoured by trtllm" in says and "line 6" in says
