"""Engine adapters: the exact argv and environment per engine, and every refusal rule's message.

The argv here is pinned on purpose: a flag renamed by accident would start an engine that exits
with "unrecognized arguments" minutes into a rollout, and these tests are where that shows first.
"""

from __future__ import annotations

import json
import signal
import sys

import attrs
import pytest

import enginedefs
import schema
from agent.discovery.model import FabricAttachment, GpuInfo
from agent.engines import (
    ENGINES,
    LaunchContext,
    ProfileRefused,
    Readiness,
    ShardSpec,
    base,
    check_spec,
    engine_for,
    flagsets,
    llamacpp,
    plan,
    select_gpus,
    sglang,
    sim,
    trtllm,
    vllm,
)
from agent.engines.base import bytes_per_param, format_indices, listed_names

H100 = "NVIDIA H100 80GB HBM3"


def gpu(index: int, cc: tuple[int, int] = (9, 0), mib: int = 81559, name: str = H100) -> GpuInfo:
    return GpuInfo(index=index, uuid=f"GPU-{index}", name=name, compute_capability=cc, memory_total_mib=mib)


def gpus(n: int, **kw: object) -> list[GpuInfo]:
    return [gpu(i, **kw) for i in range(n)]  # type: ignore[arg-type]


def profile(engine: str = "vllm", **kw: object) -> schema.EngineProfile:
    """A profile as the control plane sends it: ``served_model_name`` is always set (here to the
    model, which every engine, trtllm-serve included, can serve under)."""
    model = str(kw.get("model", "meta-llama/Llama-3.1-8B-Instruct"))
    fields: dict[str, object] = {"engine": engine, "model": model, "served_model_name": model}
    fields.update(kw)
    return schema.EngineProfile(**fields)  # type: ignore[arg-type]


def shard(p: schema.EngineProfile, **kw: object) -> ShardSpec:
    """A StartShard as the adapters take it (``plan`` converts it once)."""
    return ShardSpec.of(spec(p, **kw))


def spec(p: schema.EngineProfile, **kw: object) -> schema.StartShard:
    fields: dict[str, object] = {
        "shard_id": "s1",
        "replica_id": "r1",
        "profile": p,
        "gpu_indices": [0],
        "http_port": 8001,
    }
    fields.update(kw)
    return schema.StartShard(**fields)  # type: ignore[arg-type]


FABRICS = (FabricAttachment(fabric="ib-a", hca="mlx5_0", port=1), FabricAttachment("ib-a", "mlx5_1", 1))


def ctx(*prefix: str, **kw: object) -> LaunchContext:
    return LaunchContext(argv_prefix=prefix, mgmt_interface="eth1", fabrics=FABRICS, **kw)  # type: ignore[arg-type]


def refusal(fn: object, *args: object, **kw: object) -> ProfileRefused:
    with pytest.raises(ProfileRefused) as info:
        fn(*args, **kw)  # type: ignore[operator]
    return info.value


# ---------------------------------------------------------------------------------------------
# Registry


def test_registry_has_every_engine() -> None:
    assert set(ENGINES) == set(enginedefs.NAMES) >= {"vllm", "sglang", "llamacpp", "trtllm", "sim"}
    for name, engine in ENGINES.items():
        assert engine.name == name
        assert engine.stop.stop_signal is signal.SIGTERM


def test_unknown_engine_is_refused() -> None:
    err = refusal(engine_for, "tgi")
    assert err.rule == "engine"
    assert (
        str(err)
        == "engine 'tgi' is not one llmgw can run; known engines: llamacpp, sglang, sim, trtllm, vllm"
    )


# ---------------------------------------------------------------------------------------------
# vLLM


def test_vllm_single_node_argv() -> None:
    p = profile(
        served_model_name="llama-8b",
        tensor_parallel_size=2,
        dtype="bfloat16",
        quantization="fp8",
        max_model_len=16384,
        gpu_memory_utilization=0.85,
        extra_args=["--enable-prefix-caching", "--max-num-seqs", "128"],
        env={"NCCL_DEBUG": "INFO"},
    )
    cmd = vllm.build_command(shard(p, gpu_indices=[2, 3]), ctx("vllm"))
    assert cmd.argv == (
        "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct",
        "--served-model-name", "llama-8b",
        "--host", "0.0.0.0",
        "--port", "8001",
        "--tensor-parallel-size", "2",
        "--pipeline-parallel-size", "1",
        "--dtype", "bfloat16",
        "--quantization", "fp8",
        "--max-model-len", "16384",
        "--gpu-memory-utilization", "0.85",
        "--enable-prefix-caching", "--max-num-seqs", "128",
    )  # fmt: skip
    assert dict(cmd.env) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "2,3",
        "NCCL_DEBUG": "INFO",
    }


def test_vllm_defaults_leave_optional_flags_out() -> None:
    cmd = vllm.build_command(shard(profile()), ctx("vllm", host="10.0.0.7"))
    assert cmd.argv == (
        "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct",
        "--served-model-name", "meta-llama/Llama-3.1-8B-Instruct",
        "--host", "10.0.0.7",
        "--port", "8001",
        "--tensor-parallel-size", "1",
        "--pipeline-parallel-size", "1",
    )  # fmt: skip


