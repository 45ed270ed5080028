"""The two halves of programmatic dependent launch (`runtime.launch_mode`) for the Triton kernels of one-row
steps: a kernel launched dependent calls `allow_next` as it begins, so the next kernel's programs may start as
its own finish, and `wait_previous` before it reads anything an earlier kernel wrote. Both are nothing at PDL 0
(a launch that is not dependent, and Triton's interpreter)."""

import triton
import triton.language as tl


@triton.jit
def allow_next(PDL: tl.constexpr):
    """Let the next dependent kernel start its programs where this one's leave room (it still waits)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """Wait until the kernel before this one has ended and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()
