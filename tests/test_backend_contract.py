"""The base Backend checks every argument before a backend's own code runs (one error for all)."""

import numpy as np
import pytest

from aiperf_core.backend import Backend, BackendError, Dataset, StepClock, TrainConfig
from aiperf_core.builders import resnet_small
from aiperf_core.errors import GraphError
from aiperf_numpy.backend import NumpyBackend, NumpyModel


class Recording(NumpyBackend):
    """The reference backend, recording what reaches its own code."""

    name = "recording"

    def __init__(self):
        self.calls = []

    def predict_checked(self, model, x):
        self.calls.append(("predict", x.dtype))
        return super().predict_checked(model, x)

    def loss_and_grads_checked(self, model, x, labels, label_smoothing):
        self.calls.append(("loss_and_grads", labels.dtype, type(label_smoothing)))
        return super().loss_and_grads_checked(model, x, labels, label_smoothing)

    def train_checked(self, model, data, config, on_epoch):
        self.calls.append(("train",))
        return super().train_checked(model, data, config, on_epoch)


@pytest.fixture
def setup():
    backend = Recording()
    graph = resnet_small((8, 8, 3), 3)
    x = np.random.default_rng(0).normal(size=(2, 8, 8, 3))  # float64: converted by the check
    return backend, backend.lower(graph), x, np.array([0, 2], np.int32)


def test_checked_arguments_reach_the_backend_converted(setup):
    backend, model, x, y = setup
    backend.predict(model, x)
    backend.loss_and_grads(model, x, y, 0)
    reports = backend.train(model, Dataset(x.astype(np.float32), y, x.astype(np.float32), y, 3),
                            TrainConfig(epochs=1, batch_size=2))
    assert backend.calls[:3] == [("predict", np.float32), ("loss_and_grads", np.int64, float), ("train",)]
    assert reports[0].step_seconds is not None and reports[0].step_seconds > 0


@pytest.mark.parametrize("call, error, text", [
    (lambda b, m, x, y: b.predict("not a model", x), BackendError, "not a model lowered by the recording backend: str"),
    (lambda b, m, x, y: b.predict(m, x[:, :4]), GraphError, "input batch has shape [2, 4, 8, 3]"),
    (lambda b, m, x, y: b.loss_and_grads(m, x, y + 5), GraphError, "labels must lie in [0, 3)"),
    (lambda b, m, x, y: b.loss_and_grads(m, x, y[:1]), GraphError, "labels have shape [1], expected [2]"),
    (lambda b, m, x, y: b.loss_and_grads(m, x, y, 1.5), ValueError, "label_smoothing must be in [0, 1]"),
    (lambda b, m, x, y: b.train(m, Dataset(x, y, x, y, 3), TrainConfig(epochs=1, batch_size=0)), BackendError,
     "batch_size must be >= 1"),
    (lambda b, m, x, y: b.train(m, Dataset(x, y, x, y, 3), TrainConfig(epochs=1, batch_size=2, precision="fp16")),
     BackendError, "precision"),
])
def test_bad_arguments_never_reach_the_backend(setup, call, error, text):
    backend, model, x, y = setup
    with pytest.raises(error, match=None) as caught:
        call(backend, model, x, y)
    assert text in str(caught.value)
    assert backend.calls == []


def test_the_contract_names_what_a_backend_must_implement():
    hooks = {"model_type", "predict_checked", "loss_and_grads_checked", "train_checked"}
    assert hooks <= Backend.__abstractmethods__
    assert not {"predict", "loss_and_grads", "train"} & Backend.__abstractmethods__
    assert NumpyBackend().model_type() is NumpyModel


def test_a_step_clock_sums_what_it_wraps_and_laps_to_zero():
    clock = StepClock()
    for _ in range(3):
        with clock:
            sum(range(1000))
    first = clock.lap()
    assert first > 0 and clock.lap() == 0.0


def test_reference_counts_each_step_and_normalises_streamed_pixels_in_the_step(monkeypatch):
    """The template for vendors: clock.count(images) after every training step (live progress), and
    streamed uint8 pixels normalised inside the step (preprocess.model_input), never before it."""
    from aiperf_core.data import preprocess, stream
    from aiperf_core.data.synthetic import SyntheticSource

    counted, seen = [], []
    real_count, real_input = StepClock.count, preprocess.model_input
    monkeypatch.setattr(StepClock, "count", lambda self, images: (counted.append(images), real_count(self, images)))
    monkeypatch.setattr(preprocess, "model_input", lambda x: (seen.append(x.dtype), real_input(x))[1])
    data = stream.StreamingDataset(SyntheticSource(classes=3, train_images=11, val_images=3), image_size=8,
                                   workers=0)
    backend = NumpyBackend()
    reports = backend.train(backend.lower(resnet_small((8, 8, 3), 3)), data, TrainConfig(epochs=1, batch_size=4))
    assert counted == [4, 4, 3] and reports[0].train_images == 11 and reports[0].val_images == 3
    assert set(seen) == {np.dtype(np.uint8)}
    assert reports[0].compile_seconds == 0.0
