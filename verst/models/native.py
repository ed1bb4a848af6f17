"""A dense Llama-family checkpoint (Llama, Mistral, Qwen2, Qwen3) built without transformers: `config.json`
and the safetensors go straight into modules with the Hugging Face layout and names, so weight updates
by name, FSDP2 sharding by block and checkpoints apply as to a transformers model.

Importing transformers' modeling stack costs seconds of CPU per process at start-up
(torch.distributed.tensor, dynamo, sympy; docs/benchmarks.md); the engine's native forward (`verst.engine.native`) and the
trainer's forward here (`NativeCausalLM.forward`, transformers' arithmetic with sdpa attention) need none
of it. Which tensors exist decides the layout (biases, Qwen3's q/k norms, a separate lm_head), so one
module tree serves all four families. What differs in the arithmetic and is not covered here (rope
scaling, partial rotary, sliding windows, other activations) is refused by `native_config_reason`, and
the model then loads with transformers. The test suite compares logits and gradients with transformers'
for every family; `verst serve engine --check-native` compares logits at start-up.
"""

from __future__ import annotations

import json
import logging
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from verst.config.schema import MODEL_IMPLS
from verst.models.context_parallel import ContextShard
from verst.models.native_config import native_config_reason, rope_settings

if TYPE_CHECKING:  # its module imports torch.distributed.tensor, which only a sequence-parallel trainer needs
    from verst.models.sequence_parallel import SequenceShard

log = logging.getLogger(__name__)
# Keys some checkpoints carry that are derived, not weights (old Llama exports saved the rotary buffer).
_DERIVED_KEYS = (".rotary_emb.inv_freq",)


# ---- transformers' arithmetic, shared with the engine's native forward --------------------------------
def linear(x: torch.Tensor, module: Any) -> torch.Tensor:
    return F.linear(x, module.weight, getattr(module, "bias", None))


def rms_norm(x: torch.Tensor, module: Any) -> torch.Tensor:
    """transformers' RMSNorm: in float32, then back to the input's dtype, then the weight."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return module.weight * normed.to(x.dtype)


def sequence_mask(position_ids: torch.Tensor, shard: ContextShard | None = None) -> torch.Tensor | None:
    """Where a row's positions start again (packed sequences, or padding after one), a [batch, 1, seq, seq]
    mask keeping each token to the earlier tokens of its own sequence, as transformers derives it from
    position ids; None when every row is one sequence (plain causal attention). With `shard` (context
    parallelism, `position_ids` the whole rows): always the mask [batch, 1, seq / size, seq] of this rank's
    query positions over the keys in the order the group gathers them, causal at their places in the row."""
    seq = position_ids.shape[1]
    if shard is None and (seq < 2 or bool((position_ids[:, 1:] - position_ids[:, :-1] == 1).all())):
        return None
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    sequence = starts.cumsum(-1)  # [batch, seq]: which sequence of its row each token belongs to
    queries = keys = torch.arange(seq)
    if shard is not None:
        queries, keys = shard.columns(seq), shard.gathered_columns(seq)
    queries, keys = queries.to(position_ids.device), keys.to(position_ids.device)
    causal = keys[None, :] <= queries[:, None]  # [queries, keys]
    return (causal & (sequence[:, queries, None] == sequence[:, None, keys]))[:, None]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _unloaded(*shape: int) -> nn.Parameter:
    """A parameter to be assigned from the checkpoint: no storage, no initialisation (torch's init on the
    meta device imports its compiler stack, a slow import)."""
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)


class Linear(nn.Linear):
    """An `nn.Linear` whose `weight` [out, in] and `bias` (or None) come from the checkpoint: being one, it
    takes PEFT's LoRA layers (`verst.trainer.lora`). The trainer calls it; the engine's forward reads its
    weight through `linear()`."""

    def __init__(self, inputs: int, outputs: int, bias: bool):
        nn.Module.__init__(self)  # not nn.Linear's: no storage to allocate and initialise
        self.in_features, self.out_features = inputs, outputs
        self.weight = _unloaded(outputs, inputs)
        self.bias = _unloaded(outputs) if bias else None


class Embedding(nn.Embedding):
    """An `nn.Embedding` whose `weight` [vocab, hidden] comes from the checkpoint: being one, it takes torch's
    `RowwiseParallel` (the vocabulary split over tensor-parallel ranks, `verst.trainer.tensor_parallel`).
    `padding_idx` as transformers' embedding: that row gets no gradient through the lookup."""

    def __init__(self, num_embeddings: int, dim: int, padding_idx: int | None):
        nn.Module.__init__(self)  # not nn.Embedding's: no storage to allocate and initialise
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, dim, padding_idx
        self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse = None, 2.0, False, False
        self.weight = _unloaded(num_embeddings, dim)


