"""Positive-number arguments of the embedding layer refuse alike, naming the argument."""
import pytest

from embedding.data.example import write_example
from embedding.planner import Workload, validate_plan
from embedding.presets import preset
from embedding.types import positive_arg


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "3", None])
def test_positive_int_refused(value):
    with pytest.raises(ValueError, match=r"^n: expected a positive int, got "):
        positive_arg("n", value, int)


def test_positive_number():
    assert positive_arg("x", 2) == 2 and positive_arg("x", 0.5) == 0.5
    with pytest.raises(ValueError, match=r"^x: expected a positive number, got 0\.0$"):
        positive_arg("x", 0.0)


@pytest.mark.parametrize("call, name", [
    (lambda: Workload(batch_size=0), "batch_size"),
    (lambda: Workload(ids_per_sample=-1.0), "ids_per_sample"),
    (lambda: preset("tiny", dim=0), "dim"),
    (lambda: validate_plan(None, 0), "world_size"),
    (lambda: write_example("/nonexistent", records=0), "records"),
])
def test_callers_name_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}: expected a positive"):
        call()
