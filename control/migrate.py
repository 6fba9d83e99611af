"""``python -m control migrate-state --to etcd|file``: move a control plane's state between backends.

Run with the control plane stopped, with the llmgw.toml that names both ends: ``state_dir`` (the
file backend's ``control-state.json``, ``join-token``, ``node-credentials.json`` and
``shard-key-secret``) and ``[state]`` with ``backend = "etcd"`` (endpoints, prefix, TLS, user). The
state document is copied as it is (``control.statestore.doc_keys``/``keys_doc``, checked by
``parse_state`` on the way), so nothing is re-interpreted; the join token, the node credential
digests and the shard key secret go with it, so agents keep their credentials and running engines
keep their keys. The target must be empty (no key under the prefix, no state file) unless
``--force``: a migration must not silently replace a fleet's state.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

import statefile
from control.config import ConfigError, ControlConfig, load
from control.etcd import EtcdConfig, EtcdError, Put, connect
from control.joins import CREDENTIALS_FILE, JOIN_TOKEN_FILE
from control.state import STATE_FILE, StateFileError, parse_state, write_state
from control.statestore import (
    CREDENTIALS,
    JOIN_TOKEN_KEY,
    SHARD_KEY_SECRET_KEY,
    EtcdStore,
    doc_keys,
    etcd_config,
    keys_doc,
    prefix_is_empty,
)

#: The shard key secret's file in ``state_dir`` (``control.plane.SHARD_KEY_SECRET``).
SHARD_KEY_SECRET_FILE = "shard-key-secret"


class MigrateError(Exception):
    """The migration cannot be done: the message says why and what to do."""


def _etcd_config(config: ControlConfig) -> EtcdConfig:
    state = config.state
    if state.backend != "etcd":
        raise MigrateError(
            "[state] backend is 'file': set backend = 'etcd' with its endpoints (and prefix) in the "
            "config, so that migrate-state knows where etcd is"
        )
    try:
        return etcd_config(state, os.environ)
    except ValueError as exc:
        raise MigrateError(str(exc)) from None


def _read_file_side(state_dir: Path) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """(state keys, other keys) from the files in ``state_dir``. Blocks on the filesystem."""
    path = state_dir / STATE_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise MigrateError(f"{path}: no state file to migrate") from None
    parse_state(text, path)  # refused here, naming the field, rather than copied damaged
    keys = doc_keys(json.loads(text))
    others: dict[str, bytes] = {}
    for name, key in ((JOIN_TOKEN_FILE, JOIN_TOKEN_KEY), (SHARD_KEY_SECRET_FILE, SHARD_KEY_SECRET_KEY)):
        try:
            others[key] = (state_dir / name).read_text().strip().encode()
        except FileNotFoundError:
            pass
    try:
        creds = json.loads((state_dir / CREDENTIALS_FILE).read_text())
    except FileNotFoundError:
        creds = {}
    for node_id, digest in creds.items():
        others[CREDENTIALS + node_id] = str(digest).encode()
    return keys, others


async def to_etcd(config: ControlConfig, *, force: bool) -> str:
    keys, others = await trio.to_thread.run_sync(_read_file_side, config.state_dir)
    prefix = config.state.prefix
    async with connect(_etcd_config(config)) as client:
        if not await prefix_is_empty(client, prefix):
            if not force:
                raise MigrateError(
                    f"etcd {prefix} is not empty (a fleet's state, or a running control plane's "
                    "leader key); stop its control planes and give --force to replace it"
                )
            await client.delete_prefix(prefix.encode())
        store = EtcdStore(client, prefix)
        await store.load()
        await store.write_keys(keys)
        items = sorted(others.items())
        for start in range(0, len(items), 100):
            await client.txn([], [Put((prefix + k).encode(), v) for k, v in items[start : start + 100]])
    return f"copied {config.state_dir / STATE_FILE} ({len(keys)} keys) and {len(others)} secret(s) to etcd {prefix}"


def _write_file_side(state_dir: Path, doc: dict[str, object], others: dict[str, bytes], force: bool) -> None:
    path = state_dir / STATE_FILE
    if path.exists() and not force:
        raise MigrateError(f"{path} exists; give --force to replace it")
    parse_state(json.dumps(doc), path)
    write_state(path, doc)
    if JOIN_TOKEN_KEY in others:
        statefile.write_atomic(
            state_dir / JOIN_TOKEN_FILE, others[JOIN_TOKEN_KEY].decode() + "\n", mode=0o600
        )
    if SHARD_KEY_SECRET_KEY in others:
        statefile.write_atomic(
            state_dir / SHARD_KEY_SECRET_FILE, others[SHARD_KEY_SECRET_KEY].decode() + "\n", mode=0o600
        )
    creds = {k[len(CREDENTIALS) :]: v.decode() for k, v in others.items() if k.startswith(CREDENTIALS)}
    statefile.write_atomic(
        state_dir / CREDENTIALS_FILE, json.dumps(creds, sort_keys=True, indent=1) + "\n", mode=0o600
    )


async def to_file(config: ControlConfig, *, force: bool) -> str:
    prefix = config.state.prefix
    async with connect(_etcd_config(config)) as client:
        store = EtcdStore(client, prefix)
        keys = await store.read_keys()
        result = await client.get_prefix(prefix.encode())
    others = {
        rel: kv.value
        for kv in result.kvs
        if (rel := kv.key[len(prefix) :].decode(errors="replace")) in (JOIN_TOKEN_KEY, SHARD_KEY_SECRET_KEY)
        or rel.startswith(CREDENTIALS)
    }
    doc = keys_doc(keys, prefix)
    if doc is None:
        raise MigrateError(f"etcd {prefix}: no state to migrate (no {prefix}format key)")
    config.state_dir.mkdir(parents=True, exist_ok=True)
    await trio.to_thread.run_sync(_write_file_side, config.state_dir, doc, others, force)
    return f"copied etcd {prefix} ({len(keys)} keys) and {len(others)} secret(s) to {config.state_dir / STATE_FILE}"


def main(argv: Sequence[str]) -> int:
    """``migrate-state``'s command line; exit 0 done, 1 refused or failed, 2 a usage mistake."""
    parser = argparse.ArgumentParser(
        prog="python -m control migrate-state",
        description="Move the control plane's state between the file (state_dir) and etcd ([state]); "
        "run it with the control plane stopped.",
    )
    parser.add_argument("--to", choices=("etcd", "file"), required=True, help="the backend to copy to")
    parser.add_argument(
        "--config",
        type=Path,
        default=Path(os.environ.get("LLMGW_CONFIG", "llmgw.toml")),
        metavar="PATH",
        help="the control plane's configuration (state_dir and [state]; default: $LLMGW_CONFIG, else llmgw.toml)",
    )
    parser.add_argument("--force", action="store_true", help="replace a state already at the target")
    args = parser.parse_args(argv)
    try:
        config = load(args.config)
    except ConfigError as exc:
        print(f"migrate-state: {exc}", file=sys.stderr)
        return 2
    try:
        done = trio.run(
            functools.partial(to_etcd if args.to == "etcd" else to_file, config, force=args.force)
        )
    except (MigrateError, StateFileError, EtcdError, OSError) as exc:
        print(f"migrate-state: {exc}", file=sys.stderr)
        return 1
    print(done)
    return 0


__all__ = ["MigrateError", "main", "to_etcd", "to_file"]
