"""etcd connection settings (elasticrun.store.settings): checked before any connection, knowing no job."""

from __future__ import annotations

import pytest

from elasticrun.errors import ConfigError
from elasticrun.store.settings import EtcdSettings


def test_the_password_comes_from_the_variable_the_caller_names(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SOME_PASSWORD", "s3cret")
    s = EtcdSettings("h:1", user="u", password_env="SOME_PASSWORD").resolved()
    assert s.password == "s3cret" and s.password_env is None and "s3cret" not in repr(s)


def test_a_user_without_a_password_is_one_line_naming_where_to_put_it(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("SOME_PASSWORD", raising=False)
    with pytest.raises(ConfigError, match="^etcd user 'u' has no password: set SOME_PASSWORD or pass "
                                          "--etcd-password-file FILE$"):
        EtcdSettings("h:1", user="u", password_env="SOME_PASSWORD").resolved()
    with pytest.raises(ConfigError, match="^etcd user 'u' has no password: pass --etcd-password-file FILE$"):
        EtcdSettings("h:1", user="u").resolved()
