"""The redaction algorithm (:mod:`federation_sender.pruning`): the spec's rules version by
version, properties over arbitrary events (Hypothesis), and a differential test against
Synapse's own ``redact_event_dict`` (``prune_event_dict`` before it moved to Rust), run
in Synapse's virtualenv as a subprocess, over several hundred event shapes and every
room version Synapse defines."""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from federation_sender.pruning import ROOM_VERSIONS, RedactionRules, prune, rules_for
from federation_sender.testing.prereq import missing
from federation_sender.testing.synapse_install import (
    SynapseInstallError,
    synapse_python,
    venv_dir,
)

V1, V6, V8, V9, V11 = (ROOM_VERSIONS[v] for v in ("1", "6", "8", "9", "11"))
MSC3389 = ROOM_VERSIONS["org.matrix.msc3389.10"]
MSC4242 = ROOM_VERSIONS["org.matrix.msc4242.12"]

FULL_V1 = {
    "event_id": "$e:a.test", "type": "m.room.message", "room_id": "!r:a.test",
    "sender": "@u:a.test", "state_key": "", "content": {"body": "secret", "msgtype": "m.text"},
    "hashes": {"sha256": "abc"}, "signatures": {"a.test": {"ed25519:k": "sig"}},
    "depth": 7, "prev_events": [["$p:a.test", {}]], "auth_events": [["$c:a.test", {}]],
    "prev_state": [], "origin": "a.test", "origin_server_ts": 1_700_000_000_000,
    "membership": "join", "redacts": "$x:a.test", "age_ts": 5, "age": 5, "outlier": False,
    "destinations": ["b.test"], "user_id": "@u:a.test",
    "unsigned": {"age_ts": 1, "replaces_state": "$old", "prev_content": {"x": 1},
                 "redacted_because": {}, "transaction_id": "t"},
}  # fmt: skip


# --- the spec's rules --------------------------------------------------------------------


def test_top_level_keys_before_and_from_v11() -> None:
    assert set(prune(FULL_V1, V1)) == {
        "event_id", "type", "room_id", "sender", "state_key", "content", "hashes",
        "signatures", "depth", "prev_events", "auth_events", "prev_state", "origin",
        "origin_server_ts", "membership", "unsigned"}  # fmt: skip
    assert set(prune(FULL_V1, V11)) == {
        "event_id", "type", "room_id", "sender", "state_key", "content", "hashes",
        "signatures", "depth", "prev_events", "auth_events", "origin_server_ts",
        "unsigned"}  # fmt: skip


def test_hashes_and_signatures_are_kept_and_unsigned_keeps_two_keys() -> None:
    out = prune(FULL_V1, V11)
    assert out["hashes"] == FULL_V1["hashes"] and out["signatures"] == FULL_V1["signatures"]
    assert out["unsigned"] == {"age_ts": 1, "replaces_state": "$old"}
    assert out["content"] == {}
    assert "unsigned" not in prune({"type": "m.room.message", "content": {}}, V11)
    assert prune({"type": "x", "content": {}, "unsigned": 3}, V1)["unsigned"] == {}


def test_state_dag_versions_keep_prev_state_events_instead_of_auth_events() -> None:
    out = prune({**FULL_V1, "prev_state_events": ["$s"]}, MSC4242)
    assert out["prev_state_events"] == ["$s"] and "auth_events" not in out
    assert "prev_state_events" not in prune({**FULL_V1, "prev_state_events": ["$s"]}, V11)


