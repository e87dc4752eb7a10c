"""Where the model and its tokenizer come from: a --model-path (a Hugging Face directory or a
GGUF file), or the embedded tiny model. Used by every process that needs the tokenizer (front
end, scheduler, detokenizer) and by the model config (which file a path names)."""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Dict, Optional

from radixserve.server_args import ServerArgs


class LoadError(RuntimeError):
    """A model path that cannot be loaded: the message names the file (and tensor), one line.
    (Defined here, the lowest layer, so the tokenizer can raise it too; the models re-export it
    as radixserve.models.model_config.LoadError.)"""


def resolve_model_path(server_args: ServerArgs) -> str:
    if server_args.model_path:
        return server_args.model_path
    from radixserve.tiny_model import get_tiny_model_path

    return str(get_tiny_model_path())


def gguf_file(path: str) -> Optional[str]:
    """The GGUF file a model path names: the path itself when it is a file ending in .gguf, or
    the one .gguf file of a directory that has no config.json. None for anything else (a
    Hugging Face directory); LoadError for a directory with several .gguf files and no config."""
    if os.path.isfile(path):
        return path if path.lower().endswith(".gguf") else None
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    files = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(files) > 1:
        names = ", ".join(os.path.basename(f) for f in files)
        raise LoadError(f"{path}: {len(files)} .gguf files ({names}) and no config.json; pass one with --model-path FILE.gguf")
    return files[0] if files else None


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    fn = gguf_file(path)
    if fn is None:
        return AutoTokenizer.from_pretrained(path)
    # transformers builds a fast tokenizer (and its chat template) from the GGUF metadata; it
    # reads the file with the gguf package. Nothing is written to disk.
    try:
        return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(fn)), gguf_file=os.path.basename(fn))
    except ImportError as e:
        raise LoadError(f"{fn}: reading a GGUF tokenizer needs the gguf package (pip install gguf): {_first_line(e)}") from None
    except Exception as e:  # whatever transformers trips on in the metadata: one line naming the file
        raise LoadError(f"{fn}: cannot build the tokenizer from the GGUF metadata: {_first_line(e)}") from None


# Gemma's turn format (Gemma 3's tokenizer_config template, text only): a system message opens the
# first user turn; the assistant's turns are the "model" role's.
GEMMA_TURN_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}{%- for message in loop_messages -%}{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
GEMMA_TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")


def get_tokenizer(server_args: ServerArgs) -> Optional[Any]:
    """The server's tokenizer; None with --skip-tokenizer-init (token ids in and out)."""
    if server_args.skip_tokenizer_init:
        return None
    tokenizer = load_tokenizer(server_args.tokenizer_path or resolve_model_path(server_args))
    if server_args.chat_template is not None:
        tokenizer.chat_template = read_chat_template(server_args.chat_template)
    elif not getattr(tokenizer, "chat_template", None) and _has_gemma_turns(tokenizer):
        # Gemma GGUFs often carry no template (the 270M's does not): their turn format, not none.
        tokenizer.chat_template = GEMMA_TURN_CHAT_TEMPLATE
    return tokenizer


def _has_gemma_turns(tokenizer: Any) -> bool:
    vocab = tokenizer.get_vocab()
    return all(t in vocab for t in GEMMA_TURN_TOKENS)


def read_chat_template(value: str) -> str:
    """--chat-template: a Jinja file's text, or the value itself when it is a template."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise LoadError(f"--chat-template {value!r}: no such file, and not a Jinja template either")


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


# generation_config.json fields that become defaults with --sampling-defaults model (SGLang's set).
GENERATION_CONFIG_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_sampling_defaults(server_args: ServerArgs) -> Dict[str, Any]:
    """The sampling defaults a request's unset fields take: none with --sampling-defaults openai
    (SamplingParams' own, which are OpenAI's); the model's generation_config.json with `model`."""
    if server_args.sampling_defaults != "model":
        return {}
    path = os.path.join(resolve_model_path(server_args), "generation_config.json")
    if not os.path.isfile(path):  # e.g. a GGUF file: nothing to read
        return {}
    with open(path) as f:
        config = json.load(f)
    return {k: config[k] for k in GENERATION_CONFIG_SAMPLING_KEYS if config.get(k) is not None}
