"""Storage: the database contract (schema.py), engines (engine.py), and one module per
table group. Queries take a connection or engine explicitly; nothing here is global.
"""
