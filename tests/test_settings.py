"""The one configuration loader (``settings``) on its own: a small attrs class stands in for a
process's config, so the mechanics (precedence, sources down to a table entry's line, unknown
keys, text parsers, lists, secrets, one or several problems) are checked apart from any process's
rules; the processes' own wording is checked in test_agent_config, test_router_config and
test_control_config."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

import agent.config
import control.config
import router.config
import settings


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise settings.FieldProblem(attribute.name, f"must be more than 0, got {value:g}")


@attrs.frozen(kw_only=True)
class Demo:
    name: str
    wait: float = attrs.field(default=1.0, validator=_positive)
    count: int = 3
    verbose: bool = False
    tags: tuple[str, ...] = ()
    token: str = ""
    pin: int = 0
    limits: dict[str, int] = attrs.field(factory=dict)
    pairs: tuple[dict[str, str], ...] = ()

    def __attrs_post_init__(self) -> None:
        if self.count > 10 and self.wait < 1:
            raise ValueError(f"count ({self.count}) over 10 needs wait of 1 or more ({self.wait:g})")


SPEC = settings.Spec(
    config=Demo,
    settings={
        "name": settings.Setting(help="a name"),
        "wait": settings.Setting(help="seconds", parse=settings.parse_float),
        "count": settings.Setting(help="how many", parse=settings.parse_int),
        "verbose": settings.Setting(help="say more", switch=True),
        "tags": settings.Setting(help="a tag; repeat", flag="--tag", repeat=True),
        "token": settings.Setting(help="a secret", secret=True),
        "pin": settings.Setting(help="a secret number", secret=True, parse=settings.parse_int),
        "limits": settings.Setting(help="limits, only in the file"),
        "pairs": settings.Setting(help="pairs, only in the file"),
    },
    env_prefix="DEMO_",
    default_file=Path("/nonexistent/demo.toml"),
    prog="demo",
    description="a stand-in",
    epilog="",
    version=lambda: "demo 1",
    what="the demo configuration",
)


def load(argv: list[str], environ: dict[str, str]) -> tuple[Demo, dict[str, str]]:
    layered = settings.layers(SPEC, settings.build_parser(SPEC).parse_args(argv), environ)
    config: Demo = settings.structure(SPEC, layered)
    return config, layered.sources


def test_flags_beat_variables_which_beat_the_file_which_beats_the_defaults(tmp_path: Path) -> None:
    toml = tmp_path / "demo.toml"
    toml.write_text('name = "file"\nwait = 4\ncount = 5\n\n[limits]\na = 1\nb = 2\n')
    config, sources = load(
        ["--config", str(toml), "--wait", "2", "--tag", "x", "--tag", "y", "--verbose"],
        {"DEMO_WAIT": "3", "DEMO_COUNT": "6"},
    )
    assert (config.name, config.wait, config.count) == ("file", 2.0, 6)
    assert config.tags == ("x", "y") and config.verbose is True and config.limits == {"a": 1, "b": 2}
    assert sources == {
        "name": f"{toml} line 1",
        "wait": "--wait",
        "count": "DEMO_COUNT",
        "limits": f"{toml} line 5",
        "limits.a": f"{toml} line 6",
        "limits.b": f"{toml} line 7",
        "tags": "--tag",
        "verbose": "--verbose",
    }
    # A table replaced whole by a later layer takes its entries' lines with it.
    merged = settings.merge(
        settings.Layered({"limits": {"a": 1}}, {"limits": "f line 1", "limits.a": "f line 2"}),
        settings.Layered({"limits": {}}, {"limits": "--limits"}),
    )
    assert merged.sources == {"limits": "--limits"}
    assert load(["--name", "n"], {"DEMO_CONFIG": str(toml), "DEMO_TAGS": "a, b,,c"})[0].tags == (
        "a",
        "b",
        "c",
    )


def test_a_bad_value_names_its_key_its_source_and_what_was_expected(tmp_path: Path) -> None:
    toml = tmp_path / "demo.toml"
    toml.write_text('name = "n"\n[limits]\nok = 1\nbad = "x"\n[[pairs]]\nk = "v"\n[[pairs]]\nk = 2\n')
    with pytest.raises(settings.ConfigError) as caught:
        load(["--config", str(toml)], {})
    assert str(caught.value).splitlines() == [
        "2 problems in the demo configuration:",
        f"  limits.bad (from {toml} line 4): expected an integer, got 'x'",
        f"  pairs[1].k (from {toml} line 5): expected a string, got 2",
    ]
    with pytest.raises(
        settings.ConfigError, match=r"^count \(from DEMO_COUNT\): expected a whole number, got '-1'$"
    ):
        load(["--name", "n"], {"DEMO_COUNT": "-1"})
    with pytest.raises(settings.ConfigError, match=r"^wait \(from --wait\): must be more than 0, got -2$"):
        load(["--name", "n", "--wait", "-2"], {})
    with pytest.raises(settings.ConfigError) as caught:
        load(["--name", "n", "--count", "11", "--wait", "0.5"], {})
    assert (
        str(caught.value)
        == "count (11) over 10 needs wait of 1 or more (0.5) (wait from --wait; count from --count)"
    )


def test_a_string_is_never_read_as_a_list_of_its_characters(tmp_path: Path) -> None:
    toml = tmp_path / "demo.toml"
    toml.write_text('name = "n"\ntags = "abc"\n')
    with pytest.raises(
        settings.ConfigError, match=rf"^tags \(from {toml} line 2\): expected a list, got 'abc'$"
    ):
        load(["--config", str(toml)], {})


def test_unknown_keys_are_errors_with_the_closest_known_one(tmp_path: Path) -> None:
    toml = tmp_path / "demo.toml"
    toml.write_text('name = "n"\n\ncuont = 3\n')
    with pytest.raises(settings.ConfigError) as caught:
        load(["--config", str(toml)], {})
    assert str(caught.value).startswith(
        f"cuont (from {toml} line 3): unknown setting; did you mean 'count'? known: name,"
    )
    with pytest.raises(
        settings.ConfigError,
        match=r"^DEMO_WAITT: unknown setting 'waitt' \(from the environment\); did you mean 'wait'\?",
    ):
        load(["--name", "n"], {"DEMO_WAITT": "1"})


def test_required_settings_say_how_to_give_them() -> None:
    with pytest.raises(settings.ConfigError) as caught:
        load([], {})
    assert (
        str(caught.value) == "name: required, and not set (give --name, DEMO_NAME or name = ... in the file)"
    )


def test_a_secret_is_never_repeated(tmp_path: Path) -> None:
    with pytest.raises(settings.ConfigError) as caught:
        load(["--name", "n"], {"DEMO_PIN": "hunter2"})
    assert str(caught.value) == "pin (from DEMO_PIN): expected a whole number, got (hidden)"
    toml = tmp_path / "demo.toml"
    toml.write_text('name = "n"\ntoken = 31337\n')
    with pytest.raises(settings.ConfigError) as caught:
        load(["--config", str(toml)], {})
    assert str(caught.value) == f"token (from {toml} line 2): expected a string, got (hidden)"


def test_a_file_that_cannot_be_read_or_parsed_is_named(tmp_path: Path) -> None:
    with pytest.raises(settings.ConfigError, match=r"demo.toml: cannot read the config file: No such file"):
        load(["--config", str(tmp_path / "demo.toml")], {})
    (tmp_path / "demo.toml").write_text("name = \n")
    with pytest.raises(settings.ConfigError, match=r"demo.toml: not valid TOML: .*line 1"):
        load(["--config", str(tmp_path / "demo.toml")], {})


def test_help_names_each_settings_variable_and_default() -> None:
    text = " ".join(settings.build_parser(SPEC).format_help().split())
    assert "--wait WAIT seconds (env DEMO_WAIT; default 1)" in text
    assert "--tag TAGS a tag; repeat (env DEMO_TAGS; default none)" in text
    assert "--verbose say more (env DEMO_VERBOSE; default false)" in text


def test_every_process_raises_the_one_config_error() -> None:
    assert (
        agent.config.ConfigError
        is router.config.ConfigError
        is control.config.ConfigError
        is settings.ConfigError
    )
