"""Macro flows and the per-rank job entry point."""
