"""The static engine: the target and drafter over pre-allocated buffers, each step of fixed shapes captured
as one CUDA graph (`fast.FastEngine`, built by `engine/factory.py`). The target's layers (`target.py`): its
attention (`qkv.py`, `kv.py`), projections (`linear.py`), norms (`norms.py`), MLPs (`mlp.py`), sparse MoE blocks
(`moe.py`), Gated-DeltaNet layers (`gdn.py`) and sandwich norms (`sandwich.py`), found through the layout the
adapter declares (`layout.py`, `layout_moe.py`, `lookup.py`); the drafter (`drafter.py`); the kernels chosen
for the device (`kernel_choice.py`); running, compiling and capturing steps (`graphs.py`)."""
