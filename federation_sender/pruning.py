"""The redaction algorithm ("pruning") of the Matrix spec, per room version, pure.

A redacted event keeps only what its room's event authorisation needs (the spec's
"Redactions" section of each room version, 1 to 12; where the sender uses it:
``docs/synapse-reference.md``, "What the live queue withholds or prunes").
:func:`prune` returns that form of a PDU:

* **top-level keys**: ``event_id``, ``type``, ``room_id``, ``sender``, ``state_key``,
  ``content``, ``hashes``, ``signatures``, ``depth``, ``prev_events``, ``auth_events``,
  ``origin_server_ts``; before room version 11 also ``prev_state``, ``origin`` and
  ``membership``. ``hashes`` and ``signatures`` are kept as they are: the receiver checks
  the signatures over this pruned form (they still verify) and the content hash over the
  whole event (it no longer matches, so the receiver stores the event redacted, as the
  spec provides). From v12 (MSC4291) ``m.room.create`` loses ``room_id`` too (its
  hash is the room id); in MSC4242's state-DAG versions ``prev_state_events`` replaces
  ``auth_events``.
* **content**, emptied except for:

  - ``m.room.member``: ``membership``; ``join_authorised_via_users_server`` from v9;
    from v11 ``third_party_invite.signed`` (an object ``third_party_invite`` keeps
    only ``signed``);
  - ``m.room.create``: ``creator`` before v11; from v11 the whole content;
  - ``m.room.join_rules``: ``join_rule``; ``allow`` from v8;
  - ``m.room.power_levels``: ``ban``, ``events``, ``events_default``, ``kick``,
    ``redact``, ``state_default``, ``users``, ``users_default``; ``invite`` from v11;
  - ``m.room.aliases``: ``aliases``, v1 to v5 only;
  - ``m.room.history_visibility``: ``history_visibility``;
  - ``m.room.redaction``: ``redacts``, from v11;

  and, in MSC3389's versions only, ``m.relates_to``'s ``rel_type`` and ``event_id``
  (for every type, when one of them is there).
* **unsigned** is covered by neither hashes nor signatures and the spec's list does not
  keep it; when the event has one, it keeps ``age_ts`` and ``replaces_state`` only, as
  Synapse's own pruning does, so the bytes are those Synapse sends for a redacted event.

The rules of each room version the newest tested Synapse knows are in :data:`ROOM_VERSIONS`;
:func:`rules_for` answers None for any other (the caller withholds such an event rather
than guess). ``tests/test_pruning.py`` checks every version against Synapse's own
``redact_event_dict`` over many event shapes.

A leaf module: it imports nothing of ours.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ROOM_VERSIONS", "RedactionRules", "prune", "rules_for"]


@dataclass(frozen=True, slots=True)
class RedactionRules:
    """What differs between room versions' redaction algorithms (Synapse's room-version
    flags of the same meaning in brackets)."""

    updated_rules: bool = False
    """Room version 11's rules, MSC2176 and MSC3821 (``updated_redaction_rules``)."""
    aliases: bool = False
    """``m.room.aliases`` keeps ``aliases`` (v1 to v5: ``special_case_aliases_auth``)."""
    join_rule_allow: bool = False
    """``m.room.join_rules`` keeps ``allow`` (v8+: ``restricted_join_rule``)."""
    join_authorised: bool = False
    """``m.room.member`` keeps ``join_authorised_via_users_server`` (v9+:
    ``restricted_join_rule_fix``)."""
    relations: bool = False
    """``m.relates_to``'s ``rel_type`` and ``event_id`` survive (MSC3389)."""
    state_dags: bool = False
    """``prev_state_events`` instead of ``auth_events`` (MSC4242)."""
    room_ids_as_hashes: bool = False
    """``m.room.create`` loses ``room_id``: the room id is the create event's hash (v12,
    MSC4291: ``msc4291_room_ids_as_hashes``)."""


_V1 = RedactionRules(aliases=True)
_V6 = RedactionRules()
_V8 = RedactionRules(join_rule_allow=True)
_V9 = RedactionRules(join_rule_allow=True, join_authorised=True)
_V11 = RedactionRules(updated_rules=True, join_rule_allow=True, join_authorised=True)
_V12 = RedactionRules(updated_rules=True, join_rule_allow=True, join_authorised=True,
                      room_ids_as_hashes=True)

