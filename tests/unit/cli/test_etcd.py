"""`elasticrun etcd`: which combinations of the security flags are refused, and when it warns (no etcd)."""

from __future__ import annotations

from typing import Any, Optional

import pytest

from elasticrun.cli.etcd import exposure_warning, security_problem

TLS = {"cert_file": "s.crt", "key_file": "s.key"}


def problem(**flags: Any) -> Optional[str]:
    every = dict(cert_file=None, key_file=None, client_ca=None, root_password_file=None, job_users=[], ca_file=None,
                 admin_cert=None, admin_key=None)
    every.update(flags)
    return security_problem(**every)


@pytest.mark.parametrize("flags", [
    {},
    TLS,
    dict(TLS, client_ca="ca.crt"),
    dict(TLS, root_password_file="root.pw", ca_file="ca.crt", job_users=["j:j.pw"]),
    dict(TLS, root_password_file="root.pw", client_ca="ca.crt", admin_cert="a.crt", admin_key="a.key"),
])
def test_consistent_flags_pass(flags):
    assert problem(**flags) is None


@pytest.mark.parametrize("flags, says", [
    ({"cert_file": "s.crt"}, "TLS needs both --cert-file and --key-file"),
    ({"key_file": "s.key"}, "TLS needs both --cert-file and --key-file"),
    ({"client_ca": "ca.crt"}, "--client-ca needs --cert-file/--key-file"),
    (dict(TLS, job_users=["j:j.pw"]), "--job-user needs --root-password-file"),
    ({"root_password_file": "root.pw"}, "--root-password-file needs TLS"),
    (dict(TLS, root_password_file="root.pw"), "--root-password-file needs --ca-file"),
    (dict(TLS, root_password_file="root.pw", client_ca="ca.crt", admin_cert="a.crt"),
     "with --client-ca, setting up users needs a client certificate: pass --admin-cert and --admin-key"),
])
def test_contradictions_are_one_line_saying_what_to_pass(flags, says):
    found = problem(**flags)
    assert found is not None and found.startswith(says) and "\n" not in found


def test_the_first_problem_is_the_one_said():
    assert problem(cert_file="s.crt", job_users=["j:j.pw"]) == "TLS needs both --cert-file and --key-file"


def test_warns_only_beyond_loopback_without_tls_and_authentication():
    for host in ("127.0.0.1", "localhost", "::1"):
        assert exposure_warning(host, 2379, tls=False, auth=False, client_certs=False) is None
    assert exposure_warning("0.0.0.0", 2379, tls=True, auth=True, client_certs=False) is None
    assert exposure_warning("0.0.0.0", 2379, tls=True, auth=False, client_certs=True) is None
    bare = exposure_warning("0.0.0.0", 2379, tls=False, auth=True, client_certs=False)
    assert bare == ("etcd listens on 0.0.0.0 without TLS or authentication: anyone who can reach port 2379 can read "
                    "and rewrite every job (see docs/security.md)")
    tls_only = exposure_warning("10.1.2.3", 2400, tls=True, auth=False, client_certs=False)
    assert tls_only is not None and "without authentication (--root-password-file or --client-ca)" in tls_only
    assert "port 2400" in tls_only
    assert exposure_warning("etcd.example.com", 2379, tls=False, auth=False, client_certs=False) is not None
