from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from kvasir.cli.main import kvasir
from kvasir.config.plan import check_model_fit, load_plan, parse_plan, plan_toml
from kvasir.errors import PlanError
from tests.support.plans import refused

TWO = """
[[stages]]
layers = [0, 3]
[[stages]]
layers = [3, 6]
"""


def test_defaults_fill_omitted_keys():
    plan = parse_plan(TWO)
    assert plan.model.source == "smollm2-135m"
    assert plan.model.dtype == "float32"
    assert plan.model.max_seq_len == 2048
    assert (plan.batch.max_rows, plan.batch.max_tokens, plan.batch.inflight) == (32, 256, 3)
    assert (plan.kv.block_size, plan.kv.num_blocks) == (16, 1024)
    assert plan.bridge.max_waiting == 1024
    assert [s.layers for s in plan.stages] == [(0, 3), (3, 6)]
    assert all(s.device == "cpu" and s.threads == 1 and s.cpus is None for s in plan.stages)
    assert all(s.solo_threads is None for s in plan.stages)


def test_explicit_values_are_kept():
    plan = parse_plan(
        '[model]\nsource="x"\ndtype="bfloat16"\nmax_seq_len=64\n[batch]\nmax_rows=2\nmax_tokens=8\ninflight=1\n'
        "[kv]\nblock_size=8\nnum_blocks=8\n" + TWO.replace("[3, 6]", '[3, 6]\ndevice="cuda:1"\nthreads=2\ncpus=[0, 1]')
    )
    assert plan.model.dtype == "bfloat16" and plan.batch.inflight == 1
    assert plan.stages[1].device == "cuda:1" and plan.stages[1].cpus == (0, 1)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[batch]\nfoo = 1\n" + TWO, "batch.foo: unknown key"),
        ("colour = 'red'\n" + TWO, "colour: unknown key"),
        (TWO + "gpu = 1\n", "stages[1].gpu: unknown key"),
        ("[model]\nmax_seq_len = 'long'\n" + TWO, "model.max_seq_len: expected `int`"),
        ("[[stages]]\ndevice = 'cpu'\n[[stages]]\nlayers = [1, 2]", "stages[0].layers: required key is missing"),
    ],
)
def test_unknown_keys_and_wrong_types_are_named(text, expected):
    assert expected in refused(text)


@pytest.mark.parametrize("stages", ["", "[[stages]]\nlayers = [0, 6]\n"])
def test_fewer_than_two_stages_is_refused(stages):
    message = refused(stages)
    assert "a pipeline needs at least two stages: head and tail are different roles" in message


def test_gap_between_stages():
    message = refused("[[stages]]\nlayers=[0, 2]\n[[stages]]\nlayers=[3, 6]\n")
    assert "gap" in message and "[2, 3)" in message


def test_overlapping_stages():
    message = refused("[[stages]]\nlayers=[0, 4]\n[[stages]]\nlayers=[3, 6]\n")
    assert "overlap" in message and "[3, 4)" in message


def test_first_stage_must_start_at_zero():
    assert "[0, 1) are in no stage" in refused("[[stages]]\nlayers=[1, 4]\n[[stages]]\nlayers=[4, 6]\n")


@pytest.mark.parametrize("layers", ["[3, 3]", "[4, 2]", "[-1, 2]"])
def test_empty_or_reversed_ranges(layers):
    assert "half-open range" in refused(f"[[stages]]\nlayers={layers}\n[[stages]]\nlayers=[3, 6]\n")


def test_ranges_past_the_model_and_uncovered_layers():
    plan = parse_plan("[[stages]]\nlayers=[0, 4]\n[[stages]]\nlayers=[4, 8]\n")
    with pytest.raises(PlanError, match="goes past the model's 6 layers"):
        check_model_fit(plan, num_layers=6, max_positions=None)
    with pytest.raises(PlanError, match=r"layers \[8, 10\) of the model's 10 are in no stage"):
        check_model_fit(plan, num_layers=10, max_positions=None)
    check_model_fit(plan, num_layers=8, max_positions=4096)
    with pytest.raises(PlanError, match="max_position_embeddings = 1024"):
        check_model_fit(plan, num_layers=8, max_positions=1024)


