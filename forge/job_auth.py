"""The secret of a multi-host job and the handshake that proves a peer holds it (no torch, no Monarch).

The controller makes the secret (`make_job_secret`); the processes on its own host inherit it, and the provisioner
puts it in the environment of each process it spawns on another host, never on a command line. forge's own
sockets between hosts serve only a peer that proves it holds it: the weight relays' SegmentServers
(forge/weights/relay.py) and the controller's lifeline (forge/hosts/host_mesh.py). The handshake, once per connection:

1. the server sends `hello` (which service this is) and a fresh challenge;
2. the client answers with its own challenge and an HMAC-SHA256 of both under the secret;
3. the server answers with its own HMAC of both, which the client checks.

A client without the secret gets the hello and the end of the connection; one that says nothing is dropped after
HANDSHAKE_TIMEOUT_S. Nothing is encrypted: the trust boundary is the job's private network (docs/several_hosts.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket

SECRET_VARIABLE = "FORGE_JOB_SECRET"
_SECRET_MIN_CHARS = 32
# A client has this long to prove it holds the secret (a job's process answers within milliseconds): one that stays
# silent or says something else is dropped.
HANDSHAKE_TIMEOUT_S = 5.0
NONCE_BYTES = 32
MAC_BYTES = hashlib.sha256().digest_size


class JobAuthenticationError(ConnectionError):
    """A server and its client do not hold the same job secret (or the peer is not the service it should be)."""


def make_job_secret() -> str:
    """This controller's job secret, made on the first call (a value the user exported wins), in this process's
    environment so that the processes it spawns inherit it."""
    os.environ.setdefault(SECRET_VARIABLE, secrets.token_hex(32))
    return job_secret().decode()


def job_secret() -> bytes:
    """The job's secret in a process of the job; raises where it was not passed (no process outside a multi-host
    job's needs it) or is too short to be one."""
    value = os.environ.get(SECRET_VARIABLE)
    if value is None:
        raise RuntimeError(f"{SECRET_VARIABLE} is not set in this process: a multi-host job's controller passes it "
                           "to every process it spawns (forge.provisioner)")
    if len(value) < _SECRET_MIN_CHARS:
        raise RuntimeError(f"{SECRET_VARIABLE}: {len(value)} characters; a job secret needs at least "
                           f"{_SECRET_MIN_CHARS} (unset it and the controller makes one)")
    return value.encode()


def proof(secret: bytes, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """HMAC of both challenges under the job's secret; `role` keeps a client's proof from serving as a server's."""
    return hmac.new(secret, role + server_nonce + client_nonce, hashlib.sha256).digest()


def client_proved(connection: socket.socket, secret: bytes, hello: bytes) -> bool:
    """The server's half: challenge the client; once it proved it holds `secret`, prove this server does too. False
    when its proof is wrong; raises OSError when it stays silent past the connection's timeout or goes."""
    server_nonce = os.urandom(NONCE_BYTES)
    connection.sendall(hello + server_nonce)
    answer = receive_exactly(connection, NONCE_BYTES + MAC_BYTES)
    client_nonce, given = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(given, proof(secret, b"client", server_nonce, client_nonce)):
        return False
    connection.sendall(proof(secret, b"server", server_nonce, client_nonce))
    return True


def prove_to_server(connection: socket.socket, secret: bytes, hello: bytes, address: tuple[str, int]) -> None:
    """The client's half: answer the server's challenge, then check that the server holds `secret` too. Raises
    JobAuthenticationError when either side lacks it."""
    where = f"{address[0]}:{address[1]}"
    received = receive_exactly(connection, len(hello) + NONCE_BYTES)
    if not received.startswith(hello):
        raise JobAuthenticationError(f"{where} is not a {hello.decode(errors='replace').strip()}")
    server_nonce, client_nonce = received[len(hello):], os.urandom(NONCE_BYTES)
    connection.sendall(client_nonce + proof(secret, b"client", server_nonce, client_nonce))
    try:
        answer = receive_exactly(connection, MAC_BYTES)
    except ConnectionError:
        raise JobAuthenticationError(f"{where} refused this process's proof of the job's secret ({SECRET_VARIABLE} "
                                     "differs: a process of another job?)") from None
    if not hmac.compare_digest(answer, proof(secret, b"server", server_nonce, client_nonce)):
        raise JobAuthenticationError(f"{where} does not hold this job's secret")


def connect(address: tuple[str, int], secret: bytes, hello: bytes, timeout: float | None) -> socket.socket:
    """A connection to the server at `address` past the handshake (bounded by HANDSHAKE_TIMEOUT_S); `timeout`
    applies from then on."""
    connection = socket.create_connection(address, timeout=HANDSHAKE_TIMEOUT_S)
    try:
        prove_to_server(connection, secret, hello, address)
        connection.settimeout(timeout)
    except BaseException:
        connection.close()
        raise
    return connection


def receive_exactly(connection: socket.socket, count: int, peer: str = "the peer") -> bytes:
    data = b""
    while len(data) < count:
        chunk = connection.recv(count - len(data))
        if not chunk:
            raise ConnectionError(f"{peer} closed the connection")
        data += chunk
    return data
