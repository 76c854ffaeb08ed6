"""What the sampler recorded beyond log-probs, from a rollout's Sample to the TrainBatch: kept sets
(constrained ones too big to carry masked out and counted) and mixture-of-experts routing (per
position, multi-turn episodes from each call's own record)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flywheel.codec.dtypes import tensor_to_proto
from flywheel.common.kept import KeptSet
from flywheel.common.v1 import common_pb2 as cpb
from flywheel.errors import DataLoss
from services.controller.adapters.rollout import generation
from services.controller.batches.batching import build_train_batch
from services.controller.domain import Task, Trajectory
from services.controller.rollouts.routing import episode_routing


def _trajectory(prompt: list[int], response: list[int], **extra) -> Trajectory:
    return Trajectory(task=Task(id="t", prompt="p", index=0, epoch=0), prompt_ids=prompt, response_ids=response,
                      response_logprobs=[-0.5] * len(response), response_mask=[1] * len(response), version_start=0,
                      version_end=0, advantage=1.0, **extra)


def test_kept_sets_and_routing_become_per_position_tensors() -> None:
    routed = np.arange(4 * 2 * 2, dtype=np.uint8).reshape(4, 2, 2) % 8  # prompt 2 + completion 3 - 1 positions
    a = _trajectory([1, 2], [3, 4, 5], routed_experts=routed, kept_sets=[
        KeptSet(0, 2, (3, 9)), KeptSet(1, 300, ()), KeptSet(2, 400, (), constrained=True)])
    b = _trajectory([1, 2, 6], [7], kept_sets=[KeptSet(0, 3, (1, 7, 8), constrained=True)])
    batch = build_train_batch([a, b], target_version=0)
    t = batch.tensors
    assert t["sampler_kept_size"].tolist() == [[0, 0, 2, 300, 0], [0, 0, 0, 3, 0]]  # the excluded one: none
    assert t["sampler_kept_ids"][0, 2].tolist() == [3, 9, -1] and t["sampler_kept_ids"][1, 3].tolist() == [1, 7, 8]
    assert (t["sampler_kept_ids"][0, 3] == -1).all()  # too big: its size alone
    # The constrained token whose set was too big is out of the loss, and counted.
    assert t["loss_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 1, 0]]
    assert t["behaviour_logprobs"][0, 4] == 0
    assert batch.sampler_counts == {"kept_ids": 2, "kept_size_only": 1, "constrained": 1, "constrained_excluded": 1}
    r = t["routed_experts"]
    assert r.shape == (2, 5, 2, 2) and r.dtype == torch.uint8
    assert torch.equal(r[0, :4], torch.from_numpy(routed)) and (r[0, 4] == 255).all() and (r[1] == 255).all()


def test_a_batch_without_records_carries_no_such_tensors() -> None:
    batch = build_train_batch([_trajectory([1, 2], [3, 4])], target_version=0)
    assert not {"sampler_kept_size", "sampler_kept_ids", "routed_experts"} & set(batch.tensors)


def test_a_multi_turn_episode_takes_each_calls_own_routing_over_its_completion() -> None:
    first = np.zeros((2 + 3 - 1, 1, 2), dtype=np.uint8)  # prompt 2, completion 3
    first[2:] = 1
    last = np.full((2 + 3 + 2 + 2 - 1, 1, 2), 7, dtype=np.uint8)  # prompt: all of the above + 2 tool tokens
    out = episode_routing([(2, first), (7, last)])
    assert out[:2].max() == 7  # the prompt as the last call's prefill saw it
    assert (out[2:4] == 1).all()  # the first call's completion, fed while it sampled
    assert (out[4:] == 7).all()  # its last token, the tool tokens and the last call's own
    assert episode_routing([(2, first), (7, None)]) is None


def test_a_sample_whose_records_do_not_fit_is_data_loss() -> None:
    sample = cpb.Sample(prompt_token_ids=[1, 2], completion_token_ids=[3, 4], completion_logprobs=[-1, -1],
                        finish_reason=cpb.FINISH_REASON_STOP)
    sample.kept_sets.add(position=0, size=2, token_ids=[3, 9])
    sample.routed_experts.CopyFrom(tensor_to_proto(torch.zeros(3, 2, 2, dtype=torch.uint8)))
    g = generation(sample)
    assert g.kept_sets == [KeptSet(0, 2, (3, 9))] and g.routed_experts.shape == (3, 2, 2)
    wrong = cpb.Sample(); wrong.CopyFrom(sample)
    wrong.routed_experts.CopyFrom(tensor_to_proto(torch.zeros(4, 2, 2, dtype=torch.uint8)))
    with pytest.raises(DataLoss, match="routed_experts"):
        generation(wrong)
    wrong.CopyFrom(sample)
    wrong.kept_sets[0].token_ids[:] = [5, 9]
    with pytest.raises(DataLoss, match="not in its own kept set"):
        generation(wrong)


def test_a_session_records_routing_and_the_rebuilt_episode_carries_it() -> None:
    from flywheel.models.moe import routing_json
    from services.controller.adapters.sessions import session_call
    from services.controller.rollouts.episodes import rebuild, trajectory

    first = torch.tensor(np.arange(2 + 3 - 1, dtype=np.uint8).repeat(2).reshape(4, 1, 2))
    second = torch.full((2 + 3 + 1 + 2 - 1, 1, 2), 7, dtype=torch.uint8)

    def record(prompt, completion, routed):
        return {"prompt_token_ids": prompt, "completion_token_ids": completion, "logprobs": [-1.0] * len(completion),
                "version_start": 0, "version_end": 0, "finish_reason": "stop", "routed_experts": routing_json(routed)}

    calls = [session_call(record([1, 2], [3, 4, 5], first)), session_call(record([1, 2, 3, 4, 5, 6], [8, 9], second))]
    (segment,) = rebuild(calls).segments
    traj = trajectory(segment, Task(id="t", prompt="p", index=0, epoch=0), sample_index=0, model_tag="default",
                      engine="r")
    assert traj.routed_experts.shape == (7, 1, 2)
    assert traj.routed_experts[2:4].tolist() == first[2:4].tolist()  # the first call's own, over its completion
    assert (traj.routed_experts[4:] == 7).all() and (traj.routed_experts[:2] == 7).all()
