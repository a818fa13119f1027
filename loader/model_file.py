"""Everything one GGUF file says about its model except the weights themselves."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eagerlm.loader.architectures import config_from_gguf
from eagerlm.loader.chat_template import ChatTemplate
from eagerlm.loader.config import ModelConfig, RopeOverride
from eagerlm.loader.errors import GGUFFormatError
from eagerlm.loader.gguf_file import GGUFFile
from eagerlm.loader.tokenizer import Tokenizer


class _Vocabulary:
    """The tokenizer's token texts as a container, without copying 262k strings."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def __contains__(self, text: object) -> bool:
        return isinstance(text, str) and self.tokenizer.token_id(text) is not None


def _check_vocabulary(f: GGUFFile, config: ModelConfig, tokenizer: Tokenizer) -> None:
    """One embedding row and one output row per token, as llama.cpp requires (its loader
    wants token_embd and output of exactly {n_embd, n_vocab}, n_vocab being
    `{arch}.vocab_size` or else the token count). Fewer rows and a prompt holding a high
    id failed deep in the forward; more, and sampling could pick an id with no token."""
    n_tokens = tokenizer.vocab_size
    key = f"{config.architecture}.vocab_size"
    if key in f.metadata and int(f.metadata[key]) != n_tokens:
        raise GGUFFormatError(f"{key} is {int(f.metadata[key])} but the tokenizer has "
                              f"{n_tokens} tokens", path=f.path, field=key)
    for name in ("token_embd.weight", "output.weight"):
        if name in f.tensors and (rows := f.tensors[name].shape[0]) != n_tokens:
            raise GGUFFormatError(f"{name} has {rows} rows for a vocabulary of {n_tokens} "
                                  f"tokens: one row per token is required", path=f.path,
                                  field=name)


@dataclass
class ModelFile:
    """An opened model: the GGUF (kept open for the weight loader), its config, tokenizer
    and chat template. Opening checks the header, the architecture and the tokenizer, so
    a bad file fails here, before any weight is read."""

    path: str
    gguf: GGUFFile
    config: ModelConfig
    tokenizer: Tokenizer
    chat_template: ChatTemplate

    @classmethod
    def open(cls, path: str | os.PathLike[str], rope: RopeOverride | None = None) -> ModelFile:
        """Open and check the file; `rope` replaces the file's rope scaling (the user's
        --rope-scaling flags), so everything built from `config` uses it."""
        f = GGUFFile.open(path)
        try:
            config = config_from_gguf(f)
            if rope is not None:
                config = rope.apply(config)
            tokenizer = Tokenizer.from_metadata(f.metadata)
            _check_vocabulary(f, config, tokenizer)
            template = ChatTemplate.from_metadata(f.metadata, config.architecture,
                                                  token_texts=_Vocabulary(tokenizer))
        except BaseException:
            f.close()
            raise
        return cls(str(path), f, config, tokenizer, template)

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text for a conversation, ready for `tokenizer.encode` (which adds
        BOS itself when the model wants one, so the template's BOS is not doubled).

        `tools` (OpenAI's `{"type": "function", "function": {...}}` entries) reach the
        template as its `tools` variable; without any, the variable stays undefined, as it
        always was for conversations without tools. `template_kwargs` are more variables
        (e.g. Qwen3's `enable_thinking`), as Hugging Face's `apply_chat_template` takes them;
        the names the renderer sets itself win."""
        tok = self.tokenizer
        extra = dict(template_kwargs or {})
        for name in ("add_generation_prompt", "bos_token", "eos_token", "messages"):
            extra.pop(name, None)
        if tools:
            extra["tools"] = [dict(t) for t in tools]
        return self.chat_template.render_for_tokenizer(
            messages, tokenizer_adds_bos=tok.add_bos,
            bos_text=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
            eos_text=tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
            add_generation_prompt=add_generation_prompt, **extra)

    def close(self) -> None:
        self.gguf.close()
