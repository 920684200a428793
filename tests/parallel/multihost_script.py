"""One of two processes (2 CPU devices each) of a multi-host TP=4 run on localhost.

`python -m tests.parallel.multihost_script PROCESS_ID PORT OUT.json HANG_S`. Both processes
build the same `LLM` with `tensor_parallel_size=4` over the 4 global devices; process 0
generates (its runner broadcasts every step), process 1 sits in `worker_loop`. Process 0 then
repeats the generation with TP=1 on its own first device and writes both token lists. Either
process dumps its stacks and exits after HANG_S seconds.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(process_id: int, port: int, out_path: str, hang_s: float) -> None:
    # A hang (a collective one process never enters) prints every thread's stack and exits,
    # after ``hang_s``, before the test's own timeout: the test shows where each one stood.
    faulthandler.dump_traceback_later(hang_s, exit=True)
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2,
                               process_id=process_id, local_device_ids=[0, 1])
    from pagedjax import LLM, SamplingParams
    from pagedjax.parallel.multihost import send_stop, worker_loop
    from tests.parallel.tp_script import NoTokenizer, prompts_for, tiny_model

    assert jax.device_count() == 4 and jax.local_device_count() == 2
    cfg, params = tiny_model()
    prompts = prompts_for(cfg.vocab_size, 3)
    kw = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks=10,
              enable_prefix_caching=True)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM.from_params(cfg, params, NoTokenizer(), tensor_parallel_size=4, **kw)
    if process_id != 0:
        steps = worker_loop(llm.engine.runner)
        with open(out_path, "w") as f:
            json.dump({"worker_steps": steps,
                       "locations_limit": jax.config.jax_traceback_in_locations_limit}, f)
        return
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    send_stop()
    tp4 = [o.outputs[0].token_ids for o in outs]
    stats = llm.engine.get_stats()
    ref = LLM.from_params(cfg, params, NoTokenizer(), tensor_parallel_size=1, **kw)
    tp1 = [o.outputs[0].token_ids for o in ref.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    with open(out_path, "w") as f:
        json.dump({"tp4": tp4, "tp1": tp1, "leader_steps": stats.num_steps,
                   "preemptions": stats.num_preemptions_total,
                   "locations_limit": jax.config.jax_traceback_in_locations_limit}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4]))
