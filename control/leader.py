"""One leader among the control planes sharing an etcd prefix (``[state] backend = "etcd"``).

Each control plane campaigns for ``<prefix>leader``: a key put only if it does not exist (a txn on
its create revision being 0), attached to a lease this control plane keeps alive
(``control.etcd.LeaseKeeper``). The one whose put succeeded leads; its epoch is the key's create
revision, which etcd makes larger at every election. Every state write the leader makes is fenced by
``fence()`` (the key's create revision and value still ours), so a deposed leader's write changes
nothing. The others wait for the key's deletion (the lease lapsed or was revoked), seen through a
watch, and campaign again.

A leader that loses its lease (``EtcdLeaseLost``) or has a write refused stops: the control plane's
run ends with ``SteppedDown`` and the process exits, to start again as a standby. Stopping is the
simplest way to be sure a deposed leader sends nothing more.
"""

from __future__ import annotations

import logging

import attrs

from control.etcd import Compare, EtcdClient, LeaseKeeper, Put

log = logging.getLogger("control.leader")

#: The leader key, under the prefix.
LEADER_KEY = "leader"


class SteppedDown(Exception):
    """This control plane led and no longer does (its lease lapsed, or a fenced write failed)."""


@attrs.frozen
class Led:
    """This control plane leads: at ``epoch`` (the leader key's create revision)."""

    epoch: int
    key: bytes
    value: bytes

    def fence(self) -> list[Compare]:
        """The comparisons every write of this leader carries."""
        return [
            Compare.create_revision(self.key, "==", self.epoch),
            Compare.value(self.key, "==", self.value),
        ]


async def campaign(client: EtcdClient, prefix: str, member: str, keeper: LeaseKeeper) -> Led:
    """Return once this control plane leads (waiting, as a standby, while another does).

    ``member`` names this control plane to the others (its agent address); the leader key holds it,
    attached to ``keeper``'s lease, so the key goes when this process stops renewing."""
    key = (prefix + LEADER_KEY).encode()
    value = member.encode()
    announced = b""
    while True:
        result = await client.txn([Compare.create_revision(key, "==", 0)], [Put(key, value, lease=keeper.id)])
        current = await client.get(key)
        if result.succeeded and current is not None and current.value == value:
            log.info("leading (epoch %d, lease TTL %d s)", current.create_revision, keeper.lease.ttl)
            return Led(current.create_revision, key, value)
        if current is None:
            continue  # it lapsed between the two requests: campaign again
        if current.value != announced:
            log.info(
                "standby: %s leads (epoch %d); waiting for its lease",
                current.value.decode(errors="replace"),
                current.create_revision,
            )
            announced = current.value
        async with client.watch(key, start_revision=current.mod_revision + 1) as watch:
            async for batch in watch:
                if any(event.type == "delete" for event in batch.events):
                    break


__all__ = ["LEADER_KEY", "Led", "SteppedDown", "campaign"]
