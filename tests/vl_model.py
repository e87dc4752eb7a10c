"""Tiny random Qwen2.5-VL, Qwen3-VL and Qwen3.5 (dense, MoE) checkpoints for the tests, built by transformers 5 itself: the
config (Qwen2_5_VLConfig / Qwen3VLConfig with a small vision_config), the weights, the embedded model's tokenizer with
Qwen's three vision tokens added and a chat template that places an image part, and the Qwen2-VL
image processor (the Pillow backend) at a small patch size. Also images as data URLs."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np
import torch
import transformers
from PIL import Image

from radixserve.tiny_model import TINY_MODEL_ASSETS

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] == 'image' or part['type'] == 'image_url' %}{{- '" + IMAGE_PLACEHOLDER + "' }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# window_size 16 px = 2x2 merged patches of 4 px: the windowed blocks attend within small windows
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1])
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
# Qwen3-VL: a 4x4 learned position table, DeepStack from the first two of three blocks
VISION_QWEN3 = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                    temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
                    deepstack_visual_indexes=[0, 1])
TEXT_QWEN3 = dict(TEXT, num_hidden_layers=3, head_dim=16)
# Qwen3.5: Qwen3-VL's tower without DeepStack in front of the hybrid language model (GatedDeltaNet
# layers and gated full attention), interleaved M-RoPE on half of each head
VISION_QWEN3_5 = {k: v for k, v in VISION_QWEN3.items() if k != "deepstack_visual_indexes"}
TEXT_QWEN3_5 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                    max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                     "mrope_interleaved": True, "partial_rotary_factor": 0.5})
TEXT_QWEN3_5_MOE = dict({k: v for k, v in TEXT_QWEN3_5.items() if k != "intermediate_size"}, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2)
FAMILIES = {
    "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration, TEXT, VISION),
    "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration, TEXT_QWEN3, VISION_QWEN3),
    "qwen3_5": (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration, TEXT_QWEN3_5, VISION_QWEN3_5),
}
# built by make_vl_model_dir too, tested in test_qwen3_5.py only (test_qwen_vl.py runs FAMILIES)
MORE_FAMILIES = {
    "qwen3_5_moe": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration, TEXT_QWEN3_5_MOE,
                    VISION_QWEN3_5),
}
MIN_PIXELS, MAX_PIXELS = 8 * 8, 48 * 48  # images resize to at most 12x12 patches = 36 tokens


def make_vl_model_dir(out_dir: str, seed: int = 0, family: str = "qwen2_5_vl") -> str:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(TINY_MODEL_ASSETS))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]})
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    ids = tok.convert_tokens_to_ids(list(VISION_TOKENS))
    vocab = -(-len(tok) // 8) * 8
    config_class, model_class, text, vision = {**FAMILIES, **MORE_FAMILIES}[family]
    config = config_class(
        text_config=dict(text, vocab_size=vocab, eos_token_id=[0, 2], bos_token_id=None, pad_token_id=0),
        vision_config=vision, vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2],
        video_token_id=ids[2], tie_word_embeddings=False)
    config.architectures = [model_class.__name__]
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    with torch.no_grad():  # weights that make the logits far from uniform (no near-ties in greedy)
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = p[0].numel()
                p.normal_(0, fan_in ** -0.5)
            elif name.endswith("A_log"):  # GatedDeltaNet's decays moderate: float32 stays near float64
                p.copy_(torch.empty_like(p).uniform_(0.05, 0.5).log())
            elif ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(out))
    transformers.Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                          min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(str(out))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return str(out)


def random_image(seed: int, size: Tuple[int, int] = (40, 28)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def hf_greedy(hf, prompt: str, images: Sequence, max_new_tokens: int) -> Tuple[List[int], List[float]]:
    """transformers' greedy tokens and their logprobs: its own image processor, each image
    placeholder expanded to the image's tokens here (patches / 4), independently of radixserve.
    hf: (Qwen2_5_VLForConditionalGeneration, its tokenizer, its image processor)."""
    model, tok, image_processor = hf
    image_id = model.config.image_token_id
    ids = tok.encode(prompt)
    kwargs = {}
    if images:
        out = image_processor(images=list(images), return_tensors="pt")
        counts = iter((out["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [x for t in ids for x in ([image_id] * next(counts) if t == image_id else [t])]
        kwargs = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
    inp = torch.tensor([ids])
    with torch.no_grad():
        gen = model.generate(input_ids=inp, mm_token_type_ids=(inp == image_id).int(), max_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs)
    tokens = gen.sequences[0, len(ids):].tolist()
    return tokens, [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(gen.logits, tokens)]
