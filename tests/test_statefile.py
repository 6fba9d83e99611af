"""statefile: the one atomic, durable write every state file goes through."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
import trio

import statefile
from agent.session import CREDENTIAL_FILE, read_credential, write_credential
from agent.supervise.records import RecordStore
from control.joins import CREDENTIALS_FILE, JOIN_TOKEN_FILE, JoinBook
from control.plane import SHARD_KEY_SECRET, load_shard_key_secret
from control.state import STATE_FILE, write_state


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_writes_the_contents_with_the_mode_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    assert statefile.write_atomic(target, "héllo\n") is True
    assert target.read_bytes() == "héllo\n".encode()
    assert _mode(target) == 0o600
    statefile.write_atomic(tmp_path / "open", b"x", mode=0o644)
    assert _mode(tmp_path / "open") == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["open", "state.json"]


def test_replaces_and_tightens_a_looser_file(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text("old")
    os.chmod(target, 0o644)
    statefile.write_atomic(target, b"new")
    assert target.read_text() == "new"
    assert _mode(target) == 0o600


def test_a_leftover_temporary_file_does_not_lend_its_mode(tmp_path: Path) -> None:
    target = tmp_path / "secret"
    leftover = statefile.temp_path(target)
    leftover.write_text("half a secret")
    os.chmod(leftover, 0o666)
    statefile.write_atomic(target, "whole")
    assert (target.read_text(), _mode(target)) == ("whole", 0o600)
    assert not leftover.exists()


def test_without_replace_an_existing_file_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "secret"
    assert statefile.write_atomic(target, "first", replace=False) is True
    assert statefile.write_atomic(target, "second", replace=False) is False
    assert target.read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]


def test_a_failed_write_leaves_the_target_and_no_temporary_file(tmp_path: Path) -> None:
    # The target is a non-empty directory: the rename fails after the temporary file was written.
    target = tmp_path / "busy"
    target.mkdir()
    (target / "inside").write_text("kept")
    with pytest.raises(OSError):
        statefile.write_atomic(target, "new")
    assert (target / "inside").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]
    # A directory that does not exist: the error names the temporary file's path, nothing is made.
    with pytest.raises(FileNotFoundError):
        statefile.write_atomic(tmp_path / "nowhere" / "file", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]


async def test_the_trio_wrapper_writes_and_keeps_an_existing_file_when_asked(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    assert await statefile.write_atomic_async(target, "a") is True
    assert await statefile.write_atomic_async(target, "b", replace=False) is False
    assert target.read_text() == "a"


def test_every_state_file_is_0600(tmp_path: Path) -> None:
    """The files the agent and control plane keep, each through statefile, each private; the control
    plane's own state file included, even where an older version left it 0644."""
    state = tmp_path / "cp"
    state.mkdir()
    (state / STATE_FILE).write_text("{}")
    os.chmod(state / STATE_FILE, 0o644)
    write_state(state / STATE_FILE, {"nodes": {}, "placements": []})
    JoinBook.load(state)
    load_shard_key_secret(state)
    trio.run(JoinBook.load(state).issue, "gpu07")
    for name in (STATE_FILE, JOIN_TOKEN_FILE, CREDENTIALS_FILE, SHARD_KEY_SECRET):
        assert _mode(state / name) == 0o600, name
    agent = tmp_path / "agent"
    write_credential(agent, "gpu07", "c" * 43)
    assert read_credential(agent, "gpu07") == "c" * 43
    assert _mode(agent / CREDENTIAL_FILE) == 0o600
    assert sorted(p.name for p in state.iterdir() if p.name.endswith(statefile.TEMP_SUFFIX)) == []


def test_a_record_store_removes_leftovers_of_an_interrupted_write(tmp_path: Path) -> None:
    store = RecordStore(tmp_path)
    store.create()
    leftover = statefile.temp_path(store.path("chat-r0-s0"))
    leftover.write_text("{")
    assert store.load_all() == []
    assert not leftover.exists()


def test_without_hard_links_a_new_file_is_still_made_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Some FUSE and SMB mounts refuse link(): the file is made all the same, and kept after."""

    def no_links(src: object, dst: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    target = tmp_path / "secret"
    assert statefile.write_atomic(target, "first", replace=False) is True
    assert statefile.write_atomic(target, "second", replace=False) is False
    assert (target.read_text(), _mode(target)) == ("first", 0o600)
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]
