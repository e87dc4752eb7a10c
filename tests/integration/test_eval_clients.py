"""Two real clients that score prompts with logprobs, against the real SmolLM2-135M-Instruct served
in float32 (issue 55):

- EleutherAI's lm-evaluation-harness, `local-completions` (POST /v1/completions with echo,
  logprobs 1 and max_tokens 1, summing token_logprobs[ctxlen:-1]) on a multiple-choice task this
  test writes (YAML + JSONL), equal to the harness's own `hf` model on the same weights: accuracy,
  acc_norm, every choice's loglikelihood within 1e-3; and its generate_until answers equal.
- SGLang's frontend language: `sgl.select` chooses what SGLang's server would (the choice with the
  best mean prompt logprob, SGLang's convention: the first token from logprob_start_len has None),
  `gen(return_logprob, logprob_start_len=4)` and `top_logprobs_num=5` give transformers' numbers.
Also /v1/completions through the openai client: echo with max_tokens 0 (the prompt and its
logprobs, nothing generated), token-id prompts, a list of prompts, streamed and not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import httpx
import pytest
import torch

from conftest import REPO, serve_until_done, start_float32_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from real_model import smollm2_gguf, smollm2_hf_dir  # noqa: E402

LOGLIK_TOL = 1e-3  # the issue's bound for lm-eval's per-choice loglikelihoods
LOGPROB_TOL = 2e-4  # one token's logprob, float32 here and in transformers
NUM_ITEMS = 48


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module", autouse=True)
def _server_start(gguf_path):
    """Start the server first (wait=False): it loads while this process loads its own models."""
    return start_float32_server(gguf_path, 8192)


@pytest.fixture(scope="module")
def real_server(_server_start):
    yield from serve_until_done(_server_start)


@pytest.fixture(scope="module")
def hf_dir(gguf_path) -> Path:
    return smollm2_hf_dir(gguf_path)


@pytest.fixture(scope="module")
def hf(hf_dir):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    return model, tok


def prompt_logprobs(model, ids: List[int]) -> torch.Tensor:
    """[len(ids), vocab]: row j is log P(. | ids[:j + 1]) (transformers, float32)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


# ---- lm-evaluation-harness ------------------------------------------------------------------
def mc_items() -> List[Dict[str, Any]]:
    """Easy continuations, four choices each (generated, deterministic): the next of a run of
    numbers or letters ("4, 5, 6, 7," -> "8"), small sums ("3 + 4 =" -> "7")."""
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    items = []
    for i in range(NUM_ITEMS):
        a, b = 2 + (i * 7) % 23, 1 + (i * 5) % 9
        if i % 3 == 0:
            run = [a + j for j in range(4)]
            question, answer, wrong = f"{', '.join(map(str, run))},", str(a + 4), [a + 9, a + 2, a + 17]
        elif i % 3 == 1:
            j = i % 20
            question, answer = f"{', '.join(letters[j:j + 4])},", letters[j + 4]
            wrong = [letters[(j + 11) % 26], letters[(j + 17) % 26], letters[(j + 23) % 26]]
        else:
            question, answer, wrong = f"{a} + {b} =", str(a + b), [a + b + 1, a + b + 10, a * b + 3]
        choices = [answer, *map(str, wrong)]
        k = i % 4  # the right answer moves around
        choices[0], choices[k] = choices[k], choices[0]
        items.append({"question": question, "choices": choices, "label": k, "answer": answer})
    return items


MC_YAML = """task: radixserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
"""

