"""Qwen3: the Llama architecture with RMSNorm on each head of q and k before rotary."""

from radixserve.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