@pytest.mark.parametrize(("rules", "event_type", "content", "kept"), [
    (V1, "m.room.member", {"membership": "join", "displayname": "Eve",
                           "join_authorised_via_users_server": "@x:b"}, {"membership": "join"}),
    (V9, "m.room.member", {"membership": "join", "displayname": "Eve",
                           "join_authorised_via_users_server": "@x:b"},
     {"membership": "join", "join_authorised_via_users_server": "@x:b"}),
    (V9, "m.room.member", {"membership": "invite", "third_party_invite": {"signed": {}}},
     {"membership": "invite"}),
    (V11, "m.room.member", {"membership": "invite",
                            "third_party_invite": {"signed": {"token": "t"}, "display_name": "d"}},
     {"membership": "invite", "third_party_invite": {"signed": {"token": "t"}}}),
    (V11, "m.room.member", {"membership": "invite", "third_party_invite": {"display_name": "d"}},
     {"membership": "invite", "third_party_invite": {}}),
    (V11, "m.room.member", {"membership": "invite", "third_party_invite": "x"},
     {"membership": "invite"}),
    (V1, "m.room.create", {"creator": "@a:b", "room_version": "1"}, {"creator": "@a:b"}),
    (V11, "m.room.create", {"room_version": "11", "m.federate": False},
     {"room_version": "11", "m.federate": False}),
    (V6, "m.room.join_rules", {"join_rule": "restricted", "allow": []},
     {"join_rule": "restricted"}),
    (V8, "m.room.join_rules", {"join_rule": "restricted", "allow": [], "x": 1},
     {"join_rule": "restricted", "allow": []}),
    (V1, "m.room.power_levels", {"ban": 50, "events": {}, "events_default": 0, "kick": 50,
                                 "redact": 50, "state_default": 50, "users": {},
                                 "users_default": 0, "invite": 0, "notifications": {}},
     {"ban": 50, "events": {}, "events_default": 0, "kick": 50, "redact": 50,
      "state_default": 50, "users": {}, "users_default": 0}),
    (V11, "m.room.power_levels", {"invite": 0, "notifications": {}}, {"invite": 0}),
    (V1, "m.room.aliases", {"aliases": ["#a:b"], "x": 1}, {"aliases": ["#a:b"]}),
    (V6, "m.room.aliases", {"aliases": ["#a:b"]}, {}),
    (V1, "m.room.history_visibility", {"history_visibility": "joined", "x": 1},
     {"history_visibility": "joined"}),
    (V6, "m.room.redaction", {"redacts": "$x", "reason": "spam"}, {}),
    (V11, "m.room.redaction", {"redacts": "$x", "reason": "spam"}, {"redacts": "$x"}),
    (V11, "m.room.message", {"body": "hello", "msgtype": "m.text"}, {}),
    (V11, "m.room.message", {"body": "x", "m.relates_to": {"rel_type": "m.thread",
                                                          "event_id": "$t"}}, {}),
    (MSC3389, "m.room.message", {"body": "x", "m.relates_to": {"rel_type": "m.thread",
                                                              "event_id": "$t", "k": 1}},
     {"m.relates_to": {"rel_type": "m.thread", "event_id": "$t"}}),
    (MSC3389, "m.room.message", {"body": "x", "m.relates_to": {"k": 1}}, {}),
    (V1, "m.room.member", {"membership": None}, {"membership": None}),
])  # fmt: skip
def test_content_kept_per_type_and_version(
    rules: RedactionRules, event_type: str, content: dict[str, Any], kept: dict[str, Any]
) -> None:
    assert prune({"type": event_type, "content": content}, rules)["content"] == kept


def test_from_v12_the_create_event_loses_its_room_id() -> None:
    create = {**FULL_V1, "type": "m.room.create", "content": {"room_version": "12"}}
    assert "room_id" not in prune(create, ROOM_VERSIONS["12"])
    assert prune(create, V11)["room_id"] == "!r:a.test"
    assert prune(FULL_V1, ROOM_VERSIONS["12"])["room_id"] == "!r:a.test"


def test_missing_or_non_object_content_becomes_empty() -> None:
    assert prune({"type": "m.room.member"}, V1)["content"] == {}
    assert prune({"type": "m.room.member", "content": [1]}, V11)["content"] == {}


def test_unknown_room_versions_have_no_rules() -> None:
    assert rules_for("11") is V11
    assert rules_for("org.example.unknown") is None
    assert rules_for(None) is None


