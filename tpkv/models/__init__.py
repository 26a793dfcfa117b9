"""Models: paged TP decode engine, transformers cache adapter."""
