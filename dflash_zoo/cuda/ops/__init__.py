"""Triton kernels and the torch custom ops that run them, one operation per module (`<op>.py`, its kernels in
`<op>_kernels.py`): split-KV attention and its torch forms (`attention`), the split-K GEMV (`gemv`) and its
FP8-weight counterpart (`fp8`), the fused elementwise work between GEMMs (`fused`: norms, rotary + K/V writes,
SwiGLU), sandwich-norm residual adds (`sandwich`), routing and expert projections (`moe`), Gated-DeltaNet conv
and delta rule (`gdn`), sort-free top-p (`nucleus`); `runtime` says where they run and times their configs. They
run on CUDA, or anywhere under Triton's interpreter (the CPU tests)."""