def test_vllm_shutdown_timeout_is_below_the_sigkill_deadline() -> None:
    """The drain window ends before the supervisor's SIGKILL (stop_grace after SIGTERM), by
    max(2 s, 10%), so vLLM has time to shut its workers down after the last request."""
    cmd = vllm.build_command(
        shard(profile()), ctx("vllm", shutdown_timeout_seconds=30.0, engine_version="0.18.0")
    )
    assert cmd.argv[-2:] == ("--shutdown-timeout", "27")
    cmd = vllm.build_command(
        shard(profile()), ctx("vllm", shutdown_timeout_seconds=10.0, engine_version="0.18.0")
    )
    assert cmd.argv[-2:] == ("--shutdown-timeout", "8")
    # No window fits in 2 s: no flag (0 would mean "abort", the default anyway).
    cmd = vllm.build_command(
        shard(profile()), ctx("vllm", shutdown_timeout_seconds=2.0, engine_version="0.18.0")
    )
    assert "--shutdown-timeout" not in cmd.argv
    assert [base.drain_seconds(g) for g in (0, 1, 2, 3, 20, 30, 120)] == [0, 0, 0, 1, 18, 27, 108]
    assert vllm.STOP.graceful_flag == "--shutdown-timeout"
    assert vllm.STOP.drains_in_flight


def without_option(engine: str, version: str, flag: str) -> flagsets.FlagSet:
    """The committed flag set of engine version, less one option: a version that lacks it."""
    path = flagsets.DATA_DIR / flagsets.file_name(engine, version)
    doc = json.loads(path.read_text(encoding="utf-8"))
    doc["options"] = [o for o in doc["options"] if flag not in o["flags"]]
    return flagsets.parse_document(doc, f"{path} without {flag}")


def test_vllm_shutdown_timeout_only_where_the_version_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    older = without_option("vllm", "0.18.0", "--shutdown-timeout")
    monkeypatch.setattr(flagsets, "for_version", lambda engine, version: older)
    cmd = vllm.build_command(shard(profile()), ctx("vllm", shutdown_timeout_seconds=30.0))
    assert "--shutdown-timeout" not in cmd.argv


def test_vllm_older_than_every_flag_file_gets_no_shutdown_timeout() -> None:
    """A 0.17 node is checked against the oldest file (0.18.0), which has the flag; 0.17 has not,
    and would exit on it: the drain window is left out, the rest of the argv is built as usual."""
    old = vllm.build_command(
        shard(profile()), ctx("vllm", shutdown_timeout_seconds=30.0, engine_version="0.17.1")
    )
    assert "--shutdown-timeout" not in old.argv
    for version in ("0.18.0", "0.18.2", "0.33.0", ""):
        cmd = vllm.build_command(
            shard(profile()), ctx("vllm", shutdown_timeout_seconds=30.0, engine_version=version)
        )
        assert cmd.argv[-2:] == ("--shutdown-timeout", "27"), version


def test_the_key_goes_where_each_engine_takes_it_out_of_sight() -> None:
    """vLLM and the sim read VLLM_API_KEY, llama-server a key file, SGLang a --config YAML file: the
    key is on no command line, where ``ps`` would show it to every local user."""
    key = "k3y-of-the-shard"
    keys = ctx("x", key_dir="/var/lib/llmgw/keys/")
    for engine in ("vllm", "sim"):
        cmd = ENGINES[engine].build_command(shard(profile(engine), api_key=key), keys)
        assert key not in cmd.argv and "--api-key" not in cmd.argv
        assert cmd.env["VLLM_API_KEY"] == key and not cmd.files
    # The profile's env cannot replace the shard's key.
    p = profile(env={"VLLM_API_KEY": "operator"})
    assert vllm.build_command(shard(p, api_key=key), keys).env["VLLM_API_KEY"] == key

    cmd = llamacpp.build_command(shard(profile("llamacpp", model="m.gguf"), api_key=key), keys)
    i = cmd.argv.index("--api-key-file")
    assert cmd.argv[i + 1] == "/var/lib/llmgw/keys/s1.key" and key not in cmd.argv
    assert dict(cmd.files) == {"/var/lib/llmgw/keys/s1.key": f"{key}\n"}

    cmd = sglang.build_command(shard(profile("sglang"), api_key=key), keys)
    i = cmd.argv.index("--config")
    assert cmd.argv[i + 1] == "/var/lib/llmgw/keys/s1.yaml" and key not in cmd.argv
    assert dict(cmd.files) == {"/var/lib/llmgw/keys/s1.yaml": f'api-key: "{key}"\n'}
    # SGLang reads one --config: the operator's keeps the key on the command line.
    p = profile("sglang", extra_args=["--config", "/etc/sglang.yaml"])
    cmd = sglang.build_command(shard(p, api_key=key), keys)
    assert cmd.argv[cmd.argv.index("--api-key") + 1] == key and not cmd.files

    # A key file without a key directory is refused, not put on the command line instead.
    err = refusal(llamacpp.build_command, shard(profile("llamacpp", model="m.gguf"), api_key=key), ctx("x"))
    assert err.rule == "api-key" and "no key directory" in str(err)
    # No key, no option, no file.
    cmd = llamacpp.build_command(shard(profile("llamacpp", model="m.gguf")), keys)
    assert "--api-key-file" not in cmd.argv and not cmd.files
    assert "VLLM_API_KEY" not in vllm.build_command(shard(profile()), keys).env


