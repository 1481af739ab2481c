"""What E2EE clients do through Synapse's client API, for the EDU tests: log in devices,
publish device keys, upload and use cross-signing keys, delete devices. Keys are real
ed25519 keys and signatures (Synapse verifies cross-signing signatures)."""

from __future__ import annotations

import json
import subprocess
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from signedjson.key import encode_verify_key_base64, generate_signing_key, get_verify_key
from signedjson.sign import sign_json

from federation_sender.testing.synapse_client import ClientApiError, User
from federation_sender.testing.synapse_deployment import SynapseDeployment

PASSWORD = "test password"
REFERENCE = Path(__file__).with_name("synapse_reference.py")


def _pub(key: Any) -> str:
    return str(encode_verify_key_base64(get_verify_key(key)))


@dataclass
class CrossSigning:
    master: Any
    self_signing: Any

    @property
    def master_pub(self) -> str:
        return _pub(self.master)

    @property
    def self_signing_pub(self) -> str:
        return _pub(self.self_signing)


def _auth(user: User, session: str | None = None) -> dict[str, Any]:
    auth: dict[str, Any] = {
        "type": "m.login.password",
        "identifier": {"type": "m.id.user", "user": user.user_id},
        "password": PASSWORD,
    }
    if session:
        auth["session"] = session
    return auth


def _with_auth(d: SynapseDeployment, method: str, path: str, body: dict[str, Any],
               user: User) -> dict[str, Any]:
    """A request behind user-interactive auth: the first answer gives a session."""
    try:
        return d.client.call(method, path, body, user.access_token)
    except ClientApiError as e:
        if e.status != 401:
            raise
        session = json.loads(e.body).get("session")
    return d.client.call(method, path, {**body, "auth": _auth(user, session)}, user.access_token)


def login(d: SynapseDeployment, user: User, display_name: str) -> User:
    r = d.client.call("POST", "/_matrix/client/v3/login", {
        "type": "m.login.password",
        "identifier": {"type": "m.id.user", "user": user.user_id},
        "password": PASSWORD,
        "initial_device_display_name": display_name,
    })
    return User(r["user_id"], r["access_token"], r["device_id"])


def upload_device_keys(d: SynapseDeployment, device: User) -> tuple[dict[str, Any], Any]:
    key = generate_signing_key(device.device_id)
    keys = {
        "user_id": device.user_id,
        "device_id": device.device_id,
        "algorithms": ["m.olm.v1.curve25519-aes-sha2", "m.megolm.v1.aes-sha2"],
        "keys": {
            f"ed25519:{device.device_id}": _pub(key),
            f"curve25519:{device.device_id}": _pub(generate_signing_key("c")),
        },
    }
    signed = sign_json(keys, device.user_id, key)
    d.client.call("POST", "/_matrix/client/v3/keys/upload", {"device_keys": signed},
                  device.access_token)
    return signed, key


def upload_cross_signing(d: SynapseDeployment, user: User) -> CrossSigning:
    master = generate_signing_key("m")
    master.version = _pub(master)
    ss = generate_signing_key("s")
    ss.version = _pub(ss)
    us = generate_signing_key("u")
    us.version = _pub(us)

    def key(usage: str, k: Any) -> dict[str, Any]:
        return {"user_id": user.user_id, "usage": [usage], "keys": {f"ed25519:{_pub(k)}": _pub(k)}}

    body = {
        "master_key": key("master", master),
        "self_signing_key": sign_json(key("self_signing", ss), user.user_id, master),
        "user_signing_key": sign_json(key("user_signing", us), user.user_id, master),
    }
    _with_auth(d, "POST", "/_matrix/client/v3/keys/device_signing/upload", body, user)
    return CrossSigning(master, ss)


def sign_device(d: SynapseDeployment, user: User, device_keys: dict[str, Any],
                cs: CrossSigning) -> None:
    """Cross-sign a device with the self-signing key (a signature Synapse stores in
    ``e2e_cross_signing_signatures``)."""
    unsigned = {k: v for k, v in device_keys.items() if k not in ("signatures", "unsigned")}
    signed = sign_json(unsigned, user.user_id, cs.self_signing)
    body = {user.user_id: {device_keys["device_id"]: signed}}
    r = d.client.call("POST", "/_matrix/client/v3/keys/signatures/upload", body,
                      user.access_token)
    assert not r.get("failures"), r


def delete_device(d: SynapseDeployment, user: User, device_id: str) -> None:
    path = "/_matrix/client/v3/devices/" + urllib.parse.quote(device_id, safe="")
    _with_auth(d, "DELETE", path, {}, user)


def reference(d: SynapseDeployment, *args: str) -> Any:
    """Ask Synapse's own code (see ``synapse_reference.py``)."""
    done = subprocess.run(
        [str(d.python), str(REFERENCE), str(d.homeserver_yaml), str(d.worker_yaml), *args],
        capture_output=True, text=True, timeout=120, cwd=d.directory,
    )
    if done.returncode != 0:
        raise AssertionError(f"Synapse reference failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
