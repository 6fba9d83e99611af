"""What every engine adapter shares: the value types the supervisor consumes and the refusal rules.

An adapter is pure: it turns a ``StartShard`` into a ``Command`` (argv and the environment we add),
says how to tell the engine is ready (``Readiness``) and how to stop it (``StopBehaviour``), and
refuses a profile the engine would refuse (``ProfileRefused``) *before* anything is launched. A
refusal before launch costs milliseconds; the same mistake found by the engine costs minutes of
weight loading and leaves a crash-looping shard behind. No adapter touches a socket, a clock or a
process: the supervisor does the I/O and polls.

The rules here are the ones engines share (required fields, GPU count, compute capability, memory
fit), and the ones read from the flag set of the engine version the node runs
(``agent/engines/flags/<engine>-<version>.json``, extracted from the engine's own parser by
``python -m enginebuild.flags``): a choice it lacks, a deprecated one without its enabling flag, a
flag it does not have, a value of the wrong type, in ``extra_args`` too. Those refusals name the
engine and the version ("vLLM 0.18.0: --quantization fbgemm_fp8 is deprecated and needs
--allow-deprecated-quantization"). No choice list is typed by hand here.

Every adapter's ``build_command`` has one shape, defined at the end of this module: the profile's
options in the engine's spelling (``Spelling``, ``profile_argv``), the engine's own options, then
``assemble``: the shard's key where the engine's descriptor (``enginedefs``) says it takes it out of
sight of ``ps``, ``extra_args``, and one check of the whole line. The StartShard reaches the
adapters converted once (``ShardSpec``, by ``plan``).
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

import attrs

import schema
from agent.discovery.model import FabricAttachment, GpuInfo
from agent.engines import flagsets
from agent.engines.flagsets import FlagSet
from enginedefs import ApiKey, EngineDescriptor

GIB = 1024**3
MIB = 1024**2

#: Weights need room besides themselves: the CUDA context, activations, and at least a minimal KV
#: cache. One GiB per GPU is a floor, not an estimate: a refusal must never be wrong, so the check
#: only refuses profiles that cannot possibly load.
HEADROOM_BYTES_PER_GPU = 1 * GIB


class ProfileRefused(Exception):
    """A profile the engine would refuse, found before launch.

    ``rule`` is a short stable key (``"parallel-fit"``, ``"memory-fit"``...) for code and tests;
    the message is for a person: it names the rule's fields and the numbers that broke it.
    """

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(message)
        self.rule = rule
        self.message = message


@attrs.frozen
class LaunchContext:
    """What the node knows that the ``StartShard`` does not: how to start the engine binary here,
    which interface bootstraps NCCL/Gloo, and which fabrics the node sits on.

    ``argv_prefix`` is the engine binary as the node runs it, e.g. ``("vllm",)``,
    ``(sys.executable, "-m", "sglang.launch_server")`` or, to run a vLLM profile on the
    simulator, ``(sys.executable, "-m", "agent.engines.sim")``.
    """

    argv_prefix: tuple[str, ...] = attrs.field(validator=attrs.validators.min_len(1))
    host: str = "0.0.0.0"
    #: NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME for multi-node shards.
    mgmt_interface: str = ""
    #: Configured InfiniBand attachments; their HCAs become NCCL_IB_HCA for multi-node shards.
    fabrics: tuple[FabricAttachment, ...] = ()
    #: The node's GPUs as discovery saw them. Only engines whose argv depends on GPU sizes use it
    #: (llama.cpp ``--tensor-split``); empty means "not known", and they fall back to defaults.
    gpus: tuple[GpuInfo, ...] = ()
    #: Drain window for engines with a graceful-stop flag (vLLM ``--shutdown-timeout``): on SIGTERM
    #: they finish in-flight requests for up to this long. 0 leaves the engine's default (abort).
    shutdown_timeout_seconds: float = 0.0
    #: The engine's version installed on this node, as the agent found it at start
    #: (``agent.engines.versions``; llama.cpp: its build tag, e.g. "b6432"); "" when unknown.
    #: Adapters build flags for it (``flagsets.for_version``), never for a version they assume.
    engine_version: str = ""
    #: Where a shard's key file goes for an engine that reads its key from a file (the
    #: supervisor's ``keys`` directory, mode 0700); "" when none was given, and such a key is
    #: then refused rather than put on the command line.
    key_dir: str = ""


def _frozen_env(env: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(env))


@attrs.frozen
class Command:
    """An engine process to start: argv, and only the environment we add (the supervisor merges it
    over ``os.environ``, so PATH, HOME and the operator's own settings pass through)."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_env, hash=False)
    #: Files the engine reads its secrets from (path -> content): the supervisor writes them, mode
    #: 0600, before the spawn and removes them once the engine has exited. A key here or in
    #: ``env`` is out of sight of ``ps``; one in ``argv`` is not.
    files: Mapping[str, str] = attrs.field(factory=dict, converter=_frozen_env, hash=False)


@attrs.frozen
class Readiness:
    """How to tell an engine is ready, as data: the supervisor polls, this says what to poll.

    Ready means: ``health_path`` answers 200 and, when ``models_path`` is set, its JSON lists
    ``model_name`` (an engine can answer /health before the OpenAI app is mounted, and a router
    must never be told about a name the engine does not serve). A ``models_path`` that answers
    200 with a well-formed list *without* ``model_name`` is not "still loading": the engine is up
    and serves other names, so the start has failed (``listed_names`` tells the two apart). A
    status in ``loading_statuses``
    means "still loading, keep polling"; any other non-200 status is worth logging but not fatal,
    only the process exiting is. ``follow_rank0`` marks ranks > 0 of a multi-node replica: they
    serve no HTTP of their own, and are ready when rank 0 is.
    """

    health_path: str = "/health"
    models_path: str = ""
    model_name: str = ""
    loading_statuses: tuple[int, ...] = (503,)
    follow_rank0: bool = False

    @classmethod
    def rank0(cls) -> Readiness:
        """A rank > 0 shard: nothing to poll locally."""
        return cls(health_path="", follow_rank0=True, loading_statuses=())

    @property
    def paths(self) -> tuple[str, ...]:
        """Every HTTP path to poll, in order."""
        return tuple(p for p in (self.health_path, self.models_path) if p)

    def model_listed(self, body: bytes) -> bool:
        """Whether a ``/v1/models`` response body lists ``model_name``; false for anything that is
        not the OpenAI list shape (a loading page, a proxy's error), never an exception."""
        names = listed_names(body)
        return names is not None and self.model_name in names


def listed_names(body: bytes) -> tuple[str, ...] | None:
    """The model ids a ``/v1/models`` body lists, in order; ``None`` when the body is not the OpenAI
    list shape (``{"data": [{"id": ...}, ...]}``), so that a loading page or a proxy's error page is
    never mistaken for "serves no such model"."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        return None
    return tuple(str(m["id"]) for m in doc["data"] if isinstance(m, dict) and isinstance(m.get("id"), str))


@attrs.frozen
class StopBehaviour:
    """How an engine stops: the signal to send first, whether it finishes in-flight requests on
    that signal, and the argv flag that turns draining on (set at launch from
    ``LaunchContext.shutdown_timeout_seconds``; empty when the engine has none)."""

    stop_signal: signal.Signals = signal.SIGTERM
    graceful_flag: str = ""
    drains_in_flight: bool = False
    note: str = ""


class Validate(Protocol):
    def __call__(
        self, profile: schema.EngineProfile, gpus: Sequence[GpuInfo], *, nnodes: int = 1
    ) -> None: ...


@attrs.frozen
class ShardSpec:
    """One ``StartShard`` as the adapters take it, converted once, at the edge (``plan``): the
    profile is there (proto3 makes it optional), and the parallel sizes are what the engine sees.
    The adapters read it; none of them checks or converts the StartShard again."""

    spec: schema.StartShard
    profile: schema.EngineProfile
    tp: int
    pp: int

    @classmethod
    def of(cls, spec: schema.StartShard) -> ShardSpec:
        """Raises ProfileRefused when the StartShard carries no profile."""
        if spec.profile is None:
            raise ProfileRefused("required", "StartShard.profile is required")
        tp, pp = parallel_sizes(spec.profile)
        return cls(spec=spec, profile=spec.profile, tp=tp, pp=pp)

    @property
    def shard_id(self) -> str:
        return self.spec.shard_id

    @property
    def served_name(self) -> str:
        return served_name(self.profile)

    @property
    def api_key(self) -> str:
        return self.spec.api_key

    @property
    def multinode(self) -> bool:
        return self.spec.nnodes > 1

    @property
    def follows_rank0(self) -> bool:
        """A rank > 0 of a multi-node replica: it serves no HTTP of its own."""
        return self.spec.nnodes > 1 and self.spec.node_rank > 0


@attrs.frozen
class Engine:
    """One engine adapter, as the registry holds it: its pure functions and its stop behaviour."""

    name: str
    validate: Validate
    build_command: Callable[[ShardSpec, LaunchContext], Command]
    readiness: Callable[[ShardSpec], Readiness]
    stop: StopBehaviour


# ---------------------------------------------------------------------------------------------
# Small helpers for argv and messages.


def format_indices(indices: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``"0-3,6"``: GPU lists in messages stay short and exact."""
    values = sorted(set(indices))
    if not values:
        return "none"
    runs: list[str] = []
    start = prev = values[0]
    for v in values[1:]:
        if v == prev + 1:
            prev = v
            continue
        runs.append(f"{start}-{prev}" if prev > start else str(start))
        start = prev = v
    runs.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(runs)


def fmt_number(value: float) -> str:
    """A float as a person writes it: ``0.9`` not ``0.9000000000000001``, ``8`` not ``8.0``."""
    text = f"{value:.6g}"
    return text


def fmt_gib(n_bytes: float) -> str:
    return f"{n_bytes / GIB:.1f} GiB"


#: Why the agent never makes up a served name, for the refusal's message.
SERVED_NAME_RULE = (
    "profile.served_model_name is required: the control plane always sets the one name clients use "
    "(its catalog name when the operator set none), and the agent never derives another"
)


def served_name(profile: schema.EngineProfile) -> str:
    """The name clients use, exactly as the control plane sent it.

    There is no fallback to ``profile.model``: a second source of names is how an engine ends up
    serving one name while the router advertises another, and answers 404 to every request.
    """
    if not profile.served_model_name:
        raise ProfileRefused("served-model-name", SERVED_NAME_RULE)
    return profile.served_model_name


def parallel_sizes(profile: schema.EngineProfile) -> tuple[int, int]:
    """(tp, pp), with proto3's 0 ("unset") meaning 1."""
    return max(profile.tensor_parallel_size, 1), max(profile.pipeline_parallel_size, 1)


def host_port(addr: str, port: int) -> str:
    """``addr:port``, bracketing IPv6 literals the way torch.distributed and SGLang parse them."""
    if ":" in addr and not addr.startswith("["):
        addr = f"[{addr}]"
    return f"{addr}:{port}"


def gpu_env(spec: schema.StartShard) -> dict[str, str]:
    """The GPU pinning every CUDA engine gets.

    CUDA numbers devices fastest-first by default, while NVML and nvidia-smi (and so discovery
    and placement) number them by PCI bus id: without CUDA_DEVICE_ORDER the engine can land on
    GPUs another shard owns.
    """
    return {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in spec.gpu_indices),
    }


