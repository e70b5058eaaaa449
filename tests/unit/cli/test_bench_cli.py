"""``kvasir bench``'s subcommands parse their shared options before anything runs."""

import pytest
from click.testing import CliRunner

from kvasir.cli.main import kvasir

MODES = ("load", "sweep", "submit", "failover", "doors", "compare", "plans", "quality", "hop", "roofline")


def bench(*args: str):
    return CliRunner().invoke(kvasir, ["bench", *args], catch_exceptions=False)


def test_every_mode_is_a_subcommand_with_its_own_help():
    listing = bench("--help")
    assert listing.exit_code == 0
    for mode in MODES:
        assert f"  {mode} " in listing.output, mode
        assert bench(mode, "--help").exit_code == 0, mode


@pytest.mark.parametrize(
    "flag, mode",
    [("--compare", "compare"), ("--rate-sweep", "sweep"), ("--submit-only", "submit"), ("--hop", "hop")],
)
def test_the_old_mode_flags_name_the_subcommand_that_took_each_over(flag, mode):
    result = bench(flag)
    assert result.exit_code == 2 and f"kvasir bench {mode}" in result.output


@pytest.mark.parametrize(
    "args, says",
    [
        (("load", "--rate", "5", "--concurrency", "3"), "not both"),
        (("load", "--slo-ttft", "1"), "give both --slo-ttft and --slo-tpot"),
        (("load", "--slo-ttft", "1", "--slo-tpot", "1", "--slo-attain", "0"), "--slo-attain in (0, 1]"),
        (("load", "--output-len", "shared:4+4"), "no shared: prefix"),
        (("load", "--prompt-len", "0"), "1 <= LOW <= HIGH"),
        (("load", "--turns", "3", "--requests", "5"), "whole conversations"),
        (("load", "--turns", "2", "--prompts", __file__), "not with --prompts"),
        (("sweep",), "needs --slo-ttft and --slo-tpot"),
        (("compare", "--turns", "2", "--warmup", "2"), "--contenders ring,drained"),
        (("compare", "--contenders", "ring,vllm"), "--contenders: vllm; choose among"),
        (("quality", "--reference", "vllm"), "--reference is llama.cpp or a plan file"),
        (("quality", "--n-ctx", "0"), "--n-ctx must be positive"),
        (("compare", "--contenders", "ring,llama.cpp", "--door", "zeromq"), "--door zeromq cannot drive it"),
        (("plans", "a.toml"), "does not exist"),
        (("doors", "127.0.0.1:1"), "give the front's URL"),
        (("failover", "--rounds", "0"), "--rounds must be positive"),
        (("hop", "--link", "tcp", "--device", "cuda:0"), "--link tcp measures a cpu edge"),
        (("hop", "--device", "gpu"), "is not 'cpu' or 'cuda:N'"),
        (("load", "--structured", "xml:<a/>"), "KIND is one of json, json_object"),
        (("load", "--structured", "json:@/nonexistent/schema.json"), "cannot read /nonexistent/schema.json"),
    ],
)
def test_bad_options_are_refused_with_exit_code_2_before_anything_runs(args, says, tmp_path):
    result = bench(*args)
    assert result.exit_code == 2, result.output
    assert says in result.output


def test_structured_reads_its_text_from_a_file(tmp_path):
    from kvasir.cli.bench.options import _structured
    from kvasir.wire.base import Grammar

    (tmp_path / "s.json").write_text('{"type": "object"}')
    assert _structured(f"json:@{tmp_path / 's.json'}") == Grammar("json", '{"type": "object"}')
    assert _structured("regex:[a-z]+:x") == Grammar("regex", "[a-z]+:x")
    assert _structured(None) is None
