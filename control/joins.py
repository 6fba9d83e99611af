"""Joining the cluster: the join token, the credential each node is issued, and where they are kept.

The way operators already know it (``kubeadm join --token``, ``gpustack start --token``): on its first
start the control plane creates one cluster join token in its state directory (``join-token``, mode
0600; ``ctl token`` prints it). An agent that presents it in its first Register is issued a credential
of its own, which it keeps in its own state directory and presents from then on. From that moment the
node id is bound to that credential: a second process holding only the join token (every node has it)
cannot speak for an already-joined node, so it cannot displace the real agent's stream or stop its
engines. ``ctl node reset NODE`` forgets a binding on purpose (a reinstalled node joins again).

Credentials are 256 random bits, so a plain SHA-256 of each is all that is stored (``node-credentials
.json``, mode 0600): a slow password hash protects guessable secrets, and these are not guessable.
The join token is kept as it is, since ``ctl token`` must be able to show it. Every comparison is in
constant time (``hmac.compare_digest``), and neither secret is ever logged or written anywhere else
(``control-state.json`` keeps Registers without them).

Files are read and written in worker threads by the callers (``trio.to_thread.run_sync``); the
methods here that touch the disk say so. With ``[state] backend = "etcd"`` the token and the digests
are etcd keys instead (``JoinBook.load_etcd``, ``control.statestore``): a join or a reset writes the
one node's key, fenced by the leader's, never the whole table.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import trio

import statefile
from control.statestore import JOIN_TOKEN_KEY

if TYPE_CHECKING:
    from control.statestore import EtcdStore

#: The cluster join token, in the control plane's state directory.
JOIN_TOKEN_FILE = "join-token"
#: node id -> SHA-256 (hex) of the credential that node was issued.
CREDENTIALS_FILE = "node-credentials.json"


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    """256 random bits, URL-safe text (a token an operator can paste, a credential an agent keeps)."""
    return secrets.token_urlsafe(32)


def same_secret(given: str, expected: str) -> bool:
    """Constant-time comparison of two secrets (their length is not secret)."""
    return hmac.compare_digest(given.encode(), expected.encode())


class JoinBook:
    """The join token and the node credential bindings of one control plane (see the module doc)."""

    def __init__(
        self,
        state_dir: Path,
        join_token: str,
        bindings: dict[str, str],
        created: bool,
        bind: Callable[[str, str | None], Awaitable[None]] | None = None,
        token_path: Path | None = None,
    ) -> None:
        self.state_dir = state_dir
        #: Where the token is kept, for ``ctl token`` and the log (the etcd key in etcd).
        self.token_path = token_path or state_dir / JOIN_TOKEN_FILE
        self.credentials_path = state_dir / CREDENTIALS_FILE
        self._join_token = join_token
        #: node id -> SHA-256 (hex) of its credential.
        self._bindings = bindings
        #: Whether this start created the join token (a first start).
        self.created = created
        #: Nodes issued a credential that their agent has not yet shown it kept (it has sent nothing
        #: after the Ack that carried it). Until then the join token may join the node again and be
        #: issued a new one: an Ack lost with its connection must not lock a new node out.
        self._unconfirmed: set[str] = set()
        #: The etcd backend's one-key write of a binding (None: forget it); None: the file.
        self._bind = bind
        # One join decision at a time: two first Registers for the same node id racing each other
        # must not both be issued a credential (the second would silently unbind the first).
        self.lock = trio.Lock()

    @classmethod
    def load(cls, state_dir: Path) -> JoinBook:
        """Read the join token (creating it, mode 0600, on a first start) and the bindings.

        Blocks (file I/O): run it in a worker thread. Raises ``OSError`` or ``ValueError`` with the
        file named when one cannot be read.
        """
        state_dir.mkdir(parents=True, exist_ok=True)
        token_path = state_dir / JOIN_TOKEN_FILE
        created = False
        try:
            token = token_path.read_text().strip()
        except FileNotFoundError:
            token = new_secret()
            statefile.write_atomic(token_path, token + "\n", mode=0o600)
            created = True
        if not token:
            raise ValueError(f"{token_path} is empty; delete it to have a new join token created")
        path = state_dir / CREDENTIALS_FILE
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raw = {}
        except ValueError as exc:
            raise ValueError(
                f"{path}: not valid JSON ({exc}); nodes cannot be checked against it. Restore it, or "
                "delete it to have every node join again with the join token"
            ) from exc
        if not isinstance(raw, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in raw.items()
        ):
            raise ValueError(f"{path}: expected an object of node id -> credential digest")
        return cls(state_dir, token, dict(raw), created)

    @classmethod
    async def load_etcd(cls, store: EtcdStore, state_dir: Path) -> JoinBook:
        """The join token and bindings kept in etcd (``control.statestore``): the token is made by
        the first control plane to start, and each binding is a key of its own."""
        token, bindings, created = await store.load_joins(new_secret())
        if not token:
            raise ValueError(
                f"{store.prefix}{JOIN_TOKEN_KEY} is empty in etcd; delete it to have a new one made"
            )
        return cls(state_dir, token, bindings, created, store.bind, Path(store.prefix + JOIN_TOKEN_KEY))

    # -- checks (pure) --------------------------------------------------------------------------

    def is_join_token(self, token: str) -> bool:
        return bool(token) and same_secret(token, self._join_token)

    def join_token(self) -> str:
        """The join token itself, for ``ctl token`` (the admin API's, never a log's)."""
        return self._join_token

    def bound(self, node_id: str) -> bool:
        return node_id in self._bindings

    def may_join_again(self, node_id: str) -> bool:
        """True while ``node_id``'s credential is unconfirmed (see ``confirm``)."""
        return node_id in self._unconfirmed

    def confirm(self, node_id: str) -> None:
        """The agent sent something after the Ack with its credential, which it sends only once it
        has kept the credential: from now on only the credential speaks for the node."""
        self._unconfirmed.discard(node_id)

    def is_credential_of(self, node_id: str, credential: str) -> bool:
        expected = self._bindings.get(node_id)
        return expected is not None and bool(credential) and same_secret(_digest(credential), expected)

    def nodes(self) -> list[str]:
        return sorted(self._bindings)

    # -- changes (on disk before they return) ---------------------------------------------------

    async def issue(self, node_id: str) -> str:
        """Bind ``node_id`` to a new credential and return it; the binding is on disk first, so a
        credential the agent was given is never one a restarted control plane does not know."""
        credential = new_secret()
        digest = _digest(credential)
        bindings = {**self._bindings, node_id: digest}
        await self._persist(node_id, digest, bindings)
        self._bindings = bindings
        self._unconfirmed.add(node_id)
        return credential

    async def reset(self, node_id: str) -> bool:
        """Forget ``node_id``'s credential (it joins again with the join token); False: none was kept."""
        async with self.lock:
            if node_id not in self._bindings:
                return False
            bindings = {k: v for k, v in self._bindings.items() if k != node_id}
            await self._persist(node_id, None, bindings)
            self._bindings = bindings
            self._unconfirmed.discard(node_id)
            return True

    async def _persist(self, node_id: str, digest: str | None, bindings: dict[str, str]) -> None:
        """One binding changed: one key in etcd, or the whole (small) file rewritten."""
        if self._bind is not None:
            await self._bind(node_id, digest)
        else:
            await trio.to_thread.run_sync(self._save, bindings)

    def _save(self, bindings: dict[str, str]) -> None:
        statefile.write_atomic(
            self.credentials_path, json.dumps(bindings, sort_keys=True, indent=1) + "\n", mode=0o600
        )


__all__ = ["CREDENTIALS_FILE", "JOIN_TOKEN_FILE", "JoinBook", "new_secret", "same_secret"]
