"""Architecture name (config.json "architectures") -> model class."""

from __future__ import annotations

from typing import Dict, Type

from torch import nn

from radixserve.models.gemma3 import Gemma3ForCausalLM
from radixserve.models.llama import LlamaForCausalLM, MistralForCausalLM
from radixserve.models.llama_eagle import LlamaForCausalLMEagle
from radixserve.models.model_config import LoadError
from radixserve.models.qwen2 import Qwen2ForCausalLM
from radixserve.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from radixserve.models.qwen3_vl import Qwen3VLForConditionalGeneration
from radixserve.models.qwen3 import Qwen3ForCausalLM
from radixserve.models.qwen3_moe import Qwen3MoeForCausalLM
from radixserve.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from radixserve.models.qwen3_5_vl import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration
from radixserve.models.qwen3_next import Qwen3NextForCausalLM
from radixserve.models.qwen3_next_mtp import Qwen3_5ForCausalLMMTP, Qwen3_5MoeForCausalLMMTP, Qwen3NextForCausalLMMTP

MODEL_REGISTRY: Dict[str, Type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    # served with their vision encoder: images in (radixserve/multimodal/); the released Qwen3.5
    # checkpoints are these
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    "LlamaForCausalLMEagle": LlamaForCausalLMEagle,  # a draft head (--speculative-algorithm EAGLE)
    # the MTP layers of a Qwen3-Next / Qwen3.5 checkpoint: its NEXTN draft
    "Qwen3NextForCausalLMMTP": Qwen3NextForCausalLMMTP,
    "Qwen3_5ForCausalLMMTP": Qwen3_5ForCausalLMMTP,
    "Qwen3_5MoeForCausalLMMTP": Qwen3_5MoeForCausalLMMTP,
}


def get_model_class(architecture: str, where: str = "config.json") -> Type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise LoadError(
            f"{where}: unsupported architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}"
        ) from None
