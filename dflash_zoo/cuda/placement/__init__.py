"""A target split across the GPUs of one host, for the eager engine: `plan.py` plans contiguous layer ranges
balanced by bytes, `hooks.py` moves the modules and their inputs (docs/multi-gpu.md)."""
