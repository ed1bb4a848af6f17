"""Model and tokenizer loading (`loader`), the dense Llama-family model built without transformers
(`native`), the tiny-model factory (`factory`), the byte-level tokenizer (`tokenizer`) and the tiny chat
template (`chat_template`). Importing this package imports no torch.
"""

from __future__ import annotations

from verst.config.imports import lazy_exports

# Re-exported lazily so `from verst.models import load_model` works without importing transformers
# for callers (the CLI's --help) that only touch the torch-free modules.
_EXPORTS = {
    "load_tokenizer": "verst.models.loader",
    "load_model": "verst.models.loader",
    "load_model_and_tokenizer": "verst.models.loader",
    "chat_prompt_ids": "verst.models.loader",
    "render_chat": "verst.models.loader",
    "load_causal_lm": "verst.models.native",
    "NativeCausalLM": "verst.models.native",
    "init_model": "verst.models.factory",
    "model_config": "verst.models.factory",
    "count_parameters": "verst.models.factory",
    "TINY_CHAT_TEMPLATE": "verst.models.chat_template",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
