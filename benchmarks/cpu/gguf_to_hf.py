"""A GGUF checkpoint as a Hugging Face model directory radixserve can load (used by
benchmarks/cpu_vs_peers.sh).

    python benchmarks/cpu/gguf_to_hf.py SmolLM2-135M-Instruct.Q4_1.gguf OUT_DIR
    python benchmarks/cpu/gguf_to_hf.py --fix-config OUT_DIR     # only the config.json edits

transformers dequantizes the GGUF tensors (needs `pip install gguf accelerate`); the weights are
saved in float32 as model.safetensors (lm_head.weight dropped when the embeddings are tied),
with config.json, generation_config.json and the tokenizer. config.json is then edited:
"quantization_config" removed, "architectures": ["LlamaForCausalLM"], and the dtype set to
"bfloat16" (the upstream checkpoint's dtype, both "torch_dtype" and transformers 5's "dtype"),
so `--dtype auto` runs the model in bf16 on a CPU with native bf16, as llama.cpp runs its BF16
GGUF. The conversion writes into OUT_DIR.tmp and renames it when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys


def fix_config(out_dir: str, dtype: str = "bfloat16", architecture: str = "LlamaForCausalLM") -> bool:
    """The config.json edits; True when the file changed (rewritten atomically)."""
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    new = {k: v for k, v in cfg.items() if k != "quantization_config"}
    new["architectures"] = [architecture]
    new["torch_dtype"] = dtype
    new["dtype"] = dtype
    if new == cfg:
        return False
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(new, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return True


def convert(gguf_path: str, out_dir: str) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = os.path.split(os.path.abspath(gguf_path))
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    fix_config(tmp)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    print(f"wrote {out_dir}: {len(sd)} tensors, {sum(v.numel() for v in sd.values()) / 1e6:.1f}M parameters")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="GGUF_FILE OUT_DIR, or OUT_DIR with --fix-config")
    p.add_argument("--fix-config", action="store_true", help="only edit OUT_DIR/config.json")
    args = p.parse_args(argv)
    if args.fix_config:
        if len(args.paths) != 1:
            p.error("--fix-config takes one directory")
        changed = fix_config(args.paths[0])
        print(f"{args.paths[0]}/config.json: {'updated' if changed else 'already up to date'}")
        return 0
    if len(args.paths) != 2:
        p.error("give GGUF_FILE OUT_DIR")
    convert(*args.paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
