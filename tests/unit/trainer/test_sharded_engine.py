"""A trainer sharded over 2 ranks (FSDP2, gloo on CPU) against the one-process trainer.

Rank 0 is this test process; the engine starts rank 1 as a subprocess
(`services.trainer.rank`), as the service does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from flywheel.errors import FailedPrecondition
from services.trainer.config import TrainerConfig
from flywheel.common.v1 import common_pb2
from flywheel.probe import ProbeBatch
from services.trainer.export import MANIFEST_FILE, WeightExporter, export_state
from services.trainer.probe import published_probe
from services.trainer.loss_request import LossRequest
from services.trainer.training import TrainingEngine
from tests.unit.trainer.trainer_helpers import loaded_engine, make_batch

LOSS = LossRequest(kind="dapo", is_cap=2.0, entropy_coef=0.001)
# eps well above rounding noise: AdamW divides each gradient by its own running magnitude, so an
# element whose gradient is ~0 (rounding noise, summed in another order by two ranks) would move a
# whole lr step of either sign; with eps 1e-6 such elements barely move, and the comparison of the
# parameters below checks the learning, not the noise (CI once failed on gate_proj with eps 1e-8).
OPTIMIZER = {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.01, "warmup_steps": 2, "schedule": "cosine", "total_steps": 10}


@pytest.fixture(autouse=True)
def _threads_kept() -> Iterator[None]:
    """model.cpu_threads sets this process's thread count: the tests after these run as they would alone."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _config(model: Path, ckpt: Path, world_size: int) -> TrainerConfig:
    return TrainerConfig.model_validate({
        "model": {"path": str(model), "cpu_threads": 1},
        "optimizer": OPTIMIZER,
        "checkpoint": {"dir": str(ckpt)},
        "parallel": {"world_size": world_size, "timeout_seconds": 300},
    })


def ranks(model: Path, ckpt: Path, world_size: int = 2) -> contextlib.AbstractContextManager[TrainingEngine]:
    return loaded_engine(_config(model, ckpt, world_size))


def _state(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    with engine.lock:
        if engine.sharded:
            return engine.gathered_state(1 << 16)
        return {k: v.clone() for k, v in export_state(engine.policy, False).items()}


def _assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


def test_two_ranks_train_like_one_and_export_bit_exact(tiny_model: Path, tmp_path: Path) -> None:
    one = TrainingEngine(_config(tiny_model, tmp_path / "one", 1))
    one.load()
    batches = [make_batch(batch_size=5, seed=1), make_batch(batch_size=4, seed=2), make_batch(batch_size=1, seed=3)]
    with ranks(tiny_model, tmp_path / "two") as two:
        assert two.info().parameter_count == one.info().parameter_count
        # Export at load: the same names in the same order, the same bytes.
        _assert_bit_equal(_state(two), _state(one))

        for i, batch in enumerate(batches):
            # 5 rows: 3 + 2; 1 row: rank 1 runs a stand-in pass; micro-batches of 2.
            a = one.train_step(batch, LOSS, micro_batch_size=2)
            b = two.train_step(batch, LOSS, micro_batch_size=2)
            assert (b.step, b.weight_version, b.tokens, b.loss_tokens) == (a.step, a.weight_version, a.tokens, a.loss_tokens)
            for key in ("loss", "pg_loss", "entropy", "clip_ratio", "grad_norm", "learning_rate"):
                if key in a.metrics:
                    assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-5, abs=1e-7), (i, key)
        # ForwardBackward + OptimStep split in two calls.
        fb1, fb2 = one.forward_backward(batches[0], LOSS), two.forward_backward(batches[0], LOSS)
        assert fb2.metrics["loss"] == pytest.approx(fb1.metrics["loss"], rel=1e-5, abs=1e-7)
        # Each rank computed some of the rows: rank 0 gathers every row's log-probs, in the caller's order.
        assert torch.allclose(fb2.logprobs, fb1.logprobs, atol=1e-5) and fb2.logprobs[batches[0]["loss_mask"] > 0].all()
        o1, o2 = one.optim_step(), two.optim_step()
        assert o2.step == o1.step == 4 and o2.grad_norm == pytest.approx(o1.grad_norm, rel=1e-5)

        s1, s2 = _state(one), _state(two)
        assert list(s1) == list(s2)
        for name in s1:
            if name.endswith("k_proj.bias"):
                # A key bias shifts every score of a query alike, so softmax ignores it: its gradient is 0 up to
                # rounding, and AdamW turns that noise into lr-sized steps of either sign. Nothing to compare.
                continue
            torch.testing.assert_close(s2[name], s1[name], rtol=1e-4, atol=1e-6, msg=name)
        lp1, v1 = one.compute_logprobs(batches[0], micro_batch_size=2)
        lp2, v2 = two.compute_logprobs(batches[0], micro_batch_size=2)
        assert v1 == v2 == 4 and lp1.shape == lp2.shape
        torch.testing.assert_close(lp2, lp1, rtol=1e-4, atol=1e-5)

        # The CHECKPOINT export writes the gathered bytes (HF names, tied head dropped).
        result = asyncio.run(WeightExporter(two, two.config.sync).checkpoint())
        written = {}
        for file in sorted(Path(result.path).glob("*.safetensors")):
            written.update(load_file(str(file)))
        gathered = _state(two)
        assert set(written) == set(gathered)
        assert all(torch.equal(written[n], gathered[n]) for n in gathered)
        # Its probe is the two ranks' forward of those weights: what one rank computes of its own (alike up to rounding).
        manifest = common_pb2.WeightManifest.FromString((Path(result.path) / MANIFEST_FILE).read_bytes())
        one.policy.model.eval()
        alone = published_probe(one.policy, export_state(one.policy, False), False)
        one.policy.model.train()
        assert ProbeBatch.from_pb(manifest.probe).token_ids == alone.token_ids
        torch.testing.assert_close(torch.tensor(ProbeBatch.from_pb(manifest.probe).logprobs),
                                   torch.tensor(alone.logprobs), rtol=1e-4, atol=1e-4)
    one.close()