def multinode_env(ctx: LaunchContext) -> dict[str, str]:
    """NCCL/Gloo bootstrap settings for a shard of a multi-node replica."""
    env: dict[str, str] = {}
    if ctx.mgmt_interface:
        env["NCCL_SOCKET_IFNAME"] = ctx.mgmt_interface
        env["GLOO_SOCKET_IFNAME"] = ctx.mgmt_interface
    hcas = [f"{f.hca}:{f.port}" for f in ctx.fabrics if f.hca]
    if hcas:
        env["NCCL_IB_HCA"] = ",".join(hcas)
    return env


def merge_env(ours: Mapping[str, str], profile: schema.EngineProfile) -> dict[str, str]:
    """Ours, then the profile's on top: an operator's NCCL tuning wins over our defaults.
    (The profile cannot move the shard's GPUs: ``check_env`` refuses CUDA_VISIBLE_DEVICES.)"""
    env = dict(ours)
    env.update(profile.env)
    return env


# ---------------------------------------------------------------------------------------------
# Shared refusal rules. Each raises ProfileRefused with the rule's fields and numbers.


def check_required(profile: schema.EngineProfile, engine: str) -> None:
    if not profile.engine:
        raise ProfileRefused("required", f"profile.engine is required (this is the {engine} adapter)")
    if not profile.model:
        raise ProfileRefused("required", "profile.model is required (a model path or Hugging Face repo id)")
    served_name(profile)
    if profile.gpu_memory_utilization < 0 or profile.gpu_memory_utilization > 1:
        raise ProfileRefused(
            "gpu-memory-utilization",
            "gpu_memory_utilization must be in (0, 1], or 0 for the engine's default; "
            f"got {fmt_number(profile.gpu_memory_utilization)}",
        )
    if profile.params_billions < 0:
        raise ProfileRefused(
            "params-billions",
            f"params_billions must be >= 0, got {fmt_number(profile.params_billions)}",
        )


