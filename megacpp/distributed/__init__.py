"""Multi-GPU training under torchrun: process group, FSDP2, cross-rank checks (docs/distributed.md)."""
