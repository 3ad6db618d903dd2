"""The step worker's handshake: before the worker reads a request, the task proves that it holds the shared secret,
and the worker proves the same to the task.

The secret is `CTR_STEP_WORKER_SECRET`, in the worker's environment and in the tasks' (`ctr-pipeline stack up`
generates it into the stack's secrets file; docker-compose.yml refuses to start without it). The proof is
multiprocessing.connection's challenge-response, what its Listener and Client run when given an authkey: one side
sends a random message, the other answers with an HMAC of it under the secret, so the secret never crosses the
wire. Each side challenges the other, as Listener and Client do, so a task never takes a step's outcome from
whatever took the port of a worker that stopped. After the handshake the connection carries the step protocol's
JSON lines, unencrypted: the worker listens on loopback, or on the compose stack's private network.

    task                                           step worker
      connect --------------------------------------> challenge
      answer (HMAC of the challenge) ---------------> checked: a wrong or missing answer closes the connection
      <-------------------------------------------- welcome
      challenge -----------------------------------> answer
      welcome -------------------------------------> then the request, as before (pipelines/step_client.py)
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Mapping
from multiprocessing import AuthenticationError
from multiprocessing.connection import answer_challenge, deliver_challenge

from components.config import ConfigError

SECRET_VARIABLE = "CTR_STEP_WORKER_SECRET"
MIN_SECRET_LENGTH = 16
HANDSHAKE_TIMEOUT_S = 10.0  # a worker busy with a step (or a full garbage collection) still answers in time
_FRAME_HEADER = struct.Struct("!I")


class Refused(Exception):
    """The other side of a step worker's connection did not prove that it holds the shared secret; the message says
    how it failed."""


class _Garbled(Exception):
    """A message that is not one of the handshake's (a client that sends its request first, say)."""


class _Frames:
    """The two calls the challenge functions make on a connection, over a socket: each message a 4-byte length,
    then its bytes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(_FRAME_HEADER.pack(len(data)) + data)

    def recv_bytes(self, maxlength: int) -> bytes:
        (size,) = _FRAME_HEADER.unpack(self._exactly(_FRAME_HEADER.size))
        if size > maxlength:
            raise _Garbled(f"a message of {size} bytes where the handshake sends at most {maxlength}")
        return self._exactly(size)

    def _exactly(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise EOFError("the connection closed during the handshake")
            data += chunk
        return data


def worker_secret(environ: Mapping[str, str]) -> bytes | None:
    """The shared secret from `environ`, or None where it is not set."""
    value = environ.get(SECRET_VARIABLE, "")
    return value.encode() if value else None


def required_worker_secret(environ: Mapping[str, str]) -> bytes:
    """The shared secret the worker needs to start; a missing or short one is a ConfigError that says how to set it."""
    secret = worker_secret(environ)
    how = ("set it, the same, in the worker's environment and in the Airflow tasks' (`ctr-pipeline stack up` "
           "generates one; `python -c 'import secrets; print(secrets.token_urlsafe(24))'` makes one)")
    if secret is None:
        raise ConfigError(f"{SECRET_VARIABLE} is not set: the step worker refuses every task without it; {how}")
    if len(secret) < MIN_SECRET_LENGTH:
        raise ConfigError(f"{SECRET_VARIABLE} is {len(secret)} characters long, expected at least "
                          f"{MIN_SECRET_LENGTH}; {how}")
    return secret


def verify_client(sock: socket.socket, secret: bytes) -> bool:
    """The worker's side. Returns True once the client proved it holds `secret` (and heard the worker prove it),
    False when it closed without a word (a health check's connect-and-close); raises Refused, saying why, when it
    answered wrongly, with something else, or not at all within HANDSHAKE_TIMEOUT_S."""
    frames = _Frames(sock)
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        deliver_challenge(frames, secret)
    except AuthenticationError as err:
        raise Refused(f"its answer to the challenge does not match {SECRET_VARIABLE}: the client holds another "
                      "secret") from err
    except _Garbled as err:
        raise Refused(f"it sent something other than an answer to the challenge ({err}): a client without "
                      f"{SECRET_VARIABLE} or the handshake") from err
    except TimeoutError as err:
        raise Refused(f"it did not answer the challenge within {HANDSHAKE_TIMEOUT_S:.0f} s") from err
    except (EOFError, ConnectionError):
        return False
    try:
        answer_challenge(frames, secret)
    except (AuthenticationError, AssertionError, _Garbled, EOFError, OSError) as err:
        raise Refused(f"it did not take the worker's answer to its challenge ({type(err).__name__}: {err})") from err
    sock.settimeout(None)
    return True


def prove_to_worker(sock: socket.socket, secret: bytes) -> None:
    """The task's side: answers the worker's challenge, then checks the worker's answer to its own. Raises Refused
    when either side's secret is not the other's, or the peer does not speak the handshake; OSError or EOFError
    when the connection fails."""
    frames = _Frames(sock)
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        answer_challenge(frames, secret)
    except AuthenticationError as err:
        raise Refused(f"it refused this task's {SECRET_VARIABLE} (the worker holds another secret)") from err
    # answer_challenge asserts that the first message is a challenge.
    except (AssertionError, _Garbled) as err:
        raise Refused("what answers on its port does not speak the step worker's handshake") from err
    try:
        deliver_challenge(frames, secret)
    except AuthenticationError as err:
        raise Refused(f"it does not hold this task's {SECRET_VARIABLE}") from err
    except _Garbled as err:
        raise Refused("what answers on its port does not speak the step worker's handshake") from err
