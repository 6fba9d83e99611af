"""Which version of each configured engine this node has installed, found once at agent start.

The control plane places a profile that asks for ``engine_version = ">=0.18"`` only on nodes whose
engine satisfies it, and the adapters build flags for the version the node runs; both need the
version the *node* has, not the one an adapter was written against. The agent finds it from the
engine's own answer:

- a Python engine run as ``PYTHON -m PACKAGE...`` (SGLang's default, any engine in a venv) or as a
  console script whose ``#!`` line names a Python (``vllm``, ``trtllm-serve``): the package's
  metadata as *that* interpreter sees it (``importlib.metadata.version``). It is what the engine's
  own ``--version`` prints, without importing torch and CUDA, which takes tens of seconds;
- anything else (``llama-server``, ``python -m agent.engines.sim``, a wrapper script): the engine's
  own ``--version``. llama.cpp prints ``version: 6432 (c4df49a4)`` or, newer, ``version: 0.5.0-dev
  (build 6432, commit c4df49a4)``, reported as its build tag ``b6432`` (a tree built without git
  history says ``build 1``: ``b1``, which is also how its flag file is named); the simulator prints
  the vLLM version it imitates.

Each command runs with a deadline (``TIMEOUT``, all engines at once), in its own process group,
which is killed whole when the deadline passes: a version command that hangs, or leaves a child
behind holding its pipes, cannot hold the agent's start. It runs without the agent's own secrets
in its environment (``LLMGW_AGENT_*``), like an engine.

Once at start, not on each reconnect: an engine upgraded under a running agent is the same event
as kubelet's container runtime being upgraded under it, which kubelet also reads once at start;
the operator restarts the agent (engines keep running across that restart, see the supervisor).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
from collections.abc import Iterable, Mapping, Sequence

import attrs
import trio

import enginedefs
import schema

#: Seconds one version command may take. Python engines answer from package metadata in well
#: under a second; the bound is for the one that hangs, and all engines run at once under it.
TIMEOUT = 5.0

#: Longest version string or error reported: the control plane shows them in tables.
MAX_TEXT = 240

#: The distribution whose metadata says a Python engine's version, when the engine runs from it
#: (each descriptor's ``version.package``).
PACKAGES: Mapping[str, str] = {d.name: d.version.package for d in enginedefs.DESCRIPTORS if d.version.package}

#: Commands that start a container: ``--version`` appended to one would start the engine's image
#: (pulling it first, maybe), and killing the client on the deadline would not stop the container.
CONTAINER_RUNTIMES = frozenset({"docker", "podman", "nerdctl", "apptainer", "singularity", "enroot"})

#: Printed by ``PYTHON -c METADATA_SNIPPET DIST``: the installed version, exit 1 when not installed.
METADATA_SNIPPET = (
    "import importlib.metadata as m, sys\n"
    "try:\n"
    "    print(m.version(sys.argv[1]))\n"
    "except m.PackageNotFoundError:\n"
    "    sys.exit(f'no package {sys.argv[1]!r} in {sys.executable}')\n"
)

#: A PEP 440-looking version in free text ("vllm 0.18.0", "0.5.4.post1", "1.2.0rc1").
_VERSION_TEXT = re.compile(r"(?<![\w.])v?(\d+(?:\.\d+)+(?:[-.]?(?:a|b|rc|dev|post)\d*)*(?:\+[\w.]+)?)")

#: llama.cpp: ``version: 6432 (c4df49a4)`` (a git build), or ``version: 0.5.0-dev (build 1, commit
#: 0c1e570)`` (a build whose tree had no git history).
_LLAMA_BUILD = re.compile(r"version:\s*(\d+)\s*\(")
_LLAMA_SEMVER = re.compile(r"version:\s*(\d+\.\d+\.\d+[\w.-]*)\s*\(build\s*(\d+)")


@attrs.frozen
class Installed:
    """One engine on this node: its version, or why it is unknown (exactly one is non-empty)."""

    engine: str
    version: str = ""
    error: str = ""

    def to_proto(self) -> schema.EngineInstall:
        return schema.EngineInstall(engine=self.engine, version=self.version, error=self.error)


@attrs.frozen
class Probe:
    """How to ask one engine for its version: the command, and how to read its answer."""

    argv: tuple[str, ...]
    #: "metadata": stdout is the version; "llamacpp": llama.cpp's version line; "text": the first
    #: version-looking word of stdout, else of stderr.
    reads: str


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= MAX_TEXT else line[: MAX_TEXT - 3] + "..."


def _interpreter_of_script(path: str) -> tuple[str, ...] | None:
    """The interpreter argv of a Python console script (its ``#!`` line), or None for a binary or a
    script in another language. Reads 256 bytes of a file: call it from a worker thread."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    words = head[2:].split(b"\n", 1)[0].decode(errors="replace").split()
    if not words or "python" not in os.path.basename(words[-1] if words[0].endswith("/env") else words[0]):
        return None
    return tuple(words)


def plan_probe(engine: str, argv_prefix: Sequence[str], script: tuple[str, ...] | None) -> Probe:
    """The command that tells ``engine``'s version, from its argv prefix as the node runs it.

    ``script`` is the interpreter the ``#!`` line of ``argv_prefix[0]`` names when that is a Python
    script (found by the caller, so this stays pure)."""
    argv = tuple(argv_prefix)
    package = PACKAGES.get(engine)
    if len(argv) >= 3 and argv[1] == "-m":
        top = argv[2].split(".", 1)[0]
        if package is not None and top == package:
            return Probe((argv[0], "-c", METADATA_SNIPPET, package), "metadata")
        # Another module (the simulator standing in for an engine, a wrapper): its own --version.
        return Probe((*argv, "--version"), "text")
    if package is not None and script is not None and len(argv) == 1:
        return Probe((*script, "-c", METADATA_SNIPPET, package), "metadata")
    descriptor = enginedefs.lookup(engine)
    return Probe((*argv, "--version"), descriptor.version.reads if descriptor is not None else "text")


def read_version(probe: Probe, stdout: str, stderr: str) -> str:
    """The version in a probe's output, "" when there is none."""
    if probe.reads == "metadata":
        return stdout.strip().splitlines()[0].strip() if stdout.strip() else ""
    both = f"{stdout}\n{stderr}"
    if probe.reads == "llamacpp":
        semver = _LLAMA_SEMVER.search(both)
        if semver is not None:
            # The build number, even where it counts no real history (a tree without git gives
            # "build 1"): it is the key the flag files use too (enginebuild.flags.llamacpp).
            return f"b{semver.group(2)}"
        tagged = _LLAMA_BUILD.search(both)
        if tagged is not None:
            return f"b{tagged.group(1)}"
    for text in (stdout, stderr):
        found = _VERSION_TEXT.search(text)
        if found is not None:
            return found.group(1)
    return ""


def _probe_env() -> dict[str, str]:
    """The agent's environment less its own settings and secrets (``LLMGW_AGENT_*``)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_AGENT_")}


async def _kill_group(process: trio.Process) -> None:
    """Cancellation of a probe: SIGKILL its whole process group (it runs in a session of its own),
    so a child it left behind cannot hold its pipes open."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _locate(engine: str, argv_prefix: Sequence[str]) -> tuple[str | None, tuple[str, ...] | None]:
    """``argv_prefix[0]`` on PATH, and its Python interpreter when it is a Python script (blocking:
    stats and reads files)."""
    which = shutil.which(argv_prefix[0])
    script = _interpreter_of_script(which) if which and engine in PACKAGES else None
    return which, script


async def detect_one(engine: str, argv_prefix: Sequence[str], timeout: float = TIMEOUT) -> Installed:
    """``engine``'s installed version, or why it is unknown, within ``timeout`` seconds."""
    if not argv_prefix:
        return Installed(engine, error=f"{engine}: no command configured")
    runtime = os.path.basename(argv_prefix[0])
    if runtime in CONTAINER_RUNTIMES:
        return Installed(
            engine,
            error=f"not probed: {engine} runs through {runtime}, and a probe would start a container",
        )
    which, script = await trio.to_thread.run_sync(_locate, engine, tuple(argv_prefix))
    if which is None:
        return Installed(engine, error=f"{argv_prefix[0]}: command not found")
    probe = plan_probe(engine, argv_prefix, script)
    shown = shlex.join(probe.argv if probe.reads != "metadata" else (*probe.argv[:2], "...", probe.argv[-1]))
    completed = None
    try:
        with trio.move_on_after(timeout):
            completed = await trio.run_process(
                probe.argv,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                env=_probe_env(),
                start_new_session=True,
                deliver_cancel=_kill_group,
            )
    except OSError as exc:
        return Installed(engine, error=_one_line(f"{argv_prefix[0]}: cannot run: {exc.strerror or exc}"))
    if completed is None:
        return Installed(engine, error=_one_line(f"`{shown}` did not answer within {timeout:g} s"))
    stdout = completed.stdout.decode(errors="replace")
    stderr = completed.stderr.decode(errors="replace")
    if completed.returncode != 0:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else "no output"
        if probe.reads == "metadata" and last.startswith("no package "):
            # The interpreter runs, but this engine is not installed for it.
            return Installed(engine, error=_one_line(f"{engine} not installed: {last}"))
        return Installed(
            engine, error=_one_line(f"`{shown}` exited with status {completed.returncode}: {last}")
        )
    version = read_version(probe, stdout, stderr)
    if not version:
        said = _one_line(stdout.strip() or stderr.strip() or "nothing")
        return Installed(engine, error=_one_line(f"`{shown}` printed no version: {said}"))
    return Installed(engine, version=_one_line(version))


async def detect(
    engines: Iterable[tuple[str, Sequence[str]]], timeout: float = TIMEOUT
) -> tuple[Installed, ...]:
    """Every engine's version, all probed at once, in the order given; bounded by ``timeout``."""
    items = list(engines)
    found: dict[str, Installed] = {}

    async def one(engine: str, argv: Sequence[str]) -> None:
        found[engine] = await detect_one(engine, argv, timeout)

    async with trio.open_nursery() as nursery:
        for engine, argv in items:
            nursery.start_soon(one, engine, argv)
    return tuple(found[engine] for engine, _ in items)
