"""Placeholder: family being written."""