def check_env(profile: schema.EngineProfile) -> None:
    if "CUDA_VISIBLE_DEVICES" in profile.env:
        raise ProfileRefused(
            "env",
            "profile.env may not set CUDA_VISIBLE_DEVICES "
            f"({profile.env['CUDA_VISIBLE_DEVICES']!r}): the agent assigns each shard its GPUs",
        )


def check_choice(field: str, value: str, choices: Sequence[str], engine: str) -> None:
    """``value`` must be one of the engine's own choices (empty means "engine default");
    ``engine`` names the engine and its pinned version, e.g. "vLLM 0.18.0"."""
    if value and value not in choices:
        raise ProfileRefused(
            field, f"{field} {value!r} is not supported by {engine}; choices: {', '.join(choices)}"
        )


# ---------------------------------------------------------------------------------------------
# Rules from the engine version's own flag set (``agent/engines/flags/<engine>-<version>.json``).
# Each refusal names the engine and the version it was checked against ("vLLM 0.18.0: ...").


def flag_set(engine: str, ctx: LaunchContext) -> FlagSet:
    """The flag set for the engine version this node runs (``ctx.engine_version``): the newest
    data file not newer than it, the oldest when the version is unknown."""
    return flagsets.for_version(engine, ctx.engine_version)


def older_than_its_file(fs: FlagSet, ctx: LaunchContext) -> bool:
    """Whether the node's version is known and older than the file chosen for it (the oldest file
    stands in for every older version): the file may then list options the node's engine has not
    got yet, so an adapter leaves out the ones it can do without (vLLM's ``--shutdown-timeout``,
    new in 0.18.0, on a 0.17 node)."""
    have, file = flagsets.version_key(ctx.engine_version), flagsets.version_key(fs.version)
    return have is not None and file is not None and have[0] == file[0] and have < file


