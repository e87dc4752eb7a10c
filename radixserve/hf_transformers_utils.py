"""Where the model and its tokenizer come from: a --model-path, or the embedded tiny model.
Used by every process that needs the tokenizer (front end, scheduler, detokenizer)."""

from __future__ import annotations

from typing import Any, Optional

from radixserve.server_args import ServerArgs


def resolve_model_path(server_args: ServerArgs) -> str:
    if server_args.model_path:
        return server_args.model_path
    from radixserve.tiny_model import get_tiny_model_path

    return str(get_tiny_model_path())


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def get_tokenizer(server_args: ServerArgs) -> Optional[Any]:
    """The server's tokenizer; None with --skip-tokenizer-init (token ids in and out)."""
    if server_args.skip_tokenizer_init:
        return None
    return load_tokenizer(server_args.tokenizer_path or resolve_model_path(server_args))
