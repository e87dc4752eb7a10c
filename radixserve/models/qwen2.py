"""Qwen2: the Llama architecture with a bias on the q/k/v projections."""

from radixserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
