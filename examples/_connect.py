"""One line instead of a traceback when an example cannot use the server it was pointed at.

The examples that talk to a running server (ACTAE_URL and ACTAE_API_KEY, or --url and --key) do
their work inside `plainly(script, url)`:

    with _connect.plainly("fork_demo.py", args.url):
        return asyncio.run(run(args))

When the SDK says the server refused the key (`AuthError`: a 401), that the key may not touch the
example's channels (`APIError` 403), that nothing answers at the address (`ActaeConnectionError`
from a refused or unresolvable connection), or that what answers there is not an Actae server (a
page where Actae answers JSON, or no WebSocket at /ws), the program ends with one line on stderr
naming what to fix, and exit status 2. Any other error propagates as before, traceback and all.

`fork_demo.py` opens the SDK's WebSocket (`client.connect()`) inside `holding_websocket_errors()`:
the SDK logs the server's refusal of the key there ("WebSocket error: ...") before it raises
`AuthError` with the same words, so that log line is held back and dropped when the refusal
follows, and logged as before otherwise.

The examples import it as `import _connect` after putting their own folder on sys.path (so it is
found also when a test loads an example by its file path).
"""
from __future__ import annotations

import contextlib
import logging
import sys

import aiohttp
from actae_client import ActaeConnectionError, APIError, AuthError

EXIT_STATUS = 2
NEW_KEY = "python actae.py key create --name examples --read '*' --write '*'"


def plain_line(script: str, url: str, error: BaseException) -> str | None:
    """The one line `script` prints for `error` from the server at `url`, or None when it is none of
    the cases above."""
    url = (url or "").rstrip("/")
    if isinstance(error, AuthError):
        if "timed out" in str(error):       # the WebSocket got no answer to its auth frame: not a refusal
            return None
        return (f"{script}: the server at {url} refused the API key (401): set ACTAE_API_KEY to a key"
                f" of that server ({NEW_KEY})")
    if isinstance(error, APIError) and error.status_code == 403:
        return (f"{script}: the server at {url} does not let this API key do what the example does"
                f" ({error}): set ACTAE_API_KEY to a key that may read and write channels ({NEW_KEY})")
    bare = isinstance(error, APIError) and str(error) == f"HTTP {error.status_code}"
    if bare and error.status_code in (404, 405, 501):
        # The SDK passes no message when the body is not a JSON object: Actae answers its API's
        # unknown routes and methods with one, another web server with a page.
        return not_actae(script, url, f"HTTP {error.status_code}, not Actae's JSON")
    if isinstance(error, ActaeConnectionError):
        cause = error.__cause__
        if isinstance(cause, aiohttp.WSServerHandshakeError):
            return not_actae(script, url, f"its /ws answered HTTP {cause.status}")
        if isinstance(cause, aiohttp.ContentTypeError):
            return not_actae(script, url, f"HTTP {cause.status}, not JSON")
        if isinstance(cause, aiohttp.ClientConnectorError) and not isinstance(cause, aiohttp.ClientSSLError):
            return f"{script}: nothing answers at {url}: start the server (python actae.py) or set ACTAE_URL"
    return None


def not_actae(script: str, url: str, why: str) -> str:
    """The line for an address where something other than an Actae server answers."""
    return (f"{script}: what answers at {url} is not an Actae server ({why}): set ACTAE_URL to the address"
            f" the server printed (its Dashboard: line)")


@contextlib.contextmanager
def plainly(script: str, url: str):
    """Run the block; end the program with `plain_line`'s line and exit status 2 when it has one."""
    try:
        yield
    except (AuthError, APIError, ActaeConnectionError) as error:
        line = plain_line(script, url, error)
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        raise SystemExit(EXIT_STATUS) from None


@contextlib.contextmanager
def holding_websocket_errors():
    """Around `await client.connect()`: hold back the SDK's "WebSocket error: ..." log records; drop them
    when the block raises AuthError (`plainly` says the refusal in its line), log them otherwise."""
    logger = logging.getLogger("actae_client")
    held: list = []

    def hold(record: logging.LogRecord) -> bool:
        if record.msg == "WebSocket error: %s":
            held.append(record)
            return False
        return True

    logger.addFilter(hold)
    try:
        yield
    except AuthError:
        held.clear()
        raise
    finally:
        logger.removeFilter(hold)
        for record in held:
            logger.handle(record)
