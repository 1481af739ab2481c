"""Whole-queue figures for the metrics gauges."""

from __future__ import annotations

from federation_sender.queue.core.states import DestinationState
from federation_sender.queue.manager import QueueManager
from federation_sender.telemetry.metrics import QueueSnapshot
from federation_sender.transport.result import signature_counts


def queue_snapshot(manager: QueueManager) -> QueueSnapshot:
    pdus = edus = backing = catching = in_flight = short = 0
    for st in manager.statuses():
        pdus += st.pending_pdus
        edus += st.pending_edus
        if st.in_flight_txn_id:
            in_flight += 1
        if st.state is DestinationState.BACKING_OFF:
            backing += 1
        if st.catching_up:
            catching += 1
        if st.short_retrying:
            short += 1
    signatures, shared = signature_counts(manager.sender)
    return QueueSnapshot(
        pending_destinations=manager.owed_destinations(),
        pending_pdus=pdus,
        pending_edus=edus,
        backing_off=backing,
        catching_up=catching,
        short_retrying=short,
        in_flight_transactions=in_flight,
        oldest_in_flight_age_s=manager.oldest_in_flight_age_s() or 0.0,
        group_commits=manager.store.commits,
        group_commit_results=manager.store.committed_results,
        first_reads=manager.store.gathered_reads,
        transaction_signatures=signatures,
        shared_content_signatures=shared,
    )
