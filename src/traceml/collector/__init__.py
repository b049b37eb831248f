"""One per run: ingest over TCP, the SQLite store, the rollup and the node sampler."""
