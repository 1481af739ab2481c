-- A native SQLite database as revision 0001 made it before its DDL was shared with the
-- Synapse-side chain (Python sqlite3 iterdump of `federation-sender migrate` at 6c3eb52).
-- Frozen: tests/storage/test_migrations.py checks that revision 0001 still makes this
-- schema and that a database holding it upgrades to head.
BEGIN TRANSACTION;
CREATE TABLE alembic_version (
	version_num VARCHAR(32) NOT NULL, 
	CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num)
);
INSERT INTO "alembic_version" VALUES('0001');
CREATE TABLE destination_leases (
	destination TEXT NOT NULL, 
	instance_name TEXT NOT NULL, 
	lease_until_ts BIGINT NOT NULL, 
	fencing_token BIGINT NOT NULL, 
	CONSTRAINT pk_destination_leases PRIMARY KEY (destination)
);
CREATE TABLE destination_rooms (
	destination TEXT NOT NULL, 
	room_id TEXT NOT NULL, 
	stream_ordering BIGINT NOT NULL, 
	CONSTRAINT pk_destination_rooms PRIMARY KEY (destination, room_id)
);
CREATE TABLE destinations (
	destination TEXT NOT NULL, 
	retry_last_ts BIGINT, 
	retry_interval BIGINT, 
	failure_ts BIGINT, 
	last_successful_stream_ordering BIGINT, 
	CONSTRAINT pk_destinations PRIMARY KEY (destination)
);
CREATE TABLE device_federation_outbox (
	destination TEXT NOT NULL, 
	stream_id BIGINT NOT NULL, 
	queued_ts BIGINT NOT NULL, 
	messages_json TEXT NOT NULL, 
	sent_ts BIGINT, 
	CONSTRAINT pk_device_federation_outbox PRIMARY KEY (destination, stream_id)
);
CREATE TABLE device_lists_outbound_pokes (
	destination TEXT NOT NULL, 
	stream_id BIGINT NOT NULL, 
	user_id TEXT NOT NULL, 
	device_id TEXT NOT NULL, 
	ts BIGINT NOT NULL, 
	content_json TEXT DEFAULT '{}' NOT NULL, 
	sent BOOLEAN DEFAULT 0 NOT NULL, 
	CONSTRAINT pk_device_lists_outbound_pokes PRIMARY KEY (destination, stream_id, user_id, device_id)
);
CREATE TABLE event_forward_extremities (
	event_id TEXT NOT NULL, 
	room_id TEXT NOT NULL, 
	CONSTRAINT pk_event_forward_extremities PRIMARY KEY (event_id, room_id)
);
CREATE TABLE events (
	stream_ordering BIGINT NOT NULL, 
	instance_name TEXT DEFAULT 'master' NOT NULL, 
	event_id TEXT NOT NULL, 
	room_id TEXT NOT NULL, 
	type TEXT NOT NULL, 
	state_key TEXT, 
	sender TEXT NOT NULL, 
	origin_server_ts BIGINT NOT NULL, 
	outlier BOOLEAN DEFAULT 0 NOT NULL, 
	rejected BOOLEAN DEFAULT 0 NOT NULL, 
	json TEXT NOT NULL, 
	CONSTRAINT pk_events PRIMARY KEY (stream_ordering), 
	CONSTRAINT uq_events_event_id UNIQUE (event_id)
);
CREATE TABLE federation_sender_instances (
	instance_name TEXT NOT NULL, 
	started_ts BIGINT NOT NULL, 
	heartbeat_ts BIGINT NOT NULL, 
	CONSTRAINT pk_federation_sender_instances PRIMARY KEY (instance_name)
);
CREATE TABLE federation_transaction_log (
	id INTEGER NOT NULL, 
	txn_id TEXT NOT NULL, 
	destination TEXT NOT NULL, 
	instance_name TEXT DEFAULT 'master' NOT NULL, 
	pdu_count INTEGER NOT NULL, 
	edu_count INTEGER NOT NULL, 
	request_bytes INTEGER NOT NULL, 
	status TEXT NOT NULL, 
	http_status INTEGER, 
	started_ts BIGINT NOT NULL, 
	duration_ms INTEGER NOT NULL, 
	catchup BOOLEAN DEFAULT 0 NOT NULL, 
	max_stream_ordering BIGINT, 
	pdu_event_ids TEXT DEFAULT '[]' NOT NULL, 
	error TEXT, 
	CONSTRAINT pk_federation_transaction_log PRIMARY KEY (id)
);
CREATE TABLE partial_state_rooms (
	room_id TEXT NOT NULL, 
	CONSTRAINT pk_partial_state_rooms PRIMARY KEY (room_id)
);
CREATE TABLE room_memberships (
	event_id TEXT NOT NULL, 
	event_stream_ordering BIGINT NOT NULL, 
	room_id TEXT NOT NULL, 
	user_id TEXT NOT NULL, 
	server_name TEXT NOT NULL, 
	sender TEXT NOT NULL, 
	membership TEXT NOT NULL, 
	CONSTRAINT pk_room_memberships PRIMARY KEY (event_id)
);
CREATE TABLE stream_positions (
	stream_name TEXT NOT NULL, 
	instance_name TEXT NOT NULL, 
	stream_id BIGINT NOT NULL, 
	CONSTRAINT pk_stream_positions PRIMARY KEY (stream_name, instance_name)
);
CREATE INDEX ix_destination_rooms_destination_stream ON destination_rooms (destination, stream_ordering);
CREATE INDEX ix_destination_rooms_room_id ON destination_rooms (room_id);
CREATE INDEX ix_device_lists_outbound_pokes_dest_sent_stream ON device_lists_outbound_pokes (destination, sent, stream_id);
CREATE INDEX ix_event_forward_extremities_room_id ON event_forward_extremities (room_id);
CREATE INDEX ix_events_room_id_stream_ordering ON events (room_id, stream_ordering);
CREATE INDEX ix_federation_transaction_log_dest_started ON federation_transaction_log (destination, started_ts);
CREATE INDEX ix_room_memberships_room_server_stream ON room_memberships (room_id, server_name, event_stream_ordering);
CREATE INDEX ix_room_memberships_room_user_stream ON room_memberships (room_id, user_id, event_stream_ordering);
COMMIT;
