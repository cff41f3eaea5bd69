"""An etcd a node starts (elasticrun.launch.etcdhome.member_server): the environment's binary and history."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest

from elasticrun.errors import ConfigError, StoreSetupError
from elasticrun.job import env as names
from elasticrun.launch.etcdhome import member_server
from elasticrun.store.compaction import Retention, parse_retention
from elasticrun.store.server import EtcdServer


def local_etcd(binary: Optional[str]) -> EtcdServer:
    """A member that is never started; its home is removed at once (what its stop would do)."""
    server = member_server("t", "n", binary)
    for remove in server.after_stop:
        remove()
    return server


def test_the_defaults(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(names.ETCD_BINARY, raising=False)
    monkeypatch.delenv(names.ETCD_COMPACTION_RETENTION, raising=False)
    server = local_etcd(None)
    assert server.retention == parse_retention("5m") and server.binary and server.binary.endswith("etcd")


def test_the_variables_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv(names.ETCD_BINARY, str(fake))
    monkeypatch.setenv(names.ETCD_COMPACTION_RETENTION, "10000rev")
    server = local_etcd(None)
    assert server.binary == str(fake) and server.retention == Retention("revision", "10000")
    assert local_etcd("/bin/sh").binary == "/bin/sh", "--etcd-binary before the variable"


def test_bad_values_name_their_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(names.ETCD_BINARY, str(tmp_path / "missing"))
    with pytest.raises(StoreSetupError, match=f"{names.ETCD_BINARY} points to"):
        local_etcd(None)
    monkeypatch.delenv(names.ETCD_BINARY)
    monkeypatch.setenv(names.ETCD_COMPACTION_RETENTION, "abc")
    with pytest.raises(ConfigError, match=f"{names.ETCD_COMPACTION_RETENTION} 'abc'"):
        local_etcd(None)