def check_flag_choice(fs: FlagSet, flag: str, value: str, field: str, extra_args: Sequence[str]) -> None:
    """``value`` for ``flag`` is what this engine version accepts: the flag exists, the value is
    one of its choices, and a deprecated choice comes with the flag that enables it.

    A deprecated choice is refused rather than enabled for the operator: the enabling flag
    (``--allow-deprecated-quantization``) is the engine's own "I know", and saying it belongs in
    the profile, where it is reviewed, not in the adapter, where it would be silent. The profile
    says it by listing the flag in ``extra_args``.
    """
    if not value:
        return
    option = fs.option(flag)
    if option is None:
        raise ProfileRefused(
            field, f"{fs.label}: has no {flag} option, so {field} {value!r} cannot be passed"
        )
    if option.choices is not None and value not in {str(c) for c in option.choices}:
        listed = ", ".join(str(c) for c in option.choices)
        raise ProfileRefused(field, f"{fs.label}: {flag} {value} is not one of its choices ({listed})")
    message = option.deprecated_choices.get(value)
    if message is not None:
        enabling = re.findall(r"--[A-Za-z0-9][A-Za-z0-9_-]*", message)
        if not any(f in extra_args for f in enabling):
            hint = f" (list {enabling[0]} in extra_args to run it anyway)" if enabling else ""
            raise ProfileRefused(field, f"{fs.label}: {flag} {value} {message}{hint}")