class RMSNorm(nn.Module):
    """transformers' RMSNorm parameters (`weight`, `variance_epsilon`); `rms_norm()` does the math."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = _unloaded(size)
        self.variance_epsilon = eps


class RotaryEmbedding(nn.Module):
    """Plain rotary embeddings as transformers computes them: (cos, sin) [batch, seq, head_dim] in float32,
    cast to the hidden states' dtype. The frequencies stay float32 whatever the model's dtype (not a buffer)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self.inv_freq = 1.0 / (theta**exponents)  # [head_dim / 2]

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq  # [batch, seq, head_dim / 2]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(h.dtype), angles.sin().to(h.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Any, head_dim: int, names: set[str], prefix: str):
        super().__init__()
        heads, kv_heads, hidden = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
        bias = lambda name: f"{prefix}.{name}.bias" in names  # noqa: E731
        self.q_proj = Linear(hidden, heads * head_dim, bias=bias("q_proj"))
        self.k_proj = Linear(hidden, kv_heads * head_dim, bias=bias("k_proj"))
        self.v_proj = Linear(hidden, kv_heads * head_dim, bias=bias("v_proj"))
        self.o_proj = Linear(heads * head_dim, hidden, bias=bias("o_proj"))
        if f"{prefix}.q_norm.weight" in names:  # Qwen3
            self.q_norm, self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps), RMSNorm(head_dim, cfg.rms_norm_eps)
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scaling = head_dim**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                shard: ContextShard | None = None) -> torch.Tensor:
        """Causal self-attention over whole sequences, x [batch, seq, hidden] (transformers' sdpa path); `mask`
        [batch, 1, seq, keys] bool for rows holding several sequences (`sequence_mask`), None: causal. With `shard`
        (context parallelism) x holds this rank's positions, and the keys and values are the whole row's, gathered
        over the group after rotary embedding."""
        batch, seq, _ = x.shape
        # heads counted from the projections: under tensor parallelism each rank holds a share of them
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)
        heads = q.shape[2]
        if getattr(self, "q_norm", None) is not None:
            q, k = rms_norm(q, self.q_norm), rms_norm(k, self.k_norm)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [batch, heads, seq, dim]
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if shard is not None:  # [batch, kv_heads, whole row, dim]; gathered before the GQA copies
            k, v = shard.gather(k, dim=2), shard.gather(v, dim=2)
        keys = k.shape[2]
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:  # each KV head serves `groups` query heads, as transformers' repeat_kv lays them out
            k = k[:, :, None].expand(-1, -1, groups, -1, -1).reshape(batch, heads, keys, self.head_dim)
            v = v[:, :, None].expand(-1, -1, groups, -1, -1).reshape(batch, heads, keys, self.head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and seq > 1,
                                             scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Any, names: set[str], prefix: str):
        super().__init__()
        bias = lambda name: f"{prefix}.{name}.bias" in names  # noqa: E731
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias("gate_proj"))
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias("up_proj"))
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias("down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, head_dim: int, names: set[str], prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, head_dim, names, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, names, f"{prefix}.mlp")

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                shard: ContextShard | None = None) -> torch.Tensor:
        h = h + self.self_attn(rms_norm(h, self.input_layernorm), cos, sin, mask, shard)
        return h + self.mlp(rms_norm(h, self.post_attention_layernorm))


class DecoderStack(nn.Module):
    def __init__(self, cfg: Any, head_dim: int, theta: float, names: set[str]):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(cfg, head_dim, names, f"model.layers.{i}")
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim, theta)


class NativeCausalLM(nn.Module):
    """`model.*` and `lm_head` as in transformers' `*ForCausalLM`. `forward` is the trainer's (whole
    sequences); the engine runs `verst.engine.native.NativeForward` over its KV slots with the same weights.
    `config` is config.json as attributes (with transformers' defaults for the fields used here)."""

    _no_split_modules = ["DecoderLayer"]  # FSDP2 shards one decoder layer at a time, as for transformers'

    def __init__(self, config: dict[str, Any], names: set[str]):
        super().__init__()
        self.checkpointing: dict[str, Any] | None = None  # activation_checkpointing_enable
        self.sequence_shard: SequenceShard | None = None  # sequence_parallel_enable
        reason = native_config_reason(config)
        if reason is not None:
            raise ValueError(f"a native model cannot be built from this config: {reason}")
        cfg = _Config(config)
        self.config = cfg
        theta = rope_settings(config)
        head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
        self.model = DecoderStack(cfg, head_dim, theta, names)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self) -> Embedding:
        return self.model.embed_tokens

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict[str, Any] | None = None) -> None:
        """Recompute each decoder layer's activations in backward (transformers' method name and kwargs)."""
        self.checkpointing = dict(activation_checkpointing_kwargs or {"use_reentrant": False})

    def sequence_parallel_enable(self, shard: SequenceShard) -> None:
        """Hold the residual stream and run the norms on this rank's share of the positions between the layers'
        tensor-parallel regions (whose plan gathers and scatters it: `verst.trainer.tensor_parallel`)."""
        self.sequence_shard = shard

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                logits_to_keep: torch.Tensor | None = None, use_cache: bool = False,
                context_shard: ContextShard | None = None, **unused: Any) -> Any:
        """Causal forward over whole sequences, input_ids [batch, seq]. `logits_to_keep`: a [batch, seq] bool
        mask of the positions whose logits come back ([kept, vocab]); None keeps all ([batch, seq, vocab]).
        `context_shard` (context parallelism): the rows are whole, this rank computes its positions of them
        (`ContextShard.columns`), and the logits are those of its kept positions, row by row in that order."""
        if use_cache:
            raise ValueError("NativeCausalLM.forward computes whole sequences (use_cache=False); the engine's "
                             "incremental decoding runs verst.engine.native.NativeForward")
        inner, sequence, width = self.model, self.sequence_shard, input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(width, device=input_ids.device)[None].expand_as(input_ids)
        if sequence is not None:  # rows widened to split evenly over the group, cut again before the head
            input_ids, position_ids = sequence.pad(input_ids, position_ids)
        mask = sequence_mask(position_ids, context_shard)  # from the whole rows' positions
        if context_shard is not None:
            input_ids, position_ids = context_shard.take(input_ids), context_shard.take(position_ids)
            logits_to_keep = context_shard.take(logits_to_keep) if logits_to_keep is not None else None
        # [batch, seq, hidden]; with sequence parallelism [batch, seq / size, hidden], the vocabulary-parallel
        # lookup's partial rows reduce-scattered onto this rank's positions (attention and the MLP see whole rows)
        h = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(h, position_ids)
        cos, sin = cos[:, None], sin[:, None]  # [batch, 1, seq, head_dim]: broadcast over heads
        for layer in inner.layers:
            if self.checkpointing is not None and torch.is_grad_enabled():
                h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, mask, context_shard, **self.checkpointing)
            else:
                h = layer(h, cos, sin, mask, context_shard)
        h = rms_norm(h, inner.norm)
        if sequence is not None:
            h = sequence.gather(h)[:, :width]
        if logits_to_keep is not None:
            h = h[logits_to_keep]  # [kept, hidden]
        return types.SimpleNamespace(logits=self.lm_head(h))


