"""Every metric, span and span-attribute name, in one place, so they stay stable.

Metric names reuse Synapse's where the concept is the same (operators' dashboards and
alerts keep working); the rest are prefixed ``federation_sender_``. Counter names are
given without the ``_total`` suffix, which the exposition adds.
"""

from __future__ import annotations

# --- metrics: Synapse's names ---------------------------------------------------------
PENDING_DESTINATIONS = "synapse_federation_transaction_queue_pending_destinations"
PENDING_PDUS = "synapse_federation_transaction_queue_pending_pdus"
PENDING_EDUS = "synapse_federation_transaction_queue_pending_edus"
SENT_TRANSACTIONS = "synapse_federation_client_sent_transactions"
SENT_PDUS = "synapse_federation_client_sent_pdu_destinations"
"""PDUs queued for sending, counted once per destination (Synapse's meaning: counted
when the event is fanned out, not when the transaction succeeds)."""
SENT_PDUS_COUNT = "synapse_federation_client_sent_pdu_destinations_count"
"""PDUs queued for sending to one or more destinations (once per PDU)."""
EVENTS_PROCESSED = "synapse_federation_client_events_processed"
"""Events read by the fan-out (sendable or not)."""
EVENT_PROCESSING_LOOP_COUNT = "synapse_event_processing_loop_count"
"""Fan-out batches, label ``name="federation_sender"``."""
EVENT_PROCESSING_LOOP_ROOM_COUNT = "synapse_event_processing_loop_room_count"
"""Rooms seen per fan-out batch, summed; label ``name="federation_sender"``."""
HTTP_REQUESTS = "synapse_http_matrixfederationclient_requests"
"""Outgoing federation HTTP requests, label ``method``."""
HTTP_RESPONSES = "synapse_http_matrixfederationclient_responses"
"""Their responses, labels ``method`` and ``code``."""
SENT_EDUS = "synapse_federation_client_sent_edus"
SENT_EDUS_BY_TYPE = "synapse_federation_client_sent_edus_by_type"
EVENT_PROCESSING_LAG_MS = "synapse_event_processing_lag"
"""Milliseconds, as in Synapse, with label ``name="federation_sender"``."""
EVENT_PROCESSING_POSITIONS = "synapse_event_processing_positions"
EVENT_PROCESSING_LAST_TS = "synapse_event_processing_last_ts"
EVENT_PROCESSING_NAME = "federation_sender"
EVENT_PROCESSING_LAG_BY_EVENT = "synapse_event_processing_lag_by_event"
"""Histogram (seconds, Prometheus' default buckets as Synapse's), label
``name="federation_sender"``: per PDU queued for one or more destinations, from its
announcement to its hand-over to the queues (Grafana's "Federation send PDU lag")."""
BLOCK_COUNT = "synapse_util_metrics_block_count"
"""Synapse's ``Measure`` blocks, label ``block_name``: ``_send_new_transaction`` (every
transaction attempt, whatever its outcome: Grafana's failed-transactions line is this
rate minus ``synapse_federation_client_sent_transactions``) and ``handle_room_events``
(once per room of each fan-out batch)."""
BLOCK_TIME = "synapse_util_metrics_block_time_seconds"
BLOCK_SEND_TRANSACTION = "_send_new_transaction"
BLOCK_HANDLE_ROOM_EVENTS = "handle_room_events"

