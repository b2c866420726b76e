"""The command line a new user meets: vLLM-style flag names, each with help text and a variable, the
generated table in docs/configuration.md equal to the code, bad flags as one line (no traceback, no
prefix matching), per-role help, and the GPU plan of `splitserve up`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.cli import build_parser
from splitserve.flags import markdown_table
from splitserve.placement import Placement, PlacementError, plan, spread

ROOT = Path(__file__).resolve().parents[2]
# The names users carry over from vLLM and SGLang (issue: a user's first hour)
VLLM_FLAGS = [
    "--served-model-name",
    "--max-model-len",
    "--api-key",
    "--chat-template",
    "--dtype",
    "--gpu-memory-utilization",
    "--version",
    "--host",
    "--port",
    "--tensor-parallel-size",
    "--kv-cache-dtype",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--enable-prefix-caching",
    "--log-level",
    "--log-format",
]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "splitserve", *argv], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_docs_table_is_the_generated_one() -> None:
    text = (ROOT / "docs/configuration.md").read_text()
    documented = re.search(r"<!-- flags:begin -->\n(.*?)<!-- flags:end -->", text, re.S)
    assert documented, "docs/configuration.md lost its flags:begin/end markers"
    assert documented.group(1) == markdown_table(build_parser()), (
        "docs/configuration.md is out of date: regenerate its table with `splitserve config --markdown`"
    )


def test_every_vllm_style_flag_is_in_the_table_with_help_and_a_variable() -> None:
    rows = [line.split(" | ") for line in markdown_table(build_parser()).splitlines()[2:]]
    by_flag: dict[str, list[list[str]]] = {}
    for row in rows:
        by_flag.setdefault(row[0].strip("| `"), []).append(row)
    for name in VLLM_FLAGS:
        assert name in by_flag, f"{name} is missing"
        for row in by_flag[name]:
            assert row[4].strip(" |"), f"{name} has no help text"
            if name != "--version" and row[1] != "generate":  # one-shot generate: flags only
                assert row[2].startswith("`SPLITSERVE_"), f"{name} ({row[1]}) has no SPLITSERVE_* variable"
    for row in rows:  # every flag of every serving command says what it does
        assert row[4].strip(" |"), f"{row[0]} ({row[1]}) has no help text"


def test_the_table_does_not_depend_on_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    before = markdown_table(build_parser())
    for name, value in {
        "SPLITSERVE_ROUTER_PORT": "9999",
        "SPLITSERVE_STARTUP_TIMEOUT": "5",
        "SPLITSERVE_DEVICES": "3,4",
    }.items():
        monkeypatch.setenv(name, value)
    assert markdown_table(build_parser()) == before


def test_environment_sets_what_the_flag_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_STARTUP_TIMEOUT", "42")
    monkeypatch.setenv("SPLITSERVE_DEVICES", "2,3")
    args = build_parser().parse_args(["up"])
    assert (args.startup_timeout, args.devices) == (42.0, ["2", "3"])
    assert build_parser().parse_args(["up", "--startup-timeout", "7"]).startup_timeout == 7.0


def test_a_bad_flag_is_one_line_naming_it_and_what_it_accepts() -> None:
    for argv, expected in [
        (["up", "--max-num-seqs", "abc"], "--max-num-seqs: invalid int value: 'abc'"),
        (["up", "--dtype", "half16"], "choose from 'auto', 'float32', 'bfloat16'"),
        (["up", "--max-num-seqs", "0"], "--max-num-seqs / SPLITSERVE_MAX_NUM_SEQS"),
        (
            ["up", "--model", "/no/such/model.gguf"],
            "--model / SPLITSERVE_MODEL: model '/no/such/model.gguf' not found",
        ),
        (["up", "--devices", "0,1", "--decode", "2"], "1 prefill service + 2 decode services need 3"),
        (["decode", "--kv-cache-dtype", "int4"], "choose from 'auto', 'float32'"),
        (["router", "--routing", "random"], "choose from 'prefix_aware', 'least_loaded'"),
        (["up", "--api-key", "short"], "--api-key must be 20 to 512 printable ASCII characters"),
        (["up", "--tool-call-parser", "nope"], "--tool-call-parser: unknown tool call parser 'nope'"),
        (
            ["up", "--tool-call-parser", "auto", "--tool-call-parser", "mistral"],
            "2 --tool-call-parser for 1 model",
        ),
    ]:
        r = _run(*argv)
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        assert expected in r.stderr, (argv, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, (argv, r.stderr)
        assert "Traceback" not in r.stderr and not r.stdout, (argv, r.stdout)


def test_flags_are_never_abbreviated() -> None:
    r = _run("up", "--tensor-parallel", "2")
    assert r.returncode == 2 and "unrecognized arguments: --tensor-parallel 2" in r.stderr, r.stderr


def test_each_role_lists_only_its_own_flags() -> None:
    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    options = {name: {s for a in p._actions for s in a.option_strings} for name, p in sub.choices.items()}
    assert "--kv-port" in options["decode"] and "--kv-port" not in options["prefill"]
    assert "--api-key" in options["router"] and "--api-key" not in options["decode"]
    assert "--routing" not in options["decode"] and "--max-num-seqs" not in options["router"]
    for name in ("up", "prefill", "decode", "router"):
        for action in sub.choices[name]._actions:
            assert action.help, f"splitserve {name} {action.option_strings}: no help text"


def test_version() -> None:
    r = _run("--version")
    assert r.returncode == 0 and re.fullmatch(r"splitserve \S+\n", r.stdout), r.stdout


def test_up_passes_typed_engine_flags_on() -> None:
    args = build_parser().parse_args(
        ["up", "--tenant-weights", "a=3,b=1", "--no-enable-prefix-caching", "--max-model-len", "512"]
    )
    assert args.engine_tenant_weights == {"a": 3.0, "b": 1.0}
    assert args.engine_enable_prefix_caching is False and args.engine_max_model_len == 512


# --- GPU placement -------------------------------------------------------------------------------


def test_each_service_gets_its_own_devices_prefill_first() -> None:
    placed = plan(1, 3, 1, ["0", "1", "2", "3"])
    assert placed == [Placement((d,), 1) for d in "0123"]


def test_tensor_parallel_ranks_take_consecutive_devices() -> None:
    placed = plan(1, 1, 2, ["4", "5", "6", "7"])
    assert [p.devices for p in placed or []] == [("4", "5"), ("6", "7")]


def test_per_role_devices() -> None:
    placed = plan(1, 2, 1, prefill_devices=["7"], decode_devices=["1", "2"])
    assert [p.devices for p in placed or []] == [("7",), ("1",), ("2",)]
    mixed = plan(1, 2, 1, ["0", "1"], decode_devices=None, prefill_devices=["5"])
    assert [p.devices for p in mixed or []] == [("5",), ("0",), ("1",)]


def test_impossible_plans_are_refused_naming_the_counts() -> None:
    with pytest.raises(
        PlacementError, match="--devices names 3 device.*1 prefill service \\+ 3 decode services need 4"
    ):
        plan(1, 3, 1, ["0", "1", "2"])
    with pytest.raises(PlacementError, match="--decode-devices names 1 .*2 decode services need 2"):
        plan(1, 2, 1, ["0"], decode_devices=["1"])
    with pytest.raises(PlacementError, match="at --tensor-parallel-size 2 need 4"):
        plan(1, 1, 2, ["0", "1", "2"])
    with pytest.raises(PlacementError, match="2 distinct devices"):
        plan(0, 1, 2, ["0", "0"])


def test_shared_devices_are_counted_and_nothing_named_means_no_plan() -> None:
    assert plan(1, 1, 1) is None
    assert plan(1, 1, 1, ["0", "0"]) == [Placement(("0",), 2), Placement(("0",), 2)]
    assert spread(["0", "1"], 3, 1) == ["0", "1", "0"]


def test_up_gives_each_child_its_devices_and_a_share_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from splitserve.launch import _up_plan

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = build_parser().parse_args(["up", "--decode", "2", "--devices", "0,1,1"])
    assert _up_plan(args) == [
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"CUDA_VISIBLE_DEVICES": "1", "SPLITSERVE_GPU_MEMORY_UTILIZATION": "0.4500"},
        {"CUDA_VISIBLE_DEVICES": "1", "SPLITSERVE_GPU_MEMORY_UTILIZATION": "0.4500"},
    ]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # what `up` itself may use: spread over them
    args = build_parser().parse_args(["up"])
    assert _up_plan(args) == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _up_plan(build_parser().parse_args(["up"])) == [{}, {}]


def test_no_gpu_no_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    from splitserve.launch import _up_plan

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi
    assert _up_plan(build_parser().parse_args(["up"])) == [{}, {}]


def test_generate_takes_the_engine_flag_for_exact_prefill() -> None:
    parse = build_parser().parse_args
    assert parse(["generate", "hi", "--no-kv-exact-prefill"]).kv_exact_prefill is False
    assert parse(["generate", "hi", "--kv-exact-prefill"]).kv_exact_prefill is True
    assert parse(["generate", "hi"]).kv_exact_prefill is None  # the config (or its variable) decides
