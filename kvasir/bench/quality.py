"""``kvasir bench quality``: does the model a plan serves say what its file says?

Two measures, each set against a reference on the same model: the perplexity of a fixed
text (llama.cpp's own scheme: the text's tokens cut into chunks of ``n_ctx``, each chunk
scored on its second half, every token given all the chunk's tokens before it), and the
top-1 agreement of greedy tokens (the plan generates greedily from prompts cut from the
text; at each of its tokens, does the reference's most likely next token, given the same
prompt and the plan's tokens before, agree). The reference is llama.cpp on the GGUF file
(``llama-perplexity`` for the perplexity, ``llama-server`` for the next tokens;
kvasir/bench/llamacpp.py) or a second plan of the same model served by Kvasir (its
prompt log-probabilities). Everything on Kvasir's side goes through a real ``kvasird``.

The text is built from a package's text, the same for every run on one Python: the
standard library's ``pydoc_data.topics`` (the language reference's topics, English
prose with code), in sorted order, its first ``chars`` characters; the report names it
with its sha256.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from kvasir.bench.daemon import ManagedDaemon
from kvasir.client import AsyncClient
from kvasir.errors import KvasirError
from kvasir.wire.client import ErrorEvent, PromptLogprobs, TokenOut

TEXT_SOURCE = "pydoc_data.topics"

TopOne = Callable[[list[int], list[int]], Awaitable[list[int]]]


@dataclass(frozen=True)
class QualitySpec:
    chars: int = 40_000  # of the text
    n_ctx: int = 512  # tokens per perplexity chunk (llama-perplexity -c)
    prompts: int = 16  # greedy prompts, cut from the text at even strides
    prompt_len: int = 64
    new_tokens: int = 32  # greedy tokens per prompt
    ppl_margin: float = 0.02  # |plan / reference - 1| at most this
    min_agreement: float = 0.90  # top-1 agreement at least this

    def check(self) -> None:
        for name in ("chars", "n_ctx", "prompts", "prompt_len", "new_tokens"):
            if getattr(self, name) < 1:
                raise KvasirError(f"quality: {name} must be positive, got {getattr(self, name)}")
        if self.n_ctx < 4:
            raise KvasirError("quality: n_ctx must be at least 4")
        if not 0 <= self.min_agreement <= 1 or self.ppl_margin < 0:
            raise KvasirError("quality: the agreement is a fraction in [0, 1] and the margin is not negative")


def quality_text(chars: int) -> str:
    """The first ``chars`` characters of the standard library's pydoc topics, sorted."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))[:chars]


def text_facts(text: str, ids: list[int]) -> dict:
    digest = hashlib.sha256(text.encode()).hexdigest()
    return {"source": TEXT_SOURCE, "chars": len(text), "sha256": digest, "tokens": len(ids)}


def chunks(ids: list[int], n_ctx: int) -> list[list[int]]:
    """Whole chunks of ``n_ctx`` tokens (llama-perplexity drops the rest); at least two."""
    whole = [ids[start : start + n_ctx] for start in range(0, len(ids) - n_ctx + 1, n_ctx)]
    if len(whole) < 2:
        raise KvasirError(f"quality: the text has {len(ids)} tokens, fewer than two chunks of {n_ctx}")
    return whole


