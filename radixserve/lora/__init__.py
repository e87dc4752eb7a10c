"""Multi-LoRA serving (issue 28, SGLang's radixserve/lora names): PEFT adapters kept in host
memory (lora.py), swapped into `max_loras_per_batch` slots (mem_pool.py) as batches need them,
and a LoRA delta added by the wrapped linear layers (layers.py) per segment of tokens that share
an adapter. LoRAManager (lora_manager.py) is the one object the ModelRunner talks to."""
