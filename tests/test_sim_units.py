"""The simulator's pure parts: reading vLLM's command line and the knobs, and what it generates."""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing

from agent.engines import flagsets
from agent.engines.sim import generate
from agent.engines.sim.config import EngineUsageError, SimUsageError, parse_command_line


def test_vllm_command_line_is_understood() -> None:
    argv = [
        "serve", "org/model", "--served-model-name", "m", "m-alias",
        "--host", "127.0.0.1", "--port", "9000",
        "--tensor-parallel-size", "2", "-pp", "2",
        "--dtype", "bfloat16", "-q", "fp8", "--max-model-len", "4096",
        "--gpu-memory-utilization", "0.8",
        "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29600",
        "--headless", "--shutdown-timeout", "15",
    ]  # fmt: skip
    c = parse_command_line(argv, {})
    assert c.model == "org/model"
    assert c.served_model_names == ("m", "m-alias") and c.served_model_name == "m"
    assert (c.host, c.port) == ("127.0.0.1", 9000)
    assert (c.tensor_parallel_size, c.pipeline_parallel_size) == (2, 2)
    assert (c.dtype, c.quantization, c.max_model_len, c.gpu_memory_utilization) == (
        "bfloat16",
        "fp8",
        4096,
        0.8,
    )
    assert (c.nnodes, c.node_rank, c.master_addr, c.master_port) == (2, 1, "10.0.0.1", 29600)
    assert c.headless and c.shutdown_timeout == 15
    assert c.ignored == ()


def test_unknown_vllm_flags_are_kept_for_the_note() -> None:
    c = parse_command_line(["serve", "m", "--enforce-eager", "--max-num-seqs", "64", "--seed", "3"], {})
    assert c.model == "m"
    assert c.ignored == ("--enforce-eager", "--seed", "3")
    assert c.max_num_seqs == 64


def test_model_flag_and_positional() -> None:
    c = parse_command_line(["--model", "m", "--seed", "64"], {})
    assert c.model == "m"
    assert c.ignored == ("--seed", "64")
    # vLLM's serve takes the positional over --model.
    assert parse_command_line(["serve", "p", "--model", "m"], {}).model == "p"


def test_only_the_imitated_vllm_flags_are_accepted() -> None:
    """Strict like vLLM: no flag outside its flag file, no abbreviation, argparse's words (after
    vLLM's underscore-to-dash spelling), exit status 2; the version imitated is the newest file or the one asked."""
    newest = flagsets.available("vllm")[-1]
    assert parse_command_line(["m"], {}).vllm_version == newest
    assert parse_command_line(["m"], {"LLMGW_SIM_VLLM_VERSION": "0.18.2"}).vllm_version == "0.18.0"
    for argv, message in [
        (["serve", "m", "--bogus"], "vllm serve: error: unrecognized arguments: --bogus"),
        (["m", "--max-model"], "vllm serve: error: unrecognized arguments: --max-model"),
        (["m", "--max_num_seqz", "4"], "vllm serve: error: unrecognized arguments: --max-num-seqz 4"),
        (
            ["m", "--dtype", "fp4"],
            "vllm serve: error: argument --dtype: invalid choice: 'fp4' (choose from 'auto', ",
        ),
        (["m", "-q", "gguf"], "vllm serve: error: argument --quantization/-q: invalid choice: 'gguf'"),
        (["m", "--port"], "vllm serve: error: argument --port: expected one argument"),
    ]:
        with pytest.raises(EngineUsageError) as caught:
            parse_command_line(argv, {"LLMGW_SIM_VLLM_VERSION": "0.33.0"})
        assert str(caught.value).startswith(message), (argv, str(caught.value))
        assert caught.value.exit_code == 2 and caught.value.usage == "usage: vllm serve [model_tag] [options]"
    # vLLM's own spelling rule: underscores for dashes in a flag's name.
    assert parse_command_line(["m", "--max_model_len", "1K", "--api_key=k"], {}).max_model_len == 1024
    # 0.18.0 still had gguf.
    assert (
        parse_command_line(["m", "-q", "gguf"], {"LLMGW_SIM_VLLM_VERSION": "0.18.0"}).quantization == "gguf"
    )