# --- metrics: ours ----------------------------------------------------------------------
DELIVERED_PDUS = "federation_sender_delivered_pdus"
"""PDUs in transactions the destination accepted (200), once per destination."""
TRANSACTION_ATTEMPTS = "federation_sender_transaction_attempts"
TRANSACTION_DURATION = "federation_sender_transaction_duration_seconds"
DROPPED_ITEMS = "federation_sender_dropped_items"
DESTINATIONS_BACKING_OFF = "federation_sender_destinations_backing_off"
DESTINATIONS_CATCHING_UP = "federation_sender_destinations_catching_up"
DESTINATIONS_SHORT_RETRYING = "federation_sender_destinations_short_retrying"
"""Destinations in the short-retry phase (failed, retried in memory before a persisted
backoff); they count among ``DESTINATIONS_BACKING_OFF`` while they wait."""
SHORT_RETRY_ATTEMPTS = "federation_sender_short_retry_attempts"
"""Retries made in the short-retry phase, label ``outcome``: ``answered`` (the
destination answered, the phase ends) or ``unanswered``."""
SHORT_RETRY_PHASES = "federation_sender_short_retry_phases"
"""Short-retry phases that ended, label ``ended``: ``answered`` or ``backed_off`` (the
persisted backoff followed)."""
RETURN_PROBES = "federation_sender_return_probes"
"""Return probes (``GET /_matrix/federation/v1/version`` of a destination in its
persisted backoff with something to send, at most one a minute each), label
``outcome``: ``up`` (sent to at once) or ``down``."""
SEND_TIME_WITHHELD = "federation_sender_send_time_withheld_pdus"
"""PDUs left out of a transaction just before it went out (``queue/send_time.py``),
label ``reason``: ``erased_sender`` (erased since it was queued) or
``unknown_room_version`` (redacted, in a room whose redaction rules we do not know)."""
SEND_TIME_PRUNED = "federation_sender_send_time_pruned_pdus"
"""PDUs sent in their redacted (pruned) form: redacted since they were queued."""
IN_FLIGHT_TRANSACTIONS = "federation_sender_in_flight_transactions"
DB_GROUP_COMMITS = "federation_sender_db_group_commits"
"""Database transactions that wrote transaction results (group commits)."""
DB_GROUP_COMMIT_RESULTS = "federation_sender_db_group_commit_results"
"""Transaction results those commits carried (results per commit: this over the last)."""
QUEUE_FIRST_READS = "federation_sender_queue_first_reads"
"""Database transactions that read new queues' rows, gathered (``bootstrap_gathered``)."""
TRANSACTION_SIGNATURES = "federation_sender_transaction_signatures"
"""Transaction requests signed (``RequestBuilder.signatures``)."""
SHARED_CONTENT_SIGNATURES = "federation_sender_shared_content_signatures"
"""Of those, over a content another destination's transaction had built (its body and
first hash: ``RequestBuilder.shared``)."""
OLDEST_IN_FLIGHT_AGE = "federation_sender_oldest_in_flight_transaction_age_seconds"
REPLICATION_POSITION = "federation_sender_replication_position"
REPLICATION_LAG = "federation_sender_replication_lag"
"""Stream ids (tokens) the writer is ahead of what this worker has processed."""
REPLICATION_BATCHES = "federation_sender_replication_batches"
REPLICATION_ROWS = "federation_sender_replication_rows"
EVENT_PROCESSING_LAG_S = "federation_sender_event_processing_lag_seconds"
CATCHUP_STEPS = "federation_sender_catchup_steps"
PACING_CONFIRMATIONS = "federation_sender_pacing_confirmations"
PACING_WAIT = "federation_sender_pacing_wait_seconds"
SHARD_LIVE_INSTANCES = "federation_sender_shard_live_instances"
SHARD_LEASES_HELD = "federation_sender_shard_leases_held"

TRANSACTION_OUTCOMES = ("success", "transient", "permanent", "too_large", "error")
"""``error``: the attempt raised locally before an outcome was known."""

# --- spans --------------------------------------------------------------------------------
SPAN_TRANSACTION = "federation.transaction"
SPAN_CATCHUP_STEP = "federation.catchup_step"
SPAN_REPLICATION_BATCH = "replication.batch"
SPAN_DISCOVERY = "federation.discovery"
"""Child of the transaction: finding where the destination is reached, recorded only
when that looks something up (well-known, SRV); cached answers are not spanned."""
SPAN_HTTP_REQUEST = "HTTP PUT"
"""Child of the transaction: one PUT /send to one target (OpenTelemetry's HTTP client
span name is the method)."""
SPAN_PERSIST = "db.persist_result"
"""Child of the transaction: from handing its result to the group commit until the
commit (the transaction log row, the destination's position or backoff, outbox rows)."""

# --- span attributes ------------------------------------------------------------------------
ATTR_DESTINATION = "matrix.destination"
ATTR_TXN_ID = "matrix.txn_id"
ATTR_PDU_COUNT = "matrix.pdu_count"
ATTR_EDU_COUNT = "matrix.edu_count"
ATTR_CATCHUP = "federation.catchup"
ATTR_OUTCOME = "federation.outcome"
ATTR_HTTP_STATUS = "http.response.status_code"
ATTR_ROOMS = "federation.catchup.rooms"
ATTR_EVENTS = "federation.catchup.events"
ATTR_STREAM = "replication.stream"
ATTR_INSTANCE = "replication.instance"
ATTR_TOKEN = "replication.token"
ATTR_ROWS = "replication.rows"
ATTR_SERVICE_INSTANCE = "service.instance.id"
ATTR_HTTP_METHOD = "http.request.method"
ATTR_SERVER_ADDRESS = "server.address"
ATTR_SERVER_PORT = "server.port"
