"""LLaMA targets (meta-llama/Llama-3.1-8B-Instruct; transformers `models/llama`).

Quirks:
- `llama3` rope scaling on the target; the drafter carries its own rope parameters;
- three stop ids (128001 `<|end_of_text|>`, 128008 `<|eom_id|>`, 128009 `<|eot_id|>`), taken from the
  generation config's eos list; there is no pad token;
- the published drafter runs block size 10 (9 speculative tokens);
- full attention everywhere: negative crop of the `DynamicCache` is exact.
"""

from __future__ import annotations

from dflash_zoo.adapters import register
from dflash_zoo.adapters.base import StaticLayout, TargetAdapter


@register("llama")
class LlamaAdapter(TargetAdapter):
    static_layout = StaticLayout(cuda_verified=True)  # the defaults: q/k/v/o, no q/k norm, SwiGLU MLP
