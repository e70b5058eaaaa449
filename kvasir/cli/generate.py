"""``kvasir generate``: one request, its tokens streamed to stdout."""

from __future__ import annotations

import sys

import click

from kvasir.cli.common import RUNTIME_DIR, connect, event_json, remote_options


def shaping_options(command):
    """The logits' processing (kvasir/stage/logits.py), vLLM's meanings."""
    options = [
        click.option(
            "--presence-penalty",
            type=float,
            default=0.0,
            show_default=True,
            help="Minus this for each token the output has (-2 to 2).",
        ),
        click.option(
            "--frequency-penalty",
            type=float,
            default=0.0,
            show_default=True,
            help="Minus this times each token's count in the output (-2 to 2).",
        ),
        click.option(
            "--repetition-penalty",
            type=float,
            default=1.0,
            show_default=True,
            help="Tokens of the prompt or output: logits divided by it (> 0; 1 is off).",
        ),
        click.option(
            "--min-p",
            type=float,
            default=0.0,
            show_default=True,
            help="Drop tokens less likely than this times the best (0 to 1).",
        ),
        click.option(
            "--logit-bias",
            "logit_bias",
            multiple=True,
            metavar="ID=BIAS",
            help="Add BIAS (-100 to 100) to token ID's logit; repeatable.",
        ),
        click.option(
            "--min-tokens",
            type=int,
            default=0,
            show_default=True,
            help="No end of sequence or stop token before this many.",
        ),
        click.option(
            "--bad-word",
            "bad_words",
            multiple=True,
            metavar="TEXT",
            help="Never complete TEXT in the output; repeatable.",
        ),
        click.option(
            "--keep-special-tokens", is_flag=True, help="Keep special tokens (end of sequence...) in the text."
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def shaping_of(*, logit_bias, bad_words, keep_special_tokens, **penalties) -> dict:
    """The client library's keywords for the options ``shaping_options`` adds."""
    bias = {}
    for item in logit_bias:
        token, sep, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise click.UsageError(f"--logit-bias is ID=BIAS (e.g. 42=-5.5), got {item!r}") from None
        if not sep:
            raise click.UsageError(f"--logit-bias is ID=BIAS (e.g. 42=-5.5), got {item!r}")
    return {
        **penalties,
        "logit_bias": bias,
        "bad_words": list(bad_words),
        "skip_special_tokens": not keep_special_tokens,
    }


@click.command()
@click.argument("prompt", required=False)
@click.option("--ids", help="Submit these comma-separated token ids instead of PROMPT text.")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="Output tokens at most.")
@click.option("--temperature", type=float, default=0.7, show_default=True, help="0 means greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 means off.")
@click.option("--seed", type=int, default=None, help="Same seed, same output.")
@click.option("--chat", is_flag=True, help="Wrap PROMPT in the model's chat template.")
@click.option(
    "--cache-salt",
    default=None,
    help="Share prefix-cache blocks only with requests giving the same salt (your tenant's, see [kv] prefix_share).",
)
@click.option(
    "--no-speculative",
    is_flag=True,
    help="No draft tokens for this request where the plan has [speculative] (the output is the same).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event line (token ids included).")
@shaping_options
@RUNTIME_DIR
@remote_options
def generate(
    *,
    prompt,
    ids,
    max_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    chat,
    cache_salt,
    no_speculative,
    as_json,
    runtime_dir,
    remote,
    **shaping,
) -> None:
    """Generate from PROMPT (or --ids) and stream the text as it arrives.

    Exit code: 0 finished, 1 error or cancelled, 2 bad arguments, 3 no daemon.
    """
    from kvasir.wire.client import Cancelled, ErrorEvent, Finished, TokenOut

    if (prompt is None) == (ids is None):
        raise click.UsageError("give PROMPT text or --ids, not both and not neither")
    token_ids = None
    if ids is not None:
        try:
            token_ids = [int(part) for part in ids.split(",") if part.strip()]
        except ValueError:
            raise click.UsageError(f"--ids must be comma-separated integers, got {ids!r}") from None
    client = connect(runtime_dir, remote=remote)
    code = 1
    printed = False
    stream = None
    try:
        stream = client.submit(
            prompt,
            token_ids=token_ids,
            chat=chat,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            cache_salt=cache_salt,
            speculative=not no_speculative,
            **shaping_of(**shaping),
        )
        for event in client.events(stream):
            if as_json:
                click.echo(event_json(event))
            elif isinstance(event, TokenOut):
                click.echo(event.text if token_ids is None else f"{event.token_id} ", nl=False)
                printed = True
            elif isinstance(event, Finished):
                click.echo("")
            elif isinstance(event, (ErrorEvent, Cancelled)):
                if printed:
                    click.echo("")
                label = f"{event.code}: {event.message}" if isinstance(event, ErrorEvent) else "cancelled"
                click.echo(f"error: {label}", err=True)
            if isinstance(event, Finished):
                code = 0
    except KeyboardInterrupt:
        if stream is not None and stream.request_id is not None:
            try:
                client.cancel(stream.request_id)
            except Exception:
                pass  # the daemon may be going away too
        click.echo("", err=True)
        code = 130
    finally:
        client.close()
    sys.exit(code)