def test_trtllm_refuses_a_key_it_cannot_enforce() -> None:
    err = refusal(trtllm.build_command, shard(profile("trtllm"), api_key="k"), ctx("trtllm-serve"))
    assert err.rule == "api-key"
    assert str(err).startswith("TensorRT-LLM 1.2.1: has no API-key option (--api-key), so the shard's key")
    trtllm.build_command(shard(profile("trtllm")), ctx("trtllm-serve"))


def test_deprecated_quantization_is_refused_in_vllms_words_unless_enabled() -> None:
    p = profile(quantization="fbgemm_fp8")
    err = refusal(vllm.build_command, shard(p), ctx("vllm", engine_version="0.18.0"))
    assert err.rule == "quantization"
    assert str(err).startswith(
        "vLLM 0.18.0: --quantization fbgemm_fp8 is deprecated and needs --allow-deprecated-quantization"
    )
    enabled = profile(quantization="fbgemm_fp8", extra_args=["--allow-deprecated-quantization"])
    cmd = vllm.build_command(shard(enabled), ctx("vllm", engine_version="0.18.0"))
    assert cmd.argv[-1] == "--allow-deprecated-quantization"
    # modelopt_mxfp8 was wrongly refused by the hand-typed list; 0.18.0 accepts it.
    vllm.build_command(shard(profile(quantization="modelopt_mxfp8")), ctx("vllm", engine_version="0.18.0"))


def test_sglang_quantization_per_version() -> None:
    p = profile("sglang", quantization="auto-round")
    err = refusal(sglang.build_command, shard(p), ctx("python", engine_version="0.5.4"))
    assert str(err).startswith("SGLang 0.5.4: --quantization auto-round is not one of its choices (awq, fp8,")
    cmd = sglang.build_command(shard(p), ctx("python", engine_version="0.5.10.post1"))
    assert cmd.argv[cmd.argv.index("--quantization") + 1] == "auto-round"
    # A version between two files gets the older file's flags (0.5.9 -> 0.5.4's).
    refusal(sglang.build_command, shard(p), ctx("python", engine_version="0.5.9"))


def test_unknown_extra_args_flag_is_refused_naming_flag_and_version() -> None:
    cases = [
        (
            vllm,
            profile(extra_args=["--no-such-flag"]),
            "vllm",
            "vLLM 0.18.0: unrecognized arguments: --no-such-flag",
        ),
        (
            sglang,
            profile("sglang", extra_args=["--max-num-seqs", "8"]),
            "python",
            "SGLang 0.5.4: unrecognized arguments: --max-num-seqs 8",
        ),
        (
            llamacpp,
            profile("llamacpp", model="m.gguf", extra_args=["--tp", "2"]),
            "llama-server",
            "llama.cpp b1: unrecognized arguments: --tp 2",
        ),
        (
            trtllm,
            profile("trtllm", extra_args=["--max-num-seqs", "8"]),
            "trtllm-serve",
            "TensorRT-LLM 1.2.1: unrecognized arguments: --max-num-seqs 8",
        ),
    ]
    for module, p, prefix, message in cases:
        err = refusal(module.build_command, shard(p), ctx(prefix))
        assert err.rule == "flags"
        assert str(err) == message
    err = refusal(vllm.build_command, shard(profile(extra_args=["--max-num-seqs", "many"])), ctx("vllm"))
    assert str(err) == "vLLM 0.18.0: argument --max-num-seqs: invalid int value: 'many'"


def multinode(p: schema.EngineProfile, rank: int) -> schema.StartShard:
    return spec(
        p,
        gpu_indices=[0, 1, 2, 3, 4, 5, 6, 7],
        nnodes=2,
        node_rank=rank,
        master_addr="10.1.0.5",
        master_port=29501,
    )


def test_vllm_multi_node_rank0_and_rank1() -> None:
    p = profile(tensor_parallel_size=8, pipeline_parallel_size=2, extra_args=["--enforce-eager"])
    head = (
        "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct",
        "--served-model-name", "meta-llama/Llama-3.1-8B-Instruct",
        "--host", "0.0.0.0",
        "--port", "8001",
        "--tensor-parallel-size", "8",
        "--pipeline-parallel-size", "2",
    )  # fmt: skip
    rank0 = vllm.build_command(ShardSpec.of(multinode(p, 0)), ctx("vllm"))
    assert rank0.argv == (
        *head,
        "--nnodes", "2", "--node-rank", "0", "--master-addr", "10.1.0.5", "--master-port", "29501",
        "--enforce-eager",
    )  # fmt: skip
    rank1 = vllm.build_command(ShardSpec.of(multinode(p, 1)), ctx("vllm"))
    assert rank1.argv == (
        *head,
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.1.0.5", "--master-port", "29501",
        "--headless",
        "--enforce-eager",
    )  # fmt: skip
    for cmd in (rank0, rank1):
        assert dict(cmd.env) == {
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
            "NCCL_SOCKET_IFNAME": "eth1",
            "GLOO_SOCKET_IFNAME": "eth1",
            "NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1",
        }