# --- properties ---------------------------------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=8,
)
_CONTENT_KEYS = st.sampled_from([
    "membership", "join_authorised_via_users_server", "third_party_invite", "creator",
    "join_rule", "allow", "ban", "events", "events_default", "invite", "kick", "redact",
    "state_default", "users", "users_default", "aliases", "history_visibility", "redacts",
    "m.relates_to", "body", "msgtype", "notifications",
]) | st.text(max_size=6)  # fmt: skip
_TOP_KEYS = st.sampled_from(sorted(set(FULL_V1) | {"prev_state_events"})) | st.text(max_size=6)
_TYPES = st.sampled_from([
    "m.room.member", "m.room.create", "m.room.join_rules", "m.room.power_levels",
    "m.room.aliases", "m.room.history_visibility", "m.room.redaction", "m.room.message",
]) | st.text(max_size=10)  # fmt: skip
EVENTS = st.builds(
    lambda top, event_type, content: {**top, "type": event_type, "content": content},
    st.dictionaries(_TOP_KEYS, _JSON, max_size=8),
    _TYPES,
    st.dictionaries(_CONTENT_KEYS, _JSON, max_size=6) | _JSON,
)


@settings(max_examples=300, deadline=None)
@given(event=EVENTS, version=st.sampled_from(sorted(ROOM_VERSIONS)))
def test_pruning_is_idempotent_keeps_no_new_key_and_leaves_its_input_alone(
    event: dict[str, Any], version: str
) -> None:
    rules = ROOM_VERSIONS[version]
    before = copy.deepcopy(event)
    once = prune(event, rules)
    assert event == before
    assert prune(once, rules) == once
    assert set(once) <= set(event) | {"content", "unsigned"}
    for key in ("hashes", "signatures"):
        assert once.get(key) == event.get(key)
    content = event["content"] if isinstance(event["content"], dict) else {}
    if not (rules.updated_rules and event["type"] == "m.room.create"):
        assert set(once["content"]) <= set(content)
    if event["type"] in ("m.room.message", "m.room.encrypted") and not rules.relations:
        assert once["content"] == {}


# --- against Synapse ----------------------------------------------------------------------

_SYNAPSE_SIDE = """
import json, sys
try:
    from synapse.synapse_rust.events import redact_event_dict as redact
except ImportError:  # before the move to Rust
    from synapse.events.utils import prune_event_dict as redact
from synapse.api.room_versions import KNOWN_ROOM_VERSIONS, RoomVersions
versions = {v.identifier: v for v in vars(RoomVersions).values() if hasattr(v, "identifier")}
versions.update(KNOWN_ROOM_VERSIONS)
events = json.load(sys.stdin)
out = {"versions": sorted(versions), "results": {}}
for ident, version in versions.items():
    row = []
    for event in events:
        try:
            row.append({"ok": redact(version, event)})
        except Exception as e:
            row.append({"error": type(e).__name__})
    out["results"][ident] = row
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def synapse_redactor() -> Path:
    """Synapse's interpreter, if Synapse is installed (never installed from here)."""
    if not os.environ.get("FEDERATION_SENDER_SYNAPSE_PYTHON") and not (
        venv_dir() / ".installed"
    ).exists():
        missing(f"Synapse in {venv_dir()}")
    try:
        return synapse_python()
    except SynapseInstallError as e:
        missing(str(e))


def _contents(event_type: str) -> Iterator[dict[str, Any]]:
    relations = [{"rel_type": "m.thread", "event_id": "$t", "key": "k"}, {"key": "k"},
                 {"event_id": "$t"}, "not an object", {"rel_type": None}]  # fmt: skip
    every = {
        "membership": "join", "displayname": "Eve", "avatar_url": "mxc://a/b",
        "join_authorised_via_users_server": "@x:b.test", "reason": "r", "is_direct": True,
        "third_party_invite": {"signed": {"mxid": "@u:a", "token": "t", "signatures": {}},
                               "display_name": "d"},
        "creator": "@a:a.test", "room_version": "10", "m.federate": True, "predecessor": {},
        "additional_creators": ["@b:b.test"], "type": "m.space",
        "join_rule": "restricted", "allow": [{"type": "m.room_membership", "room_id": "!x"}],
        "ban": 50, "events": {"m.room.name": 50}, "events_default": 0, "invite": 0,
        "kick": 50, "redact": 50, "state_default": 50, "users": {"@a:a.test": 100},
        "users_default": 0, "notifications": {"room": 50},
        "aliases": ["#a:a.test"], "alias": "#a:a.test", "alt_aliases": [],
        "history_visibility": "shared", "redacts": "$x:a.test",
        "body": "hello", "msgtype": "m.text", "format": "org.matrix.custom.html",
        "name": "room", "topic": "t", "url": "mxc://x", "info": {"size": 3},
    }  # fmt: skip
    yield every
    yield {}
    yield {k: v for i, (k, v) in enumerate(every.items()) if i % 2}
    yield {k: v for i, (k, v) in enumerate(every.items()) if not i % 2}
    yield {k: None for k in every}
    for relates in relations:
        yield {"body": "x", "m.relates_to": relates}
        yield {**every, "m.relates_to": relates}
    if event_type == "m.room.member":
        for invite in ({"signed": 1}, {"display_name": "d"}, {}, "x", None, [1]):
            yield {"membership": "invite", "third_party_invite": invite}


