"""L3 tier: one rank's SSD store of KV blocks (segment files, commits, manifests) and its I/O."""
