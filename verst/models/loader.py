"""The one model and tokenizer loader every component uses, for tiny local and downloaded HF models.

Also the edge where chat text becomes token ids (`chat_prompt_ids`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
_WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"
)


def _checkpoint_dir(path: str | Path) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"model path {str(directory)!r} is not a directory; expected a Hugging Face checkpoint "
            "(make one with `verst model init --arch qwen3 --size tiny --out DIR`)"
        )
    return directory


def _check_model_files(directory: Path, field: str) -> None:
    if not (directory / "config.json").exists():
        raise FileNotFoundError(f"{field} {str(directory)!r} has no config.json; not a Hugging Face checkpoint")
    has_weights = any((directory / name).exists() for name in _WEIGHT_FILES) or any(directory.glob("*.safetensors"))
    if not has_weights:
        raise FileNotFoundError(
            f"{field} {str(directory)!r} has no weights (looked for {', '.join(_WEIGHT_FILES)}, *.safetensors)"
        )


def check_checkpoint_dir(path: str | Path, field: str = "model path") -> None:
    """Fail fast, naming `field`, unless `path` is a checkpoint directory whose config parses, which has
    weights, and whose tokenizer files parse (tokenizer.json is loaded by `tokenizers`: no transformers,
    no torch, well under a second)."""
    from tokenizers import Tokenizer

    directory = Path(path)
    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is not a directory"
        raise FileNotFoundError(f"{field} = {str(path)!r} {what}; expected a Hugging Face checkpoint directory")
    _check_model_files(directory, field)
    for name in ("config.json", "tokenizer_config.json"):
        if (directory / name).exists():
            try:
                json.loads((directory / name).read_text())
            except ValueError as error:
                raise ValueError(f"{field} = {str(path)!r}: {name} does not parse ({error})") from None
    tokenizer_file = directory / "tokenizer.json"
    if tokenizer_file.exists():
        try:
            Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises its own Exception subclass with the parser's message
            raise ValueError(f"{field} = {str(path)!r}: tokenizer.json does not load ({error})") from None
    elif not (directory / "tokenizer_config.json").exists():
        raise FileNotFoundError(f"{field} = {str(path)!r} has no tokenizer.json or tokenizer_config.json")


def check_same_tokenizer(student: str | Path, teacher: str | Path, fields: tuple[str, str] = ("model.path",
                         "teacher.model_path")) -> None:
    """Refuse, naming `fields`, a teacher whose token ids mean other strings than the student's: the teacher
    scores the student's ids as they are. Compares the token -> id maps of the two tokenizer.json files
    (added tokens included), else the bytes of the vocabulary files; and the teacher's vocabulary must
    cover the student's (`vocab_size` of config.json). No transformers, no torch."""
    from tokenizers import Tokenizer

    student, teacher = Path(student), Path(teacher)
    where = f"{fields[1]} = {str(teacher)!r} and {fields[0]} = {str(student)!r}"
    if (student / "tokenizer.json").exists() and (teacher / "tokenizer.json").exists():
        vocabs = [Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab(with_added_tokens=True)
                  for d in (student, teacher)]
        if vocabs[0] != vocabs[1]:
            differ = sorted(set(vocabs[0].items()) ^ set(vocabs[1].items()), key=lambda kv: kv[1])[:3]
            raise ValueError(f"{where} have different tokenizers ({len(vocabs[1])} vs {len(vocabs[0])} tokens; "
                             f"differing entries {differ}); on-policy distillation needs the student's tokenizer")
    else:
        names = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")
        files = [{n: (d / n).read_bytes() for n in names if (d / n).exists()} for d in (student, teacher)]
        if files[0] != files[1] or not files[0]:
            raise ValueError(f"{where}: their tokenizer files differ ({sorted(files[0])} vs {sorted(files[1])}); "
                             "on-policy distillation needs the student's tokenizer")
    sizes = [json.loads((d / "config.json").read_text()).get("vocab_size") for d in (student, teacher)]
    if None not in sizes and sizes[1] < sizes[0]:
        raise ValueError(f"{where}: the teacher's vocab_size {sizes[1]} is smaller than the student's {sizes[0]}; "
                         "it cannot score every token the student may sample")


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a checkpoint directory, with pad_token_id set.

    A folder whose tokenizer_config.json names PreTrainedTokenizerFast (ours) is loaded as exactly
    that from tokenizer.json: transformers 5.x AutoTokenizer may otherwise substitute the model
    family's own tokenizer class (e.g. Qwen2Tokenizer) and silently change the ids. That path also
    imports no torch (AutoTokenizer reads the model config, whose module imports torch: seconds of
    start-up in a process that needs none, such as the rollout manager or the driver).
    """
    from transformers import PreTrainedTokenizerFast

    directory = _checkpoint_dir(path)
    config_file = directory / "tokenizer_config.json"
    if not (directory / "tokenizer.json").exists() and not config_file.exists():
        raise FileNotFoundError(f"model path {str(directory)!r} has no tokenizer.json or tokenizer_config.json")
    tokenizer_class = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.exists() else None
    if tokenizer_class == "PreTrainedTokenizerFast":
        if not (directory / "tokenizer.json").exists():
            raise FileNotFoundError(
                f"{config_file} names PreTrainedTokenizerFast but {directory / 'tokenizer.json'} is missing"
            )
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        # Checkpoints without a pad token (Llama) pad with eos: padded positions are masked out by the
        # attention mask and the loss mask, so the id only has to exist.
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer of {str(directory)!r} has neither pad_token nor eos_token; cannot pad batches")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path: str | Path, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False) -> Any:
    """A transformers causal LM from a checkpoint directory, in eval mode on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choices: {', '.join(DTYPES)}")
    directory = _checkpoint_dir(path)
    _check_model_files(directory, "model path")
    model = AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code
    )
    return model.to(device).eval()


