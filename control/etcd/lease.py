"""Keeping an etcd lease alive, and knowing, on our own clock, until when it is surely ours.

``LeaseKeeper.run`` renews every TTL/3. A renewal sent at ``t`` that etcd answers with TTL ``ttl``
makes the lease ours until ``t + ttl`` at the earliest (etcd counts from when it received the
renewal, which is after ``t``): that is ``valid_until``, the instant a leader must have stopped acting
by. A renewal that fails is tried again until ``valid_until``; when that passes, or etcd says the
lease is gone, the keeper sets ``lost`` and raises ``EtcdLeaseLost``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import trio

from control.etcd.errors import EtcdError, EtcdLeaseLost
from control.etcd.values import Lease

if TYPE_CHECKING:
    from control.etcd.client import EtcdClient


class LeaseKeeper:
    """One lease and its renewals. Made by ``EtcdClient.keeper``."""

    def __init__(self, client: EtcdClient, lease: Lease, granted_at: float) -> None:
        self.client = client
        self.lease = lease
        #: trio's clock: until when the lease is ours at the least (see the module's docstring).
        self.valid_until = granted_at + lease.ttl
        #: Set once the lease is lost (or revoked through ``revoke``); ``lost_reason`` says why.
        self.lost = trio.Event()
        self.lost_reason = ""
        #: Renewals that etcd answered.
        self.renewals = 0

    @property
    def id(self) -> int:
        return self.lease.id

    def valid(self, margin: float = 0.0) -> bool:
        """Whether the lease is surely still ours ``margin`` seconds from now: a leader asks this
        before each command with a margin for the time the command takes to be acted on."""
        return not self.lost.is_set() and trio.current_time() + margin < self.valid_until

    def _lose(self, reason: str) -> NoReturn:
        self.lost_reason = reason
        self.lost.set()
        raise EtcdLeaseLost(f"etcd lease {self.lease.id:x}: {reason}")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        """Renew until cancelled or lost; raises ``EtcdLeaseLost`` on loss (``lost`` is set first)."""
        task_status.started()
        interval = max(self.lease.ttl / 3, 0.1)
        next_renewal = trio.current_time() + interval
        while True:
            await trio.sleep_until(min(next_renewal, self.valid_until))
            last_error = ""
            while True:
                now = trio.current_time()
                if now >= self.valid_until:
                    self._lose(
                        f"not renewed within its TTL of {self.lease.ttl} s ({last_error or 'no answer'})"
                    )
                try:
                    with trio.fail_after(self.valid_until - now):
                        renewed = await self.client.keepalive_once(self.lease.id)
                except EtcdLeaseLost as exc:
                    self._lose(str(exc))
                except trio.TooSlowError:
                    continue  # valid_until has passed: lost, above
                except EtcdError as exc:  # unavailable, or refused: tried again until valid_until
                    last_error = str(exc)
                    # Try again soon, but not in a tight loop against a cluster without quorum.
                    await trio.sleep(min(interval / 4, max(self.valid_until - trio.current_time(), 0)))
                    continue
                self.renewals += 1
                self.valid_until = now + renewed.ttl
                next_renewal = now + max(renewed.ttl / 3, 0.1)
                break

    async def revoke(self) -> None:
        """Give the lease up now (its keys are deleted); ``lost`` is set so that whatever relied on
        it stops."""
        self.lost_reason = "revoked"
        self.lost.set()
        await self.client.revoke(self.lease.id)
