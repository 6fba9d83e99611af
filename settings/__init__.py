"""Configuration for every llmgw process: one layered loader (flags > environment > TOML file >
defaults) parameterised by each process's frozen attrs class, and one :class:`ConfigError`.

The agent, the router and the control plane each keep in their own ``config`` module only what is
theirs: the attrs classes, the :class:`Spec` (flag, variable, help, parser per field) and the domain
rules. How layers are read, merged and structured, how a TOML key's line is found, and how a
cattrs error tree becomes one line per key live here once, so the three cannot drift apart. This
package imports none of ``agent``, ``control`` or ``router``, so each of them may import it.
"""

from settings.convert import converter, parse_bool, parse_float, parse_int, parse_list, text_parser
from settings.layered import (
    Describe,
    Layered,
    OneLineParser,
    Setting,
    Spec,
    build_parser,
    cite,
    layers,
    merge,
    source_of,
    structure,
)
from settings.problems import ConfigError, FieldProblem, KeyPath, config_error, dotted, problems
from settings.toml import key_lines, line_of, nearest_line, parse, read_text

__all__ = [
    "ConfigError",
    "Describe",
    "FieldProblem",
    "KeyPath",
    "Layered",
    "OneLineParser",
    "Setting",
    "Spec",
    "build_parser",
    "cite",
    "config_error",
    "converter",
    "dotted",
    "key_lines",
    "layers",
    "line_of",
    "merge",
    "nearest_line",
    "parse",
    "parse_bool",
    "parse_float",
    "parse_int",
    "parse_list",
    "problems",
    "read_text",
    "source_of",
    "structure",
    "text_parser",
]