def prompts(ids: list[int], count: int, length: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens at even strides through the text."""
    stride = (len(ids) - length) // max(count, 1)
    if stride < 1:
        raise KvasirError(f"quality: {len(ids)} tokens are too few for {count} prompts of {length}")
    return [ids[i * stride : i * stride + length] for i in range(count)]


def perplexity(nll: float, count: int) -> float:
    return math.exp(nll / count)


async def scored_chunk(client: AsyncClient, chunk: list[int]) -> tuple[float, int]:
    """The negative log-likelihood of the chunk's second half (tokens n_ctx/2 + 1 on, each
    given every token before it in the chunk) and how many tokens that is."""
    first = len(chunk) // 2 + 1
    logprobs = await prompt_scores(client, chunk, top=0)
    picked = [logprob for position, (logprob, _) in logprobs.items() if position >= first]
    if len(picked) != len(chunk) - first:
        raise KvasirError(f"quality: the daemon scored {len(picked)} of the chunk's {len(chunk) - first} tokens")
    return -sum(picked), len(picked)


async def prompt_scores(client: AsyncClient, ids: list[int], top: int) -> dict[int, tuple[float, int | None]]:
    """Per prompt position (from 1): the token's log-probability and, with ``top`` = 1,
    the id the model found most likely there."""
    stream = await client.submit(token_ids=ids, max_tokens=1, temperature=0, prompt_logprobs=top)
    scores: dict[int, tuple[float, int | None]] = {}
    async for event in stream:
        if isinstance(event, PromptLogprobs):
            for offset, logprob in enumerate(event.logprobs):
                best = event.top_logprobs[offset] if top else []
                scores[event.first + offset] = (logprob, max(best, key=lambda pair: pair[1])[0] if best else None)
        elif isinstance(event, ErrorEvent):
            raise KvasirError(f"quality: the daemon refused a scoring request: {event.code}: {event.message}")
    return scores


async def greedy(client: AsyncClient, prompt: list[int], count: int) -> list[int]:
    stream = await client.submit(token_ids=prompt, max_tokens=count, temperature=0, ignore_eos=True)
    ids = []
    async for event in stream:
        if isinstance(event, ErrorEvent):
            raise KvasirError(f"quality: the daemon refused a greedy request: {event.code}: {event.message}")
        if isinstance(event, TokenOut):
            ids.append(event.token_id)
    return ids


def kvasir_top_one(client: AsyncClient) -> TopOne:
    """The next token a Kvasir daemon finds most likely at each of ``continuation``'s
    positions, given the prompt and the continuation before it: one scoring request."""

    async def top_one(prompt: list[int], continuation: list[int]) -> list[int]:
        scores = await prompt_scores(client, prompt + continuation, top=1)
        return [int(scores[len(prompt) + i][1] or -1) for i in range(len(continuation))]

    return top_one


async def kvasir_perplexity(client: AsyncClient, pieces: list[list[int]]) -> dict:
    nll, count = 0.0, 0
    for piece in pieces:
        piece_nll, piece_count = await scored_chunk(client, piece)
        nll, count = nll + piece_nll, count + piece_count
    return {"ppl": perplexity(nll, count), "scored_tokens": count}


async def agreement(continuations: list[list[int]], starts: list[list[int]], top_one: TopOne) -> dict:
    """The share of the plan's greedy tokens the reference would have chosen too."""
    same = total = 0
    for prompt, continuation in zip(starts, continuations, strict=True):
        theirs = await top_one(prompt, continuation)
        same += sum(a == b for a, b in zip(continuation, theirs, strict=True))
        total += len(continuation)
    return {"top1_agreement": same / max(total, 1), "positions": total}


def verdicts(spec: QualitySpec, ours: dict, reference: dict, agreed: dict) -> dict:
    ratio = ours["ppl"] / reference["ppl"]
    within = abs(ratio - 1) <= spec.ppl_margin
    enough = agreed["top1_agreement"] >= spec.min_agreement
    return {"ppl_ratio": ratio, "ppl_within_margin": within, "agreement_enough": enough, "passed": within and enough}


