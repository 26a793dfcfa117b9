"""Per-rank workers: tier pools, copy engine, SSD store, collective confirm, worker loop."""
