"""--is-embedding in-process (tiny model): the pooling config read from a model directory, the
Pooler's per-forward parts, the flag's checks, the Engine's errors, and the scheduler driven
directly (a request of the wrong kind, a full queue, an abort) answering without a crash and
leaking no KV slot. Agreement with transformers is in tests/reference/test_embedding_vs_hf.py."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, List

import pytest
import torch

from radixserve.engine import Engine
from radixserve.hf_transformers_utils import LoadError
from radixserve.layers.pooler import Pooler, PoolingConfig, PoolingType
from radixserve.managers.scheduler import Scheduler
from radixserve.protocol import (
    AbortReq, BatchEmbeddingOutput, BatchTokenIDOutput, BatchTokenizedEmbeddingReqInput, TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from radixserve.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

ST = "sentence_transformers.models."
HIDDEN = 256  # the tiny model's


def write_modules(directory, modules: List[dict], pooling: dict = None) -> None:
    (directory / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (directory / "1_Pooling").mkdir()
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


def st_modules(normalize: bool = True) -> List[dict]:
    mods = [{"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"}]
    return mods + ([{"idx": 2, "name": "2", "path": "2_Normalize", "type": ST + "Normalize"}] if normalize else [])


# ---- PoolingConfig.from_model_path ---------------------------------------------------------------
def test_no_modules_json_means_last_token_normalized(tmp_path):
    assert PoolingConfig.from_model_path(str(tmp_path)) == PoolingConfig(PoolingType.LAST, normalize=True)
    assert PoolingConfig.from_model_path(None) == PoolingConfig(PoolingType.LAST, normalize=True)


@pytest.mark.parametrize("mode, kind", [("lasttoken", PoolingType.LAST), ("mean_tokens", PoolingType.MEAN),
                                        ("cls_token", PoolingType.CLS)])
@pytest.mark.parametrize("normalize", [True, False])
def test_the_pooling_module_and_normalize_module_decide(tmp_path, mode, kind, normalize):
    write_modules(tmp_path, st_modules(normalize), {f"pooling_mode_{mode}": True, "pooling_mode_max_tokens": False})
    assert PoolingConfig.from_model_path(str(tmp_path)) == PoolingConfig(kind, normalize)


def test_a_gguf_file_reads_the_modules_json_beside_it(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert PoolingConfig.from_model_path(str(gguf)) == PoolingConfig(PoolingType.LAST, True)
    write_modules(tmp_path, st_modules(normalize=False), {"pooling_mode_mean_tokens": True})
    assert PoolingConfig.from_model_path(str(gguf)) == PoolingConfig(PoolingType.MEAN, False)


@pytest.mark.parametrize("modules, pooling, message", [
    (st_modules(), {"pooling_mode_max_tokens": True}, r"1_Pooling/config.json: pooling_mode_max_tokens is not supported"),
    (st_modules(), {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, r"expected exactly one pooling_mode_"),
    (st_modules(), {"pooling_mode_lasttoken": True, "include_prompt": False}, r"include_prompt false"),
    (st_modules() + [{"path": "2_Dense", "type": ST + "Dense"}], {"pooling_mode_lasttoken": True},
     r"modules.json: unsupported sentence-transformers module 'sentence_transformers.models.Dense'"),
    (st_modules()[:1], None, r"modules.json: expected one sentence_transformers.models.Pooling module, found 0"),
    (st_modules(), None, r"1_Pooling/config.json: file not found"),
])
def test_unsupported_pooling_configs_are_refused_naming_the_file(tmp_path, modules, pooling, message):
    write_modules(tmp_path, modules, pooling)
    with pytest.raises(LoadError, match=message):
        PoolingConfig.from_model_path(str(tmp_path))


def test_invalid_modules_json(tmp_path):
    (tmp_path / "modules.json").write_text("{not json")
    with pytest.raises(LoadError, match=r"modules.json: invalid JSON"):
        PoolingConfig.from_model_path(str(tmp_path))


# ---- the Pooler's parts and their merge -----------------------------------------------------------
def test_pooler_parts_of_a_batch_and_their_merge():
    """Two requests in one forward: A (a first chunk of 3 tokens) and B (3 tokens after a prefix
    of 2). LAST takes each one's last token, CLS position 0 only where the forward holds it,
    MEAN the sum; merging A's two chunks gives the whole prompt's pooling."""
    h = torch.randn(6, 4)
    batch = SimpleNamespace(extend_seq_lens_cpu=[3, 3], extend_prefix_lens_cpu=[0, 2])
    last = Pooler(PoolingConfig(PoolingType.LAST, False))(h, batch).embeddings
    cls = Pooler(PoolingConfig(PoolingType.CLS, False))(h, batch).embeddings
    mean = Pooler(PoolingConfig(PoolingType.MEAN, False))(h, batch).embeddings
    assert torch.equal(last, h[[2, 5]])
    assert torch.equal(cls, torch.stack([h[0], torch.zeros(4)]))
    assert torch.allclose(mean, torch.stack([h[:3].sum(0), h[3:].sum(0)]))

    rest = torch.randn(2, 4)  # A's second chunk
    part2 = SimpleNamespace(extend_seq_lens_cpu=[2], extend_prefix_lens_cpu=[3])
    whole = torch.cat([h[:3], rest])
    for kind, want in [(PoolingType.LAST, whole[-1]), (PoolingType.CLS, whole[0]), (PoolingType.MEAN, whole.mean(0))]:
        cfg = PoolingConfig(kind, normalize=True)
        pooled = cfg.merge(cfg.merge(None, Pooler(cfg)(h, batch).embeddings[0]), Pooler(cfg)(rest, part2).embeddings[0])
        assert torch.allclose(cfg.finish(pooled, 5), torch.nn.functional.normalize(want, dim=-1), atol=1e-6)


# ---- the flag -------------------------------------------------------------------------------------
def test_is_embedding_runs_the_normal_loop():
    assert not ServerArgs(is_embedding=True).overlap_schedule_enabled("cuda")
    assert ServerArgs().overlap_schedule_enabled("cuda")
    with pytest.raises(ValueError, match="--is-embedding runs the normal loop"):
        ServerArgs(is_embedding=True, disable_overlap_schedule=False)
    with pytest.raises(ValueError, match="--is-embedding does not run with --disaggregation-mode"):
        ServerArgs(is_embedding=True, disaggregation_mode="prefill")


def test_cli_flag():
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli_args(parser.parse_args(["--is-embedding"])).is_embedding
    assert not ServerArgs.from_cli_args(parser.parse_args([])).is_embedding


# ---- the Engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    eng = Engine(is_embedding=True, max_total_tokens=4096, context_length=64, test_check_memory=True)
    yield eng
    eng.shutdown()


def test_encode_shapes(engine):
    one = engine.encode("Hello world")
    assert len(one["embedding"]) == HIDDEN and abs(torch.tensor(one["embedding"]).norm().item() - 1) < 1e-5
    assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert one["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode("Hello world"))
    many = engine.encode(["Hello world", "Goodbye"], rid=["a", "b"])
    assert [m["meta_info"]["id"] for m in many] == ["a", "b"]
    assert many[0]["embedding"] == pytest.approx(one["embedding"], abs=1e-5)
    by_ids = engine.encode(input_ids=[engine.tokenizer.encode("Hello world")], dimensions=HIDDEN)
    assert isinstance(by_ids, list) and by_ids[0]["embedding"] == pytest.approx(one["embedding"], abs=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=""), "The input is empty"),
    (dict(input_ids=[]), "The input is empty"),
    (dict(input_ids=[[1, 2], []]), "The input is empty"),
    (dict(prompt=[]), "The batch is empty"),
    (dict(input_ids=[5] * 64), "longer than the model's context length"),
    (dict(input_ids=[5, 9999]), r"Input token ids must be in \[0, 8192\)"),
    (dict(prompt="hi", dimensions=64), "dimensions=64 is not supported: this model's embeddings have 256 dimensions"),
    (dict(prompt="hi", dimensions=0), "dimensions must be a positive integer"),
    (dict(prompt=["a", "b"], rid=["x", "x"]), "Duplicate request id"),
    (dict(prompt=["a", "b"], rid="x"), "rid must be a non-empty string"),
    (dict(prompt="hi", input_ids=[1]), "Either text or input_ids"),
])
def test_encode_refuses_bad_input(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.encode(**kwargs)
    assert not engine.frontend.rid_to_state  # nothing left registered


def test_encode_while_paused_is_refused_instead_of_waiting_forever(engine):
    engine.pause_generation(mode="in_place")
    try:
        with pytest.raises(ValueError, match="Generation is paused"):
            engine.encode("Hello world")
    finally:
        engine.continue_generation()
    assert len(engine.encode("Hello world")["embedding"]) == HIDDEN


def test_an_embedding_engine_does_not_generate_and_the_reverse(engine):
    with pytest.raises(ValueError, match=r"serves an embedding model \(--is-embedding\)"):
        engine.generate("Hello")
    gen = Engine(max_total_tokens=2048)
    with pytest.raises(ValueError, match="embedding requests need a server started with --is-embedding"):
        gen.encode("Hello")
    gen.shutdown()


# ---- the scheduler driven directly ------------------------------------------------------------------
class Driver:
    """A Scheduler with a list for an inbox and one for its outputs."""

    def __init__(self, **kw: Any):
        self.inbox: List[Any] = []
        self.outbox: List[Any] = []
        args = ServerArgs(max_total_tokens=4096, test_check_memory=True, **kw)
        self.sched = Scheduler(args, recv_fn=self._drain, send_fn=self.outbox.append)

    def _drain(self) -> List[Any]:
        items, self.inbox = self.inbox, []
        return items

    def run(self, *msgs: Any, steps: int = 10) -> List[Any]:
        self.inbox.extend(msgs)
        for _ in range(steps):
            self.sched.process_input_requests(self.sched.recv_requests())
            self.sched.run_step()
        if not self.sched.has_work():
            self.sched.check_memory()  # idle: every slot free or in the tree, nothing locked
        out, self.outbox[:] = list(self.outbox), []
        return out


def test_an_embedding_request_to_a_generation_scheduler_is_refused():
    d = Driver()
    outs = d.run(TokenizedEmbeddingReqInput("e1", None, [5, 6, 7]))
    reasons = [r for o in outs if isinstance(o, BatchTokenIDOutput) for r in o.finished_reasons]
    assert len(reasons) == 1 and reasons[0]["status_code"] == 400 and "--is-embedding" in reasons[0]["message"]
    d.sched.shutdown()


def test_a_generate_request_to_an_embedding_scheduler_is_refused_and_others_are_served():
    d = Driver(is_embedding=True, chunked_prefill_size=8)
    gen = TokenizedGenerateReqInput("g1", None, list(range(5, 25)), SamplingParams(max_new_tokens=4))
    outs = d.run(gen, TokenizedEmbeddingReqInput("e1", None, list(range(5, 25))))
    assert all(isinstance(o, BatchEmbeddingOutput) for o in outs)
    by_rid = {rid: (reason, emb) for o in outs for rid, reason, emb in zip(o.rids, o.finished_reasons, o.embeddings)}
    assert by_rid["g1"][0]["status_code"] == 400 and by_rid["g1"][1] is None
    assert by_rid["e1"][0] == {"type": "length", "length": 0} and len(by_rid["e1"][1]) == HIDDEN
    d.sched.shutdown()


def test_full_queue_and_abort_answer_every_embedding_request():
    d = Driver(is_embedding=True, max_queued_requests=2)
    batch = BatchTokenizedEmbeddingReqInput([TokenizedEmbeddingReqInput(f"e{i}", None, [5 + i] * 10) for i in range(3)])
    d.sched.process_input_requests([batch, AbortReq(rid="e0")])  # e0, e1 queued (e0 then aborted); e2: queue full
    outs = d.run(steps=5)
    by_rid = {rid: (reason, emb) for o in outs for rid, reason, emb in zip(o.rids, o.finished_reasons, o.embeddings)}
    assert by_rid["e0"][0]["type"] == "abort" and by_rid["e0"][1] is None
    assert by_rid["e2"][0]["status_code"] == 503 and by_rid["e2"][1] is None
    assert by_rid["e1"][0]["type"] == "length" and len(by_rid["e1"][1]) == HIDDEN
    d.sched.shutdown()


def test_aborting_a_chunked_embedding_request_between_chunks_frees_its_kv():
    d = Driver(is_embedding=True, chunked_prefill_size=8)
    d.run(TokenizedEmbeddingReqInput("long", None, list(range(5, 45))), steps=2)  # 2 of its 5 chunks
    assert d.sched.chunked_req is not None and d.sched.chunked_req.rid == "long"
    outs = d.run(AbortReq(rid="long"), steps=3)  # run() checks that no slot is lost once idle
    reasons = [r for o in outs for r in o.finished_reasons]
    assert len(reasons) == 1 and reasons[0]["type"] == "abort" and outs[0].embeddings == [None]
    assert d.sched.chunked_req is None and not d.sched.has_work()
    d.sched.shutdown()
