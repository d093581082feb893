"""Multi-process agreement (``sharding/agreement.py``) with the other processes simulated: the
all-gather returns what each process would contribute."""

import numpy as np
import pytest

from kdsa.sharding import agreement


def _processes(monkeypatch, others):
    """This process is 0 of ``1 + len(others)``; ``others`` are the other processes' values."""
    monkeypatch.setattr(agreement, "_process_count", lambda: 1 + len(others))
    monkeypatch.setattr(agreement, "_gather",
                        lambda x: np.stack([np.asarray(x)] + [np.asarray(o(x)) for o in others]))


def test_a_check_failing_on_another_process_stops_this_one(monkeypatch):
    _processes(monkeypatch, [lambda x: np.int32(0), lambda x: np.int32(1)])
    with pytest.raises(ValueError, match=r"--data d.jsonl: the check failed on process\(es\) "
                                         r"\[2\] \(their error says why\)"):
        agreement.agreed(lambda: 7, "--data d.jsonl")
    with pytest.raises(ValueError, match="no such file"):  # a failing one raises its own
        agreement.agreed(lambda: (_ for _ in ()).throw(ValueError("no such file")), "--data")

    def unreadable():
        raise PermissionError(13, "Permission denied", "d.jsonl")

    with pytest.raises(ValueError, match=r"--data: Permission denied \(d.jsonl\)"):
        agreement.agreed(unreadable, "--data")


def test_any_exception_reaches_the_all_gather(monkeypatch):
    """A check failing with another exception (an ``OverflowError`` from a token id past
    int64 in a damaged data file) still takes part in the all-gather before raising: it ended
    the process first, and the others waited in the all-gather."""
    gathered = []
    _processes(monkeypatch, [lambda x: gathered.append(int(x)) or np.int32(0)])

    def damaged():
        raise OverflowError("Python int too large to convert to C long")

    with pytest.raises(OverflowError):
        agreement.agreed(damaged, "the training data")
    assert gathered == [1]  # this process told the others it failed


def test_agreed_on_every_process_returns_the_value(monkeypatch):
    _processes(monkeypatch, [lambda x: np.int32(0)])
    assert agreement.agreed(lambda: 7, "x") == 7


def test_different_data_on_another_host_is_refused(monkeypatch):
    """Each host builds the global batch from its own copy of ``--data`` and hands over its
    rows: a stale copy on one host trained on a mix of two files without an error."""
    _processes(monkeypatch, [lambda x: x, lambda x: x + np.uint32(1)])
    with pytest.raises(ValueError, match=r"the training data differs between processes: "
                                         r"process\(es\) \[2\] read other"):
        agreement.same_on_every_process("jsonl:abc", "the training data")
    _processes(monkeypatch, [lambda x: x])
    agreement.same_on_every_process("jsonl:abc", "the training data")


def test_training_refuses_other_data_on_another_host_before_compiling(monkeypatch, tmp_path):
    import json

    from kdsa.model.config import get_preset
    from kdsa.train.config import TrainConfig
    from kdsa.train.trainer import run_training

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " * 8}) + "\n" for i in range(8)))
    _processes(monkeypatch, [lambda x: x + np.uint32(x.ndim)])  # flags agree, digests differ
    with pytest.raises(ValueError, match="the training data differs between processes"):
        run_training(get_preset("tiny"), TrainConfig(steps=1, batch_size=2, seq_len=16),
                     tmp_path / "run", data_path=data)
    assert not (tmp_path / "run").exists()