def run_quality(
    plan_path: Path,
    spec: QualitySpec,
    *,
    reference: str = "llama.cpp",
    llama_server: str | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> dict:
    """The plan's perplexity and greedy tokens against ``reference`` ("llama.cpp", or the
    path of a second plan of the same model): the report, its verdicts in ``checks``."""
    from kvasir.daemon.resolve import resolve_plan
    from kvasir.model.convert import prepare
    from kvasir.model.tokenizer import load_tokenizer

    spec.check()
    plan, source = resolve_plan(plan_path)
    source = prepare(source)
    tokenizer = load_tokenizer(source.weights_dir)
    if tokenizer is None:
        raise KvasirError(f"quality: model {source.name} has no tokenizer to cut the text with")
    text = quality_text(spec.chars)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    pieces, starts = chunks(ids, spec.n_ctx), prompts(ids, spec.prompts, spec.prompt_len)
    threads = sum(stage.threads for stage in plan.all_stages)
    with tempfile.TemporaryDirectory(prefix="kvasir-quality-") as folder:
        tmp = Path(folder)
        say(f"the plan: perplexity over {len(pieces)} chunks of {spec.n_ctx}, {len(starts)} greedy prompts")
        with ManagedDaemon(plan_path, tmp / "plan", len(plan.all_stages)) as daemon:
            ours, continuations = asyncio.run(_ours(daemon.runtime_dir, pieces, starts, spec.new_tokens))
        say(f"the reference: {reference}")
        if reference == "llama.cpp":
            gguf = source.stored_gguf
            if gguf is None:
                raise KvasirError(f"quality: llama.cpp reads GGUF files, and model {source.name!r} is a folder")
            context = Context(text, ids, starts, continuations, threads, tmp)
            theirs, agreed = _against_llama(context, gguf, llama_server, spec)
        else:
            theirs, agreed = _against_plan(Path(reference), source.name, pieces, starts, continuations, tmp)
    return {
        "plan": str(plan_path),
        "served": {"dtype": plan.model.dtype, "weights": plan.model.weights},
        "text": text_facts(text, ids),
        "n_ctx": spec.n_ctx,
        "chunks": len(pieces),
        "ours": ours,
        "reference": theirs,
        "agreement": agreed,
        "margins": {"ppl": spec.ppl_margin, "top1": spec.min_agreement},
        "checks": verdicts(spec, ours, theirs, agreed),
    }


@dataclass(frozen=True)
class Context:
    """What the reference is checked on: the text, its ids, the prompts and the plan's
    greedy continuations of them, the threads to give it, a folder for its files."""

    text: str
    ids: list[int]
    starts: list[list[int]]
    continuations: list[list[int]]
    threads: int
    folder: Path


async def _ours(runtime_dir: Path, pieces, starts, new_tokens: int) -> tuple[dict, list[list[int]]]:
    async with await AsyncClient.connect(runtime_dir) as client:
        ours = await kvasir_perplexity(client, pieces)
        continuations = await asyncio.gather(*(greedy(client, prompt, new_tokens) for prompt in starts))
    return ours, list(continuations)


def _against_llama(context: Context, gguf: Path, llama_server: str | None, spec: QualitySpec) -> tuple[dict, dict]:
    """llama-server's next tokens on the plan's greedy paths, then llama-perplexity."""
    from kvasir.bench.llamacpp import (
        LlamaServer,
        ServerSpec,
        find_binary,
        llama_perplexity,
        perplexity_binary,
        slot_context,
    )

    binary = find_binary(llama_server)
    slot = slot_context(spec.prompt_len + spec.new_tokens)
    with LlamaServer(ServerSpec(binary, gguf, context.threads, 1, slot), context.folder / "server.log") as server:
        tokens, agreed = asyncio.run(_llama_tokens_and_agreement(server.door, context))
    if tokens != context.ids:
        differ = next((i for i, (a, b) in enumerate(zip(tokens, context.ids, strict=False)) if a != b), None)
        raise KvasirError(
            f"quality: llama.cpp cuts the text into {len(tokens)} tokens, the model's tokenizer into "
            f"{len(context.ids)} (first difference at token {differ}): the perplexities would not compare"
        )
    path = context.folder / "text.txt"
    path.write_text(context.text)
    ppl = llama_perplexity(
        perplexity_binary(binary), gguf, path, spec.n_ctx, context.threads, context.folder / "perplexity.log"
    )
    return {"kind": "llama.cpp", "gguf": str(gguf), "ppl": ppl, "tokens_agree": True}, agreed


async def _llama_tokens_and_agreement(door, context: Context) -> tuple[list[int], dict]:
    from kvasir.bench.llamacpp import client_session, llama_tokens, llama_top_one

    async with client_session() as session:
        tokens = await llama_tokens(session, door, context.text)
        agreed = await agreement(context.continuations, context.starts, llama_top_one(session, door))
    return tokens, agreed


def _against_plan(path: Path, model: str, pieces, starts, continuations, tmp: Path) -> tuple[dict, dict]:
    """A second plan of the same model, served by Kvasir: its perplexity and next tokens."""
    from kvasir.daemon.resolve import resolve_plan

    plan, source = resolve_plan(path)
    if source.name != model:
        raise KvasirError(f"quality: the reference plan {path} serves {source.name!r}, not {model!r}")
    with ManagedDaemon(path, tmp / "reference", len(plan.all_stages)) as daemon:
        return asyncio.run(_plan_reference(daemon.runtime_dir, path, plan, pieces, starts, continuations))


async def _plan_reference(runtime_dir: Path, path: Path, plan, pieces, starts, continuations) -> tuple[dict, dict]:
    async with await AsyncClient.connect(runtime_dir) as client:
        theirs = await kvasir_perplexity(client, pieces)
        agreed = await agreement(continuations, starts, kvasir_top_one(client))
    served = {"dtype": plan.model.dtype, "weights": plan.model.weights}
    return {"kind": "plan", "plan": str(path), "served": served} | theirs, agreed
