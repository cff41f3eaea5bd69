"""etcd users and roles: turn authentication on, and give a user read/write on one key prefix.

The same can be done with ``etcdctl`` (docs/security.md lists the commands). A user per job,
limited to that job's prefix, is :mod:`elasticrun.cli.etcd_users`.
"""

from __future__ import annotations

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


def enable_auth(store: EtcdStore, root_password: str) -> None:
    """Create the ``root`` user (role ``root``) and turn authentication on (needs a store without auth)."""
    store.auth_call("UserAdd", "AuthUserAddRequest", name=ROOT_USER, password=root_password)
    store.auth_call("UserGrantRole", "AuthUserGrantRoleRequest", user=ROOT_USER, role="root")
    store.auth_call("AuthEnable", "AuthEnableRequest")


def add_prefix_user(store: EtcdStore, user: str, password: str, role: str, prefix: str) -> None:
    """Create ``role`` with read/write on the keys under ``prefix`` and nothing else, and ``user``
    with that role (``store`` must be root)."""
    store.auth_call("RoleAdd", "AuthRoleAddRequest", name=role)
    store.auth_call(
        "RoleGrantPermission", "AuthRoleGrantPermissionRequest", name=role,
        perm={"permType": READWRITE, "key": prefix.encode(), "range_end": prefix_range_end(prefix)},
    )
    store.auth_call("UserAdd", "AuthUserAddRequest", name=user, password=password)
    store.auth_call("UserGrantRole", "AuthUserGrantRoleRequest", user=user, role=role)


__all__ = ["ROOT_USER", "add_prefix_user", "enable_auth", "prefix_range_end"]
