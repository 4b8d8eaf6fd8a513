"""DataStream: resuming at a data position, reading ahead, starting over at the end."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelining._data import DataStream


class Positioned:
  """An iterator over `items` with get_state/set_state (as grain's are)."""

  def __init__(self, items, at=0):
    self.items, self.at = items, at

  def __iter__(self):
    return self

  def __next__(self):
    if self.at >= len(self.items):
      raise StopIteration
    self.at += 1
    return self.items[self.at - 1]

  def get_state(self):
    return {"at": self.at}

  def set_state(self, state):
    self.at = state["at"]


class _Dataset:
  """A re-iterable whose iterators have positions."""

  def __init__(self, items):
    self.items = items

  def __iter__(self):
    return Positioned(self.items)


def _drain(stream):
  out = []
  for batch in stream:
    out.append((batch, stream.get_state()))
  return out


@settings(max_examples=60, deadline=None)
@given(count=st.integers(1, 6), epochs=st.integers(1, 3), data=st.data(),
       positioned=st.booleans(), at_end=st.sampled_from(["stop", "start_over"]))
def test_a_resumed_stream_continues_the_uninterrupted_one_and_at_its_end_does_as_asked(
    count, epochs, data, positioned, at_end):
  items = [f"batch {i}" for i in range(count)]
  source = _Dataset(items) if positioned else items
  uninterrupted = _drain(DataStream(source, epochs=epochs))
  assert [batch for batch, _ in uninterrupted] == items * epochs
  consumed = data.draw(st.integers(1, count * epochs), label="consumed")
  _, state = uninterrupted[consumed - 1]
  resumed = DataStream(source, epochs=epochs, batches_consumed=state["batches_consumed"],
                       position=state["position"], epoch=state["epoch"], at_end=at_end)
  if consumed < count * epochs:  # the rest, with the positions the uninterrupted one recorded
    assert not resumed.resumed_at_end
    assert _drain(resumed) == uninterrupted[consumed:]
  elif at_end == "stop":  # a complete run: nothing more
    assert resumed.resumed_at_end and _drain(resumed) == []
  else:  # the whole data again, counted from 0
    assert resumed.resumed_at_end and _drain(resumed) == uninterrupted


def test_a_one_shot_iterator_resumed_at_its_end_stays_there():
  items = ["a", "b", "c"]
  iterator = Positioned(items, at=3)
  stream = DataStream(iterator, batches_consumed=3, position={"at": 3}, at_end="start_over")
  assert stream.resumed_at_end and _drain(stream) == []


def test_the_batch_read_ahead_keeps_the_position_before_it():
  items = ["a", "b", "c", "d"]
  stream = DataStream(_Dataset(items), batches_consumed=2, position={"at": 2})
  assert stream.get_state() == {"batches_consumed": 2, "epoch": 0, "position": {"at": 2}}
  assert next(stream) == "c"
  assert stream.get_state() == {"batches_consumed": 3, "epoch": 0, "position": {"at": 3}}


@pytest.mark.parametrize("at_end", ["stop", "start_over"])
def test_a_finished_run_of_several_epochs_resumes_without_its_epochs(at_end):
  """A new Trainer resuming a run fit with epochs=3, without epochs: "cannot resume the
  data at batch 9: it holds only 3 batches"."""
  items = ["a", "b", "c"]
  finished = _drain(DataStream(items, epochs=3))
  _, state = finished[-1]
  resumed = DataStream(items, batches_consumed=state["batches_consumed"],
                       position=state["position"], epoch=state["epoch"], at_end=at_end)
  assert resumed.resumed_at_end
  assert [batch for batch, _ in _drain(resumed)] == ([] if at_end == "stop" else items)
  _, middle = finished[4]  # in its second pass: the rest of that pass, then the end
  resumed = DataStream(items, batches_consumed=middle["batches_consumed"], epoch=middle["epoch"])
  assert [batch for batch, _ in _drain(resumed)] == ["c"]


def test_a_plain_list_resumed_past_its_length_is_refused():
  with pytest.raises(ValueError, match="cannot resume the data at batch 5: it holds only 3"):
    DataStream(["a", "b", "c"], batches_consumed=5)


def test_a_one_shot_iterator_without_a_saved_state_is_told_what_is_missing():
  """A checkpoint written while training on a list holds no iterator state: the message
  said the iterator lacked get_state()/set_state(), which it had."""
  with pytest.raises(ValueError, match=r"batch 2: train_data is a one-shot iterator, and the"
                                       r" checkpoint holds no iterator state for its set_state"):
    DataStream(Positioned(["a", "b", "c"]), batches_consumed=2, position=None)
  with pytest.raises(ValueError, match=r"one-shot iterator without get_state\(\)/set_state\(\)"):
    DataStream(iter(["a", "b", "c"]), batches_consumed=2)


def test_several_epochs_of_a_one_shot_iterator_are_refused_before_the_first_batch():
  """Refused when the second pass began, the first pass had trained (and was not saved)."""
  for one_shot in (iter(["a", "b"]), Positioned(["a", "b"])):
    with pytest.raises(ValueError, match="epochs=2 needs re-iterable train_data"):
      DataStream(one_shot, epochs=2)
  # Resumed in its last pass, a one-shot iterator has that pass to make.
  resumed = DataStream(Positioned(["a", "b", "c"]), epochs=2, batches_consumed=4,
                       position={"at": 1}, epoch=1)
  assert _drain(resumed) == [("b", {"batches_consumed": 5, "epoch": 1, "position": {"at": 2}}),
                             ("c", {"batches_consumed": 6, "epoch": 1, "position": {"at": 3}})]