def test_vllm_readiness() -> None:
    p = profile(served_model_name="llama-8b")
    ready = vllm.ENGINE.readiness(shard(p))
    assert ready == Readiness(health_path="/health", models_path="/v1/models", model_name="llama-8b")
    assert ready.paths == ("/health", "/v1/models")
    assert vllm.ENGINE.readiness(ShardSpec.of(multinode(p, 0))).follow_rank0 is False
    rank1 = vllm.ENGINE.readiness(ShardSpec.of(multinode(p, 1)))
    assert rank1.follow_rank0 and rank1.paths == ()


def test_single_node_env_has_no_nccl_bootstrap() -> None:
    cmd = vllm.build_command(shard(profile()), ctx("vllm"))
    assert "NCCL_SOCKET_IFNAME" not in cmd.env


# ---------------------------------------------------------------------------------------------
# SGLang


def test_sglang_single_node_argv() -> None:
    p = profile(
        "sglang",
        served_model_name="llama-8b",
        tensor_parallel_size=2,
        dtype="bfloat16",
        quantization="fp8",
        max_model_len=32768,
        gpu_memory_utilization=0.8,
        extra_args=["--enable-metrics"],
    )
    cmd = sglang.build_command(
        shard(p, gpu_indices=[0, 1]), ctx(sys.executable, "-m", "sglang.launch_server")
    )
    assert cmd.argv == (
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", "meta-llama/Llama-3.1-8B-Instruct",
        "--served-model-name", "llama-8b",
        "--host", "0.0.0.0",
        "--port", "8001",
        "--tp-size", "2",
        "--pp-size", "1",
        "--dtype", "bfloat16",
        "--quantization", "fp8",
        "--context-length", "32768",
        "--mem-fraction-static", "0.8",
        "--enable-metrics",
    )  # fmt: skip
    assert dict(cmd.env) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1"}


def test_sglang_multi_node_rank0_and_rank1() -> None:
    p = profile("sglang", tensor_parallel_size=16)
    head = (
        "python3", "-m", "sglang.launch_server",
        "--model-path", "meta-llama/Llama-3.1-8B-Instruct",
        "--served-model-name", "meta-llama/Llama-3.1-8B-Instruct",
        "--host", "0.0.0.0",
        "--port", "8001",
        "--tp-size", "16",
        "--pp-size", "1",
    )  # fmt: skip
    for rank in (0, 1):
        cmd = sglang.build_command(
            ShardSpec.of(multinode(p, rank)), ctx("python3", "-m", "sglang.launch_server")
        )
        assert cmd.argv == (
            *head,
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
            "--dist-init-addr",
            "10.1.0.5:29501",
        )
        assert cmd.env["NCCL_IB_HCA"] == "mlx5_0:1,mlx5_1:1"
        assert cmd.env["GLOO_SOCKET_IFNAME"] == "eth1"
    assert sglang.ENGINE.readiness(ShardSpec.of(multinode(p, 0))).paths == ("/health", "/v1/models")
    assert sglang.ENGINE.readiness(ShardSpec.of(multinode(p, 1))) == Readiness.rank0()


def test_sglang_brackets_an_ipv6_master() -> None:
    s = multinode(profile("sglang", tensor_parallel_size=16), 1)
    s.master_addr = "fd00::5"
    cmd = sglang.build_command(ShardSpec.of(s), ctx("sglang"))
    assert cmd.argv[-2:] == ("--dist-init-addr", "[fd00::5]:29501")


# ---------------------------------------------------------------------------------------------
# llama.cpp


def test_llamacpp_gpu_argv_splits_by_memory() -> None:
    p = profile(
        "llamacpp", model="/models/qwen-7b-q4_k_m.gguf", served_model_name="qwen-7b", max_model_len=8192
    )
    node = (gpu(0, mib=24576), gpu(1, mib=49152))
    cmd = llamacpp.build_command(shard(p, gpu_indices=[0, 1]), ctx("llama-server", gpus=node))
    assert cmd.argv == (
        "llama-server",
        "-m", "/models/qwen-7b-q4_k_m.gguf",
        "--alias", "qwen-7b",
        "--host", "0.0.0.0",
        "--port", "8001",
        "--metrics",
        "-c", "32768",
        "-np", "4",
        "-ngl", "999",
        "--split-mode", "layer",
        "--tensor-split", "0.3333,0.6667",
        "--main-gpu", "0",
    )  # fmt: skip
    assert dict(cmd.env) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1"}


