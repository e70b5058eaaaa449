from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvasir.model.source import resolve_source
from tests.support.daemon import Daemon, serving_daemon, stage_count, write_plan
from tests.support.models import MOE_FAMILIES, make_plan, save_looping_model, save_tiny_model, save_tiny_tokenizer

pytest_plugins = ("pytester", "tests.support.timing")

TESTS = Path(__file__).parent
# scripts/test runs the suite in two processes on two cores: each one's torch (Hugging Face
# generate on tiny models, the loader) on one thread, or four threads spin for two cores
torch.set_num_threads(1)
FOLDER_MARKS = {"unit": ("unit",), "integration": ("integration", "slow"), "gpu": ("gpu", "slow")}


def pytest_collection_modifyitems(items):
    """Mark each test by the folder it lives in (see the markers in pyproject.toml)."""
    for item in items:
        folder = Path(item.fspath).relative_to(TESTS).parts[0]
        for mark in FOLDER_MARKS.get(folder, ()):
            item.add_marker(mark)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item: fixtures read it to tell a failed test."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Tiny random-weight models of six families (three of them mixtures of experts),
    saved once per session."""
    root = tmp_path_factory.mktemp("models")
    families = ("llama", "qwen2", "mistral", *MOE_FAMILIES)
    models = {family: save_tiny_model(root / family, family) for family in families}
    models["mistral-window"] = save_tiny_model(root / "mistral-window", "mistral", sliding_window=8)
    models["llama-loop"] = save_looping_model(root / "llama-loop")  # greedy output that repeats (drafts confirmed)
    models["llama-draft"] = save_tiny_model(root / "llama-draft", "llama", num_layers=2, seed=3)  # a draft model
    # a context long enough for prompts that list tools (its 310-token vocabulary makes them long)
    models["llama-tokenizer"] = save_tiny_model(root / "llama-tokenizer", "llama", max_position_embeddings=2048)
    save_tiny_tokenizer(models["llama-tokenizer"])
    return models


@pytest.fixture(scope="session")
def shared_daemon(tiny_models, tmp_path_factory):
    """One daemon (the Llama with a tokenizer, two stages, max_tokens 64) for the tests that
    only read from it: each leaves it idle, and none restarts, floods or reconfigures it.
    A test that needs a fresh daemon or other limits starts its own (start_daemon)."""
    with serving_daemon(
        tmp_path_factory.mktemp("shared"), tiny_models["llama-tokenizer"], [(0, 3), (3, 6)], max_tokens=64
    ) as daemon:
        yield daemon


@pytest.fixture
def plan_for():
    def build(folder, splits, **kw):
        plan = make_plan(folder, splits, **kw)
        return plan, resolve_source(plan.model.source)

    return build


@pytest.fixture
def start_daemon(tmp_path, request):
    """Start kvasird processes on tiny models; every one is stopped after the test, and
    when the test failed, each one's log is printed (pytest shows it with the failure)."""
    started: list[Daemon] = []

    def start(source, splits, name="rt", drain_timeout=30.0, wrap=(), **plan_values) -> Daemon:
        plan = write_plan(tmp_path / f"{name}.toml", source, splits, **plan_values)
        daemon = Daemon(plan, tmp_path / name, stage_count(splits), drain_timeout, wrap)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        for daemon in started:
            print(f"--- {daemon.log_path.name} (the daemon's log) ---\n{daemon.log()[-20_000:]}", file=sys.stderr)