def test_sharded_checkpoint_resumes_exactly(tiny_model: Path, tmp_path: Path) -> None:
    batches = [make_batch(batch_size=5, seed=s) for s in range(4)]
    ckpt = tmp_path / "ckpt"
    with ranks(tiny_model, ckpt) as first:
        for batch in batches[:2]:
            first.train_step(batch, LOSS, micro_batch_size=2)
        path, step, size = first.save_checkpoint(client_state=b"cursor=7")
        assert (path.name, step) == ("global_step_2", 2) and size > 0
        assert (path / "sharded").is_dir() and (path / "rank_0").is_dir() and (path / "rank_1").is_dir()
        uninterrupted = [first.train_step(b, LOSS, micro_batch_size=2).metrics for b in batches[2:]]
        final = _state(first)

    # The sharded checkpoint's whole state, read back without any rank: its model/ holds the same bytes.
    dcp_to_torch_save(path / "sharded", tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)["model"]
    saved_weights = load_file(str(next((path / "model").glob("*.safetensors"))))
    assert all(torch.equal(saved_weights[n], whole[n]) for n in saved_weights)

    with ranks(tiny_model, ckpt) as second:
        loaded, step, version, client_state = second.load_checkpoint(latest=True)
        assert (loaded, step, version, client_state) == (path, 2, 2, b"cursor=7")
        resumed = [second.train_step(b, LOSS, micro_batch_size=2).metrics for b in batches[2:]]
        for a, b in zip(uninterrupted, resumed):
            for key in ("loss", "grad_norm", "learning_rate"):
                assert a[key] == b[key], key
        _assert_bit_equal(_state(second), final)

    # A one-process trainer refuses the sharded checkpoint, naming what to do.
    one = TrainingEngine(_config(tiny_model, ckpt, 1))
    one.load()
    with pytest.raises(FailedPrecondition, match="sharded ranks"):
        one.load_checkpoint(path)


def test_a_bad_loss_on_one_rank_and_a_dead_rank(tiny_model: Path, tmp_path: Path) -> None:
    with ranks(tiny_model, tmp_path / "ckpt") as engine:
        engine.train_step(make_batch(), LOSS)
        before = _state(engine)
        # Rank 1's rows overflow to an infinite loss; rank 0's are fine. Both refuse, nothing moves. (Rows are
        # ordered longest first before they are shared out: lengths 12, 11, 12, 9 give rank 0 rows 0 and 2.)
        batch = make_batch()
        overflow = {**batch, "advantages": torch.tensor([1.0, 3e38, -1.0, 3e38])}
        with pytest.raises(FailedPrecondition, match="another rank's samples.*discarded"):
            engine.train_step(overflow, LOSS)
        _assert_bit_equal(_state(engine), before)
        assert engine.train_step(batch, LOSS).step == 2  # the ranks are still in step

        [worker] = engine.ranks.workers
        worker.kill()
        worker.wait()
        with pytest.raises(FailedPrecondition, match="trainer rank 1 exited"):
            engine.train_step(make_batch(), LOSS)
        assert engine.info().step == 2