@pytest.mark.parametrize(
    "section, key",
    [
        ("batch", "max_rows"),
        ("batch", "max_tokens"),
        ("batch", "inflight"),
        ("kv", "block_size"),
        ("kv", "num_blocks"),
        ("model", "max_seq_len"),
        ("bridge", "max_waiting"),
        ("bridge", "max_per_client"),
        ("bridge", "max_client_queue"),
    ],
)
@pytest.mark.parametrize("value", [0, -3])
def test_zero_or_negative_widths(section, key, value):
    message = refused(f"[{section}]\n{key} = {value}\n" + TWO)
    assert f"{section}.{key} must be a positive integer, got {value}" in message


def test_max_tokens_below_max_rows():
    message = refused("[batch]\nmax_rows = 8\nmax_tokens = 4\n" + TWO)
    assert "batch.max_tokens (4) must be >= batch.max_rows (8)" in message


def test_kv_capacity_below_one_request():
    message = refused("[model]\nmax_seq_len = 100\n[kv]\nblock_size = 16\nnum_blocks = 6\n" + TWO)
    assert "96 tokens cannot hold one request of model.max_seq_len = 100" in message


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda:-1", "cuda:01", "CPU", ""])
def test_unparseable_devices(device):
    message = refused(TWO.replace("[3, 6]", f'[3, 6]\ndevice = "{device}"'))
    assert f"stages[1].device = {device!r} is not a device" in message


def test_bad_threads_cpus_and_dtype():
    assert "stages[0].threads must be a positive integer" in refused(TWO.replace("[0, 3]", "[0, 3]\nthreads = 0"))
    assert "distinct non-negative" in refused(TWO.replace("[0, 3]", "[0, 3]\ncpus = [1, 1]"))
    assert "stages[0].cpus is empty" in refused(TWO.replace("[0, 3]", "[0, 3]\ncpus = []"))
    below = refused(TWO.replace("[3, 6]", "[3, 6]\nthreads = 2\nsolo_threads = 1"))
    assert "stages[1].solo_threads = 1 is below stages[1].threads = 2" in below
    assert parse_plan(TWO.replace("[3, 6]", "[3, 6]\nsolo_threads = 2")).stages[1].solo_threads == 2
    assert "model.dtype must be one of float32, bfloat16, float16" in refused('[model]\ndtype = "float64"\n' + TWO)


def test_malformed_toml():
    assert "malformed TOML" in refused("[batch\nmax_rows = 1\n")
    assert "malformed TOML" in refused("[batch]\nmax_rows = = 1\n")


def test_missing_file(tmp_path):
    with pytest.raises(PlanError, match="plan file not found"):
        load_plan(tmp_path / "absent.toml")
    with pytest.raises(PlanError, match="is a directory"):
        load_plan(tmp_path)


def write_plan(folder: Path, source: str, splits) -> Path:
    stages = "".join(f"[[stages]]\nlayers = [{a}, {b}]\n" for a, b in splits)
    path = folder / "plan.toml"
    path.write_text(
        f'[model]\nsource = "{source}"\nmax_seq_len = 256\n[kv]\nblock_size = 16\nnum_blocks = 32\n{stages}'
    )
    return path


def test_plan_check_prints_each_stage(tmp_path, tiny_models):
    path = write_plan(tmp_path, str(tiny_models["llama"]), [(0, 2), (2, 5), (5, 6)])
    result = CliRunner().invoke(kvasir, ["plan", "check", str(path)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("stage"))) + 1
    table = lines[start : start + 3]
    assert [row.split()[1] for row in table] == ["head", "middle", "tail"]
    assert [row.split(":")[0] for row in lines[start + 3 : start + 5]] == ["edge     0 -> 1", "edge     1 -> 2"]
    assert all(row.endswith("shm (both stages on cpu)") for row in lines[start + 3 : start + 5])
    assert lines[start + 5].startswith("hand-off")  # then the price of handing KV between pools
    assert "[0, 2)" in table[0] and "[2, 5)" in table[1] and "[5, 6)" in table[2]


def test_plan_check_json_reports_sizes(tmp_path, tiny_models):
    path = write_plan(tmp_path, str(tiny_models["llama"]), [(0, 3), (3, 6)])
    result = CliRunner().invoke(kvasir, ["plan", "check", "--json", str(path)])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    head, tail = body["stages"]
    # K and V x 3 layers x 32 blocks x 16 tokens x 2 kv heads x head dim 16 x 4 bytes
    assert head["kv_bytes"] == 2 * 3 * 32 * 16 * 2 * 16 * 4
    # max_tokens 256 x hidden 64 x 4 bytes, one slot per batch in flight
    assert head["slot_bytes"] == 0 and tail["slot_bytes"] == 256 * 64 * 4 and tail["slots"] == 3
    assert head["parameter_bytes"] == head["parameters"] * 4
    # a batch reads every weight but the embedding table, which it looks up by row (vocab 320 x hidden 64)
    assert head["product_bytes"] == head["parameter_bytes"] - 320 * 64 * 4
    assert tail["product_bytes"] == tail["parameter_bytes"]
    assert body["model"]["layers"] == 6


