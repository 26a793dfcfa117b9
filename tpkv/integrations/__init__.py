"""Bridges from serving engines to tpkv's tiers (vLLM's KV connector: tpkv.integrations.vllm)."""
