"""Measurement tools: routing statistics and transfer benchmarks."""
