"""Following one job on the job stream (kvops/stream/job_stream.py) from a web process: its
text, assembled from the database row and the stream's pieces, and its latest state.
Used by the /v1 answers and streams and by the job page's websocket."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

from asgiref.sync import sync_to_async

from kvops.jobs import job_store
from kvops.stream.job_stream import TextAssembler, state_update
from kvops.models import Job
from kvops.stream.stream_hub import StreamError, Subscription

log = logging.getLogger(__name__)

POLL_S = 5.0  # a job quiet this long is looked up in the database (did it end unseen?)
HOLE_RELOAD_S = 0.5  # a gap in the text is filled from the database this often


@sync_to_async
def reload(job_id: int) -> Job:
    return Job.objects.get(pk=job_id)


class JobFailed(Exception):
    """The job's updates cannot be followed any more (Redis failed, or the stream lost
    an entry); the message says which."""


class JobListener:
    """One job followed on the job stream: its text and its latest state."""

    def __init__(self, sub: Subscription, job: Job) -> None:
        self.sub = sub
        self.job_id = job.pk
        self.text = TextAssembler()
        self.state: dict = job_store.job_payload(job)
        self.num_output_tokens = job.num_output_tokens
        self.num_prompt_tokens = job.num_prompt_tokens  # both also in the stream's updates
        self.num_cached_tokens = job.num_cached_tokens
        self.prompt_logprobs: list[list] | None = None  # per prompt token, if asked (echo)
        # n > 1: samples 1.. (self.text and the counts above are sample 0's); their text
        # is on the stream only, and in the row's `samples` once the job has ended
        self.sample_texts: dict[int, TextAssembler] = {}
        self.sample_tokens: dict[int, int] = {}
        self._logprobs: dict[int, list[list]] = {}  # per sample: [token, logprob, top]
        self._early_logprobs: dict[int, dict[int, list[list]]] = {}  # past a hole, by offset
        self.text.add(job.attempts, 0, job.output_text)
        if job.is_terminal:  # (a retry's replay of an ended job: the row has it all)
            self.prompt_logprobs = job.prompt_logprobs or None
            if job.output_logprobs:
                self._logprobs[0] = list(job.output_logprobs)
        self._last_reload = float("-inf")

    @property
    def finished(self) -> bool:
        return bool(self.state.get("finished"))

    def text_of(self, index: int) -> str:
        """Sample `index`'s text so far (0: the job's own)."""
        if index == 0:
            return self.text.text
        assembler = self.sample_texts.get(index)
        return assembler.text if assembler is not None else ""

    def logprobs_of(self, index: int) -> list[list]:
        """Sample `index`'s logprob entries so far (0: the job's own)."""
        return self._logprobs.get(index, [])

    @property
    def num_all_output_tokens(self) -> int:
        """Tokens produced so far, every sample's."""
        return self.num_output_tokens + sum(self.sample_tokens.values())

    def apply(self, update: dict) -> None:
        index = update.get("i", 0)
        text = self.text if index == 0 else self.sample_texts.setdefault(index, TextAssembler())
        attempt = text.attempt
        if not text.add(update["attempt"], update["offset"], update["text"]):
            return  # an older attempt's
        rerun = text.attempt != attempt
        if rerun:  # a re-run starts again
            self._logprobs.pop(index, None)
        if "lp" in update:
            self._place_logprobs(index, update.get("lpo"), update["lp"])
        # (within an attempt the count only grows: a request that moved between engines
        # has two producers, whose updates may cross)
        n = update["n"] if rerun else max(update["n"], (
            self.sample_tokens.get(index, 0) if index else self.num_output_tokens))
        if index:
            self.sample_tokens[index] = n
            return
        self.num_output_tokens = n
        if "plp" in update:
            self.prompt_logprobs = update["plp"]
        if "p" in update:
            self.num_prompt_tokens, self.num_cached_tokens = update["p"], update["c"]
        # (an attempt's end is never followed by its running state: a moved request's
        # hand-over, said by the engine it left, may arrive after its end elsewhere)
        if "state" in update and (rerun or update["state"].get("finished")
                                  or not self.finished):
            self.state = update["state"]
            self.num_prompt_tokens = self.state.get("num_prompt_tokens", self.num_prompt_tokens)
            self.num_cached_tokens = self.state.get("num_cached_tokens", self.num_cached_tokens)

    def _place_logprobs(self, index: int, offset: int | None, entries: list[list]) -> None:
        """Logprob entries at their place (`offset`, the count before them): a request that
        moved between engines has two producers, whose updates may cross."""
        have = self._logprobs.setdefault(index, [])
        if offset is None or offset == len(have):
            have.extend(entries)
        elif offset < len(have):  # (some already here)
            have[offset:offset + len(entries)] = entries
        else:  # after a hole: once the hole is filled
            self._early_logprobs.setdefault(index, {})[offset] = entries
            return
        early = self._early_logprobs.get(index)
        while early and len(have) in early:
            have.extend(early.pop(len(have)))

    async def updates(self) -> AsyncIterator[None]:
        """Yields after each batch of updates, until the job ends. Raises JobFailed if
        its updates cannot be followed any more."""
        while not self.finished:
            try:
                batch = await self.sub.next_batch(POLL_S)
            except asyncio.TimeoutError:  # quiet for long: make sure it did not end unseen
                job = await reload(self.job_id)
                if not job.is_terminal:
                    continue
                batch = [state_update(job.pk, job.attempts, job_store.job_payload(job))]
            except StreamError as e:
                raise JobFailed(str(e)) from None
            for update in batch:
                self.apply(update)
            if self.text.has_hole:
                await self._fill_hole()
            yield

    async def _fill_hole(self) -> None:
        """A listener that joined a running job has the row's text and the stream's
        pieces since, with a gap between (the row is written a few times a second):
        the row fills it once it is written past the gap."""
        now = time.monotonic()
        if now - self._last_reload < HOLE_RELOAD_S:
            return
        self._last_reload = now
        job = await reload(self.job_id)
        self.text.add(job.attempts, 0, job.output_text)


def cancel_abandoned(job_id: int) -> None:
    """The client went away before its job ended: cancel it (vLLM aborts on disconnect)."""
    task = asyncio.get_running_loop().create_task(_cancel(job_id))
    _background.add(task)
    task.add_done_callback(_background.discard)


_background: set[asyncio.Task] = set()


@sync_to_async
def _cancel(job_id: int) -> None:
    job = Job.objects.filter(pk=job_id).first()
    if job is None or job.is_terminal:
        return
    try:
        job_store.cancel_job(job)
    except job_store.Conflict:
        pass  # it ended meanwhile
    except Exception as e:
        log.warning("could not cancel abandoned job %s: %s", job_id, e)


