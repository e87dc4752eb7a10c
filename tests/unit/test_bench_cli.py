"""The benchmark commands run end to end at toy sizes and write their JSON (no timing asserts)."""

from __future__ import annotations

import json

import pytest

from radixserve.cli import main


def test_bench_one_batch_writes_json(tmp_path, capsys):
    out = tmp_path / "one_batch.json"
    rc = main([
        "bench", "one-batch", "--batch-sizes", "1", "2", "--input-len", "16", "--decode-steps", "2",
        "--output", str(out),
    ])
    assert rc == 0
    assert "decode ratio" in capsys.readouterr().out  # the table was printed
    report = json.loads(out.read_text())
    assert report["batch_sizes"] == [1, 2] and report["input_len"] == 16
    assert [r["batch_size"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        for system in ("ours", "hf"):
            m = r[system]
            for key in ("prefill_ms", "prefill_tok_s", "decode_ms_per_step", "decode_tok_s"):
                assert m[key] > 0, (system, key)
        assert r["decode_ratio"] > 0 and r["prefill_ratio"] > 0 and r["decode_cpu_ratio"] > 0


def test_bench_one_batch_skip_hf(tmp_path):
    out = tmp_path / "ob.json"
    assert main(["bench", "one-batch", "--batch-sizes", "3", "--input-len", "8", "--decode-steps", "1",
                 "--skip-hf", "--output", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert "hf" not in r and r["ours"]["decode_tok_s"] > 0


def test_bench_offline_writes_json(tmp_path, capsys):
    out = tmp_path / "offline.json"
    rc = main([
        "bench", "offline", "--num-prompts", "4", "--min-input-len", "8", "--max-input-len", "24",
        "--min-output-len", "2", "--max-output-len", "6", "--hf-batch-size", "2", "--max-total-tokens", "4096",
        "--output", str(out),
    ])
    assert rc == 0
    assert "output tok/s" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["num_prompts"] == 4
    ours, other_loop, hf = report["results"]
    # the default loop first: the normal loop on the CPU
    assert ours["system"] == "radixserve (normal loop)" and other_loop["system"] == "radixserve (overlap loop)"
    assert hf["system"].startswith("transformers")
    assert other_loop["ratio_vs_normal_loop"] > 0 and 0 <= other_loop["sched_share"] < 1
    assert other_loop["wall_over_forward"] >= 0.9
    for r in (ours, other_loop, hf):
        assert r["requests"] == 4
        assert r["output_tokens"] > 0 and r["time_s"] > 0 and r["output_tok_s"] > 0
        assert 4 * 8 <= r["input_tokens"] <= 4 * 24
    assert ours["output_tokens"] == hf["output_tokens"]  # both count the requested tokens
    assert hf["raw_output_tokens"] >= hf["output_tokens"]
    assert ours["ratio_vs_hf"] > 0 and ours["cpu_ratio_vs_hf"] > 0


def test_bench_offline_json_schema(tmp_path):
    """--json-schema: the constrained row's mask and compile costs come from the grammar
    backend's own counters (Engine.grammar_stats())."""
    import xgrammar  # noqa: F401 - in the test extra (pyproject.toml): missing is a failure, not a skip

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
    out = tmp_path / "offline.json"
    assert main([
        "bench", "offline", "--num-prompts", "2", "--min-input-len", "8", "--max-input-len", "12",
        "--min-output-len", "4", "--max-output-len", "8", "--skip-hf", "--skip-other-loop",
        "--max-total-tokens", "2048", "--json-schema", str(schema), "--output", str(out),
    ]) == 0
    _, constrained, unconstrained = json.loads(out.read_text())["results"]
    assert constrained["system"] == "radixserve + json_schema"
    assert constrained["first_compile_s"] > 0 and constrained["compile_s"] > 0
    assert constrained["mask_fill_ms_per_step"] > 0 and constrained["mask_apply_us_per_row"] > 0
    assert constrained["num_stopped"] + constrained["num_length"] == 2
    assert unconstrained["output_tokens"] == constrained["output_tokens"]


def test_bench_offline_rejects_bad_lengths(capsys):
    rc = main(["bench", "offline", "--num-prompts", "2", "--min-input-len", "9", "--max-input-len", "4",
               "--skip-hf", "--output", ""])
    assert rc == 2
    assert "--min-input-len" in capsys.readouterr().err


def test_bench_one_batch_mbu_counts_weights_and_kv(tmp_path):
    """MBU = (weight bytes + KV bytes read per decode step) / step time / bandwidth, with the
    byte counts checked against transformers' copy of the model and the config."""
    import transformers

    from radixserve.models.model_config import ModelConfig
    from radixserve.tiny_model import get_tiny_model_path

    out = tmp_path / "ob.json"
    bs, input_len, steps = 2, 8, 2
    assert main(["bench", "one-batch", "--batch-sizes", str(bs), "--input-len", str(input_len), "--decode-steps",
                 str(steps), "--skip-hf", "--mem-bandwidth-gbs", "10", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mem_bandwidth_gbs"] == 10 and report["mem_bandwidth_source"] == "--mem-bandwidth-gbs"
    o = report["results"][0]["ours"]

    hf = transformers.AutoModelForCausalLM.from_pretrained(get_tiny_model_path(), dtype="float32")
    weights = sum(p.numel() * 4 for p in hf.parameters())  # shared (tied) tensors counted once
    if not hf.config.tie_word_embeddings:  # decode reads only bs rows of an untied input embedding
        weights -= hf.model.embed_tokens.weight.numel() * 4
    assert o["weight_bytes"] == weights

    cfg = ModelConfig.from_pretrained(get_tiny_model_path())
    context = input_len + 1 + (steps + 1) / 2  # the mean context of the timed steps
    kv = bs * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert o["kv_bytes_per_step"] == kv
    step_s = o["decode_ms_per_step"] / 1e3
    assert abs(o["mbu"] - (weights + kv) / step_s / 1e9 / 10) < 1e-9


def test_measured_memory_bandwidth_is_plausible():
    from radixserve.bench.one_batch import measure_mem_bandwidth_gbs

    gbs = measure_mem_bandwidth_gbs("cpu", nbytes=32 << 20, repeats=2)
    assert 0.1 < gbs < 10_000  # a real copy rate in GB/s, not seconds or bytes