def check_command_line(fs: FlagSet, args: Sequence[str]) -> None:
    """The whole command line after the program (ours and ``extra_args``) parses as this engine
    version parses it: an unknown flag, a missing value, a bad type or choice is refused here,
    in the engine's words, instead of minutes later by the engine."""
    problems = fs.check_argv(args)
    if problems:
        raise ProfileRefused("flags", "; ".join(problems))


def check_not_an_option(fs: FlagSet, field: str, value: str) -> None:
    """A value we place on the command line must not start with ``-``: the engine's parser would
    read it as an option (argparse: "expected one argument"; llama.cpp: "invalid argument"), and the
    engine exits. Refused here, naming the field, rather than quoted in a form one engine accepts
    and another does not."""
    if value.startswith("-"):
        raise ProfileRefused(
            field,
            f"{fs.label}: {field} {value!r} starts with '-', so the engine would read it as an option; "
            "use a value that does not (a path can start with ./)",
        )


def check_values(fs: FlagSet, shard: ShardSpec) -> None:
    """Every value the adapters take from the StartShard and place after a flag or as the model."""
    check_not_an_option(fs, "model", shard.profile.model)
    check_not_an_option(fs, "served_model_name", shard.profile.served_model_name)
    check_not_an_option(fs, "api_key", shard.api_key)
    check_not_an_option(fs, "master_addr", shard.spec.master_addr)


def check_no_api_key_option(fs: FlagSet, shard: ShardSpec, flag: str = "--api-key") -> None:
    """A shard key for an engine version without an API-key option cannot be enforced: refuse it
    rather than start an engine anyone on the network can call."""
    if shard.api_key and (not flag or fs.option(flag) is None):
        raise ProfileRefused(
            "api-key",
            f"{fs.label}: has no API-key option ({flag or '--api-key'}), so the shard's key cannot be "
            "enforced; the control plane sends no key for this engine",
        )


def drain_seconds(stop_grace: float) -> int:
    """An engine's drain window, below the moment the supervisor's SIGKILL fires (``stop_grace``
    after SIGTERM) by a margin of max(2 s, 10%): the engine's own shutdown (closing its workers,
    freeing the GPUs) needs time after the last request, and an engine killed mid-shutdown can
    leave its GPU memory held. Whole seconds (vLLM's option is an int); 0 when no window fits."""
    return max(int(stop_grace - max(2.0, 0.1 * stop_grace)), 0)


def check_gpus_present(gpus: Sequence[GpuInfo], engine: str) -> None:
    if not gpus:
        raise ProfileRefused("parallel-fit", f"{engine} needs at least one GPU; 0 given (a CPU-only node?)")


def check_parallel_fit(profile: schema.EngineProfile, gpus: Sequence[GpuInfo], nnodes: int) -> None:
    """tp x pp must use exactly the GPUs given (times the nodes of a multi-node replica).

    Exactly, not "at most": vLLM, SGLang and TensorRT-LLM take the first tp*pp visible devices, so
    extra GPUs would sit reserved and idle, and fewer fail only after minutes of loading.
    """
    tp, pp = parallel_sizes(profile)
    world = tp * pp
    have = len(gpus) * nnodes
    if world == have:
        return
    indices = format_indices(g.index for g in gpus)
    sizes = f"tensor_parallel_size {tp} x pipeline_parallel_size {pp}"
    if nnodes > 1:
        raise ProfileRefused(
            "parallel-fit",
            f"{sizes} needs {world} GPUs across {nnodes} nodes "
            f"({fmt_number(world / nnodes)} per node), {len(gpus)} given on this node "
            f"(indices {indices}), {have} in all",
        )
    raise ProfileRefused("parallel-fit", f"{sizes} needs {world} GPUs, {len(gpus)} given (indices {indices})")


def needs_fp8(profile: schema.EngineProfile) -> bool:
    return "fp8" in profile.dtype.lower() or "fp8" in profile.quantization.lower()


