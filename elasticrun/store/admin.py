"""etcd users and roles for elasticrun: turn auth on, and give a job a user limited to its prefix.

A job's user gets one role, ``elasticrun-<job_id>``, with read/write on ``/elasticrun/<job_id>/``
and nothing else: it cannot read or change any other job. The same can be done with
``etcdctl`` (docs/security.md lists the commands).
"""

from __future__ import annotations

from elasticrun.job.keys import JobKeys
from elasticrun.store.client import EtcdStore

ROOT_USER = "root"
READWRITE = 2  # authpb.Permission.Type


def prefix_range_end(prefix: str) -> bytes:
    """The end of etcd's key range for every key starting with ``prefix``."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b"\0"
    raw[-1] += 1
    return bytes(raw)


def job_role(job_id: str) -> str:
    """Name of the role that may read and write job ``job_id``'s keys."""
    return f"elasticrun-{job_id}"


def enable_auth(store: EtcdStore, root_password: str) -> None:
    """Create the ``root`` user (role ``root``) and turn authentication on (needs a store without auth)."""
    store.auth_call("UserAdd", "AuthUserAddRequest", name=ROOT_USER, password=root_password)
    store.auth_call("UserGrantRole", "AuthUserGrantRoleRequest", user=ROOT_USER, role="root")
    store.auth_call("AuthEnable", "AuthEnableRequest")


def add_job_user(store: EtcdStore, user: str, password: str, job_id: str) -> None:
    """Create ``user`` with a role limited to job ``job_id``'s prefix (``store`` must be root)."""
    role = job_role(job_id)
    prefix = JobKeys(job_id).prefix
    store.auth_call("RoleAdd", "AuthRoleAddRequest", name=role)
    store.auth_call(
        "RoleGrantPermission", "AuthRoleGrantPermissionRequest", name=role,
        perm={"permType": READWRITE, "key": prefix.encode(), "range_end": prefix_range_end(prefix)},
    )
    store.auth_call("UserAdd", "AuthUserAddRequest", name=user, password=password)
    store.auth_call("UserGrantRole", "AuthUserGrantRoleRequest", user=user, role=role)


__all__ = ["ROOT_USER", "add_job_user", "enable_auth", "job_role", "prefix_range_end"]