def test_llamacpp_row_split_for_tensor_parallel_and_no_split_when_sizes_unknown() -> None:
    p = profile("llamacpp", model="m.gguf", tensor_parallel_size=2)
    cmd = llamacpp.build_command(shard(p, gpu_indices=[0, 1]), ctx("llama-server"))
    assert cmd.argv[-5:] == ("-ngl", "999", "--split-mode", "row", "--main-gpu", "0")[-5:]
    assert "--tensor-split" not in cmd.argv


def test_llamacpp_cpu_argv() -> None:
    p = profile("llamacpp", model="m.gguf", extra_args=["--threads", "8"])
    cmd = llamacpp.build_command(shard(p, gpu_indices=[]), ctx("llama-server", host="127.0.0.1"))
    assert cmd.argv == (
        "llama-server", "-m", "m.gguf", "--alias", "m.gguf", "--host", "127.0.0.1", "--port", "8001",
        "--metrics", "-np", "4", "-ngl", "0", "--threads", "8",
    )  # fmt: skip
    assert dict(cmd.env) == {"CUDA_VISIBLE_DEVICES": ""}


def test_llamacpp_readiness_and_stop() -> None:
    ready = llamacpp.ENGINE.readiness(shard(profile("llamacpp", model="m.gguf", served_model_name="qwen")))
    # /v1/models is read after /health passes: the id it lists is the --alias, the served name.
    assert ready.paths == ("/health", "/v1/models") and ready.loading_statuses == (503,)
    assert ready.model_name == "qwen"
    # llama-server cuts open streams on SIGTERM: the supervisor drains it through /metrics instead.
    assert not llamacpp.STOP.drains_in_flight and llamacpp.STOP.graceful_flag == ""
    assert "/metrics" in llamacpp.STOP.note


# ---------------------------------------------------------------------------------------------
# TensorRT-LLM


def test_trtllm_argv() -> None:
    p = profile(
        "trtllm",
        tensor_parallel_size=2,
        max_model_len=8192,
        gpu_memory_utilization=0.85,
        extra_args=["--max_batch_size", "64"],
    )
    cmd = trtllm.build_command(shard(p, gpu_indices=[4, 5]), ctx("trtllm-serve"))
    assert cmd.argv == (
        "trtllm-serve", "serve", "meta-llama/Llama-3.1-8B-Instruct",
        "--host", "0.0.0.0",
        "--port", "8001",
        "--backend", "pytorch",
        "--tp_size", "2",
        "--pp_size", "1",
        "--max_seq_len", "8192",
        "--kv_cache_free_gpu_memory_fraction", "0.85",
        "--max_batch_size", "64",
    )  # fmt: skip
    assert dict(cmd.env) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "4,5"}
    ready = trtllm.ENGINE.readiness(shard(p))
    assert ready.paths == ("/health", "/v1/models")
    assert ready.model_name == "meta-llama/Llama-3.1-8B-Instruct"


# ---------------------------------------------------------------------------------------------
# sim


def test_sim_speaks_the_vllm_argv() -> None:
    p = profile("sim", served_model_name="demo", extra_args=["--enable-prefix-caching"])
    s = shard(p, gpu_indices=[])
    cmd = sim.build_command(s, ctx(*sim.ARGV_PREFIX))
    assert cmd.argv == (
        *sim.ARGV_PREFIX, "serve", "meta-llama/Llama-3.1-8B-Instruct",
        "--served-model-name", "demo",
        "--host", "0.0.0.0",
        "--port", "8001",
        "--tensor-parallel-size", "1",
        "--pipeline-parallel-size", "1",
        "--enable-prefix-caching",
    )  # fmt: skip
    assert cmd.argv[len(sim.ARGV_PREFIX) :] == vllm.build_command(s, ctx("x")).argv[1:]
    assert dict(cmd.env) == {}
    assert sim.ENGINE.readiness(s).paths == ("/health", "/v1/models")


def test_sim_accepts_a_cpu_only_node_and_checks_gpus_when_given() -> None:
    sim.validate(profile("sim", tensor_parallel_size=4), [])
    err = refusal(sim.validate, profile("sim", tensor_parallel_size=4), gpus(2))
    assert str(err) == "tensor_parallel_size 4 x pipeline_parallel_size 1 needs 4 GPUs, 2 given (indices 0-1)"


# ---------------------------------------------------------------------------------------------
# Refusal rules


