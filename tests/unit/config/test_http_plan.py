"""The plan's [http] section: what it refuses, and what resolving the plan fills in."""

from __future__ import annotations

import shutil

import pytest

from kvasir.config.http import default_model_name, parse_listen, read_api_keys, shares
from kvasir.config.plan import parse_plan
from kvasir.daemon.resolve import resolve_http
from kvasir.errors import PlanError
from tests.support.tls import self_signed

STAGES = "[[stages]]\nlayers = [0, 15]\n[[stages]]\nlayers = [15, 30]\n"


def plan(http: str):
    return parse_plan(f"[http]\n{http}\n{STAGES}")


@pytest.mark.parametrize(
    ("http", "says"),
    [
        ('listen = "localhost"', "HOST:PORT"),
        ('listen = "127.0.0.1:0"', "HOST:PORT"),
        ('listen = "127.0.0.1:70000"', "HOST:PORT"),
        ('listen = "0.0.0.0:8000"', "needs http.api_keys"),
        ('listen = "10.1.2.3:8000"', "needs http.api_keys"),
        ("workers = 0", "http.workers must be a positive integer"),
        ("workers = 65", "more than 64"),
        ('model_name = "two words"', "http.model_name"),
        ('model_name = ""', "http.model_name"),
        ("colour = 1", "http.colour: unknown key"),
        ("max_connections = 0", "http.max_connections must be a positive integer"),
        ("header_timeout_s = 0", r"http.header_timeout_s = 0.0 must be in \(0, 3600\]"),
        ("write_timeout_s = nan", "http.write_timeout_s = nan"),
        ("max_choices = 100", "http.max_choices = 100 <= http.max_per_caller = 64"),
        ("max_per_caller = 300", "http.max_per_caller = 300 <= bridge.max_per_client = 256 does not hold"),
        ("max_tokens = -1", "http.max_tokens must be a positive integer"),
        ('listen = "0.0.0.0:8000"\napi_keys = "keys"', "serve it over TLS"),
        ('tls_cert = "cert.pem"', "http.tls_cert and http.tls_key go together"),
        ('tls_key = "key.pem"', "http.tls_cert and http.tls_key go together"),
    ],
)
def test_refusals_name_the_key(http, says):
    with pytest.raises(PlanError, match=says):
        plan(http)


def test_a_reachable_address_with_keys_and_the_defaults():
    tls = 'tls_cert = "cert.pem"\ntls_key = "key.pem"'
    assert plan(f'listen = "0.0.0.0:8000"\napi_keys = "keys"\n{tls}').http.listen == "0.0.0.0:8000"
    plain = plan('listen = "0.0.0.0:8000"\napi_keys = "keys"\nallow_plaintext = true').http
    assert plain.allow_plaintext and plain.tls_cert is None
    spec = plan("").http
    assert (spec.listen, spec.workers, spec.api_keys, spec.model_name) == ("127.0.0.1:8000", 1, None, None)
    assert parse_plan(STAGES).http is None  # no [http], no HTTP
    assert parse_listen("[::1]:8080") == ("::1", 8080)
    assert shares(spec, 256) == (16, 64) and shares(spec, 8) == (8, 8)  # defaults within the shares above them
    assert shares(plan("max_choices = 4").http, 256) == (4, 64)
    assert (spec.max_connections, spec.header_timeout_s, spec.allow_ignore_eos) == (1024, 10.0, False)


def test_resolving_reads_the_keys_from_the_plans_folder_and_names_the_model(tmp_path):
    (tmp_path / "keys").write_text("# comment\n\nsk-one\n  sk-two  \n")
    with pytest.raises(PlanError, match="http.api_keys: .* is open to other users .*: chmod 600"):
        resolve_http(plan('api_keys = "keys"'), tmp_path)
    (tmp_path / "keys").chmod(0o600)
    resolved = resolve_http(plan('api_keys = "keys"'), tmp_path)
    assert resolved.http.api_keys == str(tmp_path / "keys") and resolved.http.model_name == "smollm2-135m"
    assert read_api_keys(tmp_path / "keys") == {"sk-one", "sk-two"}
    (tmp_path / "empty").write_text("# nothing\n")
    (tmp_path / "empty").chmod(0o600)
    with pytest.raises(PlanError, match="holds no key"):
        resolve_http(plan('api_keys = "empty"'), tmp_path)
    with pytest.raises(PlanError, match="key file not found"):
        resolve_http(plan('api_keys = "missing"'), tmp_path)
    named = resolve_http(plan('model_name = "mine"'), tmp_path)
    assert named.http.model_name == "mine"
    assert default_model_name("/models/Qwen2-0.5B.gguf") == "Qwen2-0.5B" and default_model_name("/m/llama/") == "llama"


def test_tls_files_resolve_from_the_plans_folder_and_a_bad_one_is_named(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    self_signed(tmp_path)
    resolved = resolve_http(plan('tls_cert = "cert.pem"\ntls_key = "key.pem"'), tmp_path).http
    assert (resolved.tls_cert, resolved.tls_key) == (str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"))
    (tmp_path / "key.pem").chmod(0o640)
    with pytest.raises(PlanError, match="http.tls_key: .* is open to other users"):
        resolve_http(plan('tls_cert = "cert.pem"\ntls_key = "key.pem"'), tmp_path)
    (tmp_path / "key.pem").chmod(0o600)
    with pytest.raises(PlanError, match="file not found"):
        resolve_http(plan('tls_cert = "nothing.pem"\ntls_key = "key.pem"'), tmp_path)
    with pytest.raises(PlanError, match="cannot load"):
        resolve_http(plan('tls_cert = "key.pem"\ntls_key = "key.pem"'), tmp_path)  # a key is no certificate


def test_a_chat_template_file_replaces_the_models_and_a_missing_one_is_named(tmp_path):
    from transformers import AutoTokenizer

    from kvasir.daemon.resolve import resolve_template
    from kvasir.model.tokenizer import load_tokenizer
    from tests.support.models import save_tiny_tokenizer

    base = parse_plan(f'[model]\nchat_template = "shout.jinja"\n{STAGES}')
    with pytest.raises(PlanError, match="model.chat_template: chat template file not found"):
        resolve_template(base, tmp_path)
    (tmp_path / "shout.jinja").write_text("{% for m in messages %}{{ m.content | upper }}{% endfor %}")
    resolved = resolve_template(base, tmp_path)
    assert resolved.model.chat_template == str(tmp_path / "shout.jinja")
    save_tiny_tokenizer(tmp_path / "tok")
    tokenizer = load_tokenizer(tmp_path / "tok", resolved.model.chat_template)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tokenizer.decode(ids) == "HI"
    assert (
        load_tokenizer(tmp_path / "tok").chat_template == AutoTokenizer.from_pretrained(tmp_path / "tok").chat_template
    )


def test_the_tool_format_is_one_of_those_kvasir_reads():
    assert parse_plan(STAGES).model.tool_format == "auto"
    assert parse_plan(f'[model]\ntool_format = "prompted"\n{STAGES}').model.tool_format == "prompted"
    with pytest.raises(PlanError, match="tool_format"):
        parse_plan(f'[model]\ntool_format = "xml"\n{STAGES}')
