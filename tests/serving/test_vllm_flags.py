"""`l3worker serve`'s command line as a vLLM user types it, parsed without starting anything: vLLM's
flag names and spellings, the ones l3worker lacks refused by name with the subcommand's usage, the
help grouped with every default shown, and what the flags become for the worker and the server."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from l3worker.serving.cli import _serve_parser, _worker_kwargs, build_parser, parse_serve_args, serve_options
from l3worker.serving.launcher import DataParallel
from l3worker.serving.vllm_flags import VLLM_SERVE_FLAGS

SERVE_USAGE = "usage: l3worker serve"


def refused(capsys, *argv: str) -> str:
    """parse_serve_args(["serve", *argv]) must exit 2; returns stderr."""
    with pytest.raises(SystemExit) as e:
        parse_serve_args(["serve", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    return err


@pytest.mark.parametrize("argv,flag", [
    (["--swap-space", "4"], "--swap-space"),
    (["--swap_space=4"], "--swap-space"),  # vLLM's underscore spelling, with =value
    (["--enable-lora-bias"], "--enable-lora-bias"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill"),  # the --no- form of a vLLM boolean
    (["-pp", "2"], "-pp"),
    (["-O3"], "-O"),
    (["--config", "serve.yaml"], "--config"),
    (["/some/model", "--pipeline-parallel-size", "2"], "--pipeline-parallel-size"),
])
def test_a_vllm_flag_l3worker_lacks_exits_2_naming_it(capsys, argv, flag) -> None:
    err = refused(capsys, *argv)
    assert err.startswith(SERVE_USAGE) and f"error: l3worker does not support {flag}\n" in err


def test_an_unknown_flag_gets_argparses_error_with_the_subcommands_usage(capsys) -> None:
    err = refused(capsys, "--no-such-flag")
    assert err.startswith(SERVE_USAGE) and "error: unrecognized arguments: --no-such-flag" in err
    err = refused(capsys, "--max-num-seqs", "many")
    assert err.startswith(SERVE_USAGE) and "argument --max-num-seqs: invalid int value: 'many'" in err
    err = refused(capsys, "--kv-cache-memory-bytes", "lots")
    assert "argument --kv-cache-memory-bytes: expected a number such as 4096, 32k or 32K, got 'lots'" in err


def test_every_vllm_serve_flag_is_implemented_or_refused_by_name(capsys) -> None:
    serve = _serve_parser(build_parser())
    supported = {s for a in serve._actions for s in a.option_strings}
    for flag in sorted(VLLM_SERVE_FLAGS - supported):
        err = refused(capsys, flag)
        assert f"l3worker does not support {flag}" in err, (flag, err)
    # and the ones implemented parse as vLLM spells them
    assert {"--model", "--gpu-memory-utilization", "--trust-remote-code", "--enforce-eager", "--kv-cache-dtype",
            "--seed", "--max-logprobs", "--chat-template", "--response-role", "--enable-log-requests",
            "--disable-log-stats", "--root-path", "--allowed-origins", "--allow-credentials", "--allowed-methods",
            "--allowed-headers", "--ssl-keyfile", "--ssl-certfile", "--generation-config",
            "--served-model-name"} <= supported


def test_vllm_spellings_and_values_parse() -> None:
    args = parse_serve_args(["serve", "--model", "Qwen/Qwen3-0.6B", "--max_model_len=32k", "--gpu-memory-utilization",
                             "0.5", "--trust-remote-code", "--enforce-eager", "--kv-cache-dtype", "auto", "--seed",
                             "3", "--max-logprobs", "5", "--served-model-name", "a", "b", "--allowed-origins",
                             '["https://x.example"]', "--allow-credentials", "-q", "fp8", "--api-key", "k1", "k2"])
    assert args.model_dir == "Qwen/Qwen3-0.6B" and args.max_model_len == 32000
    assert parse_serve_args(["serve", "--max-model-len", "32K"]).max_model_len == 32768
    assert (args.gpu_memory_utilization, args.trust_remote_code, args.enforce_eager, args.seed) == (0.5, True, True, 3)
    assert args.quantization == "fp8" and args.served_model_name == ["a", "b"]
    options = serve_options(args)
    assert options.served_model_names == ("a", "b") and options.api_key == ["k1", "k2"]
    assert options.allowed_origins == ("https://x.example",) and options.allow_credentials
    assert (options.seed, options.max_logprobs) == (3, 5)
    same = parse_serve_args(["serve", "Qwen/Qwen3-0.6B", "--model", "Qwen/Qwen3-0.6B"])
    assert same.model_dir == "Qwen/Qwen3-0.6B"


@pytest.mark.parametrize("argv,needle", [
    (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype fp8_e5m2: l3worker supports auto, fp8, fp8_e4m3"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1], got 1.5"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in (0, 1], got 0.0"),
    (["--max-logprobs", "21"], "--max-logprobs must be in [0, 20]"),
    (["--seed", "-1"], "--seed must be in [0, 2**63)"),
    (["--stream-interval", "0"], "--stream-interval must be >= 1, got 0"),
    (["a", "--model", "b"], "MODEL 'a' and --model 'b' name different models"),
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--allowed-origins", "*"], "expected a JSON list"),
])
def test_refused_values_exit_2_naming_the_flag(capsys, argv, needle) -> None:
    err = refused(capsys, *argv)
    assert err.startswith(SERVE_USAGE) and needle in err, err


def test_help_is_grouped_like_vllms_with_every_default_shown() -> None:
    serve = _serve_parser(build_parser())
    text = serve.format_help()
    for title in ("Model:", "Cache:", "Parallel:", "Scheduler:", "Device:", "Frontend:", "Logging:"):
        assert f"\n{title}\n" in text, title
    formatter = serve._get_formatter()
    for action in serve._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        shown = formatter._expand_help(action)
        assert shown.count("(default: ") == 1, (action.dest, shown)
        assert "default:" not in (action.help or "").replace("%(default)s", ""), action.dest  # none by hand


def test_flags_reach_the_worker_arguments(tmp_path) -> None:
    args = parse_serve_args(["serve", "--enforce-eager", "--gpu-memory-utilization", "0.25", "--dtype", "float"])
    kwargs = _worker_kwargs(args, str(tmp_path), 256, builtin=False)
    assert (kwargs["decode_graphs"], kwargs["gpu_memory_utilization"], kwargs["dtype"]) == (False, 0.25, "float32")
    assert kwargs["stream_interval"] == 1  # vLLM's default: every token streamed as it comes
    assert _worker_kwargs(parse_serve_args(["serve", "--stream-interval", "4"]), str(tmp_path), 256,
                          builtin=False)["stream_interval"] == 4
    plain = _worker_kwargs(parse_serve_args(["serve"]), str(tmp_path), 256, builtin=True)
    assert (plain["decode_graphs"], plain["gpu_memory_utilization"], plain["model_dir"]) == (None, None, None)
    for text, size in (("2G", 2 << 30), ("4g", 4 * 10**9), ("123456", 123456)):  # vLLM's spellings
        args = parse_serve_args(["serve", "--kv-cache-memory-bytes", text])
        assert _worker_kwargs(args, str(tmp_path), 256, builtin=False)["kv_cache_memory_bytes"] == size
    assert plain["kv_cache_memory_bytes"] is None


def test_cpu_engines_split_the_memory_fraction_accelerators_do_not() -> None:
    dp = DataParallel(size=4)
    cpu = dp.engine_kwargs({"device": "cpu", "gpu_memory_utilization": 0.8, "device_ids": None}, 1)
    assert cpu["gpu_memory_utilization"] == pytest.approx(0.2)
    cuda = dp.engine_kwargs({"device": "cuda", "gpu_memory_utilization": 0.8, "device_ids": [0, 1, 2, 3]}, 1)
    assert (cuda["gpu_memory_utilization"], cuda["device_ids"]) == (0.8, [1])


def test_chat_template_is_a_file_or_the_template_itself(tmp_path) -> None:
    from l3worker.serving.openai.chat import ChatTemplate

    inline = ChatTemplate.load(tmp_path, "{% for m in messages %}[{{ m.content }}]\\n{% endfor %}")
    assert inline.render([{"role": "user", "content": "hi"}]) == "[hi]\n"  # vLLM decodes the escapes
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}!")
    assert ChatTemplate.load(tmp_path, str(tmp_path / "t.jinja")).render([{"role": "user", "content": "a"}]) == "a!"
    with pytest.raises(ValueError, match="looks like a file path"):
        ChatTemplate.load(tmp_path, str(tmp_path / "missing.jinja"))


# Runs `l3worker.serving.cli.main(argv)` in a fresh interpreter and prints its exit code, then
# which of the heavy modules it imported.
_FRESH_MAIN = """
import sys
from l3worker.serving.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(code, sorted(m for m in ("torch", "uvicorn", "fastapi", "transformers") if m in sys.modules))
"""


@pytest.mark.parametrize("argv,code", [
    (["--help"], 0), (["serve", "--help"], 0), (["bench", "--help"], 0),
    (["serve", "--max-num-seqs"], 2), (["serve", "--swap-space", "4"], 2),
], ids=["help", "serve help", "bench help", "flag without its value", "unsupported vLLM flag"])
def test_help_and_bad_flags_answer_before_torch_and_the_http_server_load(argv: list[str], code: int) -> None:
    """`l3worker --help` and a refused flag need neither torch nor uvicorn: they answer at once."""
    done = subprocess.run([sys.executable, "-c", _FRESH_MAIN, *argv], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-1] == f"{code} []", done.stdout[-2000:] + done.stderr[-2000:]


def test_the_package_loads_its_names_on_first_use() -> None:
    """`import l3worker` is light; every public name still resolves to its defining module's object."""
    check = ("import sys, importlib, l3worker\n"
             "light = 'torch' not in sys.modules\n"
             "same = all(getattr(l3worker, n) is getattr(importlib.import_module(m), n)"
             " for n, m in l3worker._EXPORTS.items())\n"
             "print(light, same, sorted(l3worker.__all__) == sorted(l3worker._EXPORTS),"
             " 'DistributedWorker' in dir(l3worker))")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["True", "True", "True", "True"], done.stdout + done.stderr[-2000:]