def load_native_model(path: str | Path, dtype: str = "float32", device: str = "cpu",
                      trainable: bool = False) -> NativeCausalLM:
    """The checkpoint at `path` as a `NativeCausalLM` in eval mode, every parameter read from its
    safetensors (a missing or unexpected tensor, or a shape that differs, is refused by name); its
    parameters require grad only when `trainable`."""
    from safetensors import safe_open

    directory = Path(path)
    config = json.loads((directory / "config.json").read_text())
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors (the native model reads safetensors only)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    for name in [n for n in tensors if n.endswith(_DERIVED_KEYS)]:
        del tensors[name]
    model = NativeCausalLM(config, set(tensors))
    expected = dict(model.state_dict(keep_vars=True))
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")  # the embedding's
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{directory}: the safetensors do not fit a native {config['model_type']} model: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, param in expected.items():
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise ValueError(f"{directory}: {name} has shape {list(tensors[name].shape)}, the config implies "
                             f"{list(param.shape)}")
    model.load_state_dict(tensors, strict=False, assign=True)  # lm_head: tied, or in the file
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # re-tie after assign replaced the embedding
    generation = directory / "generation_config.json"  # its eos ids count too (EngineCore's _eos_ids)
    if generation.exists():
        model.generation_config = types.SimpleNamespace(**json.loads(generation.read_text()))
    return model.to(device=device, dtype=getattr(torch, dtype)).eval().requires_grad_(trainable)


def load_causal_lm(path: str | Path, impl: str = "auto", dtype: str = "float32", device: str = "cpu",
                   trust_remote_code: bool = False, trainable: bool = False) -> Any:
    """A checkpoint's causal LM: a `NativeCausalLM` (transformers' modeling never imported) when `impl` is
    native or auto and the checkpoint is covered, else transformers' model (eval mode, grads only when
    `trainable`). `impl="native"` with a checkpoint that is not covered is refused with the reason; auto
    logs it and loads transformers'."""
    from verst.models.loader import load_model

    if impl not in MODEL_IMPLS:
        raise ValueError(f"model impl must be one of {list(MODEL_IMPLS)}, got {impl!r}")
    config_file = Path(path) / "config.json"
    reason = "trust_remote_code" if trust_remote_code else "no config.json"
    if not trust_remote_code and config_file.exists():
        reason = native_config_reason(json.loads(config_file.read_text()))
        if reason is None and not any(Path(path).glob("*.safetensors")):
            reason = "no *.safetensors"
    if reason is None and impl in ("auto", "native"):
        return load_native_model(path, dtype, device, trainable=trainable)
    if impl == "native":
        raise ValueError(f"model impl 'native' cannot load {path}: {reason}")
    if impl == "auto":
        log.info("model impl auto: transformers' model (native: %s)", reason)
    return load_model(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code).requires_grad_(trainable)


class _Config(types.SimpleNamespace):
    """config.json's fields as attributes, with transformers' defaults for the ones engine and trainer read."""

    def __init__(self, raw: dict[str, Any]):
        defaults = {"num_key_value_heads": raw.get("num_attention_heads"), "head_dim": None, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": False, "max_position_embeddings": None, "eos_token_id": None,
                    "pad_token_id": None, "architectures": None, "intermediate_size": None,
                    "_attn_implementation": "sdpa"}
        super().__init__(**{**defaults, **raw})

    def get_text_config(self) -> _Config:
        return self
