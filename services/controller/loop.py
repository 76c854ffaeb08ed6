"""The RL loop of one run, in the order things happen.

Rollout workers generate in the background from the moment
`start_rollouts()` is called (how far ahead of the trainer they may run is
the mode's business: see batches/staleness.py and weights/fleet.py); the loop itself
only consumes batches, trains and keeps the books. It moves no weights: the
trainer publishes, the replicas follow (one road, through the synchronizer).
It trains on no token of a weight version that no replica verified: before
each step it takes the fleet's verdict on the versions the batch came from.
"""

from __future__ import annotations

from services.controller.pipeline import Pipeline, RunSummary


async def run(p: Pipeline) -> RunSummary:
    await p.start()  # trainer state, resume, the policy to the synchronizer, the start version published
    try:
        if p.config.validation.before_training:
            await p.validate()
        p.start_rollouts()  # workers fill the trajectory pool; the processor makes batches
        while not p.finished():
            batch = await p.next_batch()  # None: data exhausted, or a stop was requested
            if batch is None:
                break
            if not await p.weights_verified(batch):  # the fleet's verdict on each version its tokens came from
                continue  # a version no replica proved (not trained: the run stops on its error), or a stop
            result = await p.train(batch)  # TrainStep; None if the trainer rejected the batch
            if result is None:
                continue
            p.weights_published(result)  # the trainer published what was due; replicas follow by themselves
            p.record(batch, result)  # metrics: JSONL, Prometheus, Status/StreamMetrics
            if p.due_for_validation(result):
                await p.validate()
            if p.due_for_checkpoint(result):
                await p.checkpoint()
        if p.due_for_final_validation():
            await p.validate()
        if p.due_for_final_checkpoint():
            await p.checkpoint()
    finally:
        await p.stop()
    return p.summary()