GEN_YAML = """task: radixserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    items = mc_items()
    (d / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
    (d / "gen.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items[:12]))
    (d / "radixserve_mc.yaml").write_text(MC_YAML.format(data=d / "mc.jsonl"))
    (d / "radixserve_gen.yaml").write_text(GEN_YAML.format(data=d / "gen.jsonl"))
    return d


def run_lm_eval(model: str, model_args: Dict[str, Any], task_dir: Path) -> Dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a local JSONL: nothing to download
    tm = TaskManager(include_path=str(task_dir), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["radixserve_mc", "radixserve_gen"],
                                   task_manager=tm, log_samples=True, bootstrap_iters=0)


def by_doc(samples: List[Dict[str, Any]]) -> Dict[int, Dict[str, Any]]:
    return {s["doc_id"]: s for s in samples}


def test_lm_eval_local_completions_equals_its_hf_model(real_server, hf_dir, task_dir):
    name = httpx.get(real_server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    served = run_lm_eval("local-completions", {
        "model": name, "base_url": real_server.url + "/v1/completions", "tokenizer": str(hf_dir),
        "tokenizer_backend": "huggingface", "batch_size": 4, "num_concurrent": 1, "max_retries": 1,
    }, task_dir)
    ref = run_lm_eval("hf", {"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu", "batch_size": 4}, task_dir)
    got_mc, want_mc = by_doc(served["samples"]["radixserve_mc"]), by_doc(ref["samples"]["radixserve_mc"])
    assert len(got_mc) == len(want_mc) == NUM_ITEMS
    worst = 0.0
    for doc_id, want in want_mc.items():
        got = got_mc[doc_id]
        # resps: one [[loglikelihood, is_greedy]] per choice
        for (g,), (w,) in zip(got["resps"], want["resps"]):
            worst = max(worst, abs(float(g[0]) - float(w[0])))
            assert bool(g[1]) == bool(w[1]), (doc_id, g, w)
        assert (got["acc"], got["acc_norm"]) == (want["acc"], want["acc_norm"]), doc_id
    print(f"lm-eval {NUM_ITEMS} items: acc {served['results']['radixserve_mc']['acc,none']} (hf "
          f"{ref['results']['radixserve_mc']['acc,none']}), acc_norm {served['results']['radixserve_mc']['acc_norm,none']} "
          f"(hf {ref['results']['radixserve_mc']['acc_norm,none']}), worst per-choice loglikelihood gap {worst:.2e}")
    assert worst <= LOGLIK_TOL
    for metric in ("acc,none", "acc_norm,none"):
        assert served["results"]["radixserve_mc"][metric] == ref["results"]["radixserve_mc"][metric]
    # a task the model is good at, so the scores mean something: the issue's bug (every choice
    # scored 0, the first one always won) gave 0.25 here, a quarter of the answers being first
    assert ref["results"]["radixserve_mc"]["acc,none"] >= 0.5
    got_gen, want_gen = by_doc(served["samples"]["radixserve_gen"]), by_doc(ref["samples"]["radixserve_gen"])
    assert [got_gen[i]["resps"] for i in sorted(want_gen)] == [want_gen[i]["resps"] for i in sorted(want_gen)]


# ---- /v1/completions echo through the openai client -----------------------------------------
def test_completions_echo_logprobs_through_openai(real_server, hf):
    import openai

    model, tok = hf
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    texts = ["Question: What is 2 plus 2?\nAnswer: 4", "The capital of France is Paris"]
    ids = [tok.encode(t) for t in texts]
    name = client.models.list().data[0].id
    for prompt, rows in ((texts, ids), (ids, ids), (ids[1], ids[1:])):
        for max_tokens in (0, 1):
            out = client.completions.create(model=name, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             logprobs=2, echo=True)
            assert len(out.choices) == len(rows)
            echoed = texts if prompt is texts else [tok.decode(r) for r in rows]
            for choice, row, echo in zip(sorted(out.choices, key=lambda c: c.index), rows, echoed):
                lp = choice.logprobs
                ref = prompt_logprobs(model, row)
                n = len(row) + max_tokens  # the prompt's tokens, then the generated one (if any)
                assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
                assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
                want = [ref[j - 1, row[j]].item() for j in range(1, len(row))]
                assert max(abs(g - w) for g, w in zip(lp.token_logprobs[1:len(row)], want)) <= LOGPROB_TOL
                assert all(len(t) == 2 for t in lp.top_logprobs[1:])
                assert lp.text_offset == sorted(lp.text_offset)
                assert choice.text.startswith(echo)
                if max_tokens == 0:  # the prompt and its logprobs only
                    assert choice.text == echo and choice.finish_reason == "length"
                    assert out.usage.completion_tokens == 0
    # streamed: the first chunk of each choice carries the prompt's logprobs in front
    stream = client.completions.create(model=name, prompt=texts, max_tokens=2, temperature=0, logprobs=1,
                                       echo=True, stream=True)
    got: Dict[int, List[Any]] = {}
    for chunk in stream:
        for c in chunk.choices:
            if c.logprobs is not None:
                got.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    for i, row in enumerate(ids):
        ref = prompt_logprobs(model, row)
        assert len(got[i]) == len(row) + 2 and got[i][0] is None
        assert max(abs(g - ref[j - 1, row[j]].item()) for j, g in zip(range(1, len(row)), got[i][1:])) <= LOGPROB_TOL


# ---- SGLang's frontend ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def frontend_results(real_server) -> Dict[str, Any]:
    script = REPO / "tests" / "sglang_frontend_programs.py"
    run = subprocess.run([sys.executable, str(script), real_server.url], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_sglang_select_picks_what_sglang_would(frontend_results, hf):
    """SGLang's select: logprob_start_len = prompt_tokens - 2, the mean of the prompt logprobs that
    are not None (the first from the start is None); the decision is the best mean."""
    sys.path.insert(0, str(REPO / "tests"))
    from sglang_frontend_programs import WEATHER, WEATHER_CHOICES

    model, tok = hf
    start = max(len(tok.encode(WEATHER)) - 2, 0)
    means = []
    for choice, got in zip(WEATHER_CHOICES, frontend_results["select"]["meta"]["input_token_logprobs"]):
        ids = tok.encode(WEATHER + choice)
        assert [t for _, t, _ in got] == ids[start:] and got[0][0] is None
        ref = prompt_logprobs(model, ids)
        values = [ref[j - 1, ids[j]].item() for j in range(start + 1, len(ids))]
        assert max(abs(v - w) for (v, _, _), w in zip(got[1:], values)) <= LOGPROB_TOL
        means.append(sum(values) / len(values))
    assert frontend_results["select"]["meta"]["normalized_prompt_logprobs"] == pytest.approx(means, abs=LOGPROB_TOL)
    assert frontend_results["select"]["decision"] == WEATHER_CHOICES[means.index(max(means))]


def test_sglang_gen_prompt_logprobs_from_a_start(frontend_results, hf):
    from sglang_frontend_programs import CAPITAL

    model, tok = hf
    ids = tok.encode(CAPITAL)
    ref = prompt_logprobs(model, ids)
    got = frontend_results["from4"]["meta"]["input_token_logprobs"]
    assert [t for _, t, _ in got] == ids[4:] and got[0][0] is None  # SGLang: None at the start, any start
    assert max(abs(v - ref[j - 1, ids[j]].item()) for j, (v, _, _) in zip(range(5, len(ids)), got[1:])) <= LOGPROB_TOL
    assert len(frontend_results["from4"]["meta"]["output_token_logprobs"]) == 3


def test_sglang_gen_input_top_logprobs(frontend_results, hf):
    from sglang_frontend_programs import CAPITAL

    model, tok = hf
    ids = tok.encode(CAPITAL)
    ref = prompt_logprobs(model, ids)
    meta = frontend_results["top5"]["meta"]
    tops = meta["input_top_logprobs"]
    assert len(tops) == len(meta["input_token_logprobs"]) == len(ids) and tops[0] is None
    for j, row in zip(range(1, len(ids)), tops[1:]):
        best = torch.topk(ref[j - 1], 5)
        assert [t for _, t, _ in row] == best.indices.tolist()
        assert max(abs(v - w) for (v, _, _), w in zip(row, best.values.tolist())) <= LOGPROB_TOL
    assert all(len(row) == 5 for row in meta["output_top_logprobs"])