def check_capability(profile: schema.EngineProfile, gpus: Sequence[GpuInfo]) -> None:
    """bf16 kernels need Ampere (8.0); FP8 tensor cores need Ada/Hopper (8.9). Every GPU must have
    it: one older GPU in a tensor-parallel group fails the whole group at kernel selection."""
    wants: list[tuple[str, tuple[int, int]]] = []
    if profile.dtype == "bfloat16":
        wants.append((f"dtype {profile.dtype}", (8, 0)))
    if needs_fp8(profile):
        what = (
            f"quantization {profile.quantization}"
            if "fp8" in profile.quantization.lower()
            else f"dtype {profile.dtype}"
        )
        wants.append((what, (8, 9)))
    for what, need in wants:
        for gpu in gpus:
            if gpu.compute_capability < need:
                have = ".".join(map(str, gpu.compute_capability))
                raise ProfileRefused(
                    "compute-capability",
                    f"{what} needs compute capability {need[0]}.{need[1]}+ on every GPU; "
                    f"GPU {gpu.index} ({gpu.name}) has {have}",
                )


#: Nominal bytes per weight for a quantization, by family. Nominal (4-bit = 0.5) on purpose: real
#: formats carry scales and a few layers in 16 bits, so the true size is a little larger, and a
#: refusal based on the nominal size is never wrong.
_ONE_BYTE = ("fp8", "int8", "w8a8", "w8a16", "experts_int8", "mxfp8")
_HALF_BYTE = (
    "fp4",
    "int4",
    "awq",
    "gptq",
    "marlin",
    "wna16",
    "auto-round",
    "bitsandbytes",
    "qoq",
    "w4a",
)


def bytes_per_param(profile: schema.EngineProfile) -> tuple[float, str] | None:
    """(bytes per weight, the reason in words) for the memory-fit estimate, or None when the width
    is only known to the checkpoint (compressed-tensors, quark, torchao, a bare "gguf")."""
    q = profile.quantization.lower()
    if q:
        # GGUF file types (llama.cpp): q4_k_m, iq3_xs, tq1_0, q8_0, f16, bf16, f32...
        gguf = re.match(r"[it]?q(\d)", q)
        if gguf:
            bits = int(gguf.group(1))
            return bits / 8, f"{bits}-bit {profile.quantization}"
        if q in ("f32", "fp32"):
            return 4.0, profile.quantization
        if q in ("f16", "bf16", "fp16"):
            return 2.0, profile.quantization
        if any(k in q for k in _ONE_BYTE):
            return 1.0, f"8-bit {profile.quantization}"
        if any(k in q for k in _HALF_BYTE):
            return 0.5, f"4-bit {profile.quantization}"
        return None
    if profile.dtype in ("float", "float32"):
        return 4.0, profile.dtype
    if profile.dtype in ("half", "float16", "bfloat16"):
        return 2.0, profile.dtype
    return 2.0, "16-bit weights assumed for dtype auto"


def check_memory_fit(
    profile: schema.EngineProfile,
    gpus: Sequence[GpuInfo],
    nnodes: int,
    *,
    default_fraction: float,
    fraction_name: str = "gpu_memory_utilization",
    use_profile_fraction: bool = True,
) -> None:
    """The weights, split over every node of the replica, must fit this node's GPU budget.

    budget = sum(memory_total x fraction) over the GPUs given, less HEADROOM_BYTES_PER_GPU each.
    ``use_profile_fraction=False`` is for engines whose memory knob does not bound the weights.
    Skipped when ``params_billions`` is unknown (0), when no GPUs are given (CPU engines), and
    when the quantization's width is only known to the checkpoint.
    """
    width = bytes_per_param(profile)
    if profile.params_billions <= 0 or not gpus or width is None:
        return
    per_param, why = width
    weights = profile.params_billions * 1e9 * per_param
    share = weights / nnodes
    fraction = default_fraction
    if use_profile_fraction and profile.gpu_memory_utilization:
        fraction = profile.gpu_memory_utilization
    total = sum(g.memory_total_mib for g in gpus) * MIB
    budget = total * fraction
    headroom = HEADROOM_BYTES_PER_GPU * len(gpus)
    if share <= budget - headroom:
        return
    per_gpu = {g.memory_total_mib for g in gpus}
    sizes = (
        f"{len(gpus)} GPU{'s' if len(gpus) > 1 else ''} x {fmt_gib(per_gpu.pop() * MIB)}"
        if len(per_gpu) == 1
        else f"{len(gpus)} GPUs totalling {fmt_gib(total)}"
    )
    node_share = f", this node's 1/{nnodes} share is {fmt_gib(share)}" if nnodes > 1 else ""
    raise ProfileRefused(
        "memory-fit",
        f"model weights need about {fmt_gib(weights)} "
        f"({fmt_number(profile.params_billions)}B params x {fmt_number(per_param)} bytes, {why})"
        f"{node_share}, more than the {fmt_gib(budget - headroom)} this shard can give them: "
        f"{sizes} x {fraction_name} {fmt_number(fraction)} = {fmt_gib(budget)}, "
        f"less {fmt_gib(HEADROOM_BYTES_PER_GPU)} headroom per GPU",
    )