def test_deprecated_quantization_needs_its_flag_and_exits_1() -> None:
    env = {"LLMGW_SIM_VLLM_VERSION": "0.18.0"}
    with pytest.raises(EngineUsageError) as caught:
        parse_command_line(["m", "-q", "fbgemm_fp8"], env)
    assert caught.value.exit_code == 1
    assert str(caught.value) == (
        "ValueError: vLLM 0.18.0: --quantization fbgemm_fp8 is deprecated and needs --allow-deprecated-quantization"
    )
    c = parse_command_line(["m", "-q", "fbgemm_fp8", "--allow-deprecated-quantization"], env)
    assert c.quantization == "fbgemm_fp8"
    with pytest.raises(EngineUsageError):
        parse_command_line(
            [
                "m",
                "-q",
                "fbgemm_fp8",
                "--allow-deprecated-quantization",
                "--no-allow-deprecated-quantization",
            ],
            env,
        )


def test_api_keys_from_the_flag_or_vllms_variable() -> None:
    assert parse_command_line(["m", "--api-key", "a", "b"], {}).api_keys == ("a", "b")
    assert parse_command_line(["m"], {"VLLM_API_KEY": "v"}).api_keys == ("v",)
    assert parse_command_line(["m", "--api-key", "a"], {"VLLM_API_KEY": "v"}).api_keys == ("a",)
    assert parse_command_line(["m"], {}).api_keys == ()
    # vLLM drops an empty variable: no key, an open API.
    assert parse_command_line(["m"], {"VLLM_API_KEY": ""}).api_keys == ()
    assert parse_command_line(["m", "--max-model-len", "32k"], {}).max_model_len == 32000


def test_no_model_is_a_usage_error() -> None:
    with pytest.raises(SimUsageError, match="no model given"):
        parse_command_line(["serve", "--port", "1"], {})
    with pytest.raises(SimUsageError, match="--port: invalid int value"):
        parse_command_line(["serve", "m", "--port", "x"], {})


def test_knobs_flags_win_over_environment() -> None:
    env = {
        "LLMGW_SIM_LOAD_SECONDS": "3",
        "LLMGW_SIM_TTFT_MS": "7",
        "LLMGW_SIM_ITL_MS": "2",
        "LLMGW_SIM_EXIT_AFTER": "9",
        "LLMGW_SIM_EXIT_CODE": "4",
        "LLMGW_SIM_HANG": "requests,sigterm",
        "LLMGW_SIM_MAX_TOKENS": "5",
        "LLMGW_SIM_FAIL_LOADING": "1",
    }
    c = parse_command_line(["m"], env)
    assert (c.load_seconds, c.ttft_ms, c.itl_ms, c.exit_after, c.exit_code) == (3, 7, 2, 9, 4)
    assert c.hang == frozenset({"requests", "sigterm"})
    assert c.default_max_tokens == 5
    assert "CUDA out of memory" in c.fail_loading
    c = parse_command_line(
        ["m", "--sim-load-seconds", "0", "--sim-hang", "loading", "--sim-fail-loading", "boom"], env
    )
    assert c.load_seconds == 0 and c.hang == frozenset({"loading"}) and c.fail_loading == "boom"


def test_bad_knobs_name_the_variable() -> None:
    with pytest.raises(SimUsageError, match="LLMGW_SIM_TTFT_MS='fast' is not a number"):
        parse_command_line(["m"], {"LLMGW_SIM_TTFT_MS": "fast"})
    with pytest.raises(SimUsageError, match="LLMGW_SIM_HANG='forever': 'forever' is not a hang point"):
        parse_command_line(["m"], {"LLMGW_SIM_HANG": "forever"})
    assert parse_command_line(["m"], {"LLMGW_SIM_HANG": "1"}).hang == frozenset({"loading"})


def test_tokens_are_deterministic_per_prompt() -> None:
    a = generate.completion_tokens("hello", 8)
    assert a == generate.completion_tokens("hello", 8)
    assert a != generate.completion_tokens("goodbye", 8)
    assert a[0][0].isupper() and all(t.startswith(" ") for t in a[1:])
    assert generate.completion_tokens("hello", 3) == a[:3]


