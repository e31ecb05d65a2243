"""Run-time services on every rank: signals, metrics/event streams, console output."""
