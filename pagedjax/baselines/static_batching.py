"""Static (request-level) batching, FasterTransformer-style: the paper's §6 baseline.

A batch is formed only when the previous one has completely finished; nobody
joins mid-batch, so short requests wait for the longest one. The batch size is
bounded by ``max_num_seqs`` and by memory: every member reserves a contiguous
region up front (use it with ``ContiguousKVManager(policy="max")``, which is how
the paper describes FasterTransformer's memory management).
"""

from __future__ import annotations

from pagedjax.core.block_manager import AllocStatus
from pagedjax.core.scheduler import Scheduler, SchedulerOutput, SequenceStatus, _Step


class StaticBatchScheduler(Scheduler):
    """FCFS request-level batching; prompts of a new batch are prefilled under the token budget."""

    def schedule(self) -> SchedulerOutput:
        st = _Step(self.config.max_num_batched_tokens)
        if not self.running:
            self._form_batch(st)
        self._schedule_running(st, sorted(self.running, key=self._priority), [])
        return st.out

    def _form_batch(self, st: _Step) -> None:
        n = 0
        while self.waiting:
            g = self.waiting[0]
            if n + g.max_num_running_seqs() > self.config.max_num_seqs:
                break
            status = self.bm.can_allocate(g)
            if status is AllocStatus.NEVER:
                self.waiting.popleft()
                self._reject(st, g)
                continue
            if status is AllocStatus.LATER:
                break
            self.waiting.popleft()
            self.bm.allocate(g)
            for seq in g.get_unfinished_seqs():
                seq.status = SequenceStatus.RUNNING
            self.running.append(g)
            n += g.max_num_running_seqs()
