"""Per-rank workers: tier pools, copy engine, collective confirm, worker loop."""
