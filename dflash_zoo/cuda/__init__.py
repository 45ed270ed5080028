"""The CUDA wing: the static fast engine and its Triton kernels, in three rooms.

- `ops/`: one operation per module with its Triton kernels beside it (`<op>.py` and `<op>_kernels.py`, triton
  imported on first use), as torch custom ops that CUDA graphs capture and `torch.compile` sees as one call.
  Ops know nothing of models or engines: they take tensors and the few switches they need (`tune`).
- `static/`: the static engine (`fast.py`), which runs a target's decoder from its own modules found through
  the layout its adapter declares (`layout.py`), over static buffers, one CUDA graph per step (`graphs.py`).
- `placement/`: splitting a target over the GPUs of one host for the eager engine (`plan.py`, `hooks.py`).

Which engine runs a generation, and the import layers these rooms sit in: `engine/select.py`,
`engine/factory.py`.
"""
