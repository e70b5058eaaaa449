"""The front tokenizes on its tokenizer thread, never on its event loop: a request with
megabytes of prompt text must not stall every other connection of the front."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvasir.bridge.detokenizer import load_tokenizer
from kvasir.config.http import HttpSpec
from kvasir.http.api import Api
from kvasir.http.gateway import Gateway
from kvasir.http.prompts import Prompts
from kvasir.http.requests import Served
from kvasir.logs import setup_logging


class Watched:
    """The model's tokenizer, noting the thread of every call made through it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.threads: set[int] = set()

    def __getattr__(self, name: str):
        found = getattr(self.tokenizer, name)
        if not callable(found):
            return found

        def call(*args, **kwargs):
            self.threads.add(threading.get_ident())
            return found(*args, **kwargs)

        return call


@pytest.mark.asyncio
async def test_prompts_are_tokenized_off_the_loop(tiny_models, tmp_path):
    tokenizer = Watched(load_tokenizer(Path(tiny_models["llama-tokenizer"])))
    log = setup_logging("warning")
    served = Served.of("tiny", 64, 64, None, max_choices=4, allow_ignore_eos=False)
    api = Api(
        Gateway(tmp_path, log, connect_wait_s=0.1),
        Prompts(tokenizer, 64, 320),
        served,
        keys=None,
        http=HttpSpec(),
        per_caller=4,
        log=log,
    )
    async with TestClient(TestServer(api.app())) as client:
        loop = threading.get_ident()
        # tokenized (and echoed: decoded), then refused "starting": this front has no bridge
        texts = {"model": "tiny", "prompt": ["a b c d " * 200] * 2, "max_tokens": 4, "echo": True}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "x " * 400}]}
        for path, body in (("/v1/completions", texts), ("/v1/chat/completions", chat)):
            answer = await client.post(path, json=body)
            assert answer.status == 503 and (await answer.json())["error"]["code"] == "starting"
        assert tokenizer.threads and loop not in tokenizer.threads
    api.close()