def test_required_fields() -> None:
    err = refusal(vllm.validate, profile(model=""), gpus(1))
    assert (err.rule, str(err)) == (
        "required",
        "profile.model is required (a model path or Hugging Face repo id)",
    )
    err = refusal(vllm.validate, profile(engine=""), gpus(1))
    assert str(err) == "profile.engine is required (this is the vllm adapter)"
    err = refusal(plan, schema.StartShard(shard_id="s", http_port=1), [], ctx("x"))
    assert str(err) == "StartShard.profile is required"


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_every_engine_refuses_a_start_without_a_served_name(engine: str) -> None:
    """The control plane names the model; no adapter falls back to ``profile.model``."""
    p = profile(engine, served_model_name="", model="/models/m.gguf" if engine == "llamacpp" else "m")
    err = refusal(ENGINES[engine].validate, p, gpus(1))
    assert err.rule == "served-model-name"
    assert str(err).startswith("profile.served_model_name is required: the control plane always sets")
    err = refusal(plan, spec(p), gpus(1), ctx("x"))
    assert err.rule == "served-model-name"


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp", "trtllm", "sim"])
def test_every_openai_engine_checks_v1_models_for_the_served_name(engine: str) -> None:
    model = "/models/m.gguf" if engine == "llamacpp" else "m"
    ready = ENGINES[engine].readiness(shard(profile(engine, model=model, served_model_name=model)))
    assert ready.paths == ("/health", "/v1/models") and ready.model_name == model


def test_parallel_fit_single_node() -> None:
    err = refusal(vllm.validate, profile(tensor_parallel_size=8), gpus(4))
    assert err.rule == "parallel-fit"
    assert str(err) == "tensor_parallel_size 8 x pipeline_parallel_size 1 needs 8 GPUs, 4 given (indices 0-3)"
    err = refusal(
        sglang.validate, profile("sglang", tensor_parallel_size=2), [gpu(0), gpu(2), gpu(3), gpu(5)]
    )
    assert (
        str(err)
        == "tensor_parallel_size 2 x pipeline_parallel_size 1 needs 2 GPUs, 4 given (indices 0,2-3,5)"
    )


def test_parallel_fit_multi_node() -> None:
    vllm.validate(profile(tensor_parallel_size=8, pipeline_parallel_size=2), gpus(8), nnodes=2)
    err = refusal(vllm.validate, profile(tensor_parallel_size=8, pipeline_parallel_size=2), gpus(4), nnodes=2)
    assert str(err) == (
        "tensor_parallel_size 8 x pipeline_parallel_size 2 needs 16 GPUs across 2 nodes (8 per node), "
        "4 given on this node (indices 0-3), 8 in all"
    )


def test_gpu_engines_refuse_a_cpu_only_node() -> None:
    for module in (vllm, sglang, trtllm):
        err = refusal(module.validate, profile(module.NAME), [])
        assert str(err) == f"{module.NAME} needs at least one GPU; 0 given (a CPU-only node?)"


def test_bf16_needs_ampere() -> None:
    v100 = gpu(1, cc=(7, 0), mib=32768, name="Tesla V100-SXM2-32GB")
    err = refusal(vllm.validate, profile(dtype="bfloat16", tensor_parallel_size=2), [gpu(0), v100])
    assert err.rule == "compute-capability"
    assert str(err) == (
        "dtype bfloat16 needs compute capability 8.0+ on every GPU; GPU 1 (Tesla V100-SXM2-32GB) has 7.0"
    )
    vllm.validate(profile(dtype="float16"), [v100])


def test_fp8_needs_ada_or_hopper() -> None:
    a100 = gpu(0, cc=(8, 0), name="NVIDIA A100-SXM4-80GB")
    err = refusal(sglang.validate, profile("sglang", quantization="fp8"), [a100])
    assert str(err) == (
        "quantization fp8 needs compute capability 8.9+ on every GPU; GPU 0 (NVIDIA A100-SXM4-80GB) has 8.0"
    )
    err = refusal(trtllm.validate, profile("trtllm", quantization="FP8_BLOCK_SCALES"), [a100])
    assert "needs compute capability 8.9+" in str(err)
    vllm.validate(profile(quantization="fp8"), [gpu(0, cc=(8, 9), name="NVIDIA L40S")])


def test_unsupported_quantization_per_engine() -> None:
    err = refusal(vllm.build_command, shard(profile(quantization="exl2")), ctx("vllm"))
    assert err.rule == "quantization"
    assert str(err).startswith("vLLM 0.18.0: --quantization exl2 is not one of its choices (awq, fp8, ")
    err = refusal(sglang.build_command, shard(profile("sglang", quantization="fbgemm_fp8")), ctx("python"))
    assert str(err).startswith("SGLang 0.5.4: --quantization fbgemm_fp8 is not one of its choices (awq,")
    err = refusal(llamacpp.validate, profile("llamacpp", quantization="awq"), [])
    assert str(err).startswith("quantization 'awq' is not a GGUF type llama.cpp loads; choices: gguf, F32,")
    err = refusal(trtllm.validate, profile("trtllm", quantization="gguf"), gpus(1))
    assert str(err).startswith("quantization 'gguf' is not a TensorRT-LLM 1.2 QuantAlgo; choices: w8a16,")
    llamacpp.validate(profile("llamacpp", quantization="q4_k_m"), [])
    trtllm.validate(profile("trtllm", quantization="NVFP4"), gpus(1))