ROOM_VERSIONS: Mapping[str, RedactionRules] = {
    "1": _V1, "2": _V1, "3": _V1, "4": _V1, "5": _V1,
    "6": _V6, "7": _V6,
    "8": _V8,
    "9": _V9, "10": _V9,
    "org.matrix.msc1767.10": _V9,
    "org.matrix.msc3757.10": _V9,
    "org.matrix.msc3389.10": RedactionRules(join_rule_allow=True, join_authorised=True,
                                            relations=True),
    "11": _V11,
    "org.matrix.msc3757.11": _V11,
    "12": _V12,
    "org.matrix.hydra.11": _V12,
    "org.matrix.msc4242.12": RedactionRules(updated_rules=True, join_rule_allow=True,
                                            join_authorised=True, state_dags=True,
                                            room_ids_as_hashes=True),
}  # fmt: skip
"""Every room version of the newest tested Synapse (its stable ones and its experimental ones)."""

_KEYS = frozenset({
    "event_id", "type", "room_id", "sender", "state_key", "content", "hashes",
    "signatures", "depth", "prev_events", "auth_events", "origin_server_ts",
})  # fmt: skip
_KEYS_BEFORE_V11 = _KEYS | {"prev_state", "origin", "membership"}
_KEYS_STATE_DAGS = (_KEYS - {"auth_events"}) | {"prev_state_events"}
_UNSIGNED_KEYS = ("age_ts", "replaces_state")
_POWER_LEVELS = ("ban", "events", "events_default", "kick", "redact", "state_default",
                 "users", "users_default")  # fmt: skip


def rules_for(room_version: str | None) -> RedactionRules | None:
    """The rules of ``room_version``; None when it is not one we know."""
    return None if room_version is None else ROOM_VERSIONS.get(room_version)


def _kept(content: Mapping[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {k: content[k] for k in names if k in content}


def _content(event_type: object, content: Mapping[str, Any], r: RedactionRules
             ) -> dict[str, Any]:
    new: dict[str, Any]
    if event_type == "m.room.member":
        new = _kept(content, ("membership", "join_authorised_via_users_server")
                    if r.join_authorised else ("membership",))
        invite = content.get("third_party_invite")
        if r.updated_rules and isinstance(invite, dict):
            new["third_party_invite"] = _kept(invite, ("signed",))
    elif event_type == "m.room.create":
        new = dict(content) if r.updated_rules else _kept(content, ("creator",))
    elif event_type == "m.room.join_rules":
        new = _kept(content, ("join_rule", "allow") if r.join_rule_allow else ("join_rule",))
    elif event_type == "m.room.power_levels":
        new = _kept(content, (*_POWER_LEVELS, "invite") if r.updated_rules else _POWER_LEVELS)
    elif event_type == "m.room.aliases" and r.aliases:
        new = _kept(content, ("aliases",))
    elif event_type == "m.room.history_visibility":
        new = _kept(content, ("history_visibility",))
    elif event_type == "m.room.redaction" and r.updated_rules:
        new = _kept(content, ("redacts",))
    else:
        new = {}
    if r.relations:
        relates_to = content.get("m.relates_to")
        if isinstance(relates_to, dict):
            kept = _kept(relates_to, ("rel_type", "event_id"))
            if kept:
                new["m.relates_to"] = kept
    return new


def prune(pdu: Mapping[str, Any], rules: RedactionRules) -> dict[str, Any]:
    """The redacted form of ``pdu`` under ``rules`` (a new object: ``pdu`` is not
    changed; kept values are shared with it, not copied). A ``content`` that is missing
    or not an object becomes ``{}``. Pruning twice gives what pruning once does."""
    keys = (_KEYS_STATE_DAGS if rules.state_dags
            else _KEYS if rules.updated_rules else _KEYS_BEFORE_V11)  # fmt: skip
    out = {k: v for k, v in pdu.items() if k in keys}
    if rules.room_ids_as_hashes and pdu.get("type") == "m.room.create":
        out.pop("room_id", None)
    content = pdu.get("content")
    out["content"] = _content(pdu.get("type"), content if isinstance(content, dict) else {},
                              rules)
    if "unsigned" in pdu:
        unsigned = pdu["unsigned"]
        out["unsigned"] = _kept(unsigned, _UNSIGNED_KEYS) if isinstance(unsigned, dict) else {}
    return out