def test_plan_check_resolves_relative_sources_from_the_plan_folder(tmp_path, tiny_models):
    shutil.copytree(tiny_models["llama"], tmp_path / "model")
    path = write_plan(tmp_path, "model", [(0, 3), (3, 6)])
    result = CliRunner().invoke(kvasir, ["plan", "check", str(path)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    "source, splits, expected",
    [
        ("/no/such/model", [(0, 3), (3, 6)], "neither a built-in model"),
        (None, [(0, 3), (3, 8)], "goes past the model's 6 layers"),
        (None, [(0, 3), (3, 5)], "are in no stage"),
    ],
)
def test_plan_check_refusals_exit_2_with_one_line(tmp_path, tiny_models, source, splits, expected):
    path = write_plan(tmp_path, source or str(tiny_models["llama"]), splits)
    result = CliRunner().invoke(kvasir, ["plan", "check", str(path)])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and expected in result.output


def test_installed_console_script_exits_2_on_a_bad_plan(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[[stages]]\nlayers = [0, 30]\n")
    script = Path(sys.executable).parent / "kvasir"
    proc = subprocess.run([str(script), "plan", "check", str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: {bad}: stages: a pipeline needs at least two stages: head and tail are different roles "
        "(the plan has 1)"
    )
    good = subprocess.run(
        [str(script), "plan", "check", str(Path(__file__).parents[3] / "plans" / "smollm2-3stage.toml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert good.returncode == 0, good.stderr
    assert "middle" in good.stdout and "[11, 22)" in good.stdout


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[3] / "plans").glob("*.toml")), ids=lambda p: p.name)
def test_every_example_plan_checks(path):
    result = CliRunner().invoke(kvasir, ["plan", "check", str(path)])
    assert result.exit_code == 0, result.output
    assert "tail" in result.output


def test_default_plan_is_packaged():
    from kvasir.config.plan import default_plan_path

    assert default_plan_path().is_file()
    assert load_plan(default_plan_path()) == load_plan(Path(__file__).parents[3] / "plans" / "smollm2-2stage.toml")


@pytest.mark.parametrize("name", ["smollm2-2stage.toml", "smollm2-3stage.toml", "smollm2-q4.toml", "tiny-2stage.toml"])
def test_plan_toml_reads_back_equal(name):
    from kvasir.config.plan import plan_toml

    plan = load_plan(Path(__file__).parents[3] / "plans" / name)
    assert parse_plan(plan_toml(plan)) == plan
    pinned = msgspec.structs.replace(
        plan,
        stages=(msgspec.structs.replace(plan.stages[0], cpus=(0, 1)), *plan.stages[1:]),
        model=msgspec.structs.replace(plan.model, source='/models/a "quoted" dir'),
    )
    assert parse_plan(plan_toml(pinned)) == pinned


def test_supervision_settings():
    assert "supervise.max_restarts must be >= 0" in refused("[supervise]\nmax_restarts = -1\n" + TWO)
    for key in ("restart_window_s", "heartbeat_timeout_s"):
        for bad in ("0", "-1.5", "inf", "nan"):
            assert f"supervise.{key} must be a positive number of seconds" in refused(
                f"[supervise]\n{key} = {bad}\n" + TWO
            )
    assert "heartbeat_timeout_s = 0.5 is too short" in refused("[supervise]\nheartbeat_timeout_s = 0.5\n" + TWO)
    plan = parse_plan("[supervise]\nmax_restarts = 0\nheartbeat_timeout_s = 5\n" + TWO)
    assert plan.supervise.max_restarts == 0 and plan.supervise.heartbeat_timeout_s == 5.0


@pytest.mark.parametrize(
    "endpoint", ["tcp://0.0.0.0:7070", "tcp://*:7070", "tcp://10.1.2.3:7070", "tcp://example.org:1"]
)
def test_a_reachable_tcp_endpoint_needs_keys(endpoint):
    message = refused(f'[bridge]\ntcp = "{endpoint}"\n' + TWO)
    assert "is reachable from other hosts: it needs bridge.server_key and bridge.client_keys" in message
    keyed = f'[bridge]\ntcp = "{endpoint}"\nserver_key = "k/server.key_secret"\nclient_keys = "k/clients"\n' + TWO
    assert parse_plan(keyed).bridge.tcp == endpoint


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:7070", "tcp://localhost:7070", "tcp://[::1]:7070"])
def test_loopback_tcp_goes_without_keys_only_when_the_plan_says_so(endpoint):
    message = refused(f'[bridge]\ntcp = "{endpoint}"\n' + TWO)
    assert "has no keys: every local user could connect" in message
    assert "bridge.tcp_allow_local_unauthenticated = true" in message
    allowed = f'[bridge]\ntcp = "{endpoint}"\ntcp_allow_local_unauthenticated = true\n' + TWO
    assert parse_plan(allowed).bridge.server_key is None
    keyed = (
        f'[bridge]\ntcp = "{endpoint}"\nserver_key = "s"\nclient_keys = "c"\ntcp_allow_local_unauthenticated = true\n'
    )
    assert "has keys: leave it out" in refused(keyed + TWO)
    far = '[bridge]\ntcp = "tcp://0.0.0.0:1"\ntcp_allow_local_unauthenticated = true\n' + TWO
    assert "is reachable from other hosts" in refused(far)


def test_max_tokens_per_request_is_a_positive_ceiling():
    assert parse_plan(TWO).bridge.max_tokens_per_request is None
    assert parse_plan("[bridge]\nmax_tokens_per_request = 64\n" + TWO).bridge.max_tokens_per_request == 64
    for bad in (0, -3):
        assert "bridge.max_tokens_per_request must be a positive integer" in refused(
            f"[bridge]\nmax_tokens_per_request = {bad}\n" + TWO
        )


def test_malformed_tcp_and_half_given_keys():
    for bad in ("127.0.0.1:7070", "tcp://127.0.0.1", "tcp://127.0.0.1:0", "tcp://127.0.0.1:70000", "ipc:///x"):
        assert "is not an endpoint of the form tcp://HOST:PORT" in refused(f'[bridge]\ntcp = "{bad}"\n' + TWO)
    assert "go together" in refused('[bridge]\ntcp = "tcp://127.0.0.1:1"\nserver_key = "s"\n' + TWO)
    assert "keys only guard a TCP endpoint" in refused('[bridge]\nserver_key = "s"\nclient_keys = "c"\n' + TWO)


def test_key_files_are_resolved_from_the_plan_folder_and_must_load(tmp_path, tiny_models):
    from kvasir.config.keys import generate
    from kvasir.daemon.resolve import resolve_plan

    generate(tmp_path / "k", ["alice"])
    text = f'[model]\nsource = "{tiny_models["llama"]}"\nmax_seq_len = 256\n[bridge]\ntcp = "tcp://*:7070"\nserver_key = "k/server.key_secret"\nclient_keys = "k/clients"\n'
    path = tmp_path / "plan.toml"
    path.write_text(text + TWO)
    plan, _ = resolve_plan(path)
    assert plan.bridge.server_key == str(tmp_path / "k/server.key_secret")
    path.write_text(text.replace("server.key_secret", "server.key") + TWO)
    with pytest.raises(PlanError, match="bridge.server_key: .*holds only a public key"):
        resolve_plan(path)
    (tmp_path / "k/clients/alice.key").unlink()
    path.write_text(text + TWO)
    with pytest.raises(PlanError, match="bridge.client_keys: .*holds no client public keys"):
        resolve_plan(path)


SHARDED = """
[[stages]]
layers = [0, 3]
[[stages.experts]]
experts = [0, 3]
threads = 1
[[stages.experts]]
experts = [3, 8]
[[stages]]
layers = [3, 6]
"""


@pytest.mark.parametrize(
    "change, expected",
    [
        (("experts = [0, 3]", "experts = [1, 3]"), "stages[0].experts[0].experts = [1, 3] starts at 1, but the first"),
        (("experts = [3, 8]", "experts = [4, 8]"), "stages[0].experts[1].experts = [4, 8] starts at 4, but the prev"),
        (("experts = [3, 8]", "experts = [3, 3]"), "stages[0].experts[1].experts = [3, 3] is not a non-empty"),
        (("experts = [0, 3]", "experts = [-1, 3]"), "stages[0].experts[0].experts = [-1, 3] is not a non-empty"),
        (("threads = 1", "threads = 0"), "stages[0].experts[0].threads must be a positive integer"),
        (("threads = 1", 'device = "gpu"'), "stages[0].experts[0].device = 'gpu' is not a device"),
        (("threads = 1", "shards = 2"), "stages[0].experts[0].shards: unknown key"),
    ],
)
def test_bad_expert_shards_are_named(change, expected):
    assert parse_plan(SHARDED).stages[0].experts[1].experts == (3, 8)
    assert expected in refused(SHARDED.replace(*change))


@pytest.mark.parametrize(
    "experts, moe_layers, expected",
    [
        (0, (), "stages[0].experts: the model is not a mixture of experts"),
        (8, (3, 4, 5), "stages[0].experts: layers [0, 3) hold no MoE layer"),
        (6, range(6), "stages[0].experts[1].experts = [3, 8] goes past the model's 6 experts"),
        (9, range(6), "stages[0].experts[1].experts ends at 8: experts [8, 9) of the model's 9 are on no shard"),
    ],
)
def test_shards_are_checked_against_the_model(experts, moe_layers, expected):
    plan = parse_plan(SHARDED)
    check_model_fit(plan, 6, None, 8, range(6))
    with pytest.raises(PlanError, match=re.escape(expected)):
        check_model_fit(plan, 6, None, experts, moe_layers)


def test_disaggregated_pools_take_expert_shards_and_the_plan_reads_back():
    prefill = SHARDED.replace("[[stages", "[[prefill.stages")
    decode = SHARDED.replace("[[stages", "[[decode.stages")
    plan = parse_plan(prefill + decode)
    assert [len(s.experts) for s in plan.all_stages] == [2, 0, 2, 0]
    assert parse_plan(plan_toml(plan)) == plan
    assert "decode.stages[0].experts[1].experts = [4, 8]" in refused(prefill + decode.replace("[3, 8]", "[4, 8]"))
    on_gpu = decode.replace("threads = 1", 'device = "cuda:0"')
    assert "decode.stages[0].experts[0].device = 'cuda:0': in this version" in refused(prefill + on_gpu)


def test_plan_check_shows_each_shard(tmp_path, tiny_models):
    path = write_plan(tmp_path, str(tiny_models["qwen2_moe"]), [(0, 3), (3, 6)])
    path.write_text(path.read_text() + "[[stages.experts]]\nexperts = [0, 1]\n[[stages.experts]]\nexperts = [1, 8]\n")
    result = CliRunner().invoke(kvasir, ["plan", "check", str(path)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("shard"))) + 1
    assert [row.split()[:3] for row in lines[start : start + 2]] == [["0", "1", "[0,"], ["1", "1", "[1,"]]
    body = json.loads(CliRunner().invoke(kvasir, ["plan", "check", "--json", str(path)]).output)
    one, seven = body["shards"]
    # layers 3 and 5 are MoE (4 too; the tiny Qwen2-MoE's only dense layer is 1): 3 layers x 3 x 64 x 48
    assert one["parameters"] == 3 * 3 * 64 * 48 and seven["parameters"] == 7 * one["parameters"]
    assert one["stage"] == 1 and one["experts"] == [0, 1] and one["dispatch_bytes"] > 0
    assert one["dispatch_kind"] == "shm" and lines[start].split()[-1] == "shm"
    path.write_text(path.read_text().replace("experts = [1, 8]\n", 'experts = [1, 8]\ndevice = "cuda:0"\n'))
    body = json.loads(CliRunner().invoke(kvasir, ["plan", "check", "--json", str(path)]).output)
    assert [s["dispatch_kind"] for s in body["shards"]] == ["shm", "pinned"]  # a CUDA side page-locks its slot
    assert body["model"]["experts"] == 8 and body["model"]["moe_layers"] == [0, 2, 3, 4, 5]
    dense = write_plan(tmp_path, str(tiny_models["llama"]), [(0, 3), (3, 6)])
    dense.write_text(dense.read_text() + "[[stages.experts]]\nexperts = [0, 1]\n")
    refusal = CliRunner().invoke(kvasir, ["plan", "check", str(dense)])
    assert refusal.exit_code == 2 and "not a mixture of experts" in refusal.output