def _tops() -> Iterator[dict[str, Any]]:
    yield FULL_V1
    yield {k: v for k, v in FULL_V1.items() if k != "event_id"}  # room v3+
    yield {k: v for k, v in FULL_V1.items() if k not in ("unsigned", "state_key")}
    yield {**FULL_V1, "unsigned": "not an object"}
    yield {**FULL_V1, "unsigned": {}}
    yield {**FULL_V1, "prev_state_events": ["$s"], "auth_events": []}
    yield {"sender": "@u:a.test", "room_id": "!r:a.test"}


TYPES = ["m.room.member", "m.room.create", "m.room.join_rules", "m.room.power_levels",
         "m.room.aliases", "m.room.history_visibility", "m.room.redaction", "m.room.message",
         "m.room.encrypted", "m.room.name", "m.room.topic", "m.reaction",
         "m.room.third_party_invite", "m.room.canonical_alias", "org.example.custom",
         ""]  # fmt: skip


def _random_events(n: int, seed: int = 44) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    keys = sorted({*FULL_V1, "prev_state_events", "foo"})
    content_keys = sorted({k for t in TYPES for c in _contents(t) for k in c} | {"zzz"})
    values: list[Any] = [None, True, 0, 7, "s", "", [], [1, "a"], {}, {"a": 1}, {"signed": 2},
                         {"rel_type": "r", "event_id": "$e", "x": 1}]  # fmt: skip
    out = []
    for _ in range(n):
        event = {k: rng.choice(values) for k in rng.sample(keys, rng.randint(0, len(keys)))}
        event["type"] = rng.choice(TYPES)
        event["content"] = {k: rng.choice(values) for k in
                            rng.sample(content_keys, rng.randint(0, 12))}
        out.append(event)
    return out


def corpus() -> list[dict[str, Any]]:
    shapes = [{**top, "type": t, "content": c} for t in TYPES for c in _contents(t)
              for top in _tops()]  # fmt: skip
    shapes += [{**FULL_V1, "type": "m.room.message", "content": "not an object"},
               {**FULL_V1, "type": "m.room.member", "content": [1]}]  # fmt: skip
    return shapes + _random_events(400)


def test_every_shape_and_room_version_prunes_as_synapse_does(synapse_redactor: Path) -> None:
    events = corpus()
    run = subprocess.run([str(synapse_redactor), "-c", _SYNAPSE_SIDE], input=json.dumps(events),
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = json.loads(run.stdout)
    # Every room version Synapse defines has rules here, and no other.
    assert sorted(ROOM_VERSIONS) == theirs["versions"]
    compared = 0
    differences: list[str] = []
    for version, results in theirs["results"].items():
        for event, result in zip(events, results, strict=True):
            if "error" in result:  # Synapse refuses it (e.g. a content that is no object)
                continue
            ours = prune(event, ROOM_VERSIONS[version])
            compared += 1
            if ours != result["ok"] and len(differences) < 5:
                differences.append(f"v{version}: {json.dumps(event)[:300]}\n"
                                   f" ours   {json.dumps(ours)[:300]}\n"
                                   f" theirs {json.dumps(result['ok'])[:300]}")
    assert not differences, "\n".join(differences)
    assert compared > 10_000, compared
