"""Checkpoint reading: safetensors headers, tensors by offset, expert layouts."""
