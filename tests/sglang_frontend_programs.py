"""SGLang's own frontend language (`sgl.function` programs on `sgl.RuntimeEndpoint`) against a
server: `python tests/sglang_frontend_programs.py URL` prints one JSON object with what each
program got. Run in its own process (tests/integration/test_eval_clients.py does): importing
sglang patches transformers process-wide (sglang.srt.utils.hf_transformers_patches), which the
tests that compare against transformers must not inherit."""

from __future__ import annotations

import json
import sys

import sglang as sgl

WEATHER = "The weather today is"
WEATHER_CHOICES = [" sunny and warm", " a banana", " cloudy with rain", " the number seven"]
CAPITAL = "The capital of France is the city of"


@sgl.function
def pick_weather(s):
    s += WEATHER + sgl.select("weather", choices=WEATHER_CHOICES)


@sgl.function
def prompt_logprobs_from(s, start: int):
    s += CAPITAL + sgl.gen("answer", max_tokens=3, temperature=0, return_logprob=True, logprob_start_len=start)


@sgl.function
def prompt_top_logprobs(s):
    s += CAPITAL + sgl.gen("answer", max_tokens=3, temperature=0, return_logprob=True,
                           top_logprobs_num=5, logprob_start_len=0)


def main(url: str) -> None:
    backend = sgl.RuntimeEndpoint(url)
    sgl.set_default_backend(backend)
    picked = pick_weather.run()
    from4 = prompt_logprobs_from.run(start=4)
    top5 = prompt_top_logprobs.run()
    print(json.dumps({
        "select": {"decision": picked["weather"], "meta": picked.get_meta_info("weather")},
        "from4": {"text": from4["answer"], "meta": from4.get_meta_info("answer")},
        "top5": {"text": top5["answer"], "meta": top5.get_meta_info("answer")},
    }))


if __name__ == "__main__":
    main(sys.argv[1])