def test_unsupported_dtype() -> None:
    err = refusal(vllm.build_command, shard(profile(dtype="fp8")), ctx("vllm"))
    assert str(err) == (
        "vLLM 0.18.0: --dtype fp8 is not one of its choices (auto, bfloat16, float, float16, float32, half)"
    )
    err = refusal(llamacpp.validate, profile("llamacpp", dtype="bfloat16"), [])
    assert str(err).startswith(
        "dtype 'bfloat16' has no llama.cpp flag: a GGUF file fixes its own weight types"
    )
    err = refusal(trtllm.validate, profile("trtllm", dtype="bfloat16"), gpus(1))
    assert str(err).startswith("dtype 'bfloat16' has no trtllm-serve 1.2 flag")


def test_memory_fit() -> None:
    small = gpu(0, cc=(8, 9), mib=16384, name="NVIDIA RTX 4080")
    err = refusal(vllm.validate, profile(dtype="bfloat16", params_billions=8), [small])
    assert err.rule == "memory-fit"
    assert str(err) == (
        "model weights need about 14.9 GiB (8B params x 2 bytes, bfloat16), more than the 13.4 GiB "
        "this shard can give them: 1 GPU x 16.0 GiB x gpu_memory_utilization 0.9 = 14.4 GiB, "
        "less 1.0 GiB headroom per GPU"
    )
    # 4-bit weights fit where 16-bit ones do not.
    vllm.validate(profile(quantization="awq", params_billions=8), [small])
    # 70B in bf16 over two nodes of 8 x 80 GB: this node's half fits easily.
    vllm.validate(profile(tensor_parallel_size=16, params_billions=70), gpus(8), nnodes=2)
    err = refusal(
        sglang.validate, profile("sglang", tensor_parallel_size=4, params_billions=405), gpus(2), nnodes=2
    )
    assert str(err) == (
        "model weights need about 754.4 GiB (405B params x 2 bytes, 16-bit weights assumed for dtype auto), "
        "this node's 1/2 share is 377.2 GiB, more than the 133.4 GiB this shard can give them: "
        "2 GPUs x 79.6 GiB x mem_fraction_static 0.85 = 135.4 GiB, less 1.0 GiB headroom per GPU"
    )


def test_memory_fit_is_skipped_when_unknown() -> None:
    small = [gpu(0, mib=8192)]
    vllm.validate(profile(params_billions=0), small)  # size unknown
    vllm.validate(profile(quantization="compressed-tensors", params_billions=8), small)  # width unknown
    llamacpp.validate(profile("llamacpp", params_billions=70), [])  # CPU: system RAM is not ours to judge


def test_bytes_per_param() -> None:
    assert bytes_per_param(profile(dtype="float32")) == (4.0, "float32")
    assert bytes_per_param(profile(quantization="Q8_0")) == (1.0, "8-bit Q8_0")
    assert bytes_per_param(profile(quantization="IQ3_XS")) == (0.375, "3-bit IQ3_XS")
    assert bytes_per_param(profile(quantization="gptq_marlin")) == (0.5, "4-bit gptq_marlin")
    assert bytes_per_param(profile(quantization="w8a8_int8")) == (1.0, "8-bit w8a8_int8")
    assert bytes_per_param(profile(quantization="quark")) is None


def test_env_may_not_move_the_gpus() -> None:
    err = refusal(vllm.validate, profile(env={"CUDA_VISIBLE_DEVICES": "0,1"}), gpus(1))
    assert str(err) == (
        "profile.env may not set CUDA_VISIBLE_DEVICES ('0,1'): the agent assigns each shard its GPUs"
    )


def test_gpu_memory_utilization_range() -> None:
    err = refusal(vllm.validate, profile(gpu_memory_utilization=1.5), gpus(1))
    assert str(err) == "gpu_memory_utilization must be in (0, 1], or 0 for the engine's default; got 1.5"


def test_llamacpp_rules() -> None:
    llamacpp.validate(profile("llamacpp", model="m.gguf"), [])
    llamacpp.validate(profile("llamacpp", model="m.gguf"), gpus(3))  # one model over every GPU
    err = refusal(llamacpp.validate, profile("llamacpp", tensor_parallel_size=2), [])
    assert str(err).startswith(
        "tensor_parallel_size 2 x pipeline_parallel_size 1 needs 2 GPUs, 0 given (indices none)"
    )
    err = refusal(llamacpp.validate, profile("llamacpp"), gpus(1), nnodes=2)
    assert err.rule == "multi-node"
    assert str(err).startswith(
        "llamacpp cannot run across 2 nodes here: llama-server has no multi-node launcher"
    )


def test_trtllm_rules() -> None:
    err = refusal(trtllm.validate, profile("trtllm", served_model_name="llama"), gpus(1))
    assert str(err) == (
        "served_model_name 'llama' cannot be honoured: trtllm-serve 1.2 has no flag for it and serves the "
        "model as 'meta-llama/Llama-3.1-8B-Instruct'"
    )
    # A local checkpoint directory is listed under its base name (openai_server.py: Path(model).name).
    local = profile("trtllm", model="/models/llama-8b/", served_model_name="llama-8b")
    trtllm.validate(local, gpus(1))
    err = refusal(
        trtllm.validate, profile("trtllm", model="/models/llama-8b", served_model_name="x"), gpus(1)
    )
    assert str(err).endswith("serves the model as '/models/llama-8b' or 'llama-8b'")
    # The KV-cache fraction applies after the weights, so it does not shrink the weights' budget.
    trtllm.validate(profile("trtllm", params_billions=8, gpu_memory_utilization=0.1), gpus(1))
    err = refusal(trtllm.validate, profile("trtllm", params_billions=70), gpus(1))
    assert str(err).endswith("1 GPU x 79.6 GiB x weights share 1 = 79.6 GiB, less 1.0 GiB headroom per GPU")
    err = refusal(trtllm.validate, profile("trtllm", tensor_parallel_size=16), gpus(8), nnodes=2)
    assert err.rule == "multi-node"
    assert "needs an MPI launcher" in str(err)