def load_full_state_dict(model: Any, state: dict[str, Any], what: str,
                         error: type[Exception] = ValueError) -> None:
    """Copy a full state dict into a plain HF model; only a tied lm_head may be absent (it is re-tied).
    Anything else missing or unexpected raises `error`, naming `what` and the keys."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {name for name in missing if name.endswith("lm_head.weight") and model.config.tie_word_embeddings}
    if unexpected or set(missing) - tied:
        raise error(f"{what} do not fit the model: missing {sorted(set(missing) - tied)}, "
                    f"unexpected {sorted(unexpected)}")
    if tied:
        model.tie_weights()


def check_vocab(tokenizer: Any, model: Any) -> None:
    """Every token id must have an embedding row; more rows than tokens (padding) is allowed."""
    n_tokens = len(tokenizer)
    n_rows = model.get_input_embeddings().num_embeddings
    if n_tokens > n_rows:
        raise ValueError(
            f"tokenizer has {n_tokens} tokens but the model's embedding has only {n_rows} rows "
            f"(vocab_size); ids {n_rows}..{n_tokens - 1} would index past it"
        )


def load_model_and_tokenizer(
    path: str | Path, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False
) -> tuple[Any, Any]:
    """(model, tokenizer) of one checkpoint, checked to agree on the vocabulary."""
    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
    model = load_model(path, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    check_vocab(tokenizer, model)
    return model, tokenizer


def render_chat(
    tokenizer: Any,
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    **template_kwargs: Any,
) -> str:
    """The chat template's text for `messages` (and tool schemas).

    template_kwargs reach the template as variables (e.g. enable_thinking=False for Qwen3's own).
    """
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat_template; cannot render chat messages")
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **template_kwargs
    )


def drop_chat_template(directory: str | Path) -> bool:
    """Remove the chat template from an exported checkpoint's tokenizer files (tokenizer_config.json's
    `chat_template`, chat_template.jinja/.json); True when there was one. For a model trained on raw
    prompts: it never learnt the template, so chat requests to it are refused instead of answered with
    whatever the untrained format yields."""
    directory = Path(directory)
    found = False
    config_file = directory / "tokenizer_config.json"
    if config_file.exists():
        config = json.loads(config_file.read_text())
        if config.pop("chat_template", None) is not None:
            config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
            found = True
    for name in ("chat_template.jinja", "chat_template.json"):
        if (directory / name).exists():
            (directory / name).unlink()
            found = True
    return found


def chat_prompt_ids(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None = None, **template_kwargs: Any
) -> list[int]:
    """Prompt token ids: the chat template with the generation prompt, encoded once.

    add_special_tokens=False because templates that want a BOS (Llama 3) write it into the text.
    """
    text = render_chat(tokenizer, messages, tools=tools, add_generation_prompt=True, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)