def check_nnodes(nnodes: int, engine: str, why: str) -> None:
    if nnodes > 1:
        raise ProfileRefused("multi-node", f"{engine} cannot run across {nnodes} nodes here: {why}")


def check_gpu_fit(
    profile: schema.EngineProfile,
    gpus: Sequence[GpuInfo],
    nnodes: int,
    engine: str,
    *,
    default_fraction: float,
    fraction_name: str = "gpu_memory_utilization",
    use_profile_fraction: bool = True,
) -> None:
    """The GPU rules of every engine that runs on GPUs only: at least one GPU, tp x pp exactly the
    GPUs given, their compute capability, and the weights within their memory."""
    check_gpus_present(gpus, engine)
    check_parallel_fit(profile, gpus, nnodes)
    check_capability(profile, gpus)
    check_memory_fit(
        profile,
        gpus,
        nnodes,
        default_fraction=default_fraction,
        fraction_name=fraction_name,
        use_profile_fraction=use_profile_fraction,
    )


def check_weights_fixed_by_checkpoint(
    profile: schema.EngineProfile, choices: Sequence[str], *, dtype_why: str, quantization_of: str
) -> None:
    """For an engine whose checkpoint fixes the weights' types (llama.cpp's GGUF, TensorRT-LLM's
    checkpoint): no ``dtype`` (``dtype_why`` says where it comes from instead), and a stated
    ``quantization`` must be one of ``choices`` (matched case-insensitively), which only feeds the
    capability and memory checks; ``quantization_of`` names the list ("a GGUF type llama.cpp loads")."""
    if profile.dtype not in ("", "auto"):
        raise ProfileRefused("dtype", f"dtype {profile.dtype!r} {dtype_why}")
    if profile.quantization and profile.quantization.lower() not in {c.lower() for c in choices}:
        raise ProfileRefused(
            "quantization",
            f"quantization {profile.quantization!r} is not {quantization_of}; choices: {', '.join(choices)}",
        )


# ---------------------------------------------------------------------------------------------
# The command every adapter builds: the profile's options in the engine's spelling, the engine's
# own, the shard's key where the engine takes it out of sight, extra_args, one check of the whole
# line against the engine version's flag set.


@attrs.frozen
class Spelling:
    """How one engine spells the options every adapter sets from a profile; "" where it has none
    (the value is then not passed: the adapter's ``validate`` refuses what cannot be honoured)."""

    #: The model's option ("--model-path", "-m"); "" passes it as the first positional argument.
    model: str = ""
    served_name: str = ""
    #: The engine's fixed options, right after ``--port`` (trtllm-serve: ``--backend pytorch``).
    after_port: tuple[str, ...] = ()
    tp: str = ""
    pp: str = ""
    dtype: str = ""
    quantization: str = ""
    max_len: str = ""
    memory_fraction: str = ""