def test_plan_honours_max_tokens_and_context() -> None:
    prompt = generate.chat_prompt({"messages": [{"role": "user", "content": "one two three"}]})
    assert prompt.tokens == 3 + generate.CHAT_TOKENS_PER_MESSAGE
    p = generate.plan(prompt, 5, 16, 8192)
    assert (p.completion_tokens, p.finish_reason) == (5, "length")
    assert p.usage() == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    p = generate.plan(prompt, None, 16, 8192)
    assert (p.completion_tokens, p.finish_reason) == (16, "stop")
    with pytest.raises(generate.BadRequest, match="max_tokens 10 is too large"):
        generate.plan(prompt, 10, 16, 12)


def test_request_validation() -> None:
    with pytest.raises(generate.BadRequest, match="messages must be a non-empty list"):
        generate.chat_prompt({"messages": []})
    with pytest.raises(generate.BadRequest, match="max_tokens must be a positive integer"):
        generate.requested_max_tokens({"max_tokens": 0})
    assert generate.requested_max_tokens({"max_completion_tokens": 3, "max_tokens": 9}) == 3
    parts = [{"type": "text", "text": "a b"}, {"type": "image_url", "image_url": {}}]
    assert generate.chat_prompt({"messages": [{"role": "user", "content": parts}]}).tokens == 2 + 4
    assert generate.completion_prompt({"prompt": [1, 2, 3]}).tokens == 3
    assert generate.completion_prompt({"prompt": ["x y"]}).tokens == 2


def test_stream_events_are_openai_chunks() -> None:
    plan = generate.Plan(tokens=("Hi", " there"), finish_reason="length", prompt_tokens=4)
    shape = generate.Shape(chat=True, request_id="chatcmpl-1", created=7, model="m")
    events = list(shape.stream(plan, include_usage=True))
    assert [is_token for _, is_token in events] == [False, True, True, False, False, False]
    assert events[-1][0] == b"data: [DONE]\n\n"
    docs = [json.loads(e[len(b"data: ") :]) for e, _ in events[:-1]]
    assert docs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [d["choices"][0]["delta"].get("content") for d in docs[1:3]] == ["Hi", " there"]
    assert docs[3]["choices"][0]["finish_reason"] == "length"
    assert docs[4]["choices"] == [] and docs[4]["usage"]["total_tokens"] == 6
    assert all(d["object"] == "chat.completion.chunk" and d["model"] == "m" for d in docs)

    shape = generate.Shape(chat=False, request_id="cmpl-1", created=7, model="m")
    docs = [json.loads(e[len(b"data: ") :]) for e, _ in list(shape.stream(plan, include_usage=False))[:-1]]
    assert [d["choices"][0]["text"] for d in docs] == ["Hi", " there", ""]
    assert shape.full_response(plan)["choices"][0]["text"] == "Hi there"


def test_engine_loop_sleeps_while_idle_and_steps_once_a_request_comes() -> None:
    """An idle engine keeps no timer (the step loop waits on an event, never wakes every ITL for
    nothing); a request gets its first token after its prefill step and each later one a decode
    step later, never sooner than the base step time (--sim-itl-ms, times the time scale)."""
    from agent.engines.sim.engine import EngineLoop
    from agent.engines.sim.scheduler import Request

    config = parse_command_line(["m"], {"LLMGW_SIM_ITL_MS": "20", "LLMGW_SIM_TIME_SCALE": "2"})

    async def main() -> tuple[float, list[float]]:
        engine = EngineLoop(config, lambda _: None, {"PYTHONHASHSEED": "0"})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.run)
            await trio.testing.wait_all_tasks_blocked()
            idle = trio.lowlevel.current_statistics().seconds_to_next_deadline
            ticket = engine.submit(Request("r", (1, 2, 3), (4, 5, 6)), trio.current_time())
            gaps = []
            for n in (1, 2, 3):
                before = trio.current_time()
                await ticket.wait(n)
                gaps.append(trio.current_time() - before)
            engine.release(ticket)
            nursery.cancel_scope.cancel()
        return idle, gaps

    idle, gaps = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert idle == float("inf")
    assert all(gap >= 0.040 for gap in gaps), gaps
