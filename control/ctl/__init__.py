"""``ctl``: ask a running control plane, the way operators ask kubectl or nomad.

Every verb reads or writes the admin API (``control.api``) over HTTP(S) and prints either aligned
columns with a header (the default), more columns (``-o wide``), ``KIND/NAME`` lines (``-o name``)
or the API's JSON (``-o json``, ``--json``). Global options (``--api``, ``-o``, ``--json``, the token
and TLS files) are accepted anywhere on the command line, before or after the verb and its
arguments, so a command can be edited at its end the way kubectl's can.

One verb table, ``VERBS``: each verb is a ``Verb`` (``control.ctl.base``) defined in the module of
its group (``get``, ``describe``, ``logs``, ``models``, ``rollout``, ``nodes``, ``replicas``), with
its help, its arguments and the function that runs it. Every table goes through one renderer
(``control.ctl.text.table``). A new verb is a ``Verb`` in its module and one row here.

Exit status, kept as documented in ``ctl --help``: 0 done; 1 the operation failed (the API said no,
or could not be reached); 2 a usage mistake (argparse's own status for those). A watch (``get -w``)
or a follow (``logs -f``) ends with 0 on Ctrl-C: that is how a person ends one.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from control.ctl.base import (
    EXIT_CODES,
    Api,
    CtlFailed,
    Formatter,
    Verb,
    add_global_options,
    http_options,
    version,
)
from control.ctl.describe import DESCRIBE, describe_model, describe_node
from control.ctl.get import GET
from control.ctl.logs import LOGS
from control.ctl.models import APPLY, DELETE, SCALE, WHY
from control.ctl.nodes import CORDON, DRAIN, NODE, NODES, TOKEN, UNCORDON
from control.ctl.replicas import REPLICAS
from control.ctl.rollout import ROLLOUT, rollout_line

#: Every verb, in the order ``ctl --help`` lists them.
VERBS: tuple[Verb, ...] = (
    GET,
    DESCRIBE,
    LOGS,
    APPLY,
    SCALE,
    DELETE,
    ROLLOUT,
    NODES,
    REPLICAS,
    WHY,
    CORDON,
    UNCORDON,
    DRAIN,
    TOKEN,
    NODE,
)
BY_NAME = {verb.name: verb for verb in VERBS}


def build_parser() -> tuple[argparse.ArgumentParser, list[argparse.ArgumentParser]]:
    """The parser, and every verb's parser (each gets the global options)."""
    parser = argparse.ArgumentParser(
        prog="ctl",
        description="Ask a running llmgw control plane (python -m control ctl ...).\n\n"
        "Global options go anywhere: before the verb, after it or after its arguments.",
        epilog=EXIT_CODES,
        formatter_class=Formatter,
    )
    parser.add_argument("--version", action="version", version=f"ctl (llmgw) {version()}")
    add_global_options(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="VERB")
    verbs: list[argparse.ArgumentParser] = []
    for verb in VERBS:
        p = sub.add_parser(
            verb.name,
            help=verb.help,
            description=verb.description or verb.help,
            epilog=EXIT_CODES,
            formatter_class=Formatter,
        )
        verbs += [p, *verb.arguments(p)]
    for p in verbs:
        add_global_options(p, defaults=False)
    return parser, verbs


def ctl(argv: Sequence[str]) -> int:
    parser, _ = build_parser()
    args = parser.parse_args(argv)
    if not re.fullmatch(r"https?://[^/\s?#]+/?", args.api):
        parser.error(f"--api {args.api!r} is not the admin API's URL; write it as http://HOST:PORT")
    try:
        http = http_options(args)
    except (ValueError, OSError) as exc:  # ssl.SSLError is an OSError: a bad --cacert, --cert or --key
        print(f"ctl: {exc}", file=sys.stderr)
        return 2
    try:
        return BY_NAME[args.command].run(Api(args.api, http), args)
    except CtlFailed as exc:
        print(str(exc), file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 0  # how a watch or a follow is ended
    except BrokenPipeError:
        # The reader went away (`ctl logs -f | head`): done, without a traceback, and without
        # Python's own complaint when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def render(command: str, doc: Any) -> str:
    """The text a verb that prints one document (``nodes``, ``replicas``, ``why``, ``drain`` ...)
    makes of it: its ``Verb.text``."""
    text = BY_NAME[command].text
    if text is None:
        raise ValueError(f"ctl {command} prints no single document; verbs that do: {_one_document()}")
    return text(doc)


def _one_document() -> str:
    return ", ".join(v.name for v in VERBS if v.text is not None)


def main() -> int:
    """``ctl`` as its own command (a console script), the same as ``python -m control ctl``."""
    return ctl(sys.argv[1:])


__all__ = [
    "EXIT_CODES",
    "VERBS",
    "Api",
    "CtlFailed",
    "Verb",
    "build_parser",
    "ctl",
    "describe_model",
    "describe_node",
    "main",
    "render",
    "rollout_line",
    "version",
]