def profile_argv(fs: FlagSet, shard: ShardSpec, ctx: LaunchContext, spelling: Spelling) -> list[str]:
    """model, served name, host, port, the fixed options, tp, pp, dtype, quantization, context
    length and memory fraction, as this engine version spells them; its choices checked first."""
    profile = shard.profile
    check_values(fs, shard)
    if spelling.dtype:
        check_flag_choice(fs, spelling.dtype, profile.dtype, "dtype", profile.extra_args)
    if spelling.quantization:
        check_flag_choice(fs, spelling.quantization, profile.quantization, "quantization", profile.extra_args)
    argv = [spelling.model, profile.model] if spelling.model else [profile.model]
    if spelling.served_name:
        argv += [spelling.served_name, shard.served_name]
    argv += ["--host", ctx.host, "--port", str(shard.spec.http_port), *spelling.after_port]
    if spelling.tp:
        argv += [spelling.tp, str(shard.tp)]
    if spelling.pp:
        argv += [spelling.pp, str(shard.pp)]
    if spelling.dtype and profile.dtype:
        argv += [spelling.dtype, profile.dtype]
    if spelling.quantization and profile.quantization:
        argv += [spelling.quantization, profile.quantization]
    if spelling.max_len and profile.max_model_len:
        argv += [spelling.max_len, str(profile.max_model_len)]
    if spelling.memory_fraction and profile.gpu_memory_utilization:
        argv += [spelling.memory_fraction, fmt_number(profile.gpu_memory_utilization)]
    return argv


def key_file(ctx: LaunchContext, shard: ShardSpec, suffix: str) -> str:
    """Where the shard's key file goes: ``KEY_DIR/SHARD.SUFFIX``."""
    if not ctx.key_dir:
        raise ProfileRefused(
            "api-key",
            "the engine reads the shard's key from a file, and no key directory was given "
            "(LaunchContext.key_dir); not putting the key on the command line instead",
        )
    return f"{ctx.key_dir.rstrip('/')}/{shard.shard_id}{suffix}"


def place_key(
    key: ApiKey | None, fs: FlagSet, shard: ShardSpec, ctx: LaunchContext, env: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """The shard's key where the engine takes it (``enginedefs.ApiKey``): a variable in ``env``, a
    file (returned as path -> content), or, only where the engine has nothing else, ``flag KEY``
    on the command line. Returns the arguments to add and the files to write."""
    if not shard.api_key:
        return [], {}
    check_no_api_key_option(fs, shard, key.flag if key is not None else "")
    assert key is not None  # check_no_api_key_option refused a key for a keyless engine
    if key.env:
        env[key.env] = shard.api_key
        return [], {}
    if key.file_flag:
        path = key_file(ctx, shard, ".key")
        return [key.file_flag, path], {path: f"{shard.api_key}\n"}
    if key.config_flag and key.config_flag not in shard.profile.extra_args:
        # A YAML file of options (SGLang's --config); a JSON string is a YAML scalar. The engine
        # reads one such file, so an operator's own in extra_args leaves the key on the line.
        path = key_file(ctx, shard, ".yaml")
        return [key.config_flag, path], {path: f"{key.config_key}: {json.dumps(shard.api_key)}\n"}
    return [key.flag, shard.api_key], {}


def assemble(
    descriptor: EngineDescriptor,
    fs: FlagSet,
    shard: ShardSpec,
    ctx: LaunchContext,
    *,
    argv: Sequence[str],
    env: Mapping[str, str],
    subcommand: tuple[str, ...] = (),
) -> Command:
    """The launch: the engine's arguments (``argv``: what its adapter built), the shard's key where
    the engine takes it, ``extra_args``; the whole line checked as this engine version parses it;
    our environment under the profile's."""
    ours = dict(env)
    key_args, files = place_key(descriptor.key, fs, shard, ctx, ours)
    args = [*argv, *key_args, *shard.profile.extra_args]
    check_command_line(fs, args)
    merged = merge_env(ours, shard.profile)
    if descriptor.key is not None and descriptor.key.env and shard.api_key:
        merged[descriptor.key.env] = shard.api_key  # the profile's env cannot replace the shard's key
    return Command(argv=(*ctx.argv_prefix, *subcommand, *args), env=merged, files=files)


def openai_readiness(shard: ShardSpec) -> Readiness:
    """An OpenAI-compatible server: ``/health`` answers 200 (503 while loading), then ``/v1/models``
    lists the served name; a rank > 0 of a multi-node replica is ready when rank 0 is."""
    if shard.follows_rank0:
        return Readiness.rank0()
    return Readiness(health_path="/health", models_path="/v1/models", model_name=shard.served_name)
