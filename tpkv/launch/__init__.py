"""Launch: torchrun and Ray entry points, CLI."""
