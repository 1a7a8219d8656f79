"""A request's way out of the engine: each step's progress as token ids (CoreOutput),
and, for an engine that keeps text, as RequestOutput with the text detokenised here (a
stop string found in it ends the request). vLLM's OutputProcessor, in-process."""
from __future__ import annotations

from engine.model.runner import StepResult
from engine.outputs import ENDED, CoreOutput, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler
from engine.text.detokenizer import IncrementalDetokenizer, Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler, detokenize: bool) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler  # (to end a request whose text reached a stop string)
        # False: the caller turns token ids into text itself (the engine core process,
        # whose worker detokenises, as vLLM's frontend does)
        self.detokenize = detokenize
        self._detok: dict[str, IncrementalDetokenizer] = {}  # live requests' text, by id

    # --- whose text is followed --------------------------------------------------------
    def follow(self, request_id: str, params: SamplingParams) -> None:
        """Detokenise the request's output here, if this engine keeps text."""
        if self.detokenize:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop,
                                                             params.min_tokens)

    def forget(self, request_id: str) -> None:
        """Its text is no longer this engine's to deliver (it ended, or moved away)."""
        self._detok.pop(request_id, None)

    def forked(self, parent_id: str, sample_id: str, params: SamplingParams) -> None:
        """A sample of a fork is followed; the parent itself never outputs."""
        self.forget(parent_id)
        self.follow(sample_id, params)

    def arrived(self, request_id: str, params: SamplingParams, made: list[int]) -> None:
        """A request that moved here: the text of the tokens it made before was the
        source's to deliver; only what follows is this engine's."""
        self.follow(request_id, params)
        detok = self._detok.get(request_id)
        if detok is not None:
            detok.add(made)
            detok.take_delta(False)

    # --- a step's outputs ----------------------------------------------------------------
    @staticmethod
    def keep_prompt_logprobs(out: SchedulerOutput, computed: dict[str, list]) -> None:
        """Append this step's prompt-token logprobs to their requests, in prompt order
        (positions a recompute scores again are not appended twice). Before the update,
        which may fork."""
        requests = {s.request.request_id: s.request for s in out.scheduled}
        for request_id, entries in computed.items():
            request = requests[request_id]
            kept = request.prompt_logprobs
            if not kept:
                kept.append([request.prompt_token_ids[0], None, [], []])
            for position, logprob, ids, values in entries:
                if position == len(kept) - 1:
                    kept.append([request.prompt_token_ids[position + 1], logprob, ids, values])

    @staticmethod
    def add_progress(outputs: list[CoreOutput], progressed: list[Request],
                     result: StepResult) -> None:
        """Append the output of each request that made progress to `outputs`, and give
        the step's logprobs to the outputs of the requests that asked for them."""
        # As outputs.core_output, inline: this runs for every request in every step.
        # Only this step's progress: `outputs` may already hold a report of the same
        # request (its arrival from another engine), which must not take them twice.
        ended_states = ENDED
        progress = [CoreOutput(r.request_id, [r.output_token_ids[-1]],
                               r.status in ended_states, r.finish_reason,
                               len(r.prompt_token_ids), r.num_cached_tokens or 0,
                               r.num_preemptions, None, r) for r in progressed]
        outputs += progress
        for o in progress:  # the prompt's logprobs travel once, with the first token
            if o.request.prompt_logprobs and len(o.request.output_token_ids) == 1:
                o.prompt_logprobs = o.request.prompt_logprobs
        logprobs = result.logprobs
        if logprobs:  # only requests that asked for them
            for o in progress:
                entry = logprobs.get(o.request_id)
                if entry is not None:
                    o.logprobs = [entry]
                    o.request.output_logprobs.append(entry)

    def output(self, core: CoreOutput) -> RequestOutput:
        """The full output of a request, its text detokenised here (a stop string found
        now ends the request)."""
        request = core.request
        detok = self._detok.get(request.request_id)
        if detok is not None:
            detok.add(core.new_token_ids)
            if detok.stopped and not request.status.is_finished:
                self.scheduler.finish(request, RequestStatus.FINISHED, "stop")
        finished = request.status.is_finished
        delta = detok.take_delta(finished) if detok is not None else ""
        output = self.request_output(request, delta)
        if finished:
            self._detok.pop(request.request_id, None)
        return output

    def request_output(self, request: Request, text_delta: str = "") -> RequestOutput:
        """A request's output as it stands (its text so far, if this engine keeps it)."""
        detok = self._detok.get(request.request_id)
        return RequestOutput(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            text=detok.text if detok is not None else "",
            finished=request.status.is_finished, finish_reason=request.finish_reason,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_preemptions=request.num_preemptions, text_delta=text_delta,
            logprobs=list(request.output_logprobs)
            if request.sampling_params.logprobs is not None else None,
            prompt_logprobs=list(request.prompt_logprobs)
            if request.sampling_params.prompt_logprobs is not None else None,
            error=request.error)
