"""Engine: the offline API. It drives the production Scheduler in this process (no ZeroMQ):
requests go in through the scheduler's recv_fn, outputs come back through its send_fn, and
the same RequestFrontend and DetokenizerManager as the served runtime make the results, so
`Engine.generate` and POST /generate validate alike and answer in one shape.

    engine = Engine()                       # the embedded tiny model
    engine.generate("Hello", {"max_new_tokens": 16, "temperature": 0})
    for chunk in engine.generate("Hello", stream=True): print(chunk["text"])
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from tqdm import tqdm

from radixserve.hf_transformers_utils import load_sampling_defaults
from radixserve.managers.admin_requests import (
    check_reply, make_pause_req, make_profile_req, make_release_req, make_resume_req, make_set_internal_state_req,
)
from radixserve.managers.detokenizer import DetokenizerManager
from radixserve.managers.embedding_frontend import EmbeddingFrontend, check_request_kind
from radixserve.managers.request_frontend import (
    ReqState, RequestFrontend, hidden_states_refusal, input_embeds_refusal, is_single, token_ids_logprob_refusal,
)
from radixserve.managers.scheduler import Scheduler
from radixserve.managers.scheduler_builder import build_scheduler_parts
from radixserve.managers.schedule_policy import configure_lora_admission
from radixserve.managers.scheduler_stats import SchedulerStats
from radixserve.protocol import (
    ContinueGenerationReqInput, EplbRebalanceReqInput, ExpertDistributionReq, ExpertDistributionReqType, ProfileReq, ProfileReqType,
    AbortReq, BatchEmbeddingOutput, BatchTokenIDOutput, EmbeddingReqInput, FlushCacheReqInput, FlushCacheReqOutput,
    GenerateReqInput, DestroyWeightsUpdateGroupReqInput, GetWeightsByNameReqInput, InitWeightsUpdateGroupReqInput,
    UpdateWeightFromDiskReqInput, UpdateWeightsFromDistributedReqInput, UpdateWeightsFromTensorReqInput,
    LoadLoRAAdapterReqInput, LoRAUpdateOutput, UnloadLoRAAdapterReqInput,
)
from radixserve.multimodal.image_loader import MediaLimits
from radixserve.multimodal.processor import build_multimodal_processor
from radixserve.server_args import ServerArgs

SamplingArg = Optional[Union[Dict[str, Any], List[Dict[str, Any]]]]


class Engine:
    def __init__(self, model_path: Optional[str] = None, **kwargs: Any):
        self.server_args = ServerArgs(model_path=model_path, **kwargs)
        if self.server_args.null_worker:  # it measures the served host path (HTTP, processes, streams)
            raise ValueError("--null-worker is a server flag (radixserve serve --null-worker); the Engine runs the model")
        self._inbox: List[Any] = []
        self._outbox: List[Any] = []
        self.scheduler = Scheduler(self.server_args, recv_fn=self._drain_inbox, send_fn=self._outbox.append,
                                   parts=build_scheduler_parts(self.server_args))
        self.tokenizer = self.scheduler.tokenizer
        self.vocab_size = self.scheduler.vocab_size
        self.device = self.scheduler.device
        self.dtype = getattr(self.scheduler.tp_worker, "dtype", None)  # the model's weights
        self.frontend = RequestFrontend(self.tokenizer, self.scheduler.context_len, self.vocab_size,
                                        load_sampling_defaults(self.server_args))
        self.detokenizer = DetokenizerManager(self.tokenizer)
        self.frontend.weight_version = self.server_args.weight_version
        configure_lora_admission(self.scheduler.policy, self.server_args)
        self.frontend.lora_names = set(self.server_args.lora_paths) if self.server_args.enable_lora else None
        self.frontend.mm_processor = build_multimodal_processor(self.scheduler.model_config.model_path,
                                                                MediaLimits.from_server_args(self.server_args))
        self.frontend.allow_auto_truncate = self.server_args.allow_auto_truncate
        self.frontend.enable_custom_logit_processor = self.server_args.enable_custom_logit_processor
        self.frontend.token_ids_logprob_refusal = token_ids_logprob_refusal(self.server_args)
        self.frontend.hidden_states_refusal = hidden_states_refusal(self.server_args)
        self.frontend.input_embeds_refusal = input_embeds_refusal(self.server_args, self.scheduler.model_config.architecture)
        self.frontend.hidden_size = self.scheduler.model_config.hidden_size
        self.embeddings = EmbeddingFrontend(self.frontend, self.scheduler.model_config.hidden_size)

    def _drain_inbox(self) -> List[Any]:
        items, self._inbox = self._inbox, []
        return items

    # ---- requests -------------------------------------------------------------------------------
    def generate(
        self,
        prompt: Optional[Union[str, List[str]]] = None,
        sampling_params: SamplingArg = None,
        input_ids: Optional[Union[List[int], List[List[int]]]] = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        stream: bool = False,
        priority: Optional[int] = None,
        rid: Optional[Union[str, List[str]]] = None,
        return_text_in_logprobs: bool = False,
        progress: bool = True,
        lora_path: Optional[Union[str, List[Optional[str]]]] = None,
        image_data: Optional[Any] = None,
        custom_logit_processor: Optional[str] = None,
        token_ids_logprob: Optional[Union[List[int], List[List[int]]]] = None,
        return_hidden_states: Union[bool, List[bool]] = False,
        input_embeds: Optional[List[Any]] = None,
    ) -> Union[Dict[str, Any], List[Dict[str, Any]], Iterator[Dict[str, Any]]]:
        """SGLang-shaped results, the same as POST /generate's: {"text", "output_ids",
        "meta_info": {...}}; a list for a list of prompts or n > 1; with stream=True an
        iterator of such dicts with the text so far. A request the front end refuses raises
        ValueError; one the scheduler refuses or aborts (queue full, invalid grammar, an
        internal error) comes back with finish_reason {"type": "abort", "status_code", ...},
        where HTTP would answer that status, so one bad prompt does not lose a batch's results.
        image_data: a model that takes images: one per image placeholder of the prompt (a data
        URL, a path under allowed_local_media_path, bytes or a PIL image), a list of them, or
        one such entry per prompt of a batch."""
        obj = GenerateReqInput(
            text=prompt, input_ids=input_ids, sampling_params=sampling_params, rid=rid,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs,
            stream=stream, priority=priority, lora_path=lora_path, image_data=image_data,
            custom_logit_processor=custom_logit_processor, token_ids_logprob=token_ids_logprob,
            return_hidden_states=return_hidden_states, input_embeds=input_embeds,
        )
        self._check_not_paused()
        states = self.submit(obj)
        if stream:
            if len(states) != 1 or not is_single(obj):
                self._withdraw(states)
                raise ValueError("stream=True takes a single prompt (and n = 1).")
            return self._stream(states[0])
        bar = tqdm(total=len(states), desc="generate", disable=True if not progress or len(states) < 16 else None)  # None: quiet off a terminal
        done = 0
        try:
            while done < len(states):
                self.step()
                now_done = sum(s.finished for s in states)
                bar.update(now_done - done)
                done = now_done
        finally:  # interrupted: stop what still runs
            bar.close()
            for s in states:
                if not s.finished:
                    self.abort(s.rid)
        results = [self.frontend.make_output(s) for s in states]
        return results[0] if len(results) == 1 and is_single(obj) else results

    def submit(self, obj: Optional[GenerateReqInput] = None, **kwargs: Any) -> List[ReqState]:
        """Validate and queue a request (a GenerateReqInput, or its fields as keywords) without
        running it: step() runs it. One state per prompt and sample, updated as it runs.
        Raises ValueError (RequestError) for a refused request."""
        check_request_kind(self.server_args.is_embedding, is_embedding_request=False)
        reqs = self.frontend.tokenize(obj if obj is not None else GenerateReqInput(**kwargs))
        self._inbox.extend(reqs)
        return [self.frontend.rid_to_state[r.rid] for r in reqs]

    def encode(
        self,
        prompt: Optional[Union[str, List[str]]] = None,
        input_ids: Optional[Union[List[int], List[List[int]]]] = None,
        rid: Optional[Union[str, List[str]]] = None,
        dimensions: Optional[int] = None,
    ) -> Union[Dict[str, Any], List[Dict[str, Any]]]:
        """An embedding model's embeddings (--is-embedding / is_embedding=True), the same as POST
        /encode's: {"embedding": [...], "meta_info": {...}}, a list for a list of prompts. A
        request the front end refuses raises ValueError; one the scheduler refuses comes back with
        embedding None and finish_reason {"type": "abort", "status_code", ...}."""
        check_request_kind(self.server_args.is_embedding, is_embedding_request=True)
        self._check_not_paused()
        reqs, single = self.embeddings.prepare(EmbeddingReqInput(text=prompt, input_ids=input_ids, rid=rid, dimensions=dimensions))
        states = self.embeddings.register(reqs)
        self._inbox.extend(reqs)
        try:
            while not all(s.finished for s in states):
                self.step()
        finally:  # interrupted: stop what still runs
            for s in states:
                if not s.finished:
                    self.abort(s.rid)
        results = [self.embeddings.make_output(s) for s in states]
        return results[0] if single else results

    def _check_not_paused(self) -> None:
        if self.scheduler.generation_pause.engine_paused:  # this thread would wait for continue forever
            raise ValueError("Generation is paused: call continue_generation() first (or submit() and step() later).")

    def _withdraw(self, states: List[ReqState]) -> None:
        """Take back requests submitted but not yet sent to the scheduler."""
        rids = {s.rid for s in states}
        self._inbox = [r for r in self._inbox if getattr(r, "rid", None) not in rids]
        for rid in rids:
            self.frontend.rid_to_state.pop(rid, None)

    def _stream(self, state: ReqState) -> Iterator[Dict[str, Any]]:
        sent = 0
        try:
            while True:
                self.step()
                if len(state.output_ids) > sent or state.finished:
                    sent = len(state.output_ids)
                    yield self.frontend.make_output(state)
                if state.finished:
                    return
        finally:
            if not state.finished:
                self.abort(state.rid)

    def step(self) -> None:
        """One scheduler iteration, then route its outputs to the request states."""
        sched = self.scheduler
        sched.process_input_requests(sched.recv_requests())
        sched.run_step()
        outputs, self._outbox[:] = list(self._outbox), []
        for out in outputs:
            if isinstance(out, BatchEmbeddingOutput):
                for state in self.embeddings.handle_batch_embedding_output(out):
                    self.frontend.rid_to_state.pop(state.rid, None)
            elif isinstance(out, BatchTokenIDOutput):
                updated = self.frontend.handle_batch_output(self.detokenizer.handle_batch_token_id_out(out))
                for state, _ in updated:  # the caller holds its states; the rid is free again
                    if state.finished:
                        self.frontend.rid_to_state.pop(state.rid, None)

    def wait_until_idle(self) -> None:
        """Step until nothing is submitted or scheduled (the last batch retired), or until only
        what a paused generation holds is left (it waits for continue_generation)."""
        while self._inbox or self.scheduler.expects_progress():
            self.step()

    # ---- control ----------------------------------------------------------------------------------
    def abort(self, rid: str) -> None:
        """Abort a request (or the samples of an n > 1 request); its state ends at the next step."""
        for r in self.frontend.abort_targets(rid):
            self._inbox.append(AbortReq(rid=r))
        self.scheduler.process_input_requests(self._drain_inbox())

    def flush_cache(self) -> bool:
        """False while requests are queued or running. Finished requests stay in the running batch
        until the next step filters them out; with nothing of the caller's left, take those steps
        (a served scheduler's idle loop does the same between requests)."""
        for _ in range(4):
            if self._inbox or self.frontend.rid_to_state or not self.scheduler.has_work():
                break
            self.step()
        self._inbox.append(FlushCacheReqInput())
        self.scheduler.process_input_requests(self._drain_inbox())
        outs = [o for o in self._outbox if isinstance(o, FlushCacheReqOutput)]
        self._outbox[:] = [o for o in self._outbox if not isinstance(o, FlushCacheReqOutput)]
        return bool(outs and outs[-1].success)

    def get_server_info(self) -> Dict[str, Any]:
        return self.scheduler.internal_state()

    # ---- weight updates without a restart (SGLang's Engine methods; managers/scheduler_update_weights.py)
    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None,
                                 weight_version: Optional[str] = None) -> Tuple[bool, str]:
        """New weights of the same model from a checkpoint; the cache is flushed. (success, message):
        a refused update (no such path, another architecture or shape) leaves the weights as they were."""
        return self._update_weights(UpdateWeightFromDiskReqInput(model_path, load_format, weight_version=weight_version))

    def update_weights_from_tensor(self, named_tensors: List[Tuple[str, Any]], load_format: Optional[str] = None,
                                   flush_cache: bool = True, weight_version: Optional[str] = None) -> Tuple[bool, str]:
        """(checkpoint name, full tensor) pairs; each TP rank's loader takes its slice."""
        return self._update_weights(UpdateWeightsFromTensorReqInput(
            list(named_tensors), load_format, flush_cache, weight_version=weight_version))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "gloo",
                                  timeout: float = 15.0) -> Tuple[bool, str]:
        out = self._control(InitWeightsUpdateGroupReqInput(master_address, master_port, rank_offset, world_size,
                                                           group_name, backend, timeout))
        return out.success, out.message

    def update_weights_from_distributed(self, names: List[str], dtypes: List[str], shapes: List[List[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: Optional[str] = None) -> Tuple[bool, str]:
        return self._update_weights(UpdateWeightsFromDistributedReqInput(
            names, dtypes, shapes, group_name, flush_cache, weight_version=weight_version))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> Tuple[bool, str]:
        out = self._control(DestroyWeightsUpdateGroupReqInput(group_name))
        return out.success, out.message

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Optional[List[Any]]:
        return self._control(GetWeightsByNameReqInput(name, truncate_size)).parameter

    def _update_weights(self, obj: Any) -> Tuple[bool, str]:
        self.wait_until_idle()  # the requests in flight finish with the old weights first
        out = self._control(obj)
        if out.success and obj.weight_version is not None:
            self.server_args.weight_version = self.frontend.weight_version = obj.weight_version
        return out.success, out.message

    # ---- memory release, pause, profiling (SGLang's Engine methods; managers/admin_requests.py) ----
    def release_memory_occupation(self, tags: Optional[List[str]] = None) -> None:
        """Free the KV pool and / or the weights ("kv_cache", "weights"; None: all) of an idle
        engine; generate requests are refused (503) until resume_memory_occupation. Raises
        ValueError when refused (requests running, an unknown tag, already released)."""
        check_reply(self._control(make_release_req(tags)))

    def resume_memory_occupation(self, tags: Optional[List[str]] = None) -> None:
        """Restore what was released (None: all of it); the weights come back bit for bit."""
        check_reply(self._control(make_resume_req(tags)))

    def pause_generation(self, mode: str = "abort") -> None:
        """abort / retract / in_place (see managers/scheduler_pause.py); submitted requests wait
        until continue_generation (generate() refuses to wait for them meanwhile)."""
        check_reply(self._control(make_pause_req(mode)))
        self.step()  # hands the aborted requests' ends to their states

    def continue_generation(self) -> None:
        check_reply(self._control(ContinueGenerationReqInput()))

    def start_profile(self, output_dir: Optional[str] = None, start_step: Optional[int] = None,
                      num_steps: Optional[int] = None, activities: Optional[List[str]] = None,
                      with_stack: Optional[bool] = None, record_shapes: Optional[bool] = None) -> None:
        """A torch.profiler trace of the scheduler, written by stop_profile (or after num_steps
        batches) to output_dir/{profile_id}-TP-0.trace.json.gz."""
        check_reply(self._control(make_profile_req(output_dir, start_step, num_steps, activities, with_stack, record_shapes)))

    def stop_profile(self) -> None:
        check_reply(self._control(ProfileReq(ProfileReqType.STOP_PROFILE)))

    def start_expert_distribution_record(self) -> None:
        """Count the tokens each MoE layer routes to each expert (layers/expert_distribution.py)."""
        check_reply(self._control(ExpertDistributionReq(ExpertDistributionReqType.START_RECORD)))

    def stop_expert_distribution_record(self) -> None:
        check_reply(self._control(ExpertDistributionReq(ExpertDistributionReqType.STOP_RECORD)))

    def dump_expert_distribution_record(self) -> Dict[str, Any]:
        """{"path", "logical_count" [layers][experts], "num_forward_passes"}; the file holds the same."""
        return check_reply(self._control(ExpertDistributionReq(ExpertDistributionReqType.DUMP_RECORD))).record

    def eplb_rebalance(self) -> Dict[str, float]:
        """EPLB: re-place the experts now from the recorded load (radixserve/eplb/); the per-rank
        load's max / mean before and after. Raises ValueError when EPLB is off or nothing is recorded."""
        return check_reply(self._control(EplbRebalanceReqInput())).stats

    def set_internal_state(self, server_args: Dict[str, Any]) -> Dict[str, Any]:
        """SGLang's /set_internal_state: change max_running_requests / chunked_prefill_size now;
        returns the settable values after it. Raises ValueError naming the field when refused."""
        return check_reply(self._control(make_set_internal_state_req(server_args))).server_args

    # ---- LoRA adapters at run time (--enable-lora) ----------------------------------------------
    def load_lora_adapter(self, lora_name: str, lora_path: str) -> LoRAUpdateOutput:
        out = self._control(LoadLoRAAdapterReqInput(lora_name, lora_path))
        if out.success:
            self.frontend.lora_names = set(out.loaded_adapters)
        return out

    def unload_lora_adapter(self, lora_name: str) -> LoRAUpdateOutput:
        """New requests for it are refused at once; the ones running finish first (stepped here)."""
        if self.frontend.lora_names is not None:
            self.frontend.lora_names.discard(lora_name)
        while True:
            out = self._control(UnloadLoRAAdapterReqInput(lora_name))
            if not out.in_use_by:
                break
            self.step()
        if self.frontend.lora_names is not None:
            self.frontend.lora_names = set(out.loaded_adapters)
        return out

    def _control(self, obj: Any) -> Any:
        """A control request's reply: at once, in this thread, or (a group join, which answers when
        the trainer has come) once the scheduler's note that it ended comes round."""
        obj.query_id = uuid.uuid4().hex
        self._inbox.append(obj)
        self.scheduler.process_input_requests(self._drain_inbox())
        while (reply := next((o for o in self._outbox if getattr(o, "query_id", None) == obj.query_id), None)) is None:
            time.sleep(0.01)
            self.scheduler.process_input_requests(self.scheduler.recv_requests())
        self._outbox.remove(reply)
        return reply

    def stats(self) -> SchedulerStats:
        """The scheduler's counters and phase timings (a snapshot; subtract two for a run)."""
        return self.scheduler.get_stats()

    def grammar_stats(self) -> Optional[Any]:
        """A copy of the grammar backend's cost counters (constrained.GrammarStats: compile,
        mask fill and apply seconds; subtract two for a run); None without a grammar backend."""
        import dataclasses

        backend = self.scheduler.grammar_backend
        return dataclasses.replace(backend.stats) if backend is not None else None

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.frontend.rid_to_state.clear()
        self._inbox.clear()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
