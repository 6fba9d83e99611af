"""What every verb shares: the admin API client, the failure that exits 1, the global options, and
``Verb``, the record each verb module gives the verb table (``control.ctl.VERBS``)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import httpx

#: Printed by ``ctl --help`` and ``python -m control --help``: scripts rely on these staying put.
EXIT_CODES = """exit status:
  0  done (a watch or follow ended with Ctrl-C included)
  1  the operation failed: the API refused it (its reason is printed) or could not be reached
  2  a usage mistake: an unknown verb, option or value"""

#: How often ``get -w`` and ``logs -f`` poll the API (and the waits of ``--wait``, twice as often).
POLL_SECONDS = 1.0


def version() -> str:
    """llmgw's version from the installed package's metadata ("unknown" in a bare checkout)."""
    try:
        return importlib.metadata.version("llmgw")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class CtlFailed(Exception):
    """An operation that failed (exit 1), with the line that says what, where and why."""


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs keep their line breaks (the exit codes are a list)."""


def _no_arguments(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    return []


class Verb(NamedTuple):
    """One ``ctl`` verb: its name and help, a function that adds its arguments to its parser
    (returning any sub-parsers of its own, such as ``rollout status``, which get the global options
    too), and ``run``, which does it (exit status out, ``CtlFailed`` for 1). ``text`` is the text
    form of the one document a verb that predates ``get`` prints (``render`` gives it by name).

    A NamedTuple, not an attrs class: ``ctl`` imports nothing it can do without, so it starts fast
    (attrs alone is 10 to 100 ms of a ctl run, measured with ``python -X importtime``)."""

    name: str
    help: str
    run: Callable[[Api, argparse.Namespace], int]
    arguments: Callable[[argparse.ArgumentParser], list[argparse.ArgumentParser]] = _no_arguments
    description: str = ""
    text: Callable[[Any], str] | None = None


def one_request(
    request: Callable[[argparse.Namespace], tuple[str, str]], text: Callable[[Any], str]
) -> Callable[[Api, argparse.Namespace], int]:
    """``run`` for a verb that is one request and one document: printed as ``text`` makes it, or
    as the API's JSON with ``-o json``."""

    def run(api: Api, args: argparse.Namespace) -> int:
        method, path = request(args)
        doc = api.request(method, path)
        print(json.dumps(doc, indent=2) if args.output == "json" else text(doc), flush=True)
        return 0

    return run


def _print(line: str) -> None:
    print(line, flush=True)


def wait_until(
    step: Callable[[], tuple[bool, str]],
    timeout: float,
    gave_up: str,
    *,
    show: Callable[[str], None] = _print,
    poll_every: float = POLL_SECONDS / 2,
) -> None:
    """What every ``--wait`` does: call ``step`` (done, and a line on where things stand) until it
    is done, showing each line that differs from the last; past ``timeout`` seconds, ``CtlFailed``
    with ``gave_up``, the timeout and the last line."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        done, line = step()
        if line != last:
            show(line)
            last = line
        if done:
            return
        if time.monotonic() >= deadline:
            raise CtlFailed(f"{gave_up} after {timeout:g} s; {line}")
        time.sleep(min(poll_every, max(deadline - time.monotonic(), 0.0)))


def add_wait_options(parser: argparse.ArgumentParser, wait_help: str) -> None:
    """``--wait`` and its ``--timeout S`` (600 s), the same on every verb that can wait."""
    parser.add_argument("--wait", action="store_true", help=wait_help)
    parser.add_argument(
        "--timeout", type=float, default=600.0, metavar="S", help="with --wait: give up after S seconds (600)"
    )


def action(
    parser: argparse.ArgumentParser, dest: str, name: str, help_: str, description: str
) -> argparse.ArgumentParser:
    """A verb's one ACTION (``rollout status``, ``node reset``): its own parser, with the same
    epilog and layout as a verb's."""
    actions = parser.add_subparsers(dest=dest, required=True, metavar="ACTION")
    return actions.add_parser(
        name, help=help_, description=description, epilog=EXIT_CODES, formatter_class=Formatter
    )


def model_name(text: str) -> str:
    """A model argument as kubectl users write it: ``NAME``, ``model/NAME`` or ``models/NAME``."""
    return text.removeprefix("model/").removeprefix("models/")


def add_global_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """The options every verb takes, on the top parser with their defaults and on each verb with
    none (argparse.SUPPRESS), so ``ctl -o json get nodes`` and ``ctl get nodes -o json`` both work
    and a verb's parse never overwrites what was given before it."""
    group = parser.add_argument_group("global options (anywhere on the command line)")
    none = None if defaults else argparse.SUPPRESS
    group.add_argument(
        "--api",
        default=os.environ.get("LLMGW_API", "http://127.0.0.1:7080") if defaults else argparse.SUPPRESS,
        metavar="URL",
        help="the control plane's admin API (default: $LLMGW_API, else http://127.0.0.1:7080)",
    )
    group.add_argument(
        "-o",
        "--output",
        choices=("json", "wide", "name"),
        default=none,
        help="json: the API's JSON; wide: more columns; name: KIND/NAME lines (default: columns)",
    )
    group.add_argument(
        "--json", dest="output", action="store_const", const="json", default=none, help="the same as -o json"
    )
    group.add_argument(
        "--token-file",
        type=Path,
        default=none,
        metavar="PATH",
        help="a file holding the admin API token (default: $LLMGW_API_TOKEN; none: only a control plane "
        "on this machine without [api] tokens answers)",
    )
    group.add_argument(
        "--cacert",
        type=Path,
        default=Path(os.environ["LLMGW_API_CACERT"])
        if defaults and os.environ.get("LLMGW_API_CACERT")
        else none,
        metavar="PATH",
        help="https: the CA that signs the admin API's certificate (default: $LLMGW_API_CACERT, else the system's)",
    )
    group.add_argument(
        "--cert",
        type=Path,
        default=none,
        metavar="PATH",
        help="https with [api.tls] client_ca: this client's certificate (PEM; with --key, or the key inside it)",
    )
    group.add_argument(
        "--key", type=Path, default=none, metavar="PATH", help="the private key of --cert, if not inside it"
    )


def http_options(args: argparse.Namespace) -> dict[str, Any]:
    """What every request of this ``ctl`` run carries: the bearer token (``--token-file``, else
    ``$LLMGW_API_TOKEN``) and the TLS settings. Raises ``ValueError`` naming the file it cannot read."""
    token = os.environ.get("LLMGW_API_TOKEN", "").strip()
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ValueError(f"--token-file {args.token_file}: cannot read it: {reason}") from exc
        if not token:
            raise ValueError(f"--token-file {args.token_file} is empty; put the admin API token in it")
    headers = {"authorization": f"Bearer {token}"} if token else {}
    options: dict[str, Any] = {"headers": headers, "timeout": 30}
    if args.cacert is not None:
        options["verify"] = ssl.create_default_context(cafile=str(args.cacert))
    if args.cert is not None:
        context = options.get("verify") or ssl.create_default_context()
        context.load_cert_chain(str(args.cert), str(args.key) if args.key else None)
        options["verify"] = context
    return options


class Api:
    """The admin API as ``ctl`` reads it: GETs and POSTs that either return the JSON document or
    raise ``CtlFailed`` with one line naming the method, URL and reason."""

    def __init__(self, base: str, http: dict[str, Any]) -> None:
        self.base = base.rstrip("/")
        self.http = http

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        url = self.base + path
        try:
            # Writes carry a JSON body: the API refuses any other content type for them (see
            # control/api.py: ApiGuard, why a browser's text/plain POST must not get through).
            payload = body if body is not None or method == "GET" else {}
            resp = httpx.request(method, url, json=payload, **self.http)
        except httpx.HTTPError as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise CtlFailed(
                f"ctl: cannot reach the control plane: {method} {url}: {reason}; "
                "is it running, and is --api (or LLMGW_API) its admin API address?"
            ) from None
        try:
            doc = resp.json()
        except ValueError:
            text = " ".join(resp.text[:200].split())
            raise CtlFailed(f"ctl: {method} {url}: HTTP {resp.status_code} without JSON: {text}") from None
        if resp.status_code != 200:
            error = doc.get("error") if isinstance(doc, dict) else None
            # One line per line of the server's message (an apply's several problems stay a list).
            reason = "\n  ".join(
                " ".join(line.split()) for line in str(error or resp.text[:200]).splitlines()
            )
            raise CtlFailed(f"ctl: {method} {url}: HTTP {resp.status_code}: {reason}")
        return doc

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def get_if_served(self, path: str) -> Any:
        """``get``, or None from a control plane that has no such route (an older one)."""
        try:
            return self.request("GET", path)
        except CtlFailed as exc:
            if "HTTP 404: no route " in str(exc):
                return None
            raise


__all__ = [
    "EXIT_CODES",
    "POLL_SECONDS",
    "Api",
    "CtlFailed",
    "Formatter",
    "Verb",
    "action",
    "add_global_options",
    "add_wait_options",
    "http_options",
    "model_name",
    "one_request",
    "version",
    "wait_until",
]
