"""Expert tiers (disk, host, device slots), their policies, transfers and counters."""