# ---------------------------------------------------------------------------------------------
# plan(): what the supervisor calls


def test_plan_validates_and_builds() -> None:
    node = gpus(4)
    s = spec(profile(tensor_parallel_size=2, served_model_name="m"), gpu_indices=[3, 1])
    launch = plan(s, node, ctx("vllm"))
    assert launch.engine == "vllm"
    assert launch.command.env["CUDA_VISIBLE_DEVICES"] == "3,1"
    assert launch.readiness.model_name == "m"
    # No --shutdown-timeout here (no stop grace given): SIGTERM aborts, so it does not drain itself.
    assert "--shutdown-timeout" not in launch.command.argv
    assert launch.stop == attrs.evolve(vllm.STOP, drains_in_flight=False)
    graceful = plan(s, node, ctx("vllm", shutdown_timeout_seconds=30.0, engine_version="0.18.0"))
    assert "--shutdown-timeout" in graceful.command.argv and graceful.stop is vllm.STOP


def test_plan_refuses_before_launch() -> None:
    node = gpus(4)
    err = refusal(plan, spec(profile(tensor_parallel_size=2), gpu_indices=[3, 7]), node, ctx("vllm"))
    assert str(err) == "gpu_indices 7 do not exist on this node (it has 0-3)"
    err = refusal(plan, spec(profile(tensor_parallel_size=2), gpu_indices=[1, 1]), node, ctx("vllm"))
    assert str(err) == "gpu_indices [1, 1] name a GPU twice"
    err = refusal(plan, spec(profile(tensor_parallel_size=4), gpu_indices=[0, 1]), node, ctx("vllm"))
    assert err.rule == "parallel-fit"
    err = refusal(plan, spec(profile("tgi")), node, ctx("x"))
    assert err.rule == "engine"


def test_check_spec_multi_node_fields() -> None:
    p = profile(tensor_parallel_size=16)
    s = multinode(p, 1)
    check_spec(s)
    s.master_addr = ""
    assert (
        str(refusal(check_spec, s))
        == "a 2-node shard needs master_addr and master_port (got no address:29501)"
    )
    s = multinode(p, 2)
    assert str(refusal(check_spec, s)) == "node_rank 2 is outside nnodes 2"
    assert (
        str(refusal(check_spec, spec(p, http_port=0)))
        == "http_port is required (the port the engine serves on)"
    )


def test_select_gpus_keeps_spec_order() -> None:
    assert [g.index for g in select_gpus(gpus(4), [2, 0])] == [2, 0]


def test_readiness_model_listed() -> None:
    ready = Readiness(models_path="/v1/models", model_name="m")
    assert ready.model_listed(b'{"object":"list","data":[{"id":"x"},{"id":"m"}]}')
    assert not ready.model_listed(b'{"object":"list","data":[{"id":"x"}]}')
    assert not ready.model_listed(b"<html>loading</html>")
    assert not ready.model_listed(b'{"error":{"code":503}}')
    # A well-formed list is an answer ("serves x"); anything else says nothing about names.
    assert listed_names(b'{"object":"list","data":[{"id":"x"},{"id":"m"}]}') == ("x", "m")
    assert listed_names(b'{"object":"list","data":[]}') == ()
    assert listed_names(b"<html>loading</html>") is None
    assert listed_names(b'{"error":{"code":503}}') is None
    assert listed_names(b'{"data":{"id":"m"}}') is None


def test_format_indices() -> None:
    assert format_indices([]) == "none"
    assert format_indices([3, 0, 1, 2]) == "0-3"
    assert format_indices([0, 2, 3, 5, 7, 8]) == "0,2-3,5,7-8"


def test_launch_context_needs_a_binary() -> None:
    with pytest.raises(ValueError):
        LaunchContext(argv_prefix=())


def test_a_value_starting_with_a_dash_is_refused_before_the_engine_reads_it_as_an_option() -> None:
    err = refusal(vllm.build_command, shard(profile(served_model_name="-chat")), ctx("vllm"))
    assert err.rule == "served_model_name"
    assert str(err) == (
        "vLLM 0.18.0: served_model_name '-chat' starts with '-', so the engine would read it as an "
        "option; use a value that does not (a path can start with ./)"
    )
    err = refusal(llamacpp.build_command, shard(profile("llamacpp", model="m.gguf"), api_key="-k"), ctx("x"))
    assert err.rule == "api_key"
