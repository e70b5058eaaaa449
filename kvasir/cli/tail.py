"""``kvasir tail``: every request's tokens as the daemon publishes them."""

from __future__ import annotations

import sys

import click

from kvasir.cli.common import RUNTIME_DIR, connect, event_json


@click.command()
@click.option("--request", "request_id", type=int, default=None, help="Only this request's tokens.")
@click.option("--json", "as_json", is_flag=True, help="One JSON token object per line.")
@click.option("--count", type=int, default=None, help="Exit after this many token events.")
@RUNTIME_DIR
def tail(request_id, as_json, count, runtime_dir) -> None:
    """Print token events live as they leave the tail, until interrupted."""
    import zmq

    from kvasir.transport.channels import Endpoints
    from kvasir.wire.client import TokenOut
    from kvasir.wire.decoding import Decoder, Malformed

    client = connect(runtime_dir)  # checks that a daemon answers
    rt = client._client.runtime_dir
    client.close()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(Endpoints(rt).events)
    decoder: Decoder[TokenOut] = Decoder(TokenOut)
    seen = 0
    try:
        while count is None or seen < count:
            if not sub.poll(1000):
                if not Endpoints(rt).client_path.exists():
                    click.echo("error: the daemon stopped", err=True)
                    sys.exit(3)
                continue
            try:
                event = decoder.decode(sub.recv())
            except Malformed as exc:
                click.echo(f"warning: skipped an event that does not decode: {exc}", err=True)
                continue
            if request_id is not None and event.request_id != request_id:
                continue
            seen += 1
            if as_json:
                click.echo(event_json(event))
            else:
                click.echo(f"{event.request_id}\t{event.index}\t{event.token_id}\t{event.text!r}")
    except KeyboardInterrupt:
        pass
    finally:
        ctx.destroy(linger=0)
